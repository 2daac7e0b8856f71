"""ColOut: drop a random share of rows and columns from each image, so images get smaller.

The same number of rows and columns goes from every sample, so a batch stays rectangular;
which ones differs per sample. `colout_sample` is the loader-side form (one HWC numpy
image in a worker), `colout_batch` the batch-side form (an NCHW tensor on any device).
"""
from __future__ import annotations

import math

import numpy as np
import torch


def kept_size(height: int, width: int, p_row: float, p_col: float) -> tuple[int, int]:
    """(rows, cols) left after dropping p_row of the rows and p_col of the columns."""
    if not (0 <= p_row < 1 and 0 <= p_col < 1):
        raise ValueError(f"colout shares must be in [0, 1), got p_row={p_row}, p_col={p_col}")
    return max(1, math.ceil((1 - p_row) * height)), max(1, math.ceil((1 - p_col) * width))


def sample_generator(uniforms: np.ndarray) -> np.random.Generator:
    """ColOut's generator for one sample of a loader, seeded from the sample's crop uniforms
    (`pipeline.transforms.crops.sample_uniforms`): the same draws whichever backend makes the sample."""
    return np.random.default_rng(uniforms[:2].view(np.uint64))


def kept_indices(height: int, width: int, p_row: float, p_col: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The sorted rows and columns ColOut keeps of an image of that size."""
    rows, cols = kept_size(height, width, p_row, p_col)
    return np.sort(rng.choice(height, rows, replace=False)), np.sort(rng.choice(width, cols, replace=False))


def colout_sample(image: np.ndarray, p_row: float, p_col: float, rng: np.random.Generator) -> np.ndarray:
    """An (H, W, C) image without a random p_row of its rows and p_col of its columns."""
    keep_rows, keep_cols = kept_indices(*image.shape[:2], p_row, p_col, rng)
    return image[keep_rows][:, keep_cols]


def colout_batch(images: torch.Tensor, p_row: float = 0.15, p_col: float = 0.15,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """(N, C, H, W) -> (N, C, H', W'): each sample loses its own random rows and columns."""
    n, c, height, width = images.shape
    rows, cols = kept_size(height, width, p_row, p_col)
    device = images.device

    def kept(size: int, count: int) -> torch.Tensor:
        scores = torch.rand(n, size, generator=generator, device=generator.device if generator else "cpu")
        return scores.argsort(dim=1)[:, :count].sort(dim=1).values.to(device)

    keep_rows, keep_cols = kept(height, rows), kept(width, cols)
    out = images.gather(2, keep_rows[:, None, :, None].expand(n, c, rows, width))
    return out.gather(3, keep_cols[:, None, None, :].expand(n, c, rows, cols))
