"""CutOut (DeVries & Taylor 2017, arXiv:1708.04552; MosaicML Composer's `CutOut`).

What: blanks square holes in the training images: fills them with 0, which after normalization
is the dataset mean colour. Each image gets its own hole(s), as in the paper's per-image
transform (Composer cuts the same square out of the whole batch).
When it helps: small or under-regularised setups (the paper's CIFAR ResNets); Composer saw little
or no gain on well-tuned ResNets combined with MixUp or label smoothing.
Cost: one masked write over the batch; the labels are untouched.
Hyperparameters (Composer's defaults):
  num_holes=1    holes per image; they may overlap.
  length=0.5     the hole's side: a float is a share of min(H, W), an int is pixels.
A hole's centre is uniform over the image and the hole is clipped at the border (the paper's
and Composer's default sampling), so holes near an edge are smaller.
"""
from __future__ import annotations

import torch

from algorithms.base import Algorithm, Event


def cutout_batch(images: torch.Tensor, num_holes: int = 1, length: float | int = 0.5,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """`images` (N, C, H, W) with `num_holes` square holes per image set to 0 (shape, dtype and
    memory layout kept). `length`: float = share of min(H, W), int = side in pixels."""
    n, _, height, width = images.shape
    side = int(length * min(height, width)) if isinstance(length, float) else int(length)
    generator_device = generator.device if generator is not None else "cpu"
    centres = torch.rand(2, n, num_holes, 1, generator=generator, device=generator_device).to(images.device)
    starts_y = (centres[0] * height).long() - side // 2          # (N, holes, 1); ends may pass the border,
    starts_x = (centres[1] * width).long() - side // 2           # the comparisons below clip them
    rows = torch.arange(height, device=images.device)
    cols = torch.arange(width, device=images.device)
    in_rows = (rows >= starts_y) & (rows < starts_y + side)      # (N, holes, H)
    in_cols = (cols >= starts_x) & (cols < starts_x + side)      # (N, holes, W)
    holes = (in_rows[..., :, None] & in_cols[..., None, :]).any(dim=1)   # (N, H, W)
    # torch.where keeps channels_last (masked_fill with a broadcast mask would not)
    return torch.where(holes[:, None], 0, images)


class CutOut(Algorithm):
    """Cuts holes in each whole batch at AFTER_DATALOADER."""

    def __init__(self, num_holes: int = 1, length: float | int = 0.5):
        if num_holes < 0 or length < 0:
            raise ValueError(f"num_holes and length must be >= 0, got {num_holes} and {length}")
        self.num_holes, self.length = num_holes, length

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_DATALOADER

    def apply(self, event: Event, state) -> None:
        state.images = cutout_batch(state.images, self.num_holes, self.length)
