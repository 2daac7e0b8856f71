"""Whitening initialisation: the stem's first convolution set, from the first training batch, to
filters that decorrelate image patches, and held fixed for the first epochs (airbench's first
layer; its authors credit the idea to tysam-code's hlb-CIFAR10).

What: the patches the stem convolution sees (its kernel's size, every position of the batch's
normalised images) have a covariance C = V diag(l) V^T. The filters are the eigenvectors of the
`out_channels // 2` largest eigenvalues, each scaled by 1 / sqrt(l + eps), and their negatives
(so that a ReLU after it loses no sign): applied to a patch, the pairs give its coordinates along
C's main axes at unit variance, which the layers after it learn from faster than raw pixels.
airbench keeps them fixed for the whole run; here for `frozen_epochs` (their gradient dropped
before each optimizer step, so neither momentum nor weight decay moves them), then trained.
With several ranks the patch statistics are summed over all of them, so every rank sets the
same filters. A resumed run keeps the filters of its checkpoint.
When: small images and short budgets, where the first epochs go to learning the first layer.
Cost: one eigendecomposition of a (c k^2)-square matrix at the first step.
Settings: frozen_epochs=1e9 (airbench: always), eps=5e-4 (airbench's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from algorithms.base import Algorithm, Event


def patch_covariance(images: torch.Tensor, kernel_size: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """(sum of the outer products of every kernel-sized patch of `images`, the patch count): float64."""
    patches = nn.functional.unfold(images.double(), kernel_size)       # (N, c*kh*kw, positions)
    flat = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return flat.T @ flat, flat.shape[0]


def whitening_filters(covariance: torch.Tensor, shape: tuple[int, ...], eps: float = 5e-4) -> torch.Tensor:
    """`shape[0]` filters of `shape` (out, c, kh, kw) from a patch covariance: the main axes, largest
    variance first, scaled to unit variance, each followed by its negative."""
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    order = eigenvalues.argsort(descending=True)
    scaled = (eigenvectors[:, order] / torch.sqrt(eigenvalues[order].clamp(min=0) + eps)).T
    pairs = -(-shape[0] // 2)
    if pairs > len(scaled):
        raise ValueError(f"a stem of {shape[0]} filters needs {pairs} patch directions, its patches have {len(scaled)}")
    filters = torch.stack([scaled[:pairs], -scaled[:pairs]], 1).reshape(2 * pairs, *shape[1:])
    return filters[:shape[0]]


def stem_convolution(model: nn.Module) -> nn.Conv2d:
    """The model's first convolution (its stem's)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            return module
    raise ValueError("whitening_init: the model has no convolution")


@torch.no_grad()
def init_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Sets `conv`'s filters to the whitening filters of `images`' patches (one process)."""
    covariance, count = patch_covariance(images, conv.kernel_size)
    conv.weight.copy_(whitening_filters(covariance / count, tuple(conv.weight.shape), eps))


class WhiteningInit(Algorithm):
    def __init__(self, frozen_epochs: float = 1e9, eps: float = 5e-4):
        if frozen_epochs < 0 or eps <= 0:
            raise ValueError(f"whitening_init needs frozen_epochs >= 0 and eps > 0; got {frozen_epochs}, {eps}")
        self.frozen_epochs, self.eps = frozen_epochs, float(eps)
        self._initialized = False
        self._stem: nn.Conv2d | None = None     # found once, not at every step

    def match(self, event: Event, state) -> bool:
        if event == Event.AFTER_DATALOADER:
            return not self._initialized
        return event == Event.BEFORE_OPTIMIZER_STEP and state.epoch < self.frozen_epochs

    @torch.no_grad()
    def apply(self, event: Event, state) -> None:
        if self._stem is None:
            self._stem = stem_convolution(state.model)
        conv = self._stem
        if event == Event.BEFORE_OPTIMIZER_STEP:
            conv.weight.grad = None        # the optimizer then leaves the filters as they are
            return
        self._initialized = True
        if state.step > 0:                 # resumed: the checkpoint's filters
            return
        covariance, count = patch_covariance(state.images.to(conv.weight.device), conv.kernel_size)
        if dist.is_available() and dist.is_initialized():
            totals = torch.cat([covariance.flatten(), torch.tensor([float(count)], dtype=torch.float64,
                                                                   device=covariance.device)])
            dist.all_reduce(totals)
            covariance, count = totals[:-1].reshape(covariance.shape), totals[-1]
        conv.weight.copy_(whitening_filters(covariance / count, tuple(conv.weight.shape), self.eps))

    def state_dict(self) -> dict:
        return {"initialized": self._initialized}

    def load_state_dict(self, state: dict) -> None:
        self._initialized = bool(state.get("initialized", False))
