"""The optimizer and the LR schedule: SGD with decoupled weight decay, the LR scaled linearly
with the global batch size, and step-wise warmup + cosine / linear / step decay."""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from training.config import OptimizerConfig


class DecoupledSGDW(torch.optim.SGD):
    """SGD whose weight decay shrinks the weights directly, by `weight_decay` times the LR's
    share of its peak, instead of adding `weight_decay * w` to the gradient (Loshchilov and
    Hutter; Composer's DecoupledSGDW): the decay no longer changes size with the LR's
    scale, only with its schedule, so it need not be retuned when the batch size is."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool, weight_decay: float):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", weight_decay)
            group.setdefault("initial_lr", lr)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            decay = group["decoupled_weight_decay"] * group["lr"] / group["initial_lr"]
            if decay:
                params = [p for p in group["params"] if p.grad is not None]
                torch._foreach_mul_(params, 1 - decay)
        return super().step(closure)


def peak_lr(config: OptimizerConfig, global_batch: int) -> float:
    return config.lr * global_batch / config.lr_reference_batch


def build_optimizer(model: nn.Module, config: OptimizerConfig, global_batch: int) -> DecoupledSGDW:
    """BN parameters and biases get no weight decay unless `decay_bn_and_bias` (the common
    ImageNet practice: decaying them only shrinks the scale the next layer undoes)."""
    decayed, exempt = [], []
    for parameter in model.parameters():
        (exempt if parameter.ndim <= 1 and not config.decay_bn_and_bias else decayed).append(parameter)
    groups = [{"params": decayed, "decoupled_weight_decay": config.weight_decay},
              {"params": exempt, "decoupled_weight_decay": 0.0}]
    return DecoupledSGDW([g for g in groups if g["params"]], lr=peak_lr(config, global_batch),
                         momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay)


def lr_factor(step: int, *, total: int, warmup: int, kind: str, final_fraction: float,
              milestones: tuple[int, ...], gamma: float) -> float:
    """The LR at optimizer step `step` as a share of the peak: a linear warmup from 0 (reaching
    the peak at step `warmup`), then the decay `kind` over the remaining steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return final_fraction + (1 - final_fraction) * (1 - progress)
    if kind == "step":
        return gamma ** sum(step >= m for m in milestones)
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig, steps_per_epoch: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-optimizer-step LambdaLR; durations in `dur` are shares of `total_steps`."""
    def to_steps(duration):
        return duration.to_batches(steps_per_epoch, total_steps)
    factor = partial(lr_factor, total=total_steps, warmup=to_steps(config.warmup), kind=config.schedule,
                     final_fraction=config.final_lr_fraction,
                     milestones=tuple(to_steps(m) for m in config.milestones), gamma=config.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
