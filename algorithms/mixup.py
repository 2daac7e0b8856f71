"""MixUp (Zhang et al. 2018, arXiv:1710.09412; MosaicML Composer's `MixUp`).

What: trains on convex combinations of the batch with a shuffled copy of itself,
`lam * x + (1 - lam) * x[perm]`, and on the same combination of the one-hot targets.
When it helps: a regulariser: Composer found it improves the speed/accuracy trade-off for image
classification; like any regulariser it needs enough epochs (and model capacity) to pay off.
Cost: one elementwise pass over the batch; the targets become probabilities (N, C), which the
losses in training/losses.py accept.
Hyperparameters:
  alpha=0.2            Beta(alpha, alpha) draws the mixing weight, one per batch; Composer's default
                       and its ImageNet advice (1.0 for CIFAR-10). alpha -> 0 gives (nearly) the identity.
  interpolate_loss=False  keep the integer targets and mix the two losses instead
                       (lam * loss(y) + (1 - lam) * loss(y[perm])): equal for losses linear in the
                       targets (cross-entropy, BCE), and keeps F.cross_entropy's index fast path.
                       The shuffled targets are held from AFTER_DATALOADER to AFTER_LOSS: list any
                       algorithm that shrinks the batch (SelectiveBackprop) before MixUp.
As in Composer, the original batch gets the larger share: lam = max(z, 1 - z), z ~ Beta(alpha, alpha).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.base import Algorithm, Event


def sample_beta(alpha: float, generator: torch.Generator | None = None) -> float:
    """One draw from Beta(alpha, alpha) (0 for alpha=0), driven by torch's RNG (`generator` or the
    global one, which the trainer seeds and checkpoints); torch's own Beta takes no generator."""
    if alpha <= 0:
        return 0.0
    seed = int(torch.randint(2**62, (), generator=generator))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def as_probabilities(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Class probabilities (N, C) in float32 from class indices (N,) or from probabilities."""
    if targets.ndim == 1:
        return F.one_hot(targets.long(), num_classes).float()
    return targets.float()


def shuffled_order(n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random permutation of range(n) on `device` (drawn on the generator's device, the CPU by default)."""
    generator_device = generator.device if generator is not None else "cpu"
    return torch.randperm(n, generator=generator, device=generator_device).to(device)


def mixup_batch(images: torch.Tensor, targets: torch.Tensor, num_classes: int, alpha: float = 0.2,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """MixUp one batch: `(mixed_images, mixed_targets, lam)`.

    `lam` in [0.5, 1] (one per batch) is the original batch's weight; the rest comes from the batch
    shuffled. Targets (class indices (N,) or probabilities (N, C)) come back as probabilities
    (N, C) mixed with the same weight, so each row still sums to one.
    """
    lam, perm = _draw(images.shape[0], images.device, alpha, generator)
    probabilities = as_probabilities(targets, num_classes)
    mixed_images = images * lam + images[perm] * (1 - lam)
    return mixed_images, probabilities * lam + probabilities[perm] * (1 - lam), lam


def _draw(n: int, device: torch.device, alpha: float, generator) -> tuple[float, torch.Tensor]:
    z = sample_beta(alpha, generator)
    return max(z, 1 - z), shuffled_order(n, device, generator)


class MixUp(Algorithm):
    """Mixes each whole batch at AFTER_DATALOADER (before the micro-batch split)."""

    def __init__(self, alpha: float = 0.2, interpolate_loss: bool = False):
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha, self.interpolate_loss = alpha, interpolate_loss
        self._lam = 1.0
        self._pending_targets: list[torch.Tensor] = []   # interpolate_loss: shuffled targets per micro-batch

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_DATALOADER or (self.interpolate_loss and event == Event.AFTER_LOSS)

    def apply(self, event: Event, state) -> None:
        if event == Event.AFTER_LOSS:
            # the micro-batches' AFTER_LOSS fire in order, one per chunk of the shuffled targets
            with state.autocast():
                other_loss = state.loss_fn(state.outputs, self._pending_targets.pop(0))
            state.loss = state.loss * self._lam + other_loss * (1 - self._lam)
        elif not self.interpolate_loss:
            state.images, state.targets, _ = mixup_batch(state.images, state.targets, state.num_classes, self.alpha)
        else:
            self._lam, perm = _draw(state.images.shape[0], state.images.device, self.alpha, None)
            state.images = state.images * self._lam + state.images[perm] * (1 - self._lam)
            self._pending_targets = list(state.targets[perm].chunk(state.config.grad_accum))
