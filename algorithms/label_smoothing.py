"""Label smoothing (Szegedy et al. 2016, arXiv:1512.00567; MosaicML Composer's `LabelSmoothing`).

What: trains towards `(1 - s) * targets + s / C` instead of one-hot targets, so the model is
not pushed towards infinitely confident logits.
When it helps: image classification in general (Composer saw better accuracy on all its image
classification benchmarks); it also makes the predicted probabilities less over-confident.
Cost: nothing measurable; the targets become probabilities (N, C).
Hyperparameters:
  smoothing=0.1   Composer's default ("a standard starting point") and the paper's ImageNet value.
The hook runs at BEFORE_LOSS, per micro-batch, so it smooths whatever targets reach the loss:
class indices, or the soft targets MixUp/CutMix made at AFTER_DATALOADER (smoothing commutes
with their mixing). `loss.label_smoothing` in the config does the same inside the loss; use one.
"""
from __future__ import annotations

import torch

from algorithms.base import Algorithm, Event
from algorithms.mixup import as_probabilities


def smooth_labels(targets: torch.Tensor, num_classes: int, smoothing: float = 0.1) -> torch.Tensor:
    """Probabilities (N, C), float32: class indices (N,) or probabilities (N, C) mixed with the
    uniform distribution; rows keep summing to one and the true class gets 1 - s + s / C."""
    return as_probabilities(targets, num_classes) * (1 - smoothing) + smoothing / num_classes


class LabelSmoothing(Algorithm):
    """Smooths `state.targets` for the loss at BEFORE_LOSS."""

    def __init__(self, smoothing: float = 0.1):
        if not 0 <= smoothing <= 1:
            raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
        self.smoothing = smoothing

    def match(self, event: Event, state) -> bool:
        return event == Event.BEFORE_LOSS

    def apply(self, event: Event, state) -> None:
        state.targets = smooth_labels(state.targets, state.num_classes, self.smoothing)
