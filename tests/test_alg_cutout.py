"""CutOut: the pure function's defining properties, and the hook in a real (tiny) training run."""
from __future__ import annotations

import torch

from algorithms.base import Event
from algorithms.cutout import CutOut, cutout_batch
from conftest import batch_recorder, tiny_trainer


def hole_boxes(out: torch.Tensor):
    """Per image: the zeroed pixel mask (H, W), checked equal over channels."""
    zero = out == 0
    assert torch.equal(zero, zero[:, :1].expand_as(zero))
    return zero[:, 0]


def check_one_square_per_image(out: torch.Tensor, side: int) -> int:
    """Each image's hole is one rectangle, a side x side square unless it touches the border;
    returns how many were fully inside."""
    height, width = out.shape[-2:]
    inside = 0
    for mask in hole_boxes(out):
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
        assert mask[top:bottom, left:right].all() and mask.sum() == (bottom - top) * (right - left)
        assert bottom - top <= side and right - left <= side
        if top > 0 and left > 0 and bottom < height and right < width:
            assert bottom - top == side and right - left == side and mask.sum() == side * side
            inside += 1
    return inside


def test_exact_square_holes_in_pixels_and_shares():
    images = torch.rand(200, 3, 16, 24) + 1                                  # no zeros of its own
    out = cutout_batch(images, num_holes=1, length=5, generator=torch.Generator().manual_seed(0))
    assert check_one_square_per_image(out, 5) > 50
    assert torch.equal(out[out != 0], images[out != 0])                     # the rest is untouched
    out = cutout_batch(images, num_holes=1, length=0.25, generator=torch.Generator().manual_seed(1))
    assert check_one_square_per_image(out, 4) > 50                          # 0.25 x min(16, 24)
    masks = hole_boxes(out)
    assert len({tuple(m.flatten().tolist()) for m in masks}) > 20          # each image its own hole


def test_several_holes_and_dtype_layout_kept():
    images = (torch.rand(50, 3, 12, 12) + 1).half().contiguous(memory_format=torch.channels_last)
    out = cutout_batch(images, num_holes=3, length=4, generator=torch.Generator().manual_seed(2))
    assert out.dtype == torch.float16 and out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    zeroed = hole_boxes(out).sum((1, 2))
    assert (zeroed <= 3 * 16).all() and (zeroed > 16).any()
    assert torch.equal(cutout_batch(images, num_holes=0), images)


def test_hook_cuts_holes_in_training_batches(tmp_path):
    before, after = batch_recorder(Event.AFTER_DATALOADER), batch_recorder(Event.AFTER_DATALOADER)
    trainer = tiny_trainer(tmp_path, [before, CutOut(num_holes=1, length=0.5), after])
    trainer.fit()
    assert len(after.seen) == trainer.state.step == 8
    for (images, _), (out, _) in zip(before.seen, after.seen):
        new_zeros = (out == 0) & (images != 0)
        assert torch.equal(out[out != 0], images[out != 0])
        per_image = new_zeros.any(1).sum((1, 2))
        assert (per_image > 0).all() and (per_image <= 8 * 8).all()         # side 0.5 x 16 = 8
