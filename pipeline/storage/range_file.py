"""Bytes [start, start + length) of a file or object, read through `read_at(offset, size)` (a pread, a
range request), as a seekable read-only file: for readers that want a file (tarfile, pyarrow), where
the bytes lie in a bucket or inside another file. Each read fetches at least `readahead` bytes and
keeps them, so a reader's small neighbouring reads (a tar header and the byte before it) cost one."""
from __future__ import annotations

import io
from typing import Callable

ReadAt = Callable[[int, int], bytes]        # (absolute offset, size) -> the bytes there (fewer at the end)


class RangeFile(io.RawIOBase):
    def __init__(self, read_at: ReadAt, start: int, length: int, readahead: int = 0):
        super().__init__()
        self.read_at, self.start, self.length, self.readahead = read_at, start, length, readahead
        self.position, self.buffer_at, self.buffer = 0, 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.position + size)
        if end <= self.position:
            return b""
        if not (self.buffer_at <= self.position and end <= self.buffer_at + len(self.buffer)):
            fetch_end = min(self.length, max(end, self.position + self.readahead))
            self.buffer_at, self.buffer = self.position, self.read_at(self.start + self.position,
                                                                      fetch_end - self.position)
        data = self.buffer[self.position - self.buffer_at:end - self.buffer_at]
        self.position += len(data)
        return bytes(data)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def held(self, start: int, size: int) -> bytes | None:
        """Bytes [start, start + size) of the window if the last read brought them, else None."""
        if self.buffer_at <= start and start + size <= self.buffer_at + len(self.buffer):
            return bytes(self.buffer[start - self.buffer_at:start - self.buffer_at + size])
        return None
