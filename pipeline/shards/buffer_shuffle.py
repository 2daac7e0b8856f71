"""A seeded shuffle through a bounded buffer: how a streaming reader shuffles what it reads.

The first `buffer_size` items fill the buffer; from then on each new item goes in and a
random one comes out (drawn with `random.Random(seed).randint`, the chosen slot filled from
the buffer's end), and the buffer is drained the same way at the end of the stream. An item
moves at most about `buffer_size` places earlier, so a reader needs to hold only that many.
This is the order webdataset's `shuffle` stage gives with `initial == bufsize` and the same
`random.Random`, so epochs planned with it keep the samples and batches they had when the
webdataset backend called that package's function.
"""
from __future__ import annotations

import random
from typing import Iterable, Iterator, TypeVar

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
