"""pipeline/transforms/normalize.py: the normalized batch is torch's formula, and a reused batch buffer
is never one that a caller still holds, whole or through a view."""
import numpy as np
import torch

from pipeline.transforms.normalize import BatchBuffers, normalized_batch
from pipeline.spec import IMAGENET_MEAN, IMAGENET_STD


def images(count=4, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, 6, 5, 3), dtype=np.uint8)


def test_matches_torch_formula():
    pixels = images()
    want = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - 255 * torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) \
        / (255 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
    got = normalized_batch(list(pixels), IMAGENET_MEAN, IMAGENET_STD)
    assert got.shape == (4, 3, 6, 5) and got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want)


def test_buffers_are_reused_only_once_released():
    pool = BatchBuffers(keep=2)
    first = normalized_batch(images(seed=1), IMAGENET_MEAN, IMAGENET_STD, out=pool.take((4, 6, 5, 3)))
    address = first.data_ptr()
    del first                                        # released: the next batch reuses its memory
    second = normalized_batch(images(seed=2), IMAGENET_MEAN, IMAGENET_STD, out=pool.take((4, 6, 5, 3)))
    assert second.data_ptr() == address

    kept_view = second[1:3].clone(), second[1:3]     # a view alone keeps the memory from reuse
    del second
    third = normalized_batch(images(seed=3), IMAGENET_MEAN, IMAGENET_STD, out=pool.take((4, 6, 5, 3)))
    assert third.data_ptr() != address
    assert torch.equal(kept_view[0], kept_view[1])   # not overwritten
    assert pool.take((2, 6, 5, 3)).shape == (2, 6, 5, 3)   # another shape: its own buffer
