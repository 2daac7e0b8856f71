"""uint8 HWC images -> one normalized float32 batch, fast on a CPU.

A batch at 160 px is 39 MB of float32, far bigger than any cache. Two costs dominate:
- fresh memory: every new batch is new pages for the kernel to fault in and zero, which costs
  more than the arithmetic. `BatchBuffers` hands out the same few batches again once nothing
  outside holds them;
- torch's `x.float().sub_(mean).mul_(inv_std)` makes three passes over the batch with the
  channel constants broadcast along a trailing dimension of 3. Here each image is
  converted, centred and scaled while it is in cache, against the constants tiled along a
  whole row, so numpy's inner loops run over W*3 values.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def normalized_batch(images: Sequence[np.ndarray], mean, std, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same-shape (H, W, 3) uint8 images (a list or an (N, H, W, 3) array) -> (N, 3, H, W)
    float32, a channels_last view of an NHWC batch, `(x - 255 mean) / (255 std)`, written into
    `out` (an (N, H, W, 3) float32 tensor) when given."""
    height, width, channels = images[0].shape
    batch = torch.empty((len(images), height, width, channels), dtype=torch.float32) if out is None else out
    rows = batch.numpy().reshape(len(images), height, width * channels)
    row_mean = np.tile(np.asarray(mean, np.float32) * 255, width)
    row_scale = np.tile(1 / (np.asarray(std, np.float32) * 255), width)
    for row, image in zip(rows, images):
        row[...] = image.reshape(height, width * channels)
        row -= row_mean
        row *= row_scale
    return batch.permute(0, 3, 1, 2)


class BatchBuffers:
    """A few float32 NHWC batches, each handed out again only when no tensor outside this
    pool uses its memory any more: a consumer that keeps a batch, or any view of it, gets
    fresh memory next time instead of seeing its batch overwritten."""

    def __init__(self, keep: int = 2):   # one the caller holds, one being filled
        self.keep = keep
        self.buffers: list[torch.Tensor] = []

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        for buffer in self.buffers:
            if tuple(buffer.shape) == tuple(shape) and not used_elsewhere(buffer):
                return buffer
        buffer = torch.empty(shape, dtype=torch.float32)
        self.buffers = [*self.buffers, buffer][-self.keep:]
        return buffer


def used_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether any tensor other than `buffer` (a batch handed out, a view of it) uses its memory."""
    # The storage's use count: 1 for `buffer` itself, 1 for the storage object made to ask;
    # every other tensor on this memory (a batch handed out, a view of it) adds one.
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2
