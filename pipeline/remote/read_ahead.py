"""Fetching an epoch's blocks ahead of the batches that read them, by threads of the loader's
process: into the node's cache on disk, or into its own memory (`pipeline/remote/block_sources.py`).

When an epoch starts, the blocks of the coming batches are fetched in the order of their first
use, FETCH_THREADS requests at once, a window of batches ahead of the batch being consumed
(`BlockPlan.window`), so latency is hidden and what is held stays bounded.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from pipeline.remote.block_plan import MIN_WINDOW, BlockPlan

FETCH_THREADS = 16


class ReadAhead:
    """Fetches a plan's blocks in the order of their first use, a window of batches ahead of the
    consumer. Its failures are dropped: the consumer fetches the block itself and reports them."""

    def __init__(self, blocks: BlockPlan, plan: list[np.ndarray], start: int,
                 following: Callable[[], list[np.ndarray]] | None, prefetch: Callable[[int], None],
                 held: Callable[[list[int]], set[int]] | None = None,
                 keep: Callable[[dict[int, int]], None] | None = None, only: set[int] | None = None):
        """prefetch(block) fetches a block unless it is held or on its way; held(blocks), where
        given, says which are held already (they need nothing); keep(last uses), where given,
        keeps the next epoch's first blocks past this epoch's end, which are then fetched ahead
        too; only: the blocks to fetch, where not all of them."""
        self.blocks, self.prefetch, self.held, self.keep, self.only = blocks, prefetch, held, keep, only
        self.position = start
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
        return firsts if self.only is None else [(index, block) for index, block in firsts if block in self.only]

    def _run(self, plan: list[np.ndarray], start: int, following) -> None:
        # Here, not in the consumer's thread: a walk over the whole plan, at each epoch's start
        firsts = self._first_uses(plan[start:], start)
        self.window = self.blocks.window(np.array([block for _, block in firsts], np.int64), len(plan) - start)
        firsts = self._wanted(firsts)
        if self.held is not None:
            held = self.held([block for _, block in firsts])
            firsts = [(index, block) for index, block in firsts if block not in held]
        if not self._submit(firsts):
            return
        if following is not None and self.keep is not None:
            # The blocks the next epoch reads first, kept past this epoch's end; its batch i is batch
            # len(plan) + i of this plan, so the window reaches them only as this epoch ends. A block
            # it reads later is let go after its last use here.
            firsts = self.blocks.next_epoch_firsts(self._wanted(self._first_uses(following()[:self.window], len(plan))))
            self.keep({block: index for index, block in firsts})
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
            self.prefetch(block)
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

    def _read_ahead(self, *args, **options) -> None:
        self.stop_read_ahead()
        self._reader = ReadAhead(*args, **options)

    def consumed(self, batch_index: int) -> None:
        if self._reader is not None:
            self._reader.advance(batch_index)

    def stop_read_ahead(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
