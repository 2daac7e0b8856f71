"""Samples encoded in the source's order, taken back in the seeded write order, with memory bounded
whatever the dataset's size: each goes to a bucket file on disk, in OUT, by its place in the write
order (bucket k holds places [k*P, (k+1)*P)); buckets are then read back one at a time, sorted in
memory, and deleted as they are taken. The disk this needs is the output's size once, since each
bucket is gone before the shards it fills are much written; the memory, one bucket.

So a source is read front to back (a tar of tars, a parquet file row group by row group, a bucket's
objects by large ranges), never by one random read a sample.
"""
from __future__ import annotations

import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

BUCKET_BYTES = 64 << 20       # a bucket's samples are sorted in memory
OPEN_BUCKETS = 128
_RECORD = struct.Struct("<QIB")   # place in the write order, length, flags


class Reorder:
    """`put(place, data, flags)` in any order, then `taken()` in place order, once."""

    def __init__(self, folder: Path, count: int, mean_bytes: int):
        self.folder, self.count = folder, count
        self.per_bucket = max(1, BUCKET_BYTES // max(1, mean_bytes))
        self.buckets = -(-count // self.per_bucket) if count else 0
        folder.mkdir(parents=True, exist_ok=True)
        self._open: OrderedDict[int, object] = OrderedDict()

    def _path(self, bucket: int) -> Path:
        return self.folder / f"bucket-{bucket:06d}"

    def _file(self, bucket: int):
        handle = self._open.pop(bucket, None)
        if handle is None:
            if len(self._open) >= OPEN_BUCKETS:
                self._open.popitem(last=False)[1].close()
            handle = open(self._path(bucket), "ab", buffering=256 << 10)
        self._open[bucket] = handle
        return handle

    def put(self, place: int, data: bytes, flags: int = 0) -> None:
        handle = self._file(place // self.per_bucket)
        handle.write(_RECORD.pack(place, len(data), flags))
        handle.write(data)

    def taken(self) -> Iterator[tuple[int, int, bytes]]:
        """(place, flags, data) of every sample put, in place order; each bucket is deleted once read."""
        for handle in self._open.values():
            handle.close()
        self._open.clear()
        for bucket in range(self.buckets):
            path = self._path(bucket)
            if not path.exists():
                continue
            content = memoryview(path.read_bytes())
            os.unlink(path)
            records, at = [], 0
            while at < len(content):
                place, length, flags = _RECORD.unpack_from(content, at)
                at += _RECORD.size
                records.append((place, flags, at, length))
                at += length
            for place, flags, start, length in sorted(records):
                yield place, flags, bytes(content[start:start + length])
