"""Where the blocks of a split read from a URL live, and which of those places serves them: the
reader (`pipeline/remote/shards.py`) asks `SplitSources`, the one place that chooses, and reads
through one interface (`BlockSource`) without knowing which it holds.

The places:
- `DiskBlocks`: files in the node's cache on disk (`pipeline/remote/block_cache.py`), where later
  epochs find them;
- `FetchProcessBlocks`: slots of memory shared with a fetch process of their own
  (`pipeline/remote/shared_blocks.py`), so that fetching takes no turns of the loader's GIL from
  the training step;
- `MemoryBlocks`: buffers in the loader's own memory, fetched by threads here
  (`pipeline/remote/memory_blocks.py`).

Which serves, decided when the split is opened and again at each epoch's start, never within one:
1. the disk, while the split fits the cache's limit and the room its disk has (a disk that fills
   mid-run lowers the limit: the next epoch streams);
2. else the fetch process, started when the split is opened, or as soon as its manifest shows
   that it streams (`pipeline/remote/dataset.py`; its interpreter loads meanwhile), and set up at
   the first plan; what it does not give (a block it failed to fetch, one read
   outside the plan, one larger than its slots) comes from the memory source;
3. else, before the first plan, and for good once the process did not start or ended, the memory
   source alone.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol

import numpy as np

from pipeline.errors import RemoteDataError
from pipeline.formats.converted import Shard
from pipeline.remote.block_cache import OpenBlocks
from pipeline.remote.block_fetcher import FetcherSettings
from pipeline.remote.block_plan import BlockPlan, BlockReads, Visits, most_held
from pipeline.remote.memory_blocks import MemoryBlocks, Streamed
from pipeline.remote.read_ahead import ReadsAhead
from pipeline.remote.shared_blocks import FetchProcess, SharedBlocks

if TYPE_CHECKING:
    from pipeline.remote.dataset import RemoteSource

MIB = 1 << 20
LEAST_STREAMED_REQUESTS = 16   # in flight from the fetch process at least, and at most where the round trip needs them
MOST_STREAMED_REQUESTS = 64
OPEN_BLOCKS = 512              # block files kept open when no batch holds them
SPARE_SLOTS = 1.25             # over the first plan's most blocks held: later epochs' shuffles differ

log = logging.getLogger(__name__)


class BlockSource(Protocol):
    in_memory: bool     # whether the split streams through memory, fetched again each epoch

    def held(self, reads: BlockReads) -> ContextManager[tuple[np.ndarray, np.ndarray]]:
        """(fds, addresses) of the blocks read, each fetched where need be and kept while the
        context lasts: per block, a file to read it from, or the address of memory holding it
        (0 where it is read from its file: `decode_engine.StoredSamples`)."""

    def read(self, block: int, first: int, end: int) -> bytes:
        """The bytes from `first` to `end` (offsets in its shard) of a block."""

    def holds(self, reads: BlockReads) -> bool:
        """Whether every block read is held here or on its way."""

    def read_ahead(self, plan: list[np.ndarray], start: int,
                   following: Callable[[], list[np.ndarray]] | None = None) -> None:
        """Starts fetching the blocks of plan[start:] in the background (stopping any earlier
        read-ahead), and then those that `following()`, the next epoch's plan, reads first."""

    def consumed(self, batch_index: int) -> None:
        """Batch `batch_index` of the plan has been handed out: the read-ahead may go further,
        and blocks no later batch reads may be let go."""

    def stop_read_ahead(self) -> None: ...

    def forget(self, block: int) -> None:
        """The block's bytes are damaged: where it is kept for later epochs, let it be fetched again."""

    def close(self) -> None: ...


