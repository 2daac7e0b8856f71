"""Where a split's samples lie in blocks, and when an epoch's plan reads each: the arithmetic of
reading a WebDataset split from a URL (`pipeline/remote/shards.py`), apart from the fetching.
`BlockPlan` holds a split's blocks and how far ahead of the consumer they are read: the window
of batches, and what of the next epoch fits in the read-ahead's bytes.

A block is a run of consecutive samples of one shard, at most `block_bytes` long (a sample
larger than that is a block alone), fetched in one range request; blocks are cut at sample
boundaries, so each sample lies in one block. A visit is a run of batches that read a block
with few batches between them, and the bytes of the block they read: a split streamed through
memory fetches a block once per visit (`pipeline/remote/shared_blocks.py`).
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, NamedTuple

import numpy as np

BLOCK_BYTES = 1 << 20
MIN_WINDOW = 4                 # batches read ahead at least


class Visits(NamedTuple):
    """Each time a block is read, in the order of the first batches: the block, its first and last
    batch (counted on across epochs), and the first and one-past-last byte of it those batches read
    (offsets in its shard, within the block's)."""
    blocks: np.ndarray
    first: np.ndarray
    last: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def select(self, which: np.ndarray) -> Visits:
        """The visits a mask or an index array picks."""
        return Visits(*(column[which] for column in self))


def most_held(first: np.ndarray, last: np.ndarray, window: int) -> int:
    """The most blocks held at once when each is fetched `window` batches before its first use
    and let go after its last: the slots that window needs."""
    if not len(first):
        return 0
    lo = first - window - first.min() + window
    counts = np.zeros(int(last.max() - first.min()) + window + 2, np.int64)
    np.add.at(counts, lo, 1)
    np.add.at(counts, last - first.min() + window, -1)
    return int(np.cumsum(counts).max())


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


def block_visits(block_of: np.ndarray, members: np.ndarray, batches: list[np.ndarray], offset: int,
                 gap: int, next_epoch: int | None = None, reads_ahead: int = 0) -> Visits:
    """Each time a block is read: a run of the batches reading it with at most `gap` batches
    between two, and the bytes of it they read, in the order of their first batches (batch i
    counted as offset + i). Where two of the plan's lanes meet (`pipeline/shards/index.py`), a block
    is read at the epoch's start and again at its end: as one visit, it would be held all epoch;
    as two, each holds a slot a few dozen batches, and their bytes together are the block's.

    Where `batches` go on into the next epoch, from batch `next_epoch`, reads on either side of
    it are one visit only within `reads_ahead` batches (where the loader may read both at once):
    a short epoch (a rank's part of a validation split) is not held through the next."""
    if not batches:
        empty = np.empty(0, np.int64)
        return Visits(empty, empty, empty, empty, empty)
    ids = np.concatenate(batches)
    lengths = np.fromiter(map(len, batches), np.int64, len(batches))
    batch = np.repeat(np.arange(offset, offset + len(batches), dtype=np.int64), lengths)
    blocks = block_of[ids]
    by_block = np.lexsort((batch, blocks))
    ids, blocks, batch = ids[by_block], blocks[by_block], batch[by_block]
    opens = np.ones(len(ids), bool)          # a read that begins a visit
    apart = batch[1:] - batch[:-1]
    opens[1:] = (blocks[1:] != blocks[:-1]) | (apart > gap)
    if next_epoch is not None:
        opens[1:] |= (batch[:-1] < next_epoch) & (batch[1:] >= next_epoch) & (apart > reads_ahead)
    begins = np.flatnonzero(opens)
    starts, ends = sample_spans(members[ids])
    visits = Visits(blocks[begins], batch[begins], batch[np.append(begins[1:] - 1, len(ids) - 1)],
                    np.minimum.reduceat(starts, begins), np.maximum.reduceat(ends, begins))
    return visits.select(np.argsort(visits.first, kind="stable"))


def block_uses(block_of: np.ndarray, batches: list[np.ndarray], offset: int = 0):
    """(blocks in the order of their first use, first use, last use) over `batches`, batch i
    counted as offset + i."""
    if not batches:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    lengths = np.fromiter(map(len, batches), np.int64, len(batches))
    blocks = block_of[np.concatenate(batches)]
    batch = np.repeat(np.arange(offset, offset + len(batches), dtype=np.int64), lengths)
    order, first_at = np.unique(blocks, return_index=True)
    by_first = np.argsort(first_at, kind="stable")
    last = np.full(int(blocks.max()) + 1, -1, np.int64)
    np.maximum.at(last, blocks, batch)
    order = order[by_first]
    return order, batch[first_at[by_first]], last[order]


def within(sizes: np.ndarray, budget: int) -> int:
    """How many of `sizes`, taken in order, fit in `budget` bytes together."""
    return int(np.searchsorted(np.cumsum(sizes, dtype=np.int64), budget, side="right"))


class BlockReads:
    """The blocks a set of samples reads: `blocks` (each once), `which` (per sample, its block's
    place in `blocks`) and, asked for, `spans`."""

    def __init__(self, plan: BlockPlan, ids: np.ndarray):
        self._plan, self._ids = plan, ids
        self.blocks, self.which = np.unique(plan.block_of[ids], return_inverse=True)

    @cached_property
    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Per block, the first and one-past-last byte the samples read of it (offsets in its shard)."""
        sample_starts, sample_ends = sample_spans(self._plan.members[self._ids])
        starts = np.full(len(self.blocks), np.iinfo(np.int64).max, np.int64)
        ends = np.zeros(len(self.blocks), np.int64)
        np.minimum.at(starts, self.which, sample_starts)
        np.maximum.at(ends, self.which, sample_ends)
        return starts, ends


class BlockPlan:
    """A split's blocks: per sample its block (`block_of`), per block its shard and span of bytes;
    and how far ahead of the batch being consumed they are read: at most `ahead_bytes`, at least
    `reads_ahead` + 1 batches (those the loader reads past the one last handed out)."""

    def __init__(self, members: np.ndarray, counts: list[int], shard_of: np.ndarray, block_bytes: int,
                 ahead_bytes: int, reads_ahead: int):
        self.members, self.block_bytes = members, block_bytes
        self.ahead_bytes, self.reads_ahead = ahead_bytes, reads_ahead
        starts, ends = sample_spans(members)
        block_of, offset = [], 0
        for shard_index, count in enumerate(counts):
            first = int(shard_of.searchsorted(shard_index))
            block_of.append(offset + cut_blocks(starts[first:first + count], ends[first:first + count], block_bytes))
            offset = int(block_of[-1][-1]) + 1 if count else offset
        self.block_of = np.concatenate(block_of) if block_of else np.empty(0, np.int64)
        self.block_start = np.full(offset, np.iinfo(np.int64).max, np.int64)
        self.block_end = np.zeros(offset, np.int64)
        np.minimum.at(self.block_start, self.block_of, starts)
        np.maximum.at(self.block_end, self.block_of, ends)
        self.block_shard = np.zeros(offset, np.int32)
        self.block_shard[self.block_of] = shard_of
        self.sizes = self.block_end - self.block_start
        self.split_bytes = int(self.sizes.sum())

    def reads(self, ids: np.ndarray) -> BlockReads:
        return BlockReads(self, ids)

    def uses(self, batches: list[np.ndarray], offset: int = 0):
        """`block_uses` of this split's blocks."""
        return block_uses(self.block_of, batches, offset)

    def window(self, blocks: np.ndarray, batches: int) -> int:
        """Batches to read ahead: as many as `ahead_bytes` hold of the bytes per batch of `blocks`,
        read over `batches` batches."""
        per_batch = int(self.sizes[blocks].sum()) / max(1, batches)
        return max(MIN_WINDOW, self.reads_ahead + 1, int(self.ahead_bytes // max(per_batch, 1)))

    def next_epoch_firsts(self, firsts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Of the (batch, block) the next epoch reads first, in order, those `ahead_bytes` holds."""
        return firsts[:within(self.sizes[[block for _, block in firsts]], self.ahead_bytes)]

    def epoch_visits(self, plan: list[np.ndarray], start: int, following: Callable[[], list[np.ndarray]] | None,
                     base: int, gap: int, window: int) -> Visits:
        """The visits of plan[start:], batch i counted as base + i, then those of the next epoch
        that begin in its first `window` batches, as far as `ahead_bytes` goes (counting this
        epoch's visits that go on into the next), so that it starts without waiting. The two
        epochs' reads are cut into visits together, with one `gap` for the whole run: a visit
        fetched ahead then holds the bytes of the one the next plan begins with, and is kept for it.
        The next epoch's visit of a block this one reads last is fetched once that is let go."""
        batches = plan[start:] + (following() if following is not None else [])
        next_epoch = base + len(plan)
        visits = block_visits(self.block_of, self.members, batches, base + start, gap, next_epoch, self.reads_ahead)
        this_epoch = visits.first < next_epoch
        held_on = this_epoch & (visits.last >= next_epoch)      # a block read at its end and the next one's start
        ahead = np.flatnonzero(~this_epoch & (visits.first < next_epoch + window))
        budget = self.ahead_bytes - int((visits.end - visits.start)[held_on].sum())
        taken = ahead[:within(visits.end[ahead] - visits.start[ahead], budget)]
        return visits.select(np.sort(np.concatenate([np.flatnonzero(this_epoch), taken])))
