"""Where a split's samples lie in blocks, and when an epoch's plan reads each: the arithmetic of
reading a WebDataset split from a URL (`pipeline/remote/shards.py`), apart from the fetching.

A block is a run of consecutive samples of one shard, at most `block_bytes` long (a sample
larger than that is a block alone), fetched in one range request; blocks are cut at sample
boundaries, so each sample lies in one block. A visit is a run of batches that read a block
with few batches between them, and the bytes of the block they read: a split streamed through
memory fetches a block once per visit (`pipeline/remote/shared_blocks.py`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

BLOCK_BYTES = 1 << 20


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
