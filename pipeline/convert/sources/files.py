"""The files of a source, on local disk or under an s3://, gs:// or http(s):// prefix, behind one
interface (`SourceFiles`): list them, stat them, read them whole or by byte ranges. A source names
its files relative to its root and never knows which kind it holds.

Remote reads go through the client the loaders use (pipeline/storage/object_store.py): credentials,
retries and one-line errors are theirs. Both kinds are safe to use in forked workers: a worker opens
its own file descriptors, and asks the process that opened the store for remote bytes (a store
client's threads do not survive a fork).
"""
from __future__ import annotations

import bisect
import fnmatch
import os
import re
import threading
from pathlib import Path
from typing import Protocol

from pipeline.convert.errors import ConversionError
from pipeline.errors import RemoteDataError
from pipeline.storage.object_store import merge_ranges, open_store
from pipeline.storage.urls import is_url, redact

OPEN_FILES = 64          # descriptors kept per process for ranged reads (tars, parquet files)
_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")


class SourceFiles(Protocol):
    root: str            # as shown to the user (a URL redacted)
    remote: bool
    listable: bool       # a web server cannot say what it holds: its files must be named

    def shown(self, name: str) -> str: ...
    def exists(self, name: str) -> bool: ...
    def is_dir(self, name: str) -> bool: ...
    def list(self, pattern: str) -> list[str]: ...
    def size(self, name: str) -> int: ...
    def signature(self, name: str) -> str: ...
    def read(self, name: str) -> bytes: ...
    def read_at(self, name: str, offset: int, size: int) -> bytes: ...
    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list: ...


def expand_braces(pattern: str) -> list[str]:
    """`train-{000..146}.tar` as its 147 names (WebDataset's notation; numbers keep their width)."""
    found = _BRACES.search(pattern)
    if not found:
        return [pattern]
    first, last = found.group(1), found.group(2)
    width = len(first) if first.startswith("0") else 0
    head, tail = pattern[:found.start()], pattern[found.end():]
    return [name for number in range(int(first), int(last) + 1)
            for name in expand_braces(f"{head}{number:0{width}d}{tail}")]


class LocalFiles:
    """Files under a folder; names relative to it, or absolute (a list may name files elsewhere)."""
    remote, listable = False, True

    def __init__(self, root: str | Path):
        self.path = Path(root)
        self.root = str(root)
        self._fds: dict[str, int] = {}
        self._pid, self._lock = os.getpid(), threading.Lock()

    def full(self, name: str) -> Path:
        return self.path / name

    def shown(self, name: str) -> str:
        return str(self.path / name)

    def exists(self, name: str) -> bool:
        return self.full(name).exists()

    def is_dir(self, name: str) -> bool:
        return self.full(name).is_dir()

    def list(self, pattern: str) -> list[str]:
        """Names (relative) of the files that match a glob, braces expanded, sorted."""
        names = set()
        for expanded in expand_braces(pattern):
            if any(ch in expanded for ch in "*?["):
                names.update(str(p.relative_to(self.path)) for p in self.path.glob(expanded) if p.is_file())
            elif self.full(expanded).is_file():
                names.add(expanded)
        return sorted(names)

    def size(self, name: str) -> int:
        return self.full(name).stat().st_size

    def signature(self, name: str) -> str:
        """Changes when the file is replaced, resized or touched."""
        stat = self.full(name).stat()
        return f"{stat.st_size}:{stat.st_mtime_ns}"

    def read(self, name: str) -> bytes:
        with open(self.full(name), "rb") as file:
            return file.read()

    def _fd(self, name: str) -> int:
        if self._pid != os.getpid():          # a forked worker: the parent's descriptors are not ours to move
            self._fds, self._pid, self._lock = {}, os.getpid(), threading.Lock()
        with self._lock:                      # a scan reads on threads
            if name not in self._fds:
                if len(self._fds) >= OPEN_FILES:
                    os.close(self._fds.pop(next(iter(self._fds))))
                self._fds[name] = os.open(self.full(name), os.O_RDONLY)
            return self._fds[name]

    def read_at(self, name: str, offset: int, size: int) -> bytes:
        return os.pread(self._fd(name), size, offset)

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list:
        """The bytes of each (start, end), in the order given; neighbours read as one pread."""
        fd, out, pieces = self._fd(name), [], {}
        for start, end in merge_ranges(ranges):
            pieces[start] = memoryview(os.pread(fd, end - start, start))
        starts = sorted(pieces)
        for start, end in ranges:
            at = starts[bisect.bisect_right(starts, start) - 1]
            out.append(pieces[at][start - at:end - at])
        return out


