"""Samples encoded in the source's order, taken back in the seeded write order, with memory bounded
whatever the dataset's size: each goes to a bucket file on disk, in OUT, by its place in the write
order (bucket k holds places [k*P, (k+1)*P)), its place, index in the source, offset, size and
flags to the bucket's index file. Buckets are then taken one at a time: the index sorted by place,
each sample read at its offset, the bucket deleted once done. The disk this needs is the output's size once, since each
bucket is gone before the shards it fills are much written; the memory, a bucket's index (29 bytes
a sample) and one sample.

So a source is read front to back (a tar of tars, a parquet file row group by row group, a bucket's
objects by large ranges), never by one random read a sample.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np

BUCKET_BYTES = 64 << 20       # the samples of a bucket, about; its index is what is held in memory
OPEN_BUCKETS = 128
RECORD = np.dtype([("place", "<u8"), ("index", "<u8"), ("offset", "<u8"), ("length", "<u4"), ("flags", "u1")])


class Reorder:
    """`put(place, index, data, flags)` in any order, then `taken()` in place order, once."""

    def __init__(self, folder: Path, count: int, mean_bytes: int):
        self.folder, self.count = folder, count
        self.per_bucket = max(1, BUCKET_BYTES // max(1, mean_bytes))
        self.buckets = -(-count // self.per_bucket) if count else 0
        folder.mkdir(parents=True, exist_ok=True)
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._written = np.zeros(self.buckets, np.int64)     # each bucket's data bytes so far

    def _path(self, bucket: int) -> Path:
        return self.folder / f"bucket-{bucket:06d}"

    def _files(self, bucket: int) -> tuple:
        handles = self._open.pop(bucket, None)
        if handles is None:
            if len(self._open) >= OPEN_BUCKETS:
                for handle in self._open.popitem(last=False)[1]:
                    handle.close()
            path = self._path(bucket)
            handles = (open(path, "ab", buffering=64 << 10), open(path.with_suffix(".idx"), "ab", buffering=4096))
        self._open[bucket] = handles
        return handles

    def put(self, place: int, index: int, data: bytes, flags: int = 0) -> None:
        bucket = place // self.per_bucket
        data_file, index_file = self._files(bucket)
        data_file.write(data)
        index_file.write(np.array([(place, index, self._written[bucket], len(data), flags)], RECORD).tobytes())
        self._written[bucket] += len(data)

    def taken(self) -> Iterator[tuple[int, int, int, bytes]]:
        """(place, index, flags, data) of every sample put, in place order; each bucket is deleted once read."""
        for handles in self._open.values():
            for handle in handles:
                handle.close()
        self._open.clear()
        for bucket in range(self.buckets):
            path = self._path(bucket)
            if not path.exists():
                continue
            records = np.fromfile(path.with_suffix(".idx"), RECORD)
            records = records[np.argsort(records["place"], kind="stable")]
            with open(path, "rb") as data:
                for at in range(0, len(records), 4096):
                    for place, index, offset, length, flags in records[at:at + 4096].tolist():
                        yield place, index, flags, os.pread(data.fileno(), length, offset)
            os.unlink(path)
            os.unlink(path.with_suffix(".idx"))
