"""Staging one file from object storage (s3://, gs://, http(s)://) into a local folder: FFCV
memory-maps its `.beton`, so a dataset in object storage is read from a local copy.

Beside the copy `X` lie:
- `X.part`, the copy being made. Chunks are appended strictly in order, so it only ever holds a
  correct prefix of the object: a process killed half-way leaves it, and the next call resumes
  from its size (hashing the prefix first, so the whole file is still checked).
- `X.verified`, the sha256 the copy was checked against. A copy of the right size whose marker
  names the wanted sha256 is used at once, with no request made. The marker is removed before a
  new copy is renamed into place and written after, so it never vouches for other bytes.
- `X.lock`, held (flock) by the process staging: the ranks of a job on one node share one copy,
  the others wait and then find it staged. It holds the sha256 being staged, so a `.part` left
  from an older version of the dataset (converted again since) is discarded, not resumed.

Nothing is fsynced: the threat is a killed process, whose writes the kernel keeps.
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.storage.atomic_files import FULL_DISK, write_bytes_atomic
from pipeline.errors import RemoteDataError
from pipeline.progress import Progress

log = logging.getLogger(__name__)

# Chunks in flight at once, each its own request: one HTTP stream rarely fills a link to object
# storage. (Adjacent ranges given to one read_ranges call would be merged into one request.)
CONCURRENT_CHUNKS = 4
MIB = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


def stage_file(store, name: str, dest: Path, size: int, sha256: str, *, chunk_bytes: int = 8 << 20,
               progress: bool = True) -> Path:
    """`dest`, a local copy of object `name` of `store` (a `pipeline.storage.object_store.ObjectStore`)
    holding `size` bytes whose sha256 is `sha256` (hex), fetched unless already there.
    RemoteDataError (one line, naming the redacted URL) when the object cannot be read, does not
    match, or cannot fit on the local disk."""
    dest = Path(dest)
    sha256 = sha256.strip().lower()
    where = store.where(name)
    if not _HEX64.fullmatch(sha256):
        raise RemoteDataError(f"{where}: the manifest's sha256 {sha256[:80]!r} is not 64 hex digits")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    marker = _beside(dest, ".verified")
    if _verified(dest, marker, size, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(_beside(dest, ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process staging %s into %s", where, dest)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _verified(dest, marker, size, sha256):
            return dest
        if _already_there(dest, marker, size, sha256, progress):
            return dest
        lock.seek(0)
        started_for = lock.read().strip()
        part = _beside(dest, ".part")
        if started_for and started_for != sha256 or part.exists() and part.stat().st_size > size:
            part.unlink(missing_ok=True)          # a copy of another version of the object
        lock.seek(0)
        lock.truncate()
        lock.write(sha256)
        lock.flush()
        _fetch(store, name, where, dest, part, marker, size, sha256, chunk_bytes, progress)
    return dest


def _beside(dest: Path, suffix: str) -> Path:
    return dest.with_name(dest.name + suffix)


def _verified(dest: Path, marker: Path, size: int, sha256: str) -> bool:
    try:
        return dest.stat().st_size == size and marker.read_text().strip() == sha256
    except (FileNotFoundError, NotADirectoryError):
        return False


def _already_there(dest: Path, marker: Path, size: int, sha256: str, progress: bool) -> bool:
    """A copy of the right size without its marker (a process killed between the rename and the
    marker, or a copy put there by hand): hashing it locally beats fetching it again."""
    try:
        if dest.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    if _hash_prefix(dest, size, f"checking {dest}", progress).hexdigest() != sha256:
        return False
    write_bytes_atomic(marker, sha256.encode(), durable=False)
    return True


def _hash_prefix(path: Path, length: int, desc: str, progress: bool):
    """The sha256 object over the first `length` bytes of `path`, to be continued by the caller."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, Progress(_mib(length), desc, unit="MiB",
                                         enabled=progress and length >= 64 * MIB) as bar:
        done = 0
        while done < length:
            block = f.read(min(8 * MIB, length - done))
            if not block:
                break
            digest.update(block)
            bar.update(_mib(done + len(block), length) - _mib(done, length))
            done += len(block)
    return digest


def _mib(count: int, total: int | None = None) -> int:
    """Whole MiB for the progress figures (rounded up, so that the end reads as the total)."""
    return -(-count // MIB) if total is None or count >= total else count // MIB


def _append(out, data, where: str, size: int) -> None:
    """All of `data` written to the unbuffered file `out`; a full disk is one line."""
    view = memoryview(data)
    try:
        while view:
            view = view[out.write(view):]
    except OSError as error:
        if error.errno not in FULL_DISK:
            raise
        staged = os.fstat(out.fileno()).st_size
        raise RemoteDataError(f"{where}: the disk of {os.path.dirname(out.name)} filled while staging it "
                              f"({staged / MIB:,.0f} of {size / MIB:,.0f} MiB staged, which a rerun resumes from): "
                              f"free some, or set data.cache_dir to a larger disk") from None


def _fetch(store, name, where, dest, part, marker, size, sha256, chunk_bytes, progress) -> None:
    done = part.stat().st_size if part.exists() else 0
    free = shutil.disk_usage(dest.parent).free
    if size - done > free:
        raise RemoteDataError(f"{where}: staging it needs {(size - done) / MIB:,.0f} MiB free in {dest.parent}, "
                              f"{free / MIB:,.0f} MiB are")
    remote = store.size(name)
    if remote != size:
        raise RemoteDataError(f"{where}: {remote:,} bytes where the manifest says {size:,}: "
                              "the object changed since it was converted (convert the dataset again)")
    resumed = done
    digest = _hash_prefix(part, done, f"checking {part}", progress) if done else hashlib.sha256()
    starts = list(range(done, size, chunk_bytes))
    # Unbuffered: a full disk then fails the write that meets it, not a flush at close
    with open(part, "ab", buffering=0) as out, \
            Progress(_mib(size), f"staging {where}", unit="MiB", initial=_mib(done, size), enabled=progress) as bar, \
            ThreadPoolExecutor(CONCURRENT_CHUNKS, thread_name_prefix="stage") as pool:
        def submit(start):
            return pool.submit(store.read_ranges, name, [(start, min(start + chunk_bytes, size))])
        pending = collections.deque(submit(start) for start in starts[:CONCURRENT_CHUNKS])
        following = iter(starts[CONCURRENT_CHUNKS:])
        try:
            while pending:
                data = pending.popleft().result()[0]
                _append(out, data, where, size)      # in order: the .part stays a prefix of the object
                digest.update(data)
                bar.update(_mib(done + len(data), size) - _mib(done, size))
                done += len(data)
                start = next(following, None)
                if start is not None:
                    pending.append(submit(start))
        finally:
            for future in pending:
                future.cancel()
    got = digest.hexdigest()
    if done != size or got != sha256:
        part.unlink(missing_ok=True)
        # A resumed prefix may be what differs (a .part from elsewhere): it is gone, so a rerun fetches it all.
        cause = ("the object changed since it was converted, or the partial copy resumed was not its prefix "
                 "(removed: run again)" if resumed else "the object changed since it was converted (convert it again)")
        raise RemoteDataError(f"{where}: the copy staged has sha256 {got[:16]}..., the manifest says {sha256[:16]}...: "
                              f"{cause}")
    marker.unlink(missing_ok=True)
    os.replace(part, dest)
    write_bytes_atomic(marker, sha256.encode(), durable=False)
