"""Fetching an epoch's blocks ahead of the batches that read them, by threads of the loader's
process: into the node's cache on disk, or into its own memory (`pipeline/remote/block_sources.py`).

When an epoch starts, the blocks of the coming batches are fetched in the order of their first
use, FETCH_THREADS requests at once, a window of batches ahead of the batch being consumed
(`BlockPlan.window`), so latency is hidden and what is held stays bounded. The window opens over
the epoch's first batches, so that the first one's blocks are not fetched beside all of it. As
the epoch ends, those the next epoch reads first are fetched (as many as the read-ahead's bytes
hold), so that it does not start by waiting.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import numpy as np

from pipeline.remote.block_plan import MIN_WINDOW, BlockPlan

FETCH_THREADS = 64      # requests at once at most: an epoch's first batch reads a block of every lane


class FetchesAhead(Protocol):
    """What a read-ahead fetches into: a block source (`ReadsAhead` gives the defaults)."""

    def prefetch(self, block: int) -> None:
        """Fetches a block unless it is held or on its way."""

    def already_held(self, blocks: list[int]) -> set[int]:
        """Which of the blocks are held already (they need nothing)."""

    def keep_for_next_epoch(self, last_uses: dict[int, int]) -> None:
        """The next epoch's first blocks (with their last use, its batches counted on from this
        epoch's) are about to be fetched: they are to be kept past this epoch's end."""


class ReadAhead:
    """Fetches a plan's blocks in the order of their first use, a window of batches ahead of the
    consumer. Its failures are dropped: the consumer fetches the block itself and reports them."""

    def __init__(self, blocks: BlockPlan, plan: list[np.ndarray], start: int,
                 following: Callable[[], list[np.ndarray]] | None, target: FetchesAhead, only: set[int] | None = None):
        """following(): the next epoch's plan, whose first blocks are fetched as this one ends;
        only: the blocks to fetch, where not all of them."""
        self.blocks, self.target, self.only = blocks, target, only
        self.start = self.position = start
        self.stopped = False
        self.on_next_epoch = False        # submitting the next epoch's blocks: stopping lets those run
        self.window = MIN_WINDOW          # batches ahead; set from the plan's bytes per batch by the thread
        self._changed = threading.Condition()
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="read-ahead")
        self._thread = threading.Thread(target=self._run, args=(plan, start, following), daemon=True,
                                        name="read-ahead")
        self._thread.start()

    def _first_uses(self, batches: list[np.ndarray], offset: int) -> list[tuple[int, int]]:
        """(batch index, block) of each block the batches read, at the first batch reading it,
        batch i counted as offset + i."""
        order, first, _ = self.blocks.uses(batches, offset)
        return list(zip(first.tolist(), order.tolist()))

    def _wanted(self, firsts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Those of the (batch, block) to fetch: in `only`, where given, and not held already."""
        if self.only is not None:
            firsts = [(index, block) for index, block in firsts if block in self.only]
        held = self.target.already_held([block for _, block in firsts])
        return [(index, block) for index, block in firsts if block not in held] if held else firsts

    def _run(self, plan: list[np.ndarray], start: int, following) -> None:
        # Here, not in the consumer's thread: a walk over the whole plan, at each epoch's start
        firsts = self._first_uses(plan[start:], start)
        self.window = self.blocks.window(np.array([block for _, block in firsts], np.int64), len(plan) - start)
        if not self._submit(self._wanted(firsts)) or following is None:
            return
        # The blocks the next epoch reads first, kept past this epoch's end; its batch i is batch
        # len(plan) + i of this plan, so the window reaches them only as this epoch ends. A block
        # it reads later is let go after its last use here.
        firsts = self.blocks.next_epoch_firsts(self._wanted(self._first_uses(following()[:self.window], len(plan))))
        self.target.keep_for_next_epoch({block: index for index, block in firsts})
        self.on_next_epoch = True
        self._submit(firsts)

    def _reach(self) -> int:
        """The batches ahead of the consumer whose blocks may be fetched: MIN_WINDOW at the start,
        doubled with each batch handed out up to the window, so that the first batch's blocks are
        not fetched beside the whole window's (on few cores their fetching slows its decode)."""
        return min(self.window, MIN_WINDOW << min(self.position - self.start, 30))

    def _submit(self, firsts) -> bool:
        """Submits each block's fetch once the consumer is within reach of its batch; False if stopped."""
        for index, block in firsts:
            with self._changed:
                self._changed.wait_for(lambda: self.stopped or index <= self.position + self._reach())
                if self.stopped:
                    return False
            self._pool.submit(self._fetch, block)
        return True

    def _fetch(self, block: int) -> None:
        if self.stopped and not self.on_next_epoch:
            return
        try:
            self.target.prefetch(block)
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


class ReadsAhead:
    """A block source whose blocks threads here fetch ahead: at most one `ReadAhead` at a time,
    told of each batch handed out."""

    _reader: ReadAhead | None = None

    def _read_ahead(self, blocks: BlockPlan, plan: list[np.ndarray], start: int, following=None,
                    only: set[int] | None = None) -> None:
        self.stop_read_ahead()
        self._reader = ReadAhead(blocks, plan, start, following, self, only)

    def prefetch(self, block: int) -> None:
        raise NotImplementedError

    def already_held(self, blocks: list[int]) -> set[int]:
        return set()

    def keep_for_next_epoch(self, last_uses: dict[int, int]) -> None:
        pass

    def consumed(self, batch_index: int) -> None:
        if self._reader is not None:
            self._reader.advance(batch_index)

    def stop_read_ahead(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
