"""MixUp: the pure function's defining properties, and the hook in a real (tiny) training run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.base import Event
from algorithms.mixup import MixUp, mixup_batch
from conftest import batch_recorder, tiny_trainer


def labelled_images(n: int) -> torch.Tensor:
    """Sample i is the one-hot vector e_i in its channels: a mix is readable off any pixel."""
    return torch.eye(n)[:, :, None, None].expand(n, n, 3, 5).clone()


def test_images_and_targets_mixed_with_one_lambda():
    n = 8
    images, targets = labelled_images(n), torch.arange(n)
    for seed in range(20):
        mixed, mixed_targets, lam = mixup_batch(images, targets, n, alpha=0.4,
                                                generator=torch.Generator().manual_seed(seed))
        assert 0.5 <= lam <= 1 and mixed.shape == images.shape and mixed_targets.shape == (n, n)
        torch.testing.assert_close(mixed_targets.sum(1), torch.ones(n))
        # every pixel of image i holds exactly the mix its target row says
        torch.testing.assert_close(mixed, mixed_targets[:, :, None, None].expand_as(mixed))
        own_weight = mixed_targets.diagonal()
        assert (own_weight < 1).any()          # paired with itself, a sample keeps weight 1
        torch.testing.assert_close(own_weight[own_weight < 1], torch.full_like(own_weight[own_weight < 1], lam))


def test_probability_targets_accepted():
    n = 6
    probabilities = F.one_hot(torch.arange(n), n).float()
    a = mixup_batch(labelled_images(n), torch.arange(n), n, generator=torch.Generator().manual_seed(3))
    b = mixup_batch(labelled_images(n), probabilities, n, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a[1], b[1])


def test_small_alpha_is_nearly_identity():
    images, targets = torch.randn(16, 3, 8, 8), torch.randint(10, (16,))
    for seed in range(10):
        mixed, mixed_targets, lam = mixup_batch(images, targets, 10, alpha=1e-3,
                                                generator=torch.Generator().manual_seed(seed))
        assert lam > 0.99
        torch.testing.assert_close(mixed, images, atol=0.05, rtol=0)
    mixed, mixed_targets, lam = mixup_batch(images, targets, 10, alpha=0.0)
    assert lam == 1 and torch.equal(mixed, images) and torch.equal(mixed_targets.argmax(1), targets)


def test_hook_replaces_batch_with_mixed_probabilities(tmp_path):
    before, after = batch_recorder(Event.AFTER_DATALOADER), batch_recorder(Event.AFTER_DATALOADER)
    trainer = tiny_trainer(tmp_path, [before, MixUp(alpha=1.0), after])
    trainer.fit()
    assert len(after.seen) == trainer.state.step == 8
    for (images, targets), (mixed, mixed_targets) in zip(before.seen, after.seen):
        assert targets.dtype == torch.long and mixed_targets.dtype == torch.float32
        assert mixed_targets.shape == (8, 4) and mixed.shape == images.shape
        torch.testing.assert_close(mixed_targets.sum(1), torch.ones(8))
    assert any(not torch.equal(m, i) for (i, _), (m, _) in zip(before.seen, after.seen))


def test_interpolated_loss_trains_like_mixed_targets(tmp_path):
    """For cross-entropy (linear in the targets) the two modes give the same updates, with
    gradient accumulation too; interpolate_loss keeps the integer targets."""
    weights = {}
    for interpolate in (False, True):
        after = batch_recorder(Event.BEFORE_FORWARD)
        trainer = tiny_trainer(tmp_path / str(interpolate), [MixUp(alpha=1.0, interpolate_loss=interpolate), after],
                               "grad_accum=2", "optim.lr=2.0")
        trainer.fit()
        assert all(t.dtype == (torch.long if interpolate else torch.float32) for _, t in after.seen)
        weights[interpolate] = torch.cat([p.detach().flatten() for p in trainer.state.model.parameters()])
    initial = torch.cat([p.detach().flatten() for p in tiny_trainer(tmp_path / "init", []).state.model.parameters()])
    assert not torch.allclose(weights[False], initial)
    torch.testing.assert_close(weights[True], weights[False], atol=1e-5, rtol=1e-4)
