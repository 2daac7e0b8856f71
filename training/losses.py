"""Losses on logits: cross-entropy with label smoothing, and binary cross-entropy per class.

Targets are class indices (N,) or, after MixUp/CutMix-style algorithms, class
probabilities (N, C); both losses take either.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.label_smoothing import smooth_labels
from training.config import LossConfig


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    if targets.ndim == 1:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    probabilities = smooth_labels(targets, logits.shape[1], label_smoothing)
    return torch.sum(-probabilities * F.log_softmax(logits, dim=1), dim=1).mean()


def binary_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
                         reduction: str = "sum_over_classes") -> torch.Tensor:
    """One sigmoid per class. `sum_over_classes` sums over classes and averages over the batch
    (the scale of cross-entropy, which MosaicML's BCE recipes tune their LR for); `mean`
    averages over both, which makes the loss num_classes times smaller."""
    probabilities = smooth_labels(targets, logits.shape[1], label_smoothing)
    losses = F.binary_cross_entropy_with_logits(logits, probabilities, reduction="none")
    return losses.sum() / logits.shape[0] if reduction == "sum_over_classes" else losses.mean()


def build_loss(config: LossConfig):
    if config.kind == "bce":
        return lambda logits, targets: binary_cross_entropy(logits, targets, config.label_smoothing,
                                                            config.bce_reduction)
    return lambda logits, targets: cross_entropy(logits, targets, config.label_smoothing)
