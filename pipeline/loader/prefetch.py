"""Batches made ahead by one background thread into a ring of reused buffers: how the decode
engine overlaps with training without worker processes.

The thread spends its time in native code with the GIL released (`pipeline/decode/engine.py`),
so it runs beside the training step. Reused memory spares the kernel faulting in and zeroing a
fresh batch each time (`pipeline/transforms/normalize.py`), and a buffer is never overwritten while read:
before one is filled again, the copy to a GPU that read it must have finished (a CUDA event),
and no tensor outside the ring may still use it (a consumer that keeps a batch makes the ring
take fresh memory instead).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable

import torch

from pipeline.transforms.normalize import used_elsewhere



class BufferRing:
    """Up to `count` reusable buffers of `shape` and `dtype`, pinned when the batches go to a
    GPU. Kept by a loader across epochs: a first touch of fresh memory costs more than the
    decode writing into it. Never blocks: with none free, a fresh buffer is made."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool):
        self.count, self.shape, self.dtype, self.pinned = count, tuple(shape), dtype, pinned
        self.free: queue.Queue = queue.Queue()

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return self.shape == tuple(shape) and self.dtype == dtype

    def _fresh(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned)

    def take(self) -> torch.Tensor:
        try:
            buffer, copied = self.free.get_nowait()
        except queue.Empty:
            return self._fresh()
        if copied is not None:
            copied.synchronize()          # the host-to-device copy that read it has finished
        if used_elsewhere(buffer):
            buffer = self._fresh()        # the consumer kept that batch: leave it be
        return buffer

    def give_back(self, buffer: torch.Tensor, device: torch.device) -> None:
        if self.free.qsize() >= self.count:
            return
        copied = None
        if device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        self.free.put((buffer, copied))


def prefetched(start: Callable, keys: Iterable, ring: BufferRing, depth: int = 2):
    """Yields finish() for each key, where finish = start(key, buffer), made up to `depth` batches
    ahead in a thread. From the second batch on, a batch is finished only once the next one is
    started, so that what a batch's start and finish do in Python overlaps the making of another
    (the decode engine's threads then never wait on Python); the first is handed on at once, not
    held back by the next one's start (from a URL, a wait for its blocks). The consumer returns
    each buffer with ring.give_back once it no longer reads it. An error in the thread is raised
    here, after the batches before it; closing the generator early stops the thread at its next
    batch, and a batch started is finished all the same (its memory is the engine's till then)."""
    made: queue.Queue = queue.Queue(maxsize=max(depth - 1, 1))
    stop = threading.Event()

    def produce():
        begun, first = None, True         # begun: started, not yet finished
        try:
            for key in keys:
                if stop.is_set():
                    return
                started = None
                try:
                    started = start(key, ring.take())
                finally:                  # the batch before is handed on first, even where this one fails
                    previous, begun = begun, started
                    if previous is not None:
                        made.put(("batch", previous()))
                if first:                 # not held back by the next batch's start (its reads from a URL)
                    first, begun = False, None
                    made.put(("batch", started()))
            if begun is not None:
                last, begun = begun, None
                made.put(("batch", last()))
            made.put(("end", None))
        except BaseException as error:    # noqa: B902 - handed to the consumer, raised there
            made.put(("error", error))
        finally:
            if begun is not None:         # stopped early, or the batch before it failed: waited for
                try:
                    begun()
                except BaseException:     # noqa: B902 - a batch nobody will read
                    pass

    thread = threading.Thread(target=produce, name="decode-engine-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = made.get()
            if kind == "error":
                raise item
            if kind == "end":
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():          # unblock a producer waiting on a full queue, else wait for its end
            try:
                made.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
