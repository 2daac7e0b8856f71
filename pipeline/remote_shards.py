"""A WebDataset split read from a URL: the same indexed array of samples as on local disk
(`pipeline/shard_index.py`, whose epoch plans it keeps), its bytes fetched in blocks into the
node's cache (`pipeline/block_cache.py`) and read from there.

A block is a run of consecutive samples of one shard, at most BLOCK_BYTES long (a sample
larger than that is a block alone), fetched in one range request. Blocks are cut at sample
boundaries, so a rank that reads only its part of a shard fetches little beyond it, and each
sample lies in one block file: the decode engine reads it with one `pread`, as it reads a tar,
so the batches are bit for bit those of the same shards on local disk.

Read-ahead: when an epoch starts, a thread walks the epoch's plan and fetches the blocks of the
coming batches, FETCH_THREADS requests at once, staying at most `ahead_bytes` ahead of the
batch being consumed, so latency is hidden and the cache is never flooded.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from pipeline import decode_engine
from pipeline.datasets import RemoteDataError, Shard
from pipeline.shard_index import StoredShards

BLOCK_BYTES = 1 << 20
FETCH_THREADS = 16
AHEAD_BYTES = 256 << 20        # at most; a quarter of the cache's limit where that is less


def sample_spans(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the first and one-past-last byte of what a loader reads of it (image and label)."""
    starts = np.minimum(members[:, 0], members[:, 2])
    ends = np.maximum(members[:, 0] + members[:, 1], members[:, 2] + 4)
    return starts, ends


def cut_blocks(starts: np.ndarray, ends: np.ndarray, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """The block number of each of a shard's samples: consecutive samples while the block's span
    stays within block_bytes."""
    block_of = np.empty(len(starts), np.int64)
    block, block_start = -1, None
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        if block_start is None or end - block_start > block_bytes:
            block, block_start = block + 1, start
        block_of[i] = block
    return block_of


class RemoteShards(StoredShards):
    def __init__(self, shards: list[Shard], source, block_bytes: int = BLOCK_BYTES):
        super().__init__(shards)
        self.source = source
        starts, ends = sample_spans(self.members)
        block_of, offset = [], 0
        for shard_index, count in enumerate(self.counts):
            first = int(self.shard_of.searchsorted(shard_index))
            block_of.append(offset + cut_blocks(starts[first:first + count], ends[first:first + count], block_bytes))
            offset = int(block_of[-1][-1]) + 1 if count else offset
        self.block_of = np.concatenate(block_of) if block_of else np.empty(0, np.int64)
        blocks = offset
        self.block_start = np.full(blocks, np.iinfo(np.int64).max, np.int64)
        self.block_end = np.zeros(blocks, np.int64)
        np.minimum.at(self.block_start, self.block_of, starts)
        np.maximum.at(self.block_end, self.block_of, ends)
        self.block_shard = np.zeros(blocks, np.int32)
        self.block_shard[self.block_of] = self.shard_of
        self.ahead_bytes = min(AHEAD_BYTES, source.cache.limit // 4)
        self._reader: _ReadAhead | None = None

    def block_name(self, block: int) -> str:
        shard = self.shards[int(self.block_shard[block])]
        return f"{self.source.dataset}/{shard.object_name}.{block}"

    def fetch(self, block: int) -> memoryview:
        shard = self.shards[int(self.block_shard[block])]
        start, end = int(self.block_start[block]), int(self.block_end[block])
        data = self.source.store.read_ranges(shard.object_name, [(start, end)])[0]
        if len(data) != end - start:     # read_ranges checks this; a block file must never be short
            raise RemoteDataError(f"{shard.tar}: {len(data)} bytes at {start} where {end - start} were asked for")
        return data

    def _open_block(self, block: int) -> int:
        return self.source.cache.open(self.block_name(block), lambda: self.fetch(block))

    @contextmanager
    def located(self, ids: np.ndarray):
        blocks, which = np.unique(self.block_of[ids], return_inverse=True)
        fds = []
        try:
            for block in blocks.tolist():
                fds.append(self._open_block(block))
            base = self.block_start[self.block_of[ids]]
            members = self.members[ids]
            yield decode_engine.StoredSamples(ids, np.array(fds, np.int32)[which], members[:, 0] - base,
                                              members[:, 1], members[:, 2] - base)
        finally:
            for fd in fds:
                os.close(fd)

    def read(self, sample_id: int) -> tuple[bytes, int]:
        block = int(self.block_of[sample_id])
        base = int(self.block_start[block])
        image_at, image_size, label_at = (int(v) for v in self.members[sample_id])
        image_at, label_at = image_at - base, label_at - base
        fd = self._open_block(block)
        try:
            data = os.pread(fd, int(self.block_end[block]) - base, 0)
        finally:
            os.close(fd)
        label = int.from_bytes(data[label_at:label_at + 4], "little", signed=True)
        return data[image_at:image_at + image_size], label

    def read_ahead(self, plan: list[np.ndarray], start: int) -> None:
        """Starts fetching the blocks of plan[start:] in the background (stopping any earlier read-ahead)."""
        self.stop_read_ahead()
        self._reader = _ReadAhead(self, plan, start)

    def consumed(self, batch_index: int) -> None:
        """Batch `batch_index` of the plan has been handed out: the read-ahead may go further."""
        if self._reader is not None:
            self._reader.advance(batch_index)

    def stop_read_ahead(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    def close(self) -> None:
        self.stop_read_ahead()
        super().close()

    __del__ = close


class _ReadAhead:
    """Fetches a plan's blocks in the order of their first use, a window of batches ahead of the
    consumer. Its failures are dropped: the consumer fetches the block itself and reports them."""

    def __init__(self, shards: RemoteShards, plan: list[np.ndarray], start: int):
        self.shards = shards
        self.position = start
        self.stopped = False
        self._changed = threading.Condition()
        firsts, seen = [], set()
        for index in range(start, len(plan)):
            for block in dict.fromkeys(shards.block_of[plan[index]].tolist()):
                if block not in seen:
                    seen.add(block)
                    firsts.append((index, block))
        sizes = shards.block_end - shards.block_start
        per_batch = sum(int(sizes[b]) for _, b in firsts) / max(1, len(plan) - start)
        self.window = max(4, int(shards.ahead_bytes // max(per_batch, 1)))
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="read-ahead")
        self._thread = threading.Thread(target=self._run, args=(firsts,), daemon=True, name="read-ahead")
        self._thread.start()

    def _run(self, firsts) -> None:
        for index, block in firsts:
            with self._changed:
                self._changed.wait_for(lambda: self.stopped or index <= self.position + self.window)
                if self.stopped:
                    return
            self._pool.submit(self._fetch, block)

    def _fetch(self, block: int) -> None:
        if self.stopped:
            return
        try:
            self.shards.source.cache.get(self.shards.block_name(block), lambda: self.shards.fetch(block))
        except Exception:   # noqa: BLE001 - the consumer meets it again and reports it
            pass

    def advance(self, batch_index: int) -> None:
        with self._changed:
            self.position = max(self.position, batch_index)
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self.stopped = True
            self._changed.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
