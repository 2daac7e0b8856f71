"""The synthetic backend: random normalized images made once on the device, the model-bound
ceiling every real loader is measured against. It costs nothing per batch but a slice.

Every step's global batch is the same G = batch_size x world_size samples, sample j drawn from
(seed, j), and rank r holds every world_size-th of them from r, as `pipeline.loader.sharding` deals a
permutation: so a step's samples do not depend on the world size here either."""
from __future__ import annotations

import torch

from pipeline.loader.base import Loader
from pipeline.loader.sharding import rank_batches
from pipeline.spec import LoaderSpec


class SyntheticLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        self._images: torch.Tensor | None = None
        super().__init__(spec, spec.num_classes or 1000)

    def __len__(self) -> int:
        return rank_batches(self.spec.synthetic_size, self.spec)

    def _prepare_epoch(self, epoch: int) -> None:
        height, width = self.resolution
        if self._images is None or self._images.shape[2:] != (height, width):
            spec, images, labels = self.spec, [], []
            for sample in range(spec.rank, spec.batch_size * spec.world_size, spec.world_size):
                generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + sample)
                images.append(torch.randn(3, height, width, generator=generator))
                labels.append(torch.randint(self.num_classes, (), generator=generator))
            self._images = torch.stack(images).to(self.device, spec.dtype).contiguous(memory_format=torch.channels_last)
            self._labels = torch.stack(labels).to(self.device)

    def _batches(self, epoch: int, start: int):
        for index in range(start, len(self)):
            yield index, self._images, self._labels