@dataclass
class SplitBlocks:
    """A split's blocks as the sources see them: where they lie, and how one is fetched."""
    plan: BlockPlan
    shards: list[Shard]
    source: RemoteSource
    _names: dict[int, str] = field(default_factory=dict)

    def name(self, block: int) -> str:
        """The block's name in the cache."""
        name = self._names.get(block)
        if name is None:
            shard = self.shards[int(self.plan.block_shard[block])]
            name = self._names[block] = f"{self.source.dataset}/{shard.object_name}.{self.plan.block_bytes}.{block}"
        return name

    def fetch(self, block: int) -> memoryview:
        shard = self.shards[int(self.plan.block_shard[block])]
        start, end = int(self.plan.block_start[block]), int(self.plan.block_end[block])
        data = self.source.store.read_ranges(shard.object_name, [(start, end)])[0]
        if len(data) != end - start:     # read_ranges checks this; a block file must never be short
            raise RemoteDataError(f"{shard.tar}: {len(data)} bytes at {start} where {end - start} were asked for")
        return data


class SplitSources:
    """Which source serves a split's blocks (`serving`), chosen as the module docstring says, and
    the reads passed on to it."""

    def __init__(self, split: SplitBlocks):
        self.split = split
        self.disk: DiskBlocks | None = DiskBlocks(split) if _keeps_on_disk(split) else None
        self.memory: MemoryBlocks | None = None
        self.fetch_process: FetchProcessBlocks | None = None
        early = None if self.disk is None else split.source.take_fetch_process()
        if early is not None:           # started for a split that, after all, stays on disk
            early.close()
        if self.disk is None:
            self._stream()
        self.serving: BlockSource = self.disk or self.memory

    @property
    def in_memory(self) -> bool:
        """Whether the split streams through memory, fetched again each epoch."""
        return self.serving.in_memory

    def _stream(self) -> None:
        """From now on the split streams: the memory source, and the fetch process started."""
        self.memory = MemoryBlocks(self.split.plan, self.split.fetch)
        try:
            process = self.split.source.take_fetch_process() or FetchProcess()
            self.fetch_process = FetchProcessBlocks(self.split, self.memory, process)
        except OSError as error:
            self._lost_fetch_process(error)

    def read_ahead(self, plan: list[np.ndarray], start: int, following=None) -> None:
        """The epoch's source chosen, and its read-ahead started from batch `start`."""
        self.serving.stop_read_ahead()
        if self.disk is not None and self.split.plan.split_bytes > self.split.source.cache.limit:
            # Its disk filled and the cache's limit was lowered below the split (`BlockCache`):
            # keeping it would mean evicting each block before an epoch came back to it
            cache = self.split.source.cache
            log.log(cache.message_level, "%s: the split (%s MiB) no longer fits the room left on its disk: it "
                    "streams through memory from now on", cache.root, f"{self.split.plan.split_bytes / MIB:,.0f}")
            self.disk.stop_keeping()
            self.disk = None
            self._stream()
        self.serving = self.disk or self._planned_fetch_process(plan, start, following) or self.memory
        if self.serving is not self.fetch_process:
            self.serving.read_ahead(plan, start, following)

    def _planned_fetch_process(self, plan: list[np.ndarray], start: int, following) -> FetchProcessBlocks | None:
        """The fetch process's source with this epoch's plan; None where there is none, or it did not
        start or ended."""
        if self.fetch_process is None:
            return None
        try:
            self.fetch_process.read_ahead(plan, start, following)
        except OSError as error:
            self._lost_fetch_process(error)
        return self.fetch_process

    def _lost_fetch_process(self, error: OSError) -> None:
        """One line on why threads here fetch from now on; the fetch process closed."""
        if self.fetch_process is None or self.fetch_process.shared is None:
            log.warning("[loader] fetching in this process: the fetch process did not start (%s)", error)
        else:
            log.warning("[loader] the fetch process ended (exit status %s); fetching in this process from here on",
                        self.fetch_process.shared.process.poll())
        if self.fetch_process is not None:
            self.fetch_process.close()
        self.fetch_process = None

    def held(self, reads: BlockReads):
        return self.serving.held(reads)

    def holds(self, reads: BlockReads) -> bool:
        return self.serving.holds(reads)

    def read(self, block: int, first: int, end: int) -> bytes:
        return self.serving.read(block, first, end)

    def consumed(self, batch_index: int) -> None:
        self.serving.consumed(batch_index)

    def stop_read_ahead(self) -> None:
        self.serving.stop_read_ahead()

    def forget(self, block: int) -> None:
        self.serving.forget(block)

    def close(self) -> None:
        for source in (self.disk, self.fetch_process, self.memory):
            if source is not None:
                source.close()