class RemoteFiles:
    """Objects under an s3://, gs:// or http(s):// prefix; names relative to it.

    The store's client lives in the process that opened it: obstore's runtime does not survive a
    fork, so a forked worker (the converters', FFCV's writer's) asks that process instead, through
    a local socket (`_ReadServer`), and gets the bytes back."""
    remote = True

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.root = redact(self.url)
        self.listable = self.url.split("://")[0].lower() not in ("http", "https")
        self._owner = os.getpid()
        try:
            self._store = open_store(self.url)     # a bad URL or missing credentials: one line now, before any work
        except RemoteDataError as error:
            raise ConversionError(str(error)) from None
        self._server = _ReadServer(self)
        self._client, self._client_pid = None, None

    def _call(self, method: str, *args):
        if os.getpid() == self._owner:
            return getattr(self, f"_{method}")(*args)
        if self._client_pid != os.getpid():
            self._client, self._client_pid = self._server.connect(), os.getpid()
        self._client.send((method, args))
        ok, value = self._client.recv()
        if not ok:
            raise value
        return value

    def shown(self, name: str) -> str:
        return self._store.where(name)

    def exists(self, name: str) -> bool:
        return self._call("exists", name)

    def _exists(self, name: str) -> bool:
        from pipeline.storage.errors import RemoteNotFound
        try:
            self._store.size(name)
            return True
        except RemoteNotFound:
            return False

    def is_dir(self, name: str) -> bool:
        return bool(self.listing(name.rstrip("/") + "/", limit=1))

    def listing(self, prefix: str, limit: int | None = None) -> list[str]:
        import obstore
        from pipeline.storage.errors import describe_error
        if not self.listable:
            raise ConversionError(f"{self.root}: a web server cannot be listed; name the files (--split-path "
                                  f"SPLIT=PATTERN, with {{000..146}} for numbered files) or use s3:// or gs://")
        names = []
        try:
            for chunk in obstore.list(self._store.client, prefix=prefix or None, chunk_size=1000):
                names += [meta["path"] for meta in chunk]
                if limit and len(names) >= limit:
                    break
        except Exception as error:  # noqa: BLE001 - obstore's own classes, described
            raise ConversionError(f"{self.root}: cannot list ({describe_error(error)})") from None
        return names

    def list(self, pattern: str) -> list[str]:
        names = set()
        for expanded in expand_braces(pattern):
            if any(ch in expanded for ch in "*?["):
                fixed = re.split(r"[*?\[]", expanded, maxsplit=1)[0]
                names.update(n for n in self.listing(fixed) if fnmatch.fnmatchcase(n, expanded))
            elif self.exists(expanded):
                names.add(expanded)
        return sorted(names)

    def size(self, name: str) -> int:
        return self._call("size", name)

    def _size(self, name: str) -> int:
        return self._store.size(name)

    def signature(self, name: str) -> str:
        """Its size and ETag (or modification time): what changes when the object is replaced."""
        return self._call("signature", name)

    def _signature(self, name: str) -> str:
        import obstore
        from pipeline.storage.errors import store_error
        try:
            meta = obstore.head(self._store.client, name)
        except Exception as error:  # noqa: BLE001
            raise store_error(self.shown(name), error) from None
        return f"{meta['size']}:{meta.get('e_tag') or meta.get('last_modified')}"

    def read(self, name: str) -> bytes:
        return self._call("read", name)

    def _read(self, name: str) -> bytes:
        return self._store.read(name)

    def read_at(self, name: str, offset: int, size: int) -> bytes:
        return self._call("read_at", name, offset, size)

    def _read_at(self, name: str, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        return bytes(self._store.read_ranges(name, [(offset, offset + size)])[0])

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list:
        return self._call("read_ranges", name, ranges)

    def _read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list:
        return self._store.read_ranges(name, ranges)


class _ReadServer:
    """Answers the reads of forked processes with the owner's store client: one thread a connection,
    on a Unix socket only this user's processes that know its key can use."""

    def __init__(self, files: RemoteFiles):
        from multiprocessing.connection import Listener
        self.files, self.key = files, os.urandom(16)
        self.listener = Listener(family="AF_UNIX", authkey=self.key)
        self.address = self.listener.address
        threading.Thread(target=self._accept, daemon=True, name="source-reads").start()

    def connect(self):
        from multiprocessing.connection import Client
        return Client(self.address, family="AF_UNIX", authkey=self.key)

    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True, name="source-read").start()

    def _answer(self, connection) -> None:
        with connection:
            while True:
                try:
                    method, args = connection.recv()
                except (EOFError, OSError):
                    return
                try:
                    value = getattr(self.files, f"_{method}")(*args)
                    if isinstance(value, list):         # views of a response cannot travel: copies do
                        value = [bytes(piece) for piece in value]
                    answer = (True, value)
                except Exception as error:  # noqa: BLE001 - sent back, raised in the asking process
                    answer = (False, error)
                connection.send(answer)


def open_files(src: str) -> SourceFiles:
    """The files under SRC: a local folder, or an s3://, gs:// or http(s):// prefix."""
    if is_url(src):
        return RemoteFiles(src)
    if not Path(src).is_dir():
        raise ConversionError(f"{src}: source folder does not exist")
    return LocalFiles(src)
