"""Batch-norm settings for short runs (airbench's): running statistics that follow the last few
batches, a tiny epsilon, and no learned scale.

What: every BatchNorm layer gets `momentum` (PyTorch's meaning: the new batch's share of the
running statistics; airbench's 0.6 decay is 0.4 here) and `eps`; with `train_weight=False` its
scale is set to 1 and not trained (the bias still is), since the convolution before it can carry
any scale. That undoes a zero-initialised residual scale, which frozen at 0 would shut its branch
for good. Applied at INIT, before the optimizer and DDP exist, so neither sees the frozen scales
as trained parameters.
When: runs of a few epochs, where PyTorch's default momentum of 0.1 leaves the running
statistics behind the fast-moving weights, and evaluation with them suffers.
Cost: none.
Settings: momentum=0.4, eps=1e-12, train_weight=False (airbench94's).
"""
from __future__ import annotations

import torch
from torch import nn

from algorithms.base import Algorithm, Event


def set_batchnorm(model: nn.Module, momentum: float = 0.4, eps: float = 1e-12, train_weight: bool = False) -> int:
    """Sets every batch-norm layer of `model` (with `train_weight=False`, its scale to a fixed 1);
    returns how many it set."""
    layers = [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    for layer in layers:
        layer.momentum, layer.eps = momentum, eps
        if layer.weight is not None and not train_weight:
            with torch.no_grad():
                layer.weight.fill_(1.0)
            layer.weight.requires_grad_(False)
    return len(layers)


class BatchNormSettings(Algorithm):
    def __init__(self, momentum: float = 0.4, eps: float = 1e-12, train_weight: bool = False):
        if not 0 < momentum <= 1 or eps <= 0:
            raise ValueError(f"batchnorm_settings needs 0 < momentum <= 1 and eps > 0; got {momentum}, {eps}")
        self.momentum, self.eps, self.train_weight = float(momentum), float(eps), bool(train_weight)

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        set_batchnorm(state.model, self.momentum, self.eps, self.train_weight)
