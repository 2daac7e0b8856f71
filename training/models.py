"""ResNets written out here, so no torchvision is needed: ImageNet ResNet-18 and ResNet-50 with the
same layers, parameter counts and initialisation as torchvision's, and a small CIFAR-style ResNet for
28-64 px images. The blocks are laid out for the speed-up algorithms that edit models in place:
each residual block is a `BasicBlock` or `Bottleneck` with a `residual(x)` method, a `downsample`
shortcut (or None) and a `last_bn`, which is what stochastic depth and zero-init look for; strided
convs are nn.Conv2d (the projection shortcut's a subclass of it) and the stem's pool an nn.MaxPool2d,
which is what BlurPool swaps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.bce import init_logit_bias

MODELS = ("resnet18", "resnet50", "small_resnet")


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    # No bias: the BatchNorm that follows every conv has its own shift.
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    if stride > 1:
        return SubsampledConv1x1(in_channels, out_channels, stride)
    return nn.Conv2d(in_channels, out_channels, 1, bias=False)


class SubsampledConv1x1(nn.Conv2d):
    """A strided 1x1 conv computed on a CPU as what it is: every stride-th pixel, then a stride-1
    1x1 conv. The same function, Parameters and state-dict keys as nn.Conv2d(..., 1, stride).

    Why: torch's oneDNN has an AVX2 kernel for the weight gradient of a strided 1x1 conv that, with
    channels-last input and fewer than 8 input channels, writes past its workspace (oneDNN issue
    6035): gradients off by up to 213x on an EPYC, or a thread that never returns. AVX-512 CPUs
    take another kernel, and ONEDNN_MAX_CPU_ISA=AVX2 sends them to this one too. The subsampled
    form never reaches it, at any width, and is no slower (README, troubleshooting). On other
    devices the native strided conv runs, untouched. `stride` stays the conv's, so BlurPool finds the layer,
    and its blur_first=False (stride set to 1, blur subsamples) works as for any conv."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or self.stride == (1, 1):
            return super().forward(x)
        rows, cols = self.stride
        return F.conv2d(x[:, :, ::rows, ::cols], self.weight, self.bias, 1, 0, self.dilation, self.groups)


def shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """Projection shortcut where the block changes shape; None (identity) where it does not."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels))


class ResidualBlock(nn.Module):
    """relu(residual(x) + shortcut(x)); subclasses define `residual`, `downsample` and `last_bn`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(self.residual(x) + identity)


class BasicBlock(ResidualBlock):
    """Two 3x3 convs: relu(residual(x) + downsample(x)). ResNet-18/34 and the small ResNet."""
    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(in_channels, channels, stride), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = conv3x3(channels, channels), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(in_channels, channels, stride)
        self.last_bn = self.bn2

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))


class Bottleneck(ResidualBlock):
    """1x1 reduce, 3x3, 1x1 expand (x4). The stride sits on the 3x3 conv ("ResNet v1.5", as in
    torchvision and the MLPerf/FFCV/Composer recipes), not on the first 1x1 as in the paper."""
    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1, self.bn1 = conv1x1(in_channels, channels), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = conv3x3(channels, channels, stride), nn.BatchNorm2d(channels)
        self.conv3, self.bn3 = conv1x1(channels, out_channels), nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(in_channels, out_channels, stride)
        self.last_bn = self.bn3

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))


class GlobalAveragePool(nn.Module):
    """(N, C, H, W) -> (N, C, 1, 1) at any input size, as nn.AdaptiveAvgPool2d(1) gives, but as a mean:
    AdaptiveAvgPool2d's CUDA backward has no deterministic kernel, and torch raises in it when
    `deterministic: true` asks for one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3), keepdim=True)


class ResNet(nn.Module):
    """stem -> stages of residual blocks -> global average pool -> fc. The stem is passed in
    (ImageNet 7x7/2 + maxpool, or 3x3/1 for small images); the first block of a stage strides."""

    def __init__(self, stem: nn.Sequential, stem_channels: int, block: type[BasicBlock] | type[Bottleneck],
                 widths: tuple[int, ...], strides: tuple[int, ...], blocks_per_stage: tuple[int, ...],
                 num_classes: int):
        super().__init__()
        self.stem = stem
        stages, in_channels = [], stem_channels
        for width, stride, count in zip(widths, strides, blocks_per_stage):
            blocks = []
            for i in range(count):
                blocks.append(block(in_channels, width, stride if i == 0 else 1))
                in_channels = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = GlobalAveragePool()
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def imagenet_stem() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                         nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))


def initialise(model: ResNet, num_classes: int, zero_init_residual: bool, bce_bias_init: bool) -> None:
    """torchvision's init (fc keeps PyTorch's default), plus the two optional tweaks."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if zero_init_residual:
        # gamma = 0 on the branch's last BN: residual(x) == 0, so each block starts as
        # relu(shortcut(x)) and the network as a shallow one; helps large-batch training.
        for module in model.modules():
            if isinstance(module, ResidualBlock):
                nn.init.zeros_(module.last_bn.weight)
    if bce_bias_init:
        # Sigmoid outputs start near 1/num_classes, the prior of each one-vs-rest target, so
        # BCE does not begin by pushing every logit down (Composer's "linear_log_constant_bias").
        init_logit_bias(model.fc, num_classes)


def build_model(name: str, num_classes: int, *, zero_init_residual: bool = True,
                bce_bias_init: bool = False, width: int = 16, blocks_per_stage: int = 2) -> nn.Module:
    """A freshly initialised model: one of MODELS. width and blocks_per_stage are for small_resnet."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if name != "small_resnet" and (width, blocks_per_stage) != (16, 2):
        raise ValueError(f"width and blocks_per_stage apply only to small_resnet, not {name}")
    if name == "small_resnet":
        if width < 1 or blocks_per_stage < 1:
            raise ValueError(f"width and blocks_per_stage must be >= 1, got {width}, {blocks_per_stage}")
        # No maxpool and a stride-1 stem: at 28-64 px the ImageNet stem's 4x reduction
        # would leave the last stage only a few pixels wide.
        stem = nn.Sequential(conv3x3(3, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        model = ResNet(stem, width, BasicBlock, (width, 2 * width, 4 * width), (1, 2, 2),
                       (blocks_per_stage,) * 3, num_classes)
    else:
        block, depths = (BasicBlock, (2, 2, 2, 2)) if name == "resnet18" else (Bottleneck, (3, 4, 6, 3))
        model = ResNet(imagenet_stem(), 64, block, (64, 128, 256, 512), (1, 2, 2, 2), depths, num_classes)
    initialise(model, num_classes, zero_init_residual, bce_bias_init)
    return model
