"""The WebDataset conversion's plan: which samples each shard holds, in which order, under which keys,
decided from the source and the options alone before anything is written (`ShardPlan`). The train
split is written in a seeded random order, because WebDataset readers only shuffle shards and a
buffer; the other splits in the source's order. Shard k holds the samples at write positions
[k*S, (k+1)*S), S samples a shard (`--shard-samples`, or `--shard-size-mb` over the source's mean
sample size), and a sample's key is its write position; a sample that cannot be used leaves its
key unused. So any one shard can be written alone, on any machine, and comes out the same bytes:
resuming, `--part I/N`, Ray and `verify_dataset --repair` all run shard tasks of this plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.convert.options import WdsOptions
from pipeline.convert.sources.base import Source
from pipeline.convert.sources.entries import CHUNK

TAR_BYTES_A_SAMPLE = 2560      # a sample's three tar headers and its two label members, padded


def shard_samples(source: Source, split: str, options: WdsOptions) -> int:
    """Samples a shard: the option, or about --shard-size-mb of the source's samples as they are."""
    if options.shard_samples:
        return options.shard_samples
    sample_bytes = source.entries(split).mean_size() + TAR_BYTES_A_SAMPLE
    return max(1, int(options.shard_size_mb * 2**20) // sample_bytes)


def write_order(count: int, split: str, seed: int, folder: Path | None = None) -> np.ndarray | None:
    """The samples' indices in the order they are written: for train a seeded permutation (in a
    file under `folder` where given, so that memory does not grow with the count); None (the
    source's order) for the other splits."""
    if split != "train":
        return None
    if folder is None:
        return np.random.default_rng(seed).permutation(count)
    folder.mkdir(parents=True, exist_ok=True)
    order = np.memmap(folder / "order.bin", np.int64, mode="w+", shape=(max(count, 1),))[:count]
    for at in range(0, count, CHUNK):
        order[at:at + CHUNK] = np.arange(at, min(at + CHUNK, count))
    np.random.default_rng(seed).shuffle(order)      # permutation(count)'s very shuffle, on the file
    return order


def inverse(order: np.ndarray, folder: Path) -> np.ndarray:
    """Each sample's place in the write order (the inverse of `order`), in a file under `folder`."""
    place = np.memmap(folder / "place.bin", np.int64, mode="w+", shape=(max(len(order), 1),))[:len(order)]
    for at in range(0, len(order), CHUNK):
        place[order[at:at + CHUNK]] = np.arange(at, min(at + CHUNK, len(order)))
    return place


@dataclass(frozen=True)
class ShardPlan:
    """A split's shards: `count` samples in the source, `per_shard` a shard, written in the order
    seeded by `seed` (train) or the source's."""
    split: str
    count: int
    per_shard: int
    seed: int

    @classmethod
    def of(cls, source: Source, split: str, options: WdsOptions) -> ShardPlan:
        return cls(split, len(source.entries(split)), shard_samples(source, split, options), options.seed)

    @property
    def shards(self) -> int:
        return -(-self.count // self.per_shard)

    @property
    def shuffled(self) -> bool:
        return self.split == "train"

    def order(self, folder: Path) -> np.ndarray | None:
        """The samples' indices in write order (a file under `folder`); None: the source's order."""
        return write_order(self.count, self.split, self.seed, folder)

    def order_and_places(self, folder: Path) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`order()` and each sample's place in it (its inverse), in files under `folder`."""
        order = self.order(folder)
        return order, None if order is None else inverse(order, folder)

    def samples(self, number: int, order: np.ndarray | None) -> np.ndarray:
        """The source indices shard `number` holds, in its write order (`order`, from `order()`)."""
        start, end = number * self.per_shard, min((number + 1) * self.per_shard, self.count)
        return np.arange(start, end) if order is None else np.asarray(order[start:end])

    def samples_in(self, numbers) -> int:
        """How many samples the shards `numbers` hold together."""
        return sum(min(self.per_shard, self.count - number * self.per_shard) for number in numbers)

    def key(self, place: int) -> str:
        return f"{place:09d}"

    def as_dict(self) -> dict:
        return {"split": self.split, "count": self.count, "per_shard": self.per_shard, "seed": self.seed}
