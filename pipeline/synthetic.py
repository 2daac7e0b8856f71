"""The synthetic backend: random normalized images made once on the device, the model-bound
ceiling every real loader is measured against. It costs nothing per batch but a slice."""
from __future__ import annotations

import math

import torch

from pipeline.colout import kept_size
from pipeline.spec import LoaderSpec


class SyntheticLoader:
    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        self.num_classes = spec.num_classes or 1000
        self.epoch, self.position, self._resume_from = 0, 0, 0
        self._images: torch.Tensor | None = None
        self.set_epoch(0)

    def __len__(self) -> int:
        per_rank = self.spec.synthetic_size / self.spec.world_size
        batches = per_rank / self.spec.batch_size
        return math.floor(batches) if self.spec.drop_last else math.ceil(batches)

    @property
    def resolution(self) -> tuple[int, int]:
        side = self.spec.resolution_at(self.epoch)
        if self.spec.colout and self.spec.train:
            return kept_size(side, side, *self.spec.colout)
        return side, side

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._resume_from = epoch, 0, 0
        height, width = self.resolution
        if self._images is None or self._images.shape[2:] != (height, width):
            generator = torch.Generator().manual_seed(self.spec.seed + self.spec.rank)
            images = torch.randn(self.spec.batch_size, 3, height, width, generator=generator)
            self._images = images.to(self.spec.device, self.spec.dtype).contiguous(memory_format=torch.channels_last)
            self._labels = torch.randint(self.num_classes, (self.spec.batch_size,), generator=generator).to(self.spec.device)

    def __iter__(self):
        # A new iteration starts the epoch over, except right after load_state_dict.
        self.position, self._resume_from = self._resume_from, 0
        while self.position < len(self):
            self.position += 1
            yield self._images, self._labels

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"])
        self._resume_from = self.position = state["position"]
