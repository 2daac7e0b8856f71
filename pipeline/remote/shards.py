"""A WebDataset split read from a URL: the same indexed array of samples as on local disk
(`pipeline/shards/index.py`, whose epoch plans it keeps), its bytes fetched in blocks.

A block is a run of consecutive samples of one shard, at most `fetch_size` long, fetched in one
range request (`pipeline/remote/block_plan.py`). Blocks are cut at sample boundaries, so a rank that
reads only its part of a shard fetches little beyond it, and each sample lies in one block: the
decode engine reads it from there as it reads a tar, so the batches are bit for bit those of the
same shards on local disk.

Where the blocks are kept, and how they are fetched ahead of the batches that read them, is the
block sources' (`pipeline/remote/block_sources.py`, which chooses): the node's cache on disk for a
split that fits in it, memory for a larger one, which streams through it, fetched again each epoch. When an epoch
starts, the blocks of the coming batches are fetched in the order of their first use, several
requests at once, at most `ahead_bytes` ahead of the batch being consumed, so latency is hidden
and the cache is never flooded. An epoch's first batch, where its blocks are not held, reads its
samples' own ranges, fetched before the read-ahead starts (`pipeline/remote/first_batch.py`).
"""
from __future__ import annotations

from contextlib import contextmanager
import logging
from typing import Callable

import numpy as np

from pipeline.decode import engine as decode_engine
from pipeline.errors import FAILS_CHECKSUM, CorruptSample
from pipeline.formats.converted import Shard
from pipeline.remote.block_plan import BLOCK_BYTES, MIN_WINDOW, BlockPlan
from pipeline.remote.block_sources import LEAST_STREAMED_REQUESTS, MOST_STREAMED_REQUESTS, SplitBlocks, SplitSources
from pipeline.remote.first_batch import FirstBatch
from pipeline.shards.index import StoredShards
from pipeline.spec import parse_size

__all__ = ["RemoteShards", "LEAST_STREAMED_REQUESTS", "MOST_STREAMED_REQUESTS"]   # the last two: the fetch-ceiling benchmark imports them from here

AHEAD_BYTES = 256 << 20        # at most; a quarter of the cache's limit where that is less
HEALING_FETCHES = 3            # a sample failing its checksum is fetched again at most this many times
log = logging.getLogger(__name__)


class RemoteShards(StoredShards):
    def __init__(self, shards: list[Shard], source, block_bytes=None, reads_ahead: int = MIN_WINDOW - 1):
        """reads_ahead: the most batches past the one last handed out (`consumed`) whose samples
        the loader reads."""
        super().__init__(shards)
        self.source = source
        self.reads_ahead = reads_ahead
        self.block_bytes = parse_size(block_bytes) if block_bytes is not None else BLOCK_BYTES
        self.ahead_bytes = min(AHEAD_BYTES, source.cache.limit // 4)
        self.block_plan = plan = BlockPlan(self.members, self.counts, self.shard_of, self.block_bytes,
                                           self.ahead_bytes, reads_ahead)
        self.block_of, self.block_start, self.block_end = plan.block_of, plan.block_start, plan.block_end
        self.block_shard, self.split_bytes = plan.block_shard, plan.split_bytes
        self.sources = SplitSources(SplitBlocks(plan, shards, source))
        self._first_batch: FirstBatch | None = None

    @property
    def in_memory(self) -> bool:
        """Whether the split streams through memory, fetched again each epoch."""
        return self.sources.in_memory

    @contextmanager
    def located(self, ids: np.ndarray):
        first, self._first_batch = self._first_batch, None
        if first is not None and first.is_for(ids):
            yield first.samples
            return
        reads = self.block_plan.reads(ids)
        with self.sources.held(reads) as (fds, bases):
            base = self.block_start[self.block_of[ids]]
            members = self.members[ids]
            yield decode_engine.StoredSamples(ids, fds[reads.which], members[:, 0] - base, members[:, 1],
                                              members[:, 2] - base, bases=bases[reads.which],
                                              checksums=self.checksums[ids] if self.checksums is not None else None)

    def read(self, sample_id: int) -> tuple[bytes, int]:
        image_at, image_size, label_at = (int(v) for v in self.members[sample_id])
        first, end = min(image_at, label_at), max(image_at + image_size, label_at + 4)
        chunk = self.sources.read(int(self.block_of[sample_id]), first, end)
        try:
            return self.checked(sample_id, chunk, image_at - first, image_size, label_at - first)
        except CorruptSample:
            chunk = self.healed(sample_id)
            return self.checked(sample_id, chunk, image_at - first, image_size, label_at - first)

    def healed(self, sample_id: int):
        """The bytes from a sample's first (image or label) to its last, fetched again from the store
        after they failed their checksum (an answer damaged in transit, or a cached block since), up
        to HEALING_FETCHES times; its block is dropped from the cache, so that later epochs fetch it
        whole again. A CorruptSample naming the sample when every answer fails too."""
        image_at, image_size, label_at = (int(v) for v in self.members[sample_id])
        first, end = min(image_at, label_at), max(image_at + image_size, label_at + 4)
        shard = self.shards[int(self.shard_of[sample_id])]
        self.sources.forget(int(self.block_of[sample_id]))
        for attempt in range(1, HEALING_FETCHES + 1):
            chunk = bytes(self.source.store.read_ranges(shard.object_name, [(first, end)])[0])   # sent to workers
            try:
                self.checked(sample_id, chunk, image_at - first, image_size, label_at - first)
            except CorruptSample:
                continue
            log.warning("%s: its bytes failed their checksum; fetched again, sound (fetch %d)", self.name(sample_id),
                        attempt)
            return chunk
        raise CorruptSample(f"{self.name(sample_id)}: {FAILS_CHECKSUM}, as "
                            f"fetched {HEALING_FETCHES} more times")

    def read_ahead(self, plan: list[np.ndarray], start: int,
                   following: Callable[[], list[np.ndarray]] | None = None, first_batch_located: bool = False) -> None:
        """Starts fetching the blocks of plan[start:] in the background (stopping any earlier
        read-ahead), and then those that `following()`, the next epoch's plan, reads first, so that
        an epoch streamed through memory starts without waiting. first_batch_located: batch
        `start` is read by `located`; its samples are fetched alone first where its blocks are not held."""
        self._first_batch = None
        if first_batch_located and start < len(plan) and not self.sources.holds(self.block_plan.reads(plan[start])):
            try:
                self._first_batch = FirstBatch(plan[start], self.source.store, self.shards, self.shard_of, self.members,
                                               self.checksums)
            except Exception as error:   # noqa: BLE001 - the batch reads its blocks, whose fetch reports what fails
                log.debug("the first batch's samples, fetched alone: %s", error)
        self.sources.read_ahead(plan, start, following)

    def consumed(self, batch_index: int) -> None:
        """Batch `batch_index` of the plan has been handed out: the read-ahead may go further,
        and in memory the blocks no later batch reads are let go."""
        self.sources.consumed(batch_index)

    def stop_read_ahead(self) -> None:
        self._first_batch = None
        self.sources.stop_read_ahead()

    def close(self) -> None:
        if getattr(self, "sources", None) is not None:
            self.sources.close()
        super().close()

    __del__ = close
