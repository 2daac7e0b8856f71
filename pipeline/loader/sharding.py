"""Which samples a rank reads in an epoch, and in which order: the one sharding rule.

Train: an epoch is a sequence of global steps of G = batch_size x world_size samples, and which
samples make up global step s depends on (seed, epoch, s) and G alone, never on the world size:
rank r takes its batch_size of each. So a run stopped mid-epoch on W1 ranks goes on at W2 ranks
(W2 dividing G) with exactly the samples it has not yet seen. Backends that read any sample at
any time (folder, ffcv, dali's folder source) deal one permutation drawn from (seed, epoch):
global step s is its slice [s*G, (s+1)*G), and rank r takes every world_size-th sample of it
from r. Streaming readers (webdataset) follow `pipeline/shards/index.py`'s lanes instead. Every
rank takes the same number of samples, so DDP ranks stay in step. Val: no shuffle, rank r takes
the contiguous range [n*r//W, n*(r+1)//W), so every sample is read exactly once over all ranks;
ranks may differ by one sample. Batches are consecutive slices of a rank's list.
"""
from __future__ import annotations

import math

import numpy as np


def rank_samples(count: int, epoch: int, seed: int, rank: int, world_size: int, shuffle: bool) -> np.ndarray:
    """Sample ids (into the stored order) this rank reads in this epoch, in reading order."""
    if shuffle:
        order = np.random.default_rng((seed, epoch)).permutation(count)
        return order[rank::world_size][:count // world_size]
    return np.arange(*rank_range(count, rank, world_size))


def rank_range(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous [lo, hi) of `count` samples read in their stored order (val)."""
    return count * rank // world_size, count * (rank + 1) // world_size


def rank_sample_count(count: int, spec) -> int:
    """How many samples `spec`'s rank (a LoaderSpec) reads in an epoch of a split of `count`."""
    if spec.train:
        return count // spec.world_size
    lo, hi = rank_range(count, spec.rank, spec.world_size)
    return hi - lo


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def rank_batches(count: int, spec) -> int:
    """Batches per epoch on `spec`'s rank (a LoaderSpec) for a split of `count` samples: in
    training (drop_last) count // G, the same at every world size for one global batch G."""
    return batch_count(rank_sample_count(count, spec), spec.batch_size, spec.drop_last)
