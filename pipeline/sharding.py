"""Which samples a rank reads in an epoch, and in which order: the one sharding rule.

Train: a permutation of all samples drawn from (seed, epoch); rank r takes every
world_size-th sample of it starting at r, and every rank takes the same number,
`n // world_size`, so no sample is read twice in an epoch and DDP ranks stay in step (the
at most world_size - 1 left over differ from epoch to epoch). Val: no shuffle, rank r takes
the contiguous range [n*r//W, n*(r+1)//W), so every sample is read exactly once over all
ranks; ranks may differ by one sample. Batches are consecutive slices of a rank's list.
"""
from __future__ import annotations

import math

import numpy as np


def rank_samples(count: int, epoch: int, seed: int, rank: int, world_size: int, shuffle: bool) -> np.ndarray:
    """Sample ids (into the stored order) this rank reads in this epoch, in reading order."""
    if shuffle:
        order = np.random.default_rng((seed, epoch)).permutation(count)
        return order[rank::world_size][:count // world_size]
    return np.arange(*rank_range(count, rank, world_size, shuffle=False))


def rank_range(count: int, rank: int, world_size: int, shuffle: bool) -> tuple[int, int]:
    """This rank's contiguous [lo, hi) of a stream of `count` samples, for readers that stream
    (webdataset): as many samples as `rank_samples` gives, from a stream already shuffled."""
    if shuffle:
        per_rank = count // world_size
        return rank * per_rank, (rank + 1) * per_rank
    return count * rank // world_size, count * (rank + 1) // world_size


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def rank_batches(count: int, spec) -> int:
    """Batches per epoch on `spec`'s rank (a LoaderSpec) for a split of `count` samples."""
    lo, hi = rank_range(count, spec.rank, spec.world_size, shuffle=spec.train)
    return batch_count(hi - lo, spec.batch_size, spec.drop_last)
