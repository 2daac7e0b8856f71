"""The blocks of a split larger than the node's cache, held in the loader's own memory only while
the epoch's plan still needs them, fetched by threads here: one of the places a block lives
(`pipeline/remote/block_sources.py`), and where the fetch process's blocks come from should it not
give them.

On disk such a split's blocks would each be written, read back and evicted before an epoch
came back to them: a copy into the page cache and one out of it for nothing. Here a block is
a buffer in memory; the decode engine reads its samples where they lie
(`decode_engine.StoredSamples.bases`). A block is let go once the consumer has passed the
last batch of the plan that reads it, so what is held is bounded by the read-ahead window and
the blocks the current batches read. No two fetches of one block run at once in a process:
the second waits for the first.

A response is copied once into a buffer of this store's own, reused from block to block: the
client library's buffers, freed by other threads than made them and held for different
times, would otherwise fragment the heap until the process grew well past what it holds.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pipeline.remote.block_plan import BlockPlan, BlockReads
from pipeline.remote.read_ahead import ReadsAhead


@dataclass
class _Block:
    data: memoryview
    address: int
    holders: int = 0
    ready: Future = field(default_factory=Future)
    buffer: np.ndarray | None = None
    filled: bool = False        # ready, without a Future's lock: read per block, per batch


class Streamed:
    """A source a split streams through: every epoch fetches its blocks again, nothing is kept."""

    in_memory = True

    def forget(self, block: int) -> None:
        pass                # nothing kept: the next epoch fetches it again


class MemoryBlocks(ReadsAhead, Streamed):
    """Fetched blocks by number. The read-ahead's bytes bound what is kept when no plan says when
    a block is done with (reads outside an epoch's plan): past them, the least recently used
    blocks that no reader holds are let go."""

    def __init__(self, blocks: BlockPlan, fetch: Callable[[int], memoryview]):
        """fetch(block): its bytes."""
        self.blocks, self._fetch = blocks, fetch
        self.most_bytes = blocks.ahead_bytes
        self.buffer_bytes = blocks.block_bytes  # a block's usual most; a larger one gets a buffer of its own
        self._free_buffers: list[np.ndarray] = []
        self.bytes_held = 0
        self.peak_bytes = 0
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._last_use: dict[int, int] = {}
        # The blocks no plan reads, least recently used first: the only ones `most_bytes` can
        # let go, kept apart so that letting go is not a walk over every block held
        self._unplanned: dict[int, None] = {}
        self._lock = threading.Lock()

    def read_ahead(self, plan: list[np.ndarray], start: int, following=None) -> None:
        """Plans the epoch from batch `start` on and fetches its blocks ahead."""
        self.stop_read_ahead()
        self.plan_epoch(plan, start)
        self.fetch_ahead(plan, start, following)

    def fetch_ahead(self, plan: list[np.ndarray], start: int, following=None, only: set[int] | None = None) -> None:
        """Fetches the blocks of plan[start:] (those in `only`, where given) ahead by threads, and
        those the next epoch reads first."""
        self._read_ahead(self.blocks, plan, start, following, only)

    def plan_epoch(self, plan: list[np.ndarray], start: int) -> np.ndarray:
        """The epoch's plan from batch `start` on: blocks it does not read are let go now, the
        others once past their last batch. Returns its blocks in the order of their first use."""
        order, _, last = self.blocks.uses(plan[start:], start)
        last_use = dict(zip(order.tolist(), last.tolist()))
        with self._lock:
            self._last_use = last_use
            for block in [b for b, held in self._blocks.items() if b not in last_use and not held.holders]:
                self._drop(block)
            self._unplanned = {block: None for block in self._blocks if block not in last_use}
        return order

    def keep_for_next_epoch(self, last_use: dict[int, int]) -> None:
        """More of the plan (the next epoch's, its batch indices counted on from this one's)."""
        with self._lock:
            for block, index in last_use.items():
                self._last_use[block] = max(index, self._last_use.get(block, index))
                self._unplanned.pop(block, None)

    def consumed(self, batch_index: int) -> None:
        """Batches up to `batch_index` are made: the blocks only they read are let go."""
        super().consumed(batch_index)
        with self._lock:
            for block in [b for b, held in self._blocks.items()
                          if not held.holders and self._last_use.get(b, batch_index + 1) <= batch_index]:
                self._drop(block)

    def prefetch(self, block: int) -> None:
        """Fetches a block the plan will read, unless it is here or on its way."""
        self._unhold([self._acquire(block)])

    @contextmanager
    def held(self, reads: BlockReads):
        """(fds, addresses) of the blocks read, fetched where need be and kept while the context
        lasts: no file, the memory holding each."""
        with self.holding(reads.blocks.tolist()) as (addresses, _):
            yield np.full(len(addresses), -1, np.int32), np.array(addresses, np.uint64)

    def holds(self, reads: BlockReads) -> bool:
        """Whether every block read is here or on its way."""
        with self._lock:
            return all(block in self._blocks for block in reads.blocks.tolist())

    def read(self, block: int, first: int, end: int) -> bytes:
        """The bytes from `first` to `end` (offsets in its shard) of a block."""
        with self.holding([block]) as (_, buffers):
            base = int(self.blocks.block_start[block])
            return bytes(buffers[0][first - base:end - base])

    @contextmanager
    def holding(self, blocks: list[int]):
        """The memory addresses of the blocks, fetched where need be and kept while the context
        lasts, with the buffers holding them."""
        entries = []
        try:
            with self._lock:        # a batch's blocks are mostly here already: held under one lock
                for block in blocks:
                    entry = self._blocks.get(block)
                    entries.append(self._hold(block, entry) if entry is not None and entry.filled else None)
            for i, block in enumerate(blocks):
                if entries[i] is None:
                    entries[i] = self._acquire(block)
            yield [entry.address for entry in entries], [entry.data for entry in entries]
        finally:
            self._unhold([entry for entry in entries if entry is not None])

    def _acquire(self, block: int) -> _Block:
        """The block, fetched here or by another thread, held once more."""
        for attempt in (0, 1):
            entry, fetching = self._entry(block)
            try:
                if fetching:
                    self._fill(block, entry)
                elif not entry.filled:
                    entry.ready.result()
                return entry
            except BaseException:
                self._unhold([entry])
                if fetching or attempt:     # another thread's failure (a read-ahead's) is tried once more here
                    raise
        raise AssertionError("unreachable")

    def _unhold(self, entries: list[_Block]) -> None:
        with self._lock:
            for entry in entries:
                entry.holders -= 1
            self._trim()

    def _entry(self, block: int) -> tuple[_Block, bool]:
        """The block's entry, held once more, and whether the caller is to fetch it."""
        with self._lock:
            entry = self._blocks.get(block)
            fetching = entry is None
            if fetching:
                entry = self._blocks[block] = _Block(memoryview(b""), 0)
            return self._hold(block, entry), fetching

    def _hold(self, block: int, entry: _Block) -> _Block:
        """Under the lock: the entry held once more, and used most recently."""
        self._blocks.move_to_end(block)
        if block not in self._last_use:
            self._unplanned.pop(block, None)
            self._unplanned[block] = None
        entry.holders += 1
        return entry

    def _fill(self, block: int, entry: _Block) -> None:
        try:
            data = self._fetch(block)
        except BaseException as error:
            with self._lock:                    # the next reader tries again
                if self._blocks.get(block) is entry:
                    del self._blocks[block]
                    self._unplanned.pop(block, None)
            entry.ready.set_exception(error)
            raise
        with self._lock:
            buffer = self._free_buffers.pop() if self._free_buffers and len(data) <= self.buffer_bytes else None
        if buffer is None:
            buffer = np.empty(max(len(data), self.buffer_bytes), np.uint8)
        buffer[:len(data)] = np.frombuffer(data, np.uint8)
        entry.buffer, entry.data, entry.address = buffer, memoryview(buffer)[:len(data)], buffer.ctypes.data
        with self._lock:
            self.bytes_held += len(data)
            self.peak_bytes = max(self.peak_bytes, self.bytes_held)
            entry.filled = True
        entry.ready.set_result(None)

    def _trim(self) -> None:
        if self.bytes_held <= self.most_bytes:
            return
        for block in list(self._unplanned):
            if self.bytes_held <= self.most_bytes:
                return
            held = self._blocks[block]
            if not held.holders and held.filled:
                self._drop(block)

    def _drop(self, block: int) -> None:
        entry = self._blocks.pop(block)
        self._unplanned.pop(block, None)
        if entry.filled:
            self.bytes_held -= len(entry.data)
            if len(entry.buffer) == self.buffer_bytes:
                self._free_buffers.append(entry.buffer)

    def clear(self) -> None:
        with self._lock:
            for block in [b for b, held in self._blocks.items() if not held.holders]:
                self._drop(block)

    def close(self) -> None:
        self.stop_read_ahead()