def _keeps_on_disk(split: SplitBlocks) -> bool:
    """Whether the split's blocks are kept on disk: where it fits in the cache's limit and in the
    room its disk has; else they stream through memory, since on disk they would be evicted before
    an epoch came back to them."""
    return split.plan.split_bytes <= split.source.cache.limit and _fits_on_disk(split)


def _fits_on_disk(split: SplitBlocks) -> bool:
    """Whether the cache's disk has room for the blocks of the split it does not hold yet; one
    line saying so where it has not."""
    cache, sizes = split.source.cache, split.plan.sizes
    room = cache.room()
    if split.plan.split_bytes <= room:
        return True
    names = [split.name(block) for block in range(len(sizes))]
    held = cache.present(names)
    missing = int(sum(size for name, size in zip(names, sizes.tolist()) if name not in held))
    if missing <= room:
        return True
    log.log(cache.message_level, "%s: its disk has room for %s MiB (less a reserve for the run), the split needs %s MiB "
            "more: it streams through memory, fetched again each epoch (data.cache_dir on a larger disk keeps it)",
            cache.root, f"{room / MIB:,.0f}", f"{missing / MIB:,.0f}")
    return False


class DiskBlocks(ReadsAhead):
    """Blocks as files in the node's cache; the files batches read are kept open (`OpenBlocks`).
    Threads here fetch an epoch's blocks ahead, those the cache does not hold already."""

    in_memory = False

    def __init__(self, split: SplitBlocks):
        self.split = split
        cache = split.source.cache
        self._open = OpenBlocks(cache, max(4, min(OPEN_BLOCKS, cache.limit // 4 // split.plan.block_bytes)))

    def _wanted(self, blocks: list[int]):
        return [(self.split.name(block), partial(self.split.fetch, block)) for block in blocks]

    @contextmanager
    def held(self, reads: BlockReads):
        with self._open.held(self._wanted(reads.blocks.tolist())) as fds:
            yield np.array(fds, np.int32), np.zeros(len(fds), np.uint64)

    def holds(self, reads: BlockReads) -> bool:
        return len(self.already_held(reads.blocks.tolist())) == len(reads.blocks)

    def read(self, block: int, first: int, end: int) -> bytes:
        with self._open.held(self._wanted([block])) as fds:
            return os.pread(fds[0], end - first, first - int(self.split.plan.block_start[block]))

    def forget(self, block: int) -> None:
        self._open.forget(self.split.name(block))

    def prefetch(self, block: int) -> None:
        """Fetches a block a coming batch reads, unless a thread or process already has."""
        self.split.source.cache.get(self.split.name(block), partial(self.split.fetch, block))

    def already_held(self, blocks: list[int]) -> set[int]:
        present = self.split.source.cache.present([self.split.name(block) for block in blocks])
        return {block for block in blocks if self.split.name(block) in present}

    def read_ahead(self, plan: list[np.ndarray], start: int, following=None) -> None:
        self._read_ahead(self.split.plan, plan, start, following)

    def stop_keeping(self) -> None:
        """The split streams from now on: no more read-ahead, and the files no batch holds closed."""
        self.stop_read_ahead()
        self._open.close_unheld()

    def close(self) -> None:
        self.stop_read_ahead()
        self._open.close()


class FetchProcessBlocks(Streamed):
    """Blocks in slots of the fetch process's memory (`SharedBlocks`), set up at the first plan
    with slots sized from it. What it does not give (a block it failed to fetch, one read outside
    the plan, one larger than its slots, which threads here fetch ahead) comes from `memory`.
    An OSError from planning means the process did not start or ended: `SplitSources` moves on."""

    def __init__(self, split: SplitBlocks, memory: MemoryBlocks, process: FetchProcess):
        """`process`: the fetch process, started, to set up at the first plan."""
        self.split, self.memory, self._process = split, memory, process
        self.shared: SharedBlocks | None = None
        self.visit_gap: int | None = None      # set at the first plan, kept: see `BlockPlan.epoch_visits`
        self._base, self._plan_length = 0, 0    # where this plan's batch 0 lies, counted across epochs

    @contextmanager
    def held(self, reads: BlockReads):
        addresses = self.shared.addresses(reads.blocks, *reads.spans)
        missing = np.flatnonzero(addresses == 0)
        fds = np.full(len(addresses), -1, np.int32)
        if not len(missing):
            yield fds, addresses
            return
        with self.memory.holding(reads.blocks[missing].tolist()) as (held, _):
            addresses[missing] = held
            yield fds, addresses

    def holds(self, reads: BlockReads) -> bool:
        return self.shared is not None and self.shared.has(reads.blocks, *reads.spans)

    def read(self, block: int, first: int, end: int) -> bytes:
        # In the fetch process's memory, the block stays while the batch reading the sample is not handed out
        shared = (self.shared.view(block)
                  if self.shared.addresses(np.array([block]), np.array([first]), np.array([end]))[0] else None)
        if shared is None:
            return self.memory.read(block, first, end)
        base = int(self.split.plan.block_start[block])
        return bytes(shared[first - base:end - base])

    def read_ahead(self, plan: list[np.ndarray], start: int, following=None) -> None:
        """Plans the fetch process from batch `start` on; an OSError where it did not start or ended."""
        self.stop_read_ahead()
        blocks = self.split.plan
        self._base, self._plan_length = self._base + self._plan_length, len(plan)
        window = blocks.window(self.memory.plan_epoch(plan, start), len(plan) - start)
        if self.visit_gap is None:     # one gap for every plan, so a visit fetched ahead is the next plan's
            self.visit_gap = window
        visits = blocks.epoch_visits(plan, start, following, self._base, self.visit_gap, window)
        if self.shared is None:
            self.shared = self._set_up(visits, window)
        left_out = self.shared.plan(visits, window, position=self._base + start - 1)
        if left_out:     # blocks larger than its slots (a sample larger than the fetch size)
            self.memory.fetch_ahead(plan, start, following, only=left_out)

    def _set_up(self, visits: Visits, window: int) -> SharedBlocks:
        """The fetch process set up, its slots sized from the first plan's visits."""
        slots = int(most_held(visits.first, visits.last, window) * SPARE_SLOTS) + MOST_STREAMED_REQUESTS
        store, blocks = self.split.source.store, self.split.plan
        settings = FetcherSettings(store.client_url, store.options, [shard.object_name for shard in self.split.shards],
                                   blocks.block_shard, blocks.block_start, blocks.block_end, blocks.block_bytes,
                                   slots, LEAST_STREAMED_REQUESTS, MOST_STREAMED_REQUESTS)
        process, self._process = self._process, None
        try:
            return SharedBlocks(settings, process)
        except OSError:
            process.close()
            raise

    def _count(self) -> None:
        self.split.source.store.count(*self.shared.counted())

    def consumed(self, batch_index: int) -> None:
        self.shared.at(self._base + batch_index)
        self._count()
        self.memory.consumed(batch_index)

    def stop_read_ahead(self) -> None:
        self.memory.stop_read_ahead()

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None
        if self.shared is not None:
            self._count()
            self.shared.close()
            self.shared = None
