"""The synthetic backend: random normalized images made once on the device, the model-bound
ceiling every real loader is measured against. It costs nothing per batch but a slice."""
from __future__ import annotations

import torch

from pipeline.base import Loader
from pipeline.sharding import rank_batches
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
            generator = torch.Generator().manual_seed(self.spec.seed + self.spec.rank)
            images = torch.randn(self.spec.batch_size, 3, height, width, generator=generator)
            self._images = images.to(self.device, self.spec.dtype).contiguous(memory_format=torch.channels_last)
            self._labels = torch.randint(self.num_classes, (self.spec.batch_size,), generator=generator).to(self.device)

    def _batches(self, epoch: int, start: int):
        for index in range(start, len(self)):
            yield index, self._images, self._labels
