"""Crop boxes of the one train/val semantics, and the per-sample random seeds behind them.

Every backend that draws its own crops (folder, webdataset, ffcv) calls these functions,
so a crop means the same thing everywhere; DALI draws its own with the same parameters.
- train: RandomResizedCrop as torchvision defines it (10 attempts at a random area share
  and log-uniform aspect ratio, then a center crop clamped to the ratio range);
- val: a centered square of side `int(CENTER_CROP_RATIO * min(height, width))`, as FFCV's
  CenterCropRGBImageDecoder cuts it.
The functions take their random numbers as an argument and use nothing but arithmetic, so
numba compiles the same code for FFCV's decoders and Python runs it in DataLoader workers.
Randomness is drawn per sample from a seed mixed of (seed, epoch, sample id): a sample's
augmentation does not depend on which worker or thread handles it, or on where a resumed
epoch starts.
"""
from __future__ import annotations

import math

import numpy as np

CENTER_CROP_RATIO = 224 / 256
RANDOM_CROP_ATTEMPTS = 10
UNIFORMS_PER_SAMPLE = 4 * RANDOM_CROP_ATTEMPTS + 1   # 4 per crop attempt, 1 for the flip


def random_resized_crop(height, width, scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, uniforms):
    """(top, left, crop_height, crop_width) of a RandomResizedCrop; `uniforms`: 40 numbers in [0, 1)."""
    area = height * width
    for attempt in range(RANDOM_CROP_ATTEMPTS):
        u = uniforms[4 * attempt: 4 * attempt + 4]
        target_area = area * (scale_lo + (scale_hi - scale_lo) * u[0])
        aspect = math.exp(log_ratio_lo + (log_ratio_hi - log_ratio_lo) * u[1])
        crop_width = int(round(math.sqrt(target_area * aspect)))
        crop_height = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = int(u[2] * (height - crop_height + 1))
            left = int(u[3] * (width - crop_width + 1))
            return top, left, crop_height, crop_width
    in_ratio = width / height
    ratio_lo, ratio_hi = math.exp(log_ratio_lo), math.exp(log_ratio_hi)
    if in_ratio < ratio_lo:
        crop_width, crop_height = width, int(round(width / ratio_lo))
    elif in_ratio > ratio_hi:
        crop_width, crop_height = int(round(height * ratio_hi)), height
    else:
        crop_width, crop_height = width, height
    return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width


def center_crop(height, width, ratio=CENTER_CROP_RATIO):
    """(top, left, side, side) of the validation crop: a share `ratio` of the shorter side."""
    side = max(1, int(ratio * min(height, width)))
    return (height - side) // 2, (width - side) // 2, side, side


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 32-bit seed for one sample's augmentation in one epoch (numba-compatible arithmetic)."""
    mixed = (seed * 1_000_003 + epoch) * 2_654_435_761 + sample_id * 40_503
    return mixed % 4_294_967_291


def sample_uniforms(seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """The UNIFORMS_PER_SAMPLE random numbers of one sample's augmentation, for Python workers."""
    return np.random.default_rng(sample_seed(seed, epoch, sample_id)).random(UNIFORMS_PER_SAMPLE)


def compiled_sample_uniforms():
    """`sample_uniforms` compiled (pipeline/native/sample_uniforms.c) as a ctypes function, which numba
    code can call: f(seed, epoch, sample_id, out.ctypes.data, len(out)) fills `out` (float64)."""
    import ctypes

    from pipeline.native.library import load_library, source
    function = load_library(source("sample_uniforms.c"), libraries=()).sample_uniforms
    function.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int]
    function.restype = None
    return function


def train_crop(height: int, width: int, scale, ratio, uniforms) -> tuple[tuple[int, int, int, int], bool]:
    """The crop box and whether to flip, for one training sample."""
    box = random_resized_crop(height, width, scale[0], scale[1], math.log(ratio[0]), math.log(ratio[1]), uniforms)
    return box, bool(uniforms[-1] < 0.5)
