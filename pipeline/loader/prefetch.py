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


def prefetched(make: Callable, keys: Iterable, ring: BufferRing, depth: int = 2):
    """Yields make(key, buffer) for each key, made up to `depth` batches ahead in a thread.
    The consumer returns each buffer with ring.give_back once it no longer reads it. An error
    in the thread is raised here, at the batch it belongs to; closing the generator early stops
    the thread at its next batch."""
    made: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for key in keys:
                if stop.is_set():
                    return
                made.put(("batch", make(key, ring.take())))
            made.put(("end", None))
        except BaseException as error:    # noqa: B902 - handed to the consumer, raised there
            made.put(("error", error))

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
        while thread.is_alive():          # unblock a producer waiting on a full queue
            try:
                made.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()
