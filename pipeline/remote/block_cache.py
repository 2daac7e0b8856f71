"""A bounded cache of immutable blocks on local disk, shared by every process of a node.

The remote readers keep what they fetch here (`pipeline/remote/block_sources.py`), so a later epoch
reads a block from disk where the data fits. Each block is a file written under a temporary
name and renamed into place, so a reader never sees a torn one. Fetching a block takes an
exclusive `flock` on one of `LOCK_STRIPES` lock files chosen by the block's name: two
processes (or threads, each with its own open file) never fetch one block at once; the second
waits and then finds it there.

Past `limit` bytes, the least recently used blocks are deleted (by modification time, which
each use renews) until the cache holds `EVICT_TO` of it. A process still reading a deleted
block keeps its open file; the next one to need it fetches it again.

A disk that fills before the limit (a limit larger than the disk, or other files growing on it)
lowers the limit below what the cache holds, with one line saying so, and evicts to make room;
a block that still finds no room is handed to its reader in memory (a memfd) and not kept. A run
thus goes on, at the cost of fetching again what it could not keep. `room` says beforehand what the
disk can take, so that a split it cannot hold streams through memory from the start
(`pipeline/remote/block_sources.py`).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.storage.atomic_files import FULL_DISK

LOCK_STRIPES = 4096
EVICT_TO = 0.9          # of the limit, so that eviction is not run again at the very next block
BLOCK_SUFFIX = ".block"
RENEW_SECONDS = 1.0          # how often a block kept open is marked used again, for the LRU
STALE_TMP_SECONDS = 600      # a block takes far less to write; older temporary files are a dead writer's
# Left free on the cache's disk, at most RESERVE_MOST: a run's checkpoints and logs often share it
DISK_RESERVE = 0.05
RESERVE_MOST = 4 << 30
LOWER_ONCE_S = 1.0

log = logging.getLogger(__name__)


class BlockCache:
    def __init__(self, root: str | Path, limit: int, first_on_node: bool = True):
        """first_on_node: whether this process is its node's first rank, which says what befalls
        the cache folder (WARNING; DEBUG on the others: the folder is the node's, and each rank
        would otherwise say the same), as `message_level`."""
        self.root = Path(root)
        self.limit = limit
        self.message_level = logging.WARNING if first_on_node else logging.DEBUG
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        self._added_since_scan = limit      # scan at the first block this process adds
        self._lock = threading.Lock()
        self._lowered_at = 0.0              # time.monotonic() when a full disk last lowered the limit
        self.fetched_bytes = 0              # by this process
        self.fetches = 0

    def path(self, name: str) -> Path:
        return self.root / f"{name}{BLOCK_SUFFIX}"

    def room(self) -> int:
        """The bytes its disk can take now, less a reserve for the rest of the run."""
        disk = shutil.disk_usage(self.root)
        return max(0, disk.free - min(int(DISK_RESERVE * disk.total), RESERVE_MOST))

    def open(self, name: str, fetch: Callable[[], bytes]) -> int:
        """A file descriptor to pread block `name` from, fetched if need be: its file (O_RDONLY), or
        a memfd holding it where the disk has no room for it. The caller closes it."""
        for attempt in range(3):
            got = self._got(name, fetch)
            if not isinstance(got, Path):
                return _in_memory_file(name, got)
            try:
                return os.open(got, os.O_RDONLY)
            except FileNotFoundError:       # evicted by another process between the fetch and the open
                if attempt == 2:
                    raise

    def present(self, names: list[str]) -> set[str]:
        """Which of the blocks `names` are in the cache now: a listing of each folder rather than
        a call for each block (a read-ahead over an epoch already cached asks for all of them)."""
        wanted: dict[str, dict[str, str]] = {}
        for name in names:
            folder, _, file = f"{self.root}/{name}{BLOCK_SUFFIX}".rpartition("/")
            wanted.setdefault(folder, {})[file] = name
        found = set()
        for folder, files in wanted.items():
            try:
                found.update(files[entry] for entry in os.listdir(folder) if entry in files)
            except FileNotFoundError:
                continue
        return found

    def renew(self, name: str) -> None:
        """Marks block `name` recently used, if it is still there."""
        _renew(self.path(name))

    def get(self, name: str, fetch: Callable[[], bytes]) -> Path | None:
        """The file holding block `name`, fetched with `fetch()` unless a process has already;
        None where the disk had no room to keep it."""
        got = self._got(name, fetch)
        return got if isinstance(got, Path) else None

    def _got(self, name: str, fetch: Callable[[], bytes]):
        """The file holding block `name`, or its bytes where the disk had no room for them."""
        path = self.path(name)
        if _renew(path):
            return path
        stripe = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") % LOCK_STRIPES
        with open(self.root / ".locks" / f"{stripe:04d}", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if _renew(path):                # fetched by whoever held the lock before us
                    return path
                data = fetch()
                kept = self._kept(path, data)
            finally:
                # Unlocked explicitly, not by closing: a process forked meanwhile (a DataLoader
                # starting its workers) holds a copy of this file, and with it the lock, until it exits.
                fcntl.flock(lock, fcntl.LOCK_UN)
        with self._lock:
            self.fetched_bytes += len(data)
            self.fetches += 1
            if kept:
                self._added_since_scan += len(data)
            due = kept and self._added_since_scan >= (1 - EVICT_TO) * self.limit
            if due:
                self._added_since_scan = 0
        if due:
            self.evict(keep=path)
        return path if kept else data

    def _kept(self, path: Path, data) -> bool:
        """Writes block file `path`; False where its disk is full even after the cache evicted to
        make room."""
        for attempt in range(2):
            try:
                _write_file(path, data)
                return True
            except OSError as error:
                if error.errno not in FULL_DISK:
                    raise
            if attempt == 0 and self._out_of_room() == 0:     # nothing freed: no room to write it again in
                break
        return False

    def _out_of_room(self) -> int:
        """The disk filled before the limit: the limit lowered below what the cache holds (EVICT_TO
        of it), least recently used blocks evicted; the bytes freed."""
        with self._lock:
            # Writers failing together are one event: each lowering the limit again would take it to nothing
            if time.monotonic() - self._lowered_at < LOWER_ONCE_S:
                return 0
            blocks = self._blocks()
            # Below what filled the disk: a scan is due only every (1 - EVICT_TO) of the limit added
            lowered = int(EVICT_TO * sum(size for _, size, _ in blocks))
            if lowered < self.limit and not self._lowered_at:
                log.log(self.message_level, "%s: its disk is full; the cache keeps at most %s MiB from now on "
                        "(data.cache_limit %s MiB), so what it cannot keep is fetched again",
                        self.root, f"{lowered / (1 << 20):,.0f}", f"{self.limit / (1 << 20):,.0f}")
            self.limit = min(self.limit, lowered)
            self._lowered_at = time.monotonic()
        return self._delete_oldest(blocks)

    def evict(self, keep: Path | None = None) -> int:
        """Deletes least recently used blocks until the cache holds at most EVICT_TO of its
        limit, if it holds more than the limit, never `keep` (the block about to be read);
        returns the bytes it freed."""
        blocks = self._blocks()
        if sum(size for _, size, _ in blocks) <= self.limit:
            return 0
        return self._delete_oldest(blocks, keep)

    def _blocks(self) -> list[tuple[int, int, str]]:
        """(time of last use, size, path) of each block in the cache; stale temporary files removed."""
        blocks, now = [], time.time()
        for folder, _, files in os.walk(self.root):
            for file in files:
                if ".tmp-" in file:
                    _remove_stale(os.path.join(folder, file), now)
                elif file.endswith(BLOCK_SUFFIX):
                    try:
                        stat = os.stat(os.path.join(folder, file))
                    except FileNotFoundError:   # evicted by another process meanwhile
                        continue
                    blocks.append((stat.st_mtime_ns, stat.st_size, os.path.join(folder, file)))
        return blocks

    def _delete_oldest(self, blocks: list[tuple[int, int, str]], keep: Path | None = None) -> int:
        """Deletes the least recently used of `blocks` until they hold EVICT_TO of the limit; the bytes freed."""
        total, freed = sum(size for _, size, _ in blocks), 0
        for _, size, file in sorted(blocks):
            if total - freed <= EVICT_TO * self.limit:
                break
            if keep is not None and file == str(keep):
                continue
            try:
                os.unlink(file)
                freed += size
            except FileNotFoundError:
                pass
        return freed


class OpenBlocks:
    """The block files of a cache this process keeps open, least recently used closed first,
    never one a reader holds: a batch then costs a lookup per block rather than an open, a
    close and a touch of its time of use (a batch reads a sample of each of its lanes, so a
    block serves many in a row). At most `capacity` are kept when no reader holds them, since a
    file evicted while open keeps its disk space until closed. Each is marked used in the cache
    again at most every RENEW_SECONDS while it is read, so that eviction (by time of use) takes
    the blocks no batch reads any more."""

    def __init__(self, cache: BlockCache, capacity: int):
        self.cache, self.capacity = cache, capacity
        self._files: OrderedDict[str, _OpenBlock] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @contextmanager
    def held(self, wanted: list[tuple[str, Callable[[], bytes]]]):
        """The fds of the (block name, fetch) wanted, none closed until the context ends."""
        opened = []
        try:
            with self._lock:        # a batch's blocks are mostly open already: held under one lock
                if self._pid != os.getpid():        # a forked process: the parent's files are not ours to share
                    self._files, self._pid = OrderedDict(), os.getpid()
                now = time.monotonic()
                for name, _ in wanted:
                    entry = self._files.get(name)
                    opened.append(None if entry is None else self._hold_open(name, entry, now))
            for i, (name, fetch) in enumerate(wanted):
                if opened[i] is None:
                    opened[i] = self._open(name, fetch)
            yield [entry.fd for entry in opened]
        finally:
            with self._lock:
                for entry in opened:
                    if entry is not None:
                        entry.holders -= 1
                self._close_beyond_capacity()

    def _hold_open(self, name: str, entry: "_OpenBlock", now: float) -> "_OpenBlock":
        """Under the lock: an open block held once more, marked used in the cache if due."""
        entry.holders += 1
        self._files.move_to_end(name)
        if now - entry.renewed > RENEW_SECONDS:
            entry.renewed = now
            self.cache.renew(name)
        return entry

    def _open(self, name: str, fetch) -> "_OpenBlock":
        fd = self.cache.open(name, fetch)       # outside the lock: it may wait for a fetch
        with self._lock:
            entry = self._files.get(name)
            if entry is not None:               # opened meanwhile by another thread
                os.close(fd)
            else:
                entry = self._files[name] = _OpenBlock(fd, time.monotonic())
            entry.holders += 1
            self._files.move_to_end(name)
            return entry

    def _close_beyond_capacity(self) -> None:
        for name in list(self._files):
            if len(self._files) <= self.capacity:
                return
            if self._files[name].holders == 0:
                os.close(self._files.pop(name).fd)

    def forget(self, name: str) -> None:
        """Drops a block whose bytes are damaged: its open file (once no reader holds it) and the
        cache's file, so that the next read fetches it again."""
        with self._lock:
            entry = self._files.get(name)
            if entry is not None and entry.holders == 0:
                os.close(self._files.pop(name).fd)
        self.cache.path(name).unlink(missing_ok=True)

    def close_unheld(self) -> None:
        """Closes the files no reader holds, and each other one once let go: a split that no
        longer reads them (it streams through memory now) must not keep evicted files' space."""
        with self._lock:
            self.capacity = 0
            self._close_beyond_capacity()

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for entry in self._files.values():
                    os.close(entry.fd)
            self._files = OrderedDict()


@dataclass
class _OpenBlock:
    fd: int
    renewed: float            # time.monotonic() when last marked used in the cache
    holders: int = 0


def _remove_stale(tmp: str, now: float) -> None:
    """A temporary block left by a process killed while writing it."""
    try:
        if now - os.stat(tmp).st_mtime > STALE_TMP_SECONDS:
            os.unlink(tmp)
    except FileNotFoundError:
        pass


def _write_file(path: Path, data) -> None:
    """Block file `path` written under a temporary name and renamed into place; on a failure
    (a full disk) nothing is left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _in_memory_file(name: str, data) -> int:
    """A memfd holding `data`, read as the block's file would be."""
    fd = os.memfd_create(name.rpartition("/")[2], os.MFD_CLOEXEC)
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return fd


def _renew(path: Path) -> bool:
    """True if the block is there, marking it recently used."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False
