"""ChannelsLast (MosaicML Composer's ChannelsLast): store the model's 4-D tensors (conv weights,
4-D buffers) in torch.channels_last (NHWC) memory format.

What: cuDNN's tensor-core convolutions work in NHWC; given NCHW weights and activations it
transposes them around every conv. Converting the weights once, with channels-last
input batches, keeps the whole network in NHWC (the first conv converts an NCHW input and the
format then persists). When it helps: convnets on NVIDIA GPUs, most under AMP (bf16/fp16), where
tensor cores work in NHWC. Cost: a one-time copy of the weights; the math is unchanged. Layers
that cannot take NHWC make PyTorch convert back and forth. No hyperparameters.
In this system the trainer's `channels_last: true` config key (the default) already does this
conversion before INIT, and the loaders already deliver channels-last batches, so the hook is a
no-op there; it exists for Composer parity and for configs that set channels_last=false.
Applied at INIT, before DDP and the optimizer see the parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from algorithms.base import Algorithm, Event


def channels_last_model(model: nn.Module) -> nn.Module:
    """`model`, its 4-D parameters and buffers converted in place to channels_last; the
    Parameters stay the same objects, so an optimizer built before still holds them."""
    return model.to(memory_format=torch.channels_last)


class ChannelsLast(Algorithm):
    """Channels-last weights via `channels_last_model`, once at INIT."""

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        channels_last_model(state.model)
