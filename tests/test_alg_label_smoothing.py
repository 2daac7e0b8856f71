"""LabelSmoothing: the pure function's defining properties, and the hook in a real (tiny) training run."""
from __future__ import annotations

import torch

from algorithms.base import Event
from algorithms.label_smoothing import LabelSmoothing, smooth_labels
from algorithms.mixup import MixUp
from conftest import batch_recorder, tiny_trainer


def test_index_targets_smoothed():
    targets = torch.tensor([0, 3, 2, 2, 1])
    smoothed = smooth_labels(targets, 4, smoothing=0.2)
    assert smoothed.shape == (5, 4) and smoothed.dtype == torch.float32
    torch.testing.assert_close(smoothed.sum(1), torch.ones(5))
    torch.testing.assert_close(smoothed[torch.arange(5), targets], torch.full((5,), 1 - 0.2 + 0.2 / 4))
    off = torch.ones(5, 4, dtype=torch.bool)
    off[torch.arange(5), targets] = False
    torch.testing.assert_close(smoothed[off], torch.full((15,), 0.2 / 4))


def test_soft_targets_smoothed():
    soft = torch.softmax(torch.randn(7, 5), dim=1)
    smoothed = smooth_labels(soft, 5, smoothing=0.1)
    torch.testing.assert_close(smoothed.sum(1), torch.ones(7))
    torch.testing.assert_close(smoothed, soft * 0.9 + 0.02)


def parameters(trainer):
    return torch.cat([p.detach().flatten() for p in trainer.state.model.parameters()])


def test_hook_smooths_targets_for_the_loss(tmp_path):
    """The hook's probabilities reach the loss, and train exactly like the loss's own label_smoothing."""
    seen = batch_recorder(Event.BEFORE_LOSS)
    hooked = tiny_trainer(tmp_path / "hook", [LabelSmoothing(smoothing=0.1), seen], "optim.lr=2.0", "grad_accum=2")
    hooked.fit()
    assert len(seen.seen) == 16                                              # 8 steps x 2 micro-batches
    for _, targets in seen.seen:
        assert targets.shape == (4, 4) and targets.dtype == torch.float32
        torch.testing.assert_close(targets.max(1).values, torch.full((4,), 0.9 + 0.1 / 4))
    in_loss = tiny_trainer(tmp_path / "loss", [], "optim.lr=2.0", "grad_accum=2", "loss.label_smoothing=0.1")
    in_loss.fit()
    torch.testing.assert_close(parameters(hooked), parameters(in_loss), atol=1e-5, rtol=1e-4)


def test_hook_after_mixup_smooths_soft_targets(tmp_path):
    mixed, smoothed = batch_recorder(Event.AFTER_DATALOADER), batch_recorder(Event.BEFORE_LOSS)
    tiny_trainer(tmp_path, [MixUp(alpha=1.0), mixed, LabelSmoothing(smoothing=0.2), smoothed]).fit()
    for (_, soft), (_, final) in zip(mixed.seen, smoothed.seen):
        assert soft.ndim == 2 and (soft.max(1).values < 1).any()
        torch.testing.assert_close(final, soft * 0.8 + 0.05)
