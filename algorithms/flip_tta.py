"""Flip test-time augmentation: evaluate on each image and its mirror image, average the logits.

What: at evaluation the model's logits become `(f(x) + f(flip(x))) / 2`, flip being the
left-right mirror, so the prediction is the same for an image and its mirror image. Training
is untouched. The simplest test-time augmentation: VGG (Simonyan & Zisserman 2015) averaged the
softmax of an image and its mirror; airbench's fast CIFAR-10 runs average the logits, as here.
When it helps: when training used random flips, so both views are in distribution, and the
classes are mirror-symmetric (garments, animals; not digits or text).
Cost: a second forward pass per evaluated image, which counts in the run's time as every
evaluation does. Evaluate less often (eval_interval) if the final evaluation is what matters.
Order: list it after `ema` in a recipe, so that at EVAL_START it wraps the model that already
holds the averaged weights, and at EVAL_END it unwraps before EMA swaps them back out.
"""
from __future__ import annotations

import torch
from torch import nn

from algorithms.base import Algorithm, Event


def flip_averaged_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The mean of the model's logits for `images` (N, C, H, W) and their left-right mirrors."""
    return (model(images) + model(images.flip(-1))) / 2


class FlipAveraged(nn.Module):
    """`model` whose forward is `flip_averaged_logits`; its parameters are the model's, in order."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return flip_averaged_logits(self.model, images)


class FlipTTA(Algorithm):
    """Wraps `state.model` in `FlipAveraged` from EVAL_START to EVAL_END."""

    def __init__(self):
        self._unwrapped: nn.Module | None = None

    def match(self, event: Event, state) -> bool:
        return event in (Event.EVAL_START, Event.EVAL_END)

    def apply(self, event: Event, state) -> None:
        if event == Event.EVAL_START:
            self._unwrapped, state.model = state.model, FlipAveraged(state.model)
        elif self._unwrapped is not None:
            state.model, self._unwrapped = self._unwrapped, None
