"""Muon for the convolutions: each filter bank's momentum orthogonalised before it is applied
(Keller Jordan's Muon, "MomentUm Orthogonalized by Newton-Schulz"; airbench94_muon trains
CIFAR-10's convolutions with it and the rest with SGD).

What: for each convolution weight W but the stem's, at each optimizer step, with its gradient G
(already reduced over ranks): the momentum M = momentum * M + G (Nesterov: G + momentum * M) is
seen as a matrix (out, in * kh * kw) and replaced by its nearest semi-orthogonal matrix (all its
singular values near 1), through a few Newton-Schulz iterations; W is scaled back to the norm
sqrt(out) (the batch norm after it makes its scale idle, and a fixed scale fixes the step's
relative size), then moves by -lr times that update. Those weights' gradients are then dropped,
so the run's SGD steps everything else (the stem, the batch norms, the head) as before.
`lr` follows the run's schedule: it is scaled by the SGD's current share of its peak LR.
The stem is left to SGD: its few input channels give a matrix of 27 columns, and
`whitening_init` sets it to decorrelate its input already.
When: short budgets; every direction of a filter bank learns at the same pace, where SGD's
largest singular directions take most of the step.
Cost: per convolution and step, the Newton-Schulz iterations, each three matrix products of
the (out, in * kh * kw) matrix (small beside a batch's forward and backward); one momentum
buffer per convolution, kept in the checkpoint.
Settings: lr=0.24, momentum=0.6, nesterov=True, steps=3 (airbench94_muon's); fp16 with a
GradScaler is refused (a step it skips for an overflow would already have moved the filters).
"""
from __future__ import annotations

import torch
from torch import nn

from algorithms.base import Algorithm, Event

# The quintic's coefficients: its slope at 0 as steep as convergence allows, so a few iterations
# lift the smallest singular values toward 1 (they end spread over about 0.7-1.2, which trains
# as well as exactly 1).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


@torch.no_grad()
def orthogonalize(matrix: torch.Tensor, steps: int = 3, eps: float = 1e-7) -> torch.Tensor:
    """A matrix with `matrix`'s singular vectors and singular values near 1, by `steps`
    Newton-Schulz iterations X <- aX + (b XX^T + c (XX^T)^2) X from X = matrix / ||matrix||."""
    if matrix.ndim != 2:
        raise ValueError(f"orthogonalize needs a matrix, got shape {tuple(matrix.shape)}")
    a, b, c = NEWTON_SCHULZ
    x = matrix.float() / (matrix.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:                                # iterate on the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@torch.no_grad()
def muon_step(weight: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, lr: float, momentum: float = 0.6,
              nesterov: bool = True, steps: int = 3) -> None:
    """One Muon step on a filter bank (out, ...), in place: the momentum `buffer` takes `grad`,
    `weight` is scaled to norm sqrt(out) and moves by -lr times the orthogonalised momentum."""
    buffer.mul_(momentum).add_(grad)
    direction = grad.add(buffer, alpha=momentum) if nesterov else buffer
    weight.mul_(len(weight) ** 0.5 / weight.norm().clamp(min=1e-12))
    update = orthogonalize(direction.reshape(len(direction), -1), steps).view(direction.shape)
    weight.add_(update.to(weight.dtype), alpha=-lr)


def muon_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The convolution weights Muon trains: every trainable Conv2d's but the first (the stem's)."""
    convolutions = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Conv2d)]
    return {f"{name}.weight": module.weight for name, module in convolutions[1:] if module.weight.requires_grad}


class Muon(Algorithm):
    def __init__(self, lr: float = 0.24, momentum: float = 0.6, nesterov: bool = True, steps: int = 3):
        if lr <= 0 or not 0 <= momentum < 1 or steps < 1 or (nesterov and momentum == 0):
            raise ValueError(f"Muon needs lr > 0, 0 <= momentum < 1 (> 0 with nesterov) and steps >= 1; got lr={lr}, "
                             f"momentum={momentum}, nesterov={nesterov}, steps={steps}")
        self.lr, self.momentum, self.nesterov, self.steps = float(lr), float(momentum), bool(nesterov), int(steps)
        self._weights: dict[str, nn.Parameter] | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def match(self, event: Event, state) -> bool:
        return event in (Event.FIT_START, Event.BEFORE_OPTIMIZER_STEP)

    def apply(self, event: Event, state) -> None:
        if event == Event.FIT_START:
            if state.scaler is not None and state.scaler.is_enabled():
                raise ValueError("Muon does not support fp16 with a GradScaler: a step skipped for an overflow "
                                 "would already have moved the filters; use precision=bf16 or fp32")
            self._weights = muon_weights(state.model)
            if self._buffers and set(self._buffers) != set(self._weights):
                raise ValueError("Muon's momentum in the checkpoint does not match the model's convolutions")
            self._buffers = {name: self._buffers[name].to(w.device, w.dtype) if name in self._buffers
                             else torch.zeros_like(w) for name, w in self._weights.items()}
            return
        group = state.optimizer.param_groups[0]
        lr = self.lr * group["lr"] / group["initial_lr"]
        for name, weight in self._weights.items():
            if weight.grad is not None:
                muon_step(weight, weight.grad, self._buffers[name], lr, self.momentum, self.nesterov, self.steps)
                weight.grad = None     # the run's SGD leaves this weight alone

    def state_dict(self) -> dict:
        return {"momentum": dict(self._buffers)}

    def load_state_dict(self, state: dict) -> None:
        # Kept as loaded (on the CPU); FIT_START checks the names and moves them to the weights' devices.
        self._buffers = dict(state.get("momentum", {}))
