"""Stochastic depth (Huang et al. 2016, "Deep Networks with Stochastic Depth"; MosaicML Composer's
StochasticDepth), in the "drop path" form of timm and torchvision.

What: during training each residual block's branch is zeroed at random, so the block passes only
its shortcut, relu(shortcut(x)); kept branches are scaled by 1/(1-p), so the branch's expected
value is unchanged and evaluation runs the plain block as it was (the paper instead scales the
branch by 1-p at test time: the same in expectation). Block i of L drops with
p_i = drop_rate * (i+1)/L ("linear": deep blocks, whose features are most redundant, drop most,
as in the paper and Composer) or p_i = drop_rate ("uniform").
mode="sample" (default) draws keep/drop per sample and block, so every step trains every block on
part of the batch (lower-variance gradients); it is Composer's "sample" method, the one its
ResNet-50 spicy recipe uses, and timm's. mode="batch" drops the branch for the whole batch (the
paper's and Composer's "block" method; Composer's constructor default). Both compute the dropped
branch and multiply it by zero: skipping it would save time but leave its parameters without
gradients, which DDP without find_unused_parameters rejects.
When it helps: deep ResNets trained long enough (Composer: +0.4% top-1 on ResNet-50/101 with
drop_rate=0.1, linear); it is a regulariser, so on short runs it can cost accuracy. Cost: one mask
multiply per block (~nothing). Defaults: drop_rate=0.1, drop_distribution="linear" (Composer's
suggested values and spicy recipe; its own constructor default is 0.2), mode="sample".
"""
from __future__ import annotations

import types
import warnings

import torch
from torch import nn

from algorithms.base import Algorithm, Event

DISTRIBUTIONS = ("linear", "uniform")
MODES = ("sample", "batch")


def drop_path(branch: torch.Tensor, drop_rate: float, mode: str = "sample") -> torch.Tensor:
    """`branch` zeroed with probability `drop_rate` per sample (or once for the batch) and
    scaled by 1/(1 - drop_rate) where kept, so that its expected value is `branch`."""
    keep = 1.0 - drop_rate
    shape = (branch.shape[0],) + (1,) * (branch.dim() - 1) if mode == "sample" else (1,) * branch.dim()
    mask = branch.new_empty(shape).bernoulli_(keep)
    if keep > 0:
        mask.div_(keep)
    return branch * mask


def _stochastic_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The residual block's forward, relu(residual(x) + shortcut(x)), with the branch dropped in training."""
    identity = x if block.downsample is None else block.downsample(x)
    branch = block.residual(x)
    if block.training and block.drop_rate > 0:
        branch = drop_path(branch, block.drop_rate, block.drop_mode)
    return block.relu(branch + identity)


def residual_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's residual blocks in depth order: modules with `residual` and `downsample`."""
    return [module for module in model.modules() if hasattr(module, "residual") and hasattr(module, "downsample")]


def stochastic_depth_model(model: nn.Module, drop_rate: float = 0.1, drop_distribution: str = "linear",
                           mode: str = "sample") -> list[float]:
    """Make each residual block of `model` drop its branch in training; the per-block drop rates.

    Each block gets `drop_rate`/`drop_mode` attributes and an instance-level forward (no new
    modules, so the state dict and the optimizer's parameters are unchanged; a deepcopy, e.g. an
    EMA model, keeps the behaviour). In eval mode the blocks compute exactly what they did before."""
    _check(drop_rate, drop_distribution, mode)
    blocks = residual_blocks(model)
    if not blocks:
        warnings.warn("stochastic depth changed nothing: no residual blocks (modules with `residual` "
                      "and `downsample`) in the model")
    rates = [drop_rate * (i + 1) / len(blocks) if drop_distribution == "linear" else drop_rate
             for i in range(len(blocks))]
    for block, rate in zip(blocks, rates):
        block.drop_rate, block.drop_mode = rate, mode
        block.forward = types.MethodType(_stochastic_forward, block)
    return rates


def _check(drop_rate: float, drop_distribution: str, mode: str) -> None:
    if not 0.0 <= drop_rate <= 1.0:
        raise ValueError(f"drop_rate must be in [0, 1], got {drop_rate}")
    if drop_distribution not in DISTRIBUTIONS:
        raise ValueError(f"drop_distribution must be one of {', '.join(DISTRIBUTIONS)}, got {drop_distribution!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


class StochasticDepth(Algorithm):
    """Stochastic depth via `stochastic_depth_model`, once at INIT."""

    def __init__(self, drop_rate: float = 0.1, drop_distribution: str = "linear", mode: str = "sample"):
        _check(drop_rate, drop_distribution, mode)
        self.drop_rate, self.drop_distribution, self.mode = drop_rate, drop_distribution, mode

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        stochastic_depth_model(state.model, self.drop_rate, self.drop_distribution, self.mode)
