"""A seeded shuffle through a bounded buffer: how a streaming reader shuffles what it reads.

The first `buffer_size` items fill the buffer; from then on each new item goes in and a
random one comes out (drawn with `random.Random(seed).randint`, the chosen slot filled from
the buffer's end), and the buffer is drained the same way at the end of the stream. An item
moves at most about `buffer_size` places earlier, so a reader needs to hold only that many.
This is the order webdataset's `shuffle` stage gives with `initial == bufsize` and the same
`random.Random`, so epochs planned with it keep the samples and batches they had when the
webdataset backend called that package's function. `shuffle_lanes` gives the same order for
many lanes at once, in C (pipeline/native/buffer_shuffle.c).
"""
from __future__ import annotations

import ctypes
import functools
import random
from typing import Iterable, Iterator, TypeVar

import numpy as np

Item = TypeVar("Item")


def buffer_shuffle(items: Iterable[Item], buffer_size: int, seed: int) -> Iterator[Item]:
    """`items` in the order a `buffer_size` buffer shuffled with `seed` gives them."""
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    rng, buffer = random.Random(seed), []
    for item in items:
        buffer.append(item)
        if len(buffer) >= buffer_size:
            yield _take_one(buffer, rng)
    while buffer:
        yield _take_one(buffer, rng)


def _take_one(buffer: list, rng: random.Random):
    """A random item out of the buffer, its slot filled with the last one (no shifting)."""
    slot = rng.randint(0, len(buffer) - 1)
    item, buffer[slot] = buffer[slot], buffer[-1]
    buffer.pop()
    return item


def shuffle_lanes(lanes: np.ndarray, buffer_size: int, seeds: list[int]) -> np.ndarray:
    """Each row of `lanes` (int64) as `buffer_shuffle(row, buffer_size, seed)` orders it, with
    its own seed of `seeds`."""
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    if buffer_size >= 2 ** 32:
        raise ValueError(f"buffer_size must be < 2**32, got {buffer_size}")
    lanes = np.ascontiguousarray(lanes, np.int64)
    if lanes.ndim != 2 or len(lanes) != len(seeds):
        raise ValueError(f"one seed per lane: {len(seeds)} seeds for lanes of shape {lanes.shape}")
    states = np.array([random.Random(seed).getstate()[1] for seed in seeds], np.uint32).reshape(len(seeds), -1)
    out = np.empty_like(lanes)
    buffer = np.empty(min(buffer_size, max(1, lanes.shape[1])), np.int64)
    _compiled()(lanes.ctypes.data, len(lanes), lanes.shape[1], buffer_size, states.ctypes.data, buffer.ctypes.data,
                out.ctypes.data)
    return out


@functools.cache
def _compiled():
    from pipeline.native.library import load_library, source
    function = load_library(source("buffer_shuffle.c"), libraries=()).buffer_shuffle_lanes
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_void_p]
    function.restype = None
    return function
