"""A WebDataset split read from a URL: the same indexed array of samples as on local disk
(`pipeline/shards/index.py`, whose epoch plans it keeps), its bytes fetched in blocks.

A block is a run of consecutive samples of one shard, at most `fetch_size` long, fetched in one
range request (`pipeline/remote/block_plan.py`). Blocks are cut at sample boundaries, so a rank that
reads only its part of a shard fetches little beyond it, and each sample lies in one block: the
decode engine reads it from there as it reads a tar, so the batches are bit for bit those of the
same shards on local disk. Where the blocks are kept:
- a split that fits in the cache's limit and in the room its disk has: in the node's cache on disk
  (`pipeline/remote/block_cache.py`), where later epochs find them; their files are kept open while
  batches read them. Should the disk fill mid-run, the split streams from the next epoch on;
- a larger one: in memory, while the epoch's plan still needs them, fetched by a process of its
  own into memory shared with this one (`pipeline/remote/shared_blocks.py`), so that fetching takes no
  turns of this process's GIL from the training step. A block that process does not give (one it
  failed to fetch, one read outside the plan) is fetched here and kept in `pipeline/remote/memory_blocks.py`;
  one larger than its slots (a sample larger than `fetch_size`) is fetched ahead here, by threads.
  That process fetches a block for each visit: a block read at the epoch's start
  and again at its end, where two lanes of the plan meet, is fetched twice, each time the bytes
  then read, rather than held all epoch.

Read-ahead: when an epoch starts, the blocks of the coming batches are fetched in the order of
their first use, several requests at once, at most `ahead_bytes` ahead of the batch being
consumed, so latency is hidden and the cache is never flooded: by that process in memory (16
requests at once, up to 64 where the round trip needs them), by FETCH_THREADS threads here
(`_ReadAhead`) into the cache on disk.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import numpy as np

from pipeline.decode import engine as decode_engine
from pipeline.remote.block_cache import OpenBlocks, node_level
from pipeline.spec import parse_size
from pipeline.remote.block_plan import BLOCK_BYTES, Visits, block_uses, block_visits, cut_blocks, most_held, sample_spans
from pipeline.errors import RemoteDataError
from pipeline.formats.converted import Shard
from pipeline.remote.memory_blocks import MemoryBlocks
from pipeline.remote.shared_blocks import SharedBlocks
from pipeline.shards.index import StoredShards

MIB = 1 << 20
FETCH_THREADS = 16
MOST_STREAMED_REQUESTS = 64    # in flight from the fetch process, where the round trip needs them
AHEAD_BYTES = 256 << 20        # at most; a quarter of the cache's limit where that is less
OPEN_BLOCKS = 512              # block files kept open when no batch holds them
MIN_WINDOW = 4                 # batches read ahead at least
SPARE_SLOTS = 1.25             # over the first plan's most blocks held: later epochs' shuffles differ

log = logging.getLogger(__name__)


class RemoteShards(StoredShards):
    def __init__(self, shards: list[Shard], source, block_bytes=None, reads_ahead: int = MIN_WINDOW - 1):
        """reads_ahead: the most batches past the one last handed out (`consumed`) whose samples
        the loader reads."""
        super().__init__(shards)
        self.source = source
        self.reads_ahead = reads_ahead
        self.block_bytes = block_bytes = parse_size(block_bytes) if block_bytes is not None else BLOCK_BYTES
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
        self._block_names: dict[int, str] = {}
        self._reader: _ReadAhead | None = None
        # A split larger than the cache, or than its disk has room for, streams through memory: on
        # disk its blocks would be evicted before an epoch came back to them
        sizes = self.block_end - self.block_start
        self.split_bytes = int(sizes.sum())
        self.in_memory = self.split_bytes > source.cache.limit or not self._fits_on_disk(sizes)
        self._memory = MemoryBlocks(self.ahead_bytes, block_bytes) if self.in_memory else None
        self._shared: SharedBlocks | None = None      # started at the first epoch, sized from its plan
        self._shared_failed = False
        self._base, self._plan_length = 0, 0          # where this plan's batch 0 lies, counted across epochs
        self._visit_gap: int | None = None            # set at the first plan, kept: see `_shared_plan`
        self._open = None if self.in_memory else OpenBlocks(
            source.cache, max(4, min(OPEN_BLOCKS, source.cache.limit // 4 // block_bytes)))

    def _fits_on_disk(self, sizes: np.ndarray) -> bool:
        """Whether the cache's disk has room for the blocks of the split it does not hold yet; one
        line saying so where it has not."""
        cache = self.source.cache
        room = cache.room()
        if self.split_bytes <= room:
            return True
        names = [self.block_name(block) for block in range(len(sizes))]
        held = cache.present(names)
        missing = int(sum(size for name, size in zip(names, sizes.tolist()) if name not in held))
        if missing <= room:
            return True
        log.log(node_level(), "%s: its disk has room for %s MiB (less a reserve for the run), the split needs %s MiB "
                "more: it streams through memory, fetched again each epoch (data.cache_dir on a larger disk keeps it)",
                cache.root, f"{room / MIB:,.0f}", f"{missing / MIB:,.0f}")
        return False

    def block_name(self, block: int) -> str:
        name = self._block_names.get(block)
        if name is None:
            shard = self.shards[int(self.block_shard[block])]
            name = self._block_names[block] = f"{self.source.dataset}/{shard.object_name}.{self.block_bytes}.{block}"
        return name

    def fetch(self, block: int) -> memoryview:
        shard = self.shards[int(self.block_shard[block])]
        start, end = int(self.block_start[block]), int(self.block_end[block])
        data = self.source.store.read_ranges(shard.object_name, [(start, end)])[0]
        if len(data) != end - start:     # read_ranges checks this; a block file must never be short
            raise RemoteDataError(f"{shard.tar}: {len(data)} bytes at {start} where {end - start} were asked for")
        return data

    def prefetch(self, block: int) -> None:
        """Fetches a block a coming batch reads, unless a thread or process already has."""
        if self._memory is not None:
            self._memory.prefetch(block, lambda: self.fetch(block))
        else:
            self.source.cache.get(self.block_name(block), lambda: self.fetch(block))

    @contextmanager
    def _holding(self, blocks: list[int], starts: np.ndarray | None, ends: np.ndarray | None):
        """The blocks, of which the bytes from `starts` to `ends` are read (needed only with the
        fetch process), fetched where need be, while the context lasts: (fds, None), the file
        descriptors of their files in the cache (kept open after), or (None, (addresses, buffers))
        of the memory holding them."""
        shared = self._shared
        if shared is not None and starts is not None:
            addresses = shared.addresses(np.asarray(blocks, np.int64), starts, ends)
            missing = [i for i, address in enumerate(addresses.tolist()) if not address]
            if not missing:
                yield None, (addresses, None)
                return
            with self._memory.held([(blocks[i], lambda block=blocks[i]: self.fetch(block)) for i in missing]) as held:
                addresses[missing] = held[0]
                yield None, (addresses, None)
        elif self._memory is not None:
            with self._memory.held([(block, lambda block=block: self.fetch(block)) for block in blocks]) as held:
                yield None, held
        else:
            with self._open.held([(self.block_name(block), lambda block=block: self.fetch(block))
                                  for block in blocks]) as fds:
                yield fds, None

    @contextmanager
    def located(self, ids: np.ndarray):
        blocks, which = np.unique(self.block_of[ids], return_inverse=True)
        starts = ends = None
        if self._shared is not None:     # the bytes of each block the batch reads, checked against what is held
            sample_starts, sample_ends = sample_spans(self.members[ids])
            starts, ends = np.full(len(blocks), np.iinfo(np.int64).max, np.int64), np.zeros(len(blocks), np.int64)
            np.minimum.at(starts, which, sample_starts)
            np.maximum.at(ends, which, sample_ends)
        with self._holding(blocks.tolist(), starts, ends) as (fds, in_memory):
            base = self.block_start[self.block_of[ids]]
            members = self.members[ids]
            if in_memory is None:
                fds, bases = np.array(fds, np.int32)[which], None
            else:
                fds, bases = np.full(len(ids), -1, np.int32), np.array(in_memory[0], np.uint64)[which]
            yield decode_engine.StoredSamples(ids, fds, members[:, 0] - base, members[:, 1], members[:, 2] - base,
                                              bases=bases)

    def read(self, sample_id: int) -> tuple[bytes, int]:
        block = int(self.block_of[sample_id])
        base = int(self.block_start[block])
        image_at, image_size, label_at = (int(v) for v in self.members[sample_id])
        first, end = min(image_at, label_at), max(image_at + image_size, label_at + 4)
        # In the fetch process's memory, the block stays while the batch reading the sample is not handed out
        shared = (self._shared.view(block) if self._shared is not None
                  and self._shared.addresses(np.array([block]), np.array([first]), np.array([end]))[0] else None)
        if shared is not None:
            chunk = bytes(shared[first - base:end - base])
        elif self._memory is not None:
            with self._memory.held([(block, lambda: self.fetch(block))]) as (_, buffers):
                chunk = bytes(buffers[0][first - base:end - base])
        else:
            with self._holding([block], np.array([first]), np.array([end])) as (fds, _):
                chunk = os.pread(fds[0], end - first, first - base)
        label = int.from_bytes(chunk[label_at - first:label_at - first + 4], "little", signed=True)
        return chunk[image_at - first:image_at - first + image_size], label

    def read_ahead(self, plan: list[np.ndarray], start: int,
                   following: Callable[[], list[np.ndarray]] | None = None) -> None:
        """Starts fetching the blocks of plan[start:] in the background (stopping any earlier
        read-ahead), and then those that `following()`, the next epoch's plan, reads first, so that
        an epoch streamed through memory starts without waiting."""
        self.stop_read_ahead()
        self._base, self._plan_length = self._base + self._plan_length, len(plan)
        if not self.in_memory and self.split_bytes > self.source.cache.limit:
            self._stream_through_memory()
        if self._memory is not None:
            uses = block_uses(self.block_of, plan[start:], start)
            self._memory.plan(dict(zip(uses[0].tolist(), uses[2].tolist())))
            if not self._shared_failed:
                window = self._window(plan, start, uses[0])
                visits = self._shared_plan(plan, start, following, window)
                if self._shared is None:
                    self._start_shared(visits, window)
                if self._shared is not None:
                    try:
                        left_out = self._shared.plan(visits, window, position=self._base + start - 1)
                    except OSError:     # it ended
                        self._shared_gone()
                    else:
                        # Blocks larger than the fetch process's slots (a sample larger than the
                        # fetch size) are fetched ahead by threads here, into `_memory`
                        if left_out:
                            self._reader = _ReadAhead(self, plan, start, following, only=left_out)
                        return
        self._reader = _ReadAhead(self, plan, start, following)

    def _stream_through_memory(self) -> None:
        """From this plan on, the split streams as one larger than the cache does: its disk filled
        and the cache's limit was lowered below it (`BlockCache`), so keeping it would mean
        evicting each block before an epoch came back to it."""
        log.log(node_level(), "%s: the split (%s MiB) no longer fits the room left on its disk: it streams through "
                "memory from now on", self.source.cache.root, f"{self.split_bytes / MIB:,.0f}")
        self.in_memory = True
        self._memory = MemoryBlocks(self.ahead_bytes, self.block_bytes)
        self._open.close_unheld()

    def _window(self, plan: list[np.ndarray], start: int, order: np.ndarray) -> int:
        """Batches to read ahead: as many as `ahead_bytes` hold of the plan's bytes per batch."""
        per_batch = int((self.block_end[order] - self.block_start[order]).sum()) / max(1, len(plan) - start)
        return max(MIN_WINDOW, self.reads_ahead + 1, int(self.ahead_bytes // max(per_batch, 1)))

    def _shared_plan(self, plan: list[np.ndarray], start: int, following, window: int) -> Visits:
        """The visits of plan[start:], counted from this plan's base, then those of the next epoch
        that begin in its first `window` batches, as far as `ahead_bytes` goes (counting this
        epoch's visits that go on into the next), so that it starts without waiting. The two
        epochs' reads are cut into visits together, with one gap for the whole run: a visit
        fetched ahead then holds the bytes of the one the next plan begins with, and is kept for it.
        The next epoch's visit of a block this one reads last is fetched once that is let go."""
        if self._visit_gap is None:     # one gap for every plan, so a visit fetched ahead is the next plan's
            self._visit_gap = window
        batches = plan[start:] + (following() if following is not None else [])
        next_epoch = self._base + len(plan)
        visits = block_visits(self.block_of, self.members, batches, self._base + start, self._visit_gap, next_epoch,
                              self.reads_ahead)
        this_epoch = visits.first < next_epoch
        held_on = this_epoch & (visits.last >= next_epoch)      # a block read at its end and the next one's start
        ahead = np.flatnonzero(~this_epoch & (visits.first < next_epoch + window))
        budget = self.ahead_bytes - int((visits.end - visits.start)[held_on].sum())
        taken = ahead[:int(np.searchsorted(np.cumsum(visits.end[ahead] - visits.start[ahead]), budget, side="right"))]
        return visits.select(np.sort(np.concatenate([np.flatnonzero(this_epoch), taken])))

    def _start_shared(self, visits: Visits, window: int) -> None:
        """The fetch process, its slots sized from the first plan; where it cannot start, the blocks
        are fetched by threads here, as for the disk cache."""
        slots = int(most_held(visits.first, visits.last, window) * SPARE_SLOTS) + MOST_STREAMED_REQUESTS
        store = self.source.store
        try:
            self._shared = SharedBlocks(store.client_url, store.options, [shard.object_name for shard in self.shards],
                                        self.block_shard, self.block_start, self.block_end, self.block_bytes,
                                        slots, FETCH_THREADS, MOST_STREAMED_REQUESTS)
        except OSError as error:
            self._shared_failed = True
            log.warning("[loader] fetching in this process: the fetch process did not start (%s)", error)

    def _shared_gone(self) -> None:
        """The fetch process ended under us (killed, out of memory): threads here fetch from now on."""
        code = self._shared.process.poll()
        log.warning("[loader] the fetch process ended (exit status %s); fetching in this process from here on", code)
        self.source.store.count(*self._shared.counted())
        self._shared.close()
        self._shared, self._shared_failed = None, True

    def consumed(self, batch_index: int) -> None:
        """Batch `batch_index` of the plan has been handed out: the read-ahead may go further,
        and in memory the blocks no later batch reads are let go."""
        if self._reader is not None:
            self._reader.advance(batch_index)
        if self._shared is not None:
            self._shared.at(self._base + batch_index)
            self.source.store.count(*self._shared.counted())
        if self._memory is not None:
            self._memory.consumed(batch_index)

    def stop_read_ahead(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    def close(self) -> None:
        self.stop_read_ahead()
        if getattr(self, "_open", None) is not None:
            self._open.close()
        if getattr(self, "_shared", None) is not None:
            self.source.store.count(*self._shared.counted())
            self._shared.close()
            self._shared = None
        super().close()

    __del__ = close


class _ReadAhead:
    """Fetches a plan's blocks in the order of their first use, a window of batches ahead of the
    consumer. Its failures are dropped: the consumer fetches the block itself and reports them."""

    def __init__(self, shards: RemoteShards, plan: list[np.ndarray], start: int, following=None,
                 only: set[int] | None = None):
        """only: the blocks to fetch, where not all of them."""
        self.shards, self.only = shards, only
        self.position = start
        self.stopped = False
        self.on_next_epoch = False        # submitting the next epoch's blocks: stopping lets those run
        self.window = 4                   # batches ahead; set from the plan's bytes per batch by the thread
        self._changed = threading.Condition()
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="read-ahead")
        self._thread = threading.Thread(target=self._run, args=(plan, start, following), daemon=True,
                                        name="read-ahead")
        self._thread.start()

    def _first_uses(self, batches: list[np.ndarray], offset: int) -> list[tuple[int, int]]:
        """(batch index, block) of each block the batches read, at the first batch reading it,
        batch i counted as offset + i."""
        order, first, _ = block_uses(self.shards.block_of, batches, offset)
        return list(zip(first.tolist(), order.tolist()))

    def _wanted(self, firsts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return firsts if self.only is None else [(index, block) for index, block in firsts if block in self.only]

    def _run(self, plan: list[np.ndarray], start: int, following) -> None:
        # Here, not in the consumer's thread: a walk over the whole plan, at each epoch's start
        firsts = self._first_uses(plan[start:], start)
        self.window = self.shards._window(plan, start, np.array([block for _, block in firsts], np.int64))
        firsts = self._wanted(firsts)
        if not self.shards.in_memory:     # the blocks already on disk need nothing (a later epoch, all of them)
            cached = self.shards.source.cache.present([self.shards.block_name(b) for _, b in firsts])
            firsts = [(index, block) for index, block in firsts if self.shards.block_name(block) not in cached]
        if not self._submit(firsts):
            return
        if following is not None and self.shards.in_memory:
            # The blocks the next epoch reads first, as many as the read-ahead's bytes allow, kept in
            # memory past this epoch's end; its batch i is batch len(plan) + i of this plan, so the window
            # reaches them only as this epoch ends. A block it reads later is let go after its last use here.
            firsts = self._wanted(self._first_uses(following()[:self.window], len(plan)))
            sizes = np.cumsum([int(self.shards.block_end[b] - self.shards.block_start[b]) for _, b in firsts])
            firsts = firsts[:int(np.searchsorted(sizes, self.shards.ahead_bytes, side="right"))]
            self.shards._memory.extend_plan({block: index for index, block in firsts})
            self.on_next_epoch = True
            self._submit(firsts)

    def _submit(self, firsts) -> bool:
        """Submits each block's fetch once the consumer is within the window of its batch; False if stopped."""
        for index, block in firsts:
            with self._changed:
                self._changed.wait_for(lambda: self.stopped or index <= self.position + self.window)
                if self.stopped:
                    return False
            self._pool.submit(self._fetch, block)
        return True

    def _fetch(self, block: int) -> None:
        if self.stopped and not self.on_next_epoch:
            return
        try:
            self.shards.prefetch(block)
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
        # At an epoch's end, the next epoch's fetches already asked for go on: it is about to start
        self._pool.shutdown(wait=False, cancel_futures=not self.on_next_epoch)
