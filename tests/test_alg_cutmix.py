"""CutMix: the pure function's defining properties, and the hook in a real (tiny) training run."""
from __future__ import annotations

import torch

from algorithms.base import Event
from algorithms.cutmix import CutMix, cutmix_batch
from conftest import batch_recorder, tiny_trainer


def test_target_weights_are_the_pasted_pixel_share():
    n, height, width = 6, 9, 14
    images = torch.eye(n)[:, :, None, None].expand(n, n, height, width).clone()   # sample i = e_i everywhere
    targets = torch.arange(n)
    shares, clipped = [], 0
    for seed in range(60):
        mixed, mixed_targets, (top, bottom, left, right) = cutmix_batch(
            images, targets, n, alpha=1.0, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(mixed_targets.sum(1), torch.ones(n))
        outside = torch.ones(height, width, dtype=torch.bool)
        outside[top:bottom, left:right] = False
        assert torch.equal(mixed[..., outside], images[..., outside])        # untouched outside the box
        source = mixed.argmax(1)                                             # (N, H, W): whose pixel is this
        for i in range(n):
            pasted = int((source[i] != i).sum()) / (height * width)
            if pasted:                                                       # paired with another sample
                other = source[i][source[i] != i].unique()
                assert other.numel() == 1
                assert abs(mixed_targets[i, other.item()].item() - pasted) < 1e-6
                assert abs(mixed_targets[i, i].item() - (1 - pasted)) < 1e-6
                assert pasted == (bottom - top) * (right - left) / (height * width)
        shares.append((bottom - top) * (right - left) / (height * width))
        clipped += top == 0 or left == 0 or bottom == height or right == width
    assert min(shares) < 0.2 and max(shares) > 0.5 and clipped > 0


def test_probability_targets_accepted():
    images, targets = torch.randn(5, 3, 8, 8), torch.tensor([0, 1, 2, 1, 0])
    soft = torch.nn.functional.one_hot(targets, 3).float()
    a = cutmix_batch(images, targets, 3, generator=torch.Generator().manual_seed(1))
    b = cutmix_batch(images, soft, 3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_hook_replaces_batch_with_cutmixed_probabilities(tmp_path):
    before, after = batch_recorder(Event.AFTER_DATALOADER), batch_recorder(Event.AFTER_DATALOADER)
    trainer = tiny_trainer(tmp_path, [before, CutMix(alpha=1.0), after])
    trainer.fit()
    assert len(after.seen) == trainer.state.step == 8
    for (images, targets), (mixed, mixed_targets) in zip(before.seen, after.seen):
        assert mixed_targets.dtype == torch.float32 and mixed_targets.shape == (8, 4)
        torch.testing.assert_close(mixed_targets.sum(1), torch.ones(8))
        assert mixed.shape == images.shape and mixed.is_contiguous(memory_format=torch.channels_last)
        changed = (mixed != images).any(1).float().mean()                   # share of pixels replaced
        assert changed <= 1 - mixed_targets.gather(1, targets[:, None]).min() + 1e-6
    assert any(not torch.equal(m, i) for (i, _), (m, _) in zip(before.seen, after.seen))
