"""BlurPool: anti-aliased downsampling (Zhang 2019, "Making Convolutional Networks Shift-Invariant
Again"; MosaicML Composer's BlurPool).

What: a strided conv or max-pool samples its input on a coarse grid, so frequencies above the new
Nyquist limit alias into the output and a one-pixel shift of the image can change it a lot.
BlurPool low-pass filters before each subsampling with a fixed 3x3 binomial kernel
([1,2,1] outer [1,2,1] / 16, depthwise, zero padding 1, as Composer): every strided nn.Conv2d
becomes a `BlurConv2d` (blur_first: blur at stride 1, then the conv with its own stride; else the
conv at stride 1, then the blur with the conv's stride, as in the paper) and every nn.MaxPool2d a
`BlurMaxPool2d` (max over the window at stride 1, then the blur with the pool's stride).
When it helps: natural images, ImageNet ResNets (+0.5-1% top-1 in the paper; a Pareto gain for
ResNet-50 in Composer's runs); a model with nothing to replace is left as is, with a warning.
Cost: one depthwise 3x3 conv per replaced layer; blur_first=False runs those convs at stride 1
(4x their multiply-adds; Composer saw ~0.1% more accuracy for ~10% slowdown). No parameters are
added; each conv keeps its Parameters (its state-dict keys gain ".conv").
Hyperparameters (Composer's defaults, also in its ResNet-50 medium/spicy recipes): replace_convs=True,
replace_maxpools=True, blur_first=True, min_channels=16 (convs with fewer input channels, i.e. the
RGB stem, stay as they are). Applied at INIT, before the optimizer holds the parameters.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.base import Algorithm, Event


def binomial_filter(channels: int, like: torch.Tensor) -> torch.Tensor:
    """The 3x3 binomial low-pass kernel, one copy per channel: shape (channels, 1, 3, 3)."""
    taps = torch.tensor([1.0, 2.0, 1.0], device=like.device, dtype=like.dtype)
    kernel = torch.outer(taps, taps) / 16
    return kernel.expand(channels, 1, 3, 3).contiguous()


def blur(x: torch.Tensor, filter_: torch.Tensor, stride) -> torch.Tensor:
    """Depthwise blur of NCHW `x` with `filter_` (C or 1, 1, 3, 3), zero padding 1, then subsampling."""
    channels = x.shape[1]
    return F.conv2d(x, filter_.expand(channels, 1, 3, 3), stride=stride, padding=1, groups=channels)


class BlurConv2d(nn.Module):
    """A strided conv with a blur before it (blur_first) or after it at the conv's stride.

    Wraps the given conv (the same module and Parameters); with blur_first=False its stride is
    set to 1, since the blur then does the subsampling."""

    def __init__(self, conv: nn.Conv2d, blur_first: bool = True):
        super().__init__()
        self.blur_first, self.blur_stride = blur_first, (1 if blur_first else conv.stride)
        if not blur_first:
            conv.stride = (1, 1)
        self.conv = conv
        channels = conv.in_channels if blur_first else conv.out_channels
        # A buffer so that .to()/channels_last follow the model; not persistent: it is a constant.
        self.register_buffer("blur_filter", binomial_filter(channels, conv.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blur_first:
            return self.conv(blur(x, self.blur_filter, 1))
        return blur(self.conv(x), self.blur_filter, self.blur_stride)


class BlurMaxPool2d(nn.Module):
    """nn.MaxPool2d with the subsampling moved after a blur: max at stride 1, blur at the stride."""

    def __init__(self, pool: nn.MaxPool2d, like: torch.Tensor):
        super().__init__()
        self.kernel_size, self.stride, self.padding = pool.kernel_size, pool.stride, pool.padding
        self.dilation, self.ceil_mode = pool.dilation, pool.ceil_mode
        self.register_buffer("blur_filter", binomial_filter(1, like), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maxes = F.max_pool2d(x, self.kernel_size, 1, self.padding, self.dilation, self.ceil_mode)
        return blur(maxes, self.blur_filter, self.stride)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


def blurpool_model(model: nn.Module, replace_convs: bool = True, replace_maxpools: bool = True,
                   blur_first: bool = True, min_channels: int = 16) -> int:
    """Swap, in place, every strided nn.Conv2d with at least `min_channels` input channels for a
    BlurConv2d and every nn.MaxPool2d for a BlurMaxPool2d; the number of modules replaced.
    The convs' Parameters stay the same objects, so an optimizer built before still holds them."""
    like = next(model.parameters(), torch.empty(0))      # device and dtype for the blur filters

    def replacement(module: nn.Module) -> nn.Module | None:
        if (replace_convs and isinstance(module, nn.Conv2d) and max(module.stride) > 1
                and module.in_channels >= min_channels):
            return BlurConv2d(module, blur_first)
        if replace_maxpools and isinstance(module, nn.MaxPool2d):
            return BlurMaxPool2d(module, like)
        return None

    def replace_children(parent: nn.Module) -> int:
        count = 0
        for name, child in parent.named_children():
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
            elif not isinstance(child, BlurConv2d):      # its conv is already blurred
                count += replace_children(child)
        return count

    count = replace_children(model)
    if count == 0:
        warnings.warn("BlurPool changed nothing: no strided Conv2d with "
                      f">= {min_channels} input channels and no MaxPool2d in the model")
    return count


class BlurPool(Algorithm):
    """Anti-aliased downsampling via `blurpool_model`, once at INIT."""

    def __init__(self, replace_convs: bool = True, replace_maxpools: bool = True, blur_first: bool = True,
                 min_channels: int = 16):
        self.replace_convs, self.replace_maxpools = replace_convs, replace_maxpools
        self.blur_first, self.min_channels = blur_first, min_channels

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        blurpool_model(state.model, self.replace_convs, self.replace_maxpools, self.blur_first, self.min_channels)
