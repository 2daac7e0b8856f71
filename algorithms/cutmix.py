"""CutMix (Yun et al. 2019, arXiv:1905.04899; MosaicML Composer's `CutMix`).

What: pastes one rectangle from a shuffled copy of the batch into every image (the same box for
the whole batch, as in Composer) and mixes the targets by the share of pixels actually pasted.
When it helps: a regulariser for image classification (the paper trains ImageNet ResNets for
300 epochs); like MixUp it needs enough epochs to pay off, and stacking it with other regularisers
gives diminishing returns (Composer).
Cost: one copy of the box region; the targets become probabilities (N, C), which the losses in
training/losses.py accept.
Hyperparameters:
  alpha=1.0   the box's nominal area share is drawn from Beta(alpha, alpha), one per batch
              (the paper's and Composer's default: a uniform share).
The box is centred uniformly over the image and clipped at the border (Composer's default
sampling), so the pasted share can be smaller than the drawn one; the targets use the real one.
"""
from __future__ import annotations

import math

import torch

from algorithms.base import Algorithm, Event
from algorithms.mixup import as_probabilities, sample_beta, shuffled_order


def cutmix_batch(images: torch.Tensor, targets: torch.Tensor, num_classes: int, alpha: float = 1.0,
                 generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """CutMix one (N, C, H, W) batch: `(mixed_images, mixed_targets, box)`.

    `box` = (top, bottom, left, right), half-open, is where every image got the pixels of the image
    it was paired with; targets (class indices (N,) or probabilities (N, C)) come back as
    probabilities (N, C), weighted by the pasted pixel share.
    """
    height, width = images.shape[-2:]
    side = math.sqrt(sample_beta(alpha, generator))      # the box's sides scale with sqrt(area share)
    box_height, box_width = int(height * side), int(width * side)
    centre_y, centre_x = (int(torch.randint(size, (), generator=generator)) for size in (height, width))
    top, left = max(centre_y - box_height // 2, 0), max(centre_x - box_width // 2, 0)
    bottom = min(centre_y - box_height // 2 + box_height, height)
    right = min(centre_x - box_width // 2 + box_width, width)

    perm = shuffled_order(images.shape[0], images.device, generator)
    mixed = images.clone()
    mixed[:, :, top:bottom, left:right] = images[perm, :, top:bottom, left:right]
    pasted = (bottom - top) * (right - left) / (height * width)
    probabilities = as_probabilities(targets, num_classes)
    return mixed, probabilities * (1 - pasted) + probabilities[perm] * pasted, (top, bottom, left, right)


class CutMix(Algorithm):
    """CutMixes each whole batch at AFTER_DATALOADER (before the micro-batch split)."""

    def __init__(self, alpha: float = 1.0):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_DATALOADER

    def apply(self, event: Event, state) -> None:
        state.images, state.targets, _ = cutmix_batch(state.images, state.targets, state.num_classes, self.alpha)
