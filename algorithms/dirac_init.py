"""Dirac initialisation: each convolution after the stem starts by passing its input through
(airbench's convolutions; Zagoruyko and Komodakis, "DiracNets", 2017).

What: of each convolution's filters, the first `in_channels` are set to the identity (a one at
the kernel's centre, on their own input channel); the others keep their random initialisation.
So at the start every layer carries its input forward, and training learns what to add to it.
The stem is left alone (`whitening_init` or the default sets it). Applied at INIT, before a
checkpoint is loaded: a resumed run gets its trained filters back.
When: short budgets with plain (airbench) or residual stacks, where the first steps otherwise
go to finding a signal path through random filters.
Cost: nothing after the first step.
Settings: none.
"""
from __future__ import annotations

import torch
from torch import nn

from algorithms.base import Algorithm, Event


@torch.no_grad()
def dirac_init(model: nn.Module) -> int:
    """Sets the first in_channels filters of every convolution but the first to the identity;
    returns how many convolutions it set."""
    convolutions = [module for module in model.modules() if isinstance(module, nn.Conv2d)][1:]
    for conv in convolutions:
        weight = conv.weight
        nn.init.dirac_(weight[:weight.shape[1]], groups=1)
    return len(convolutions)


class DiracInit(Algorithm):
    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        dirac_init(state.model)
