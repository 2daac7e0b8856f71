"""SelectiveBackprop: the selection's defining properties, and the hook in a real (tiny) training run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.base import Event
from algorithms.selective_backprop import SelectiveBackprop, per_sample_losses, select_hard_examples
from conftest import batch_recorder, tiny_trainer


def test_kept_count_and_pairs():
    n = 10
    images, targets = torch.arange(n).float()[:, None].expand(n, 3).clone(), torch.arange(n)
    losses = torch.rand(n)
    for keep, multiple_of, expected in [(0.5, 1, 5), (0.33, 1, 3), (0.4, 2, 4), (0.3, 4, 4), (0.01, 2, 2), (1.0, 1, 10)]:
        kept_images, kept_targets = select_hard_examples(images, targets, losses, keep, multiple_of=multiple_of)
        assert kept_targets.shape == (expected,)
        assert torch.equal(kept_images[:, 0].long(), kept_targets)            # pairs stay together
        assert torch.equal(kept_targets, kept_targets.sort().values)          # batch order kept


def test_higher_loss_kept_more_often():
    n, keep = 12, 0.5
    losses = torch.randn(n)
    counts = torch.zeros(n)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3000):
        _, kept = select_hard_examples(torch.zeros(n, 1), torch.arange(n), losses, keep, generator=generator)
        counts[kept] += 1
    by_loss = counts[losses.argsort()]                                       # lowest loss first
    assert by_loss[-1] > 2 * by_loss[0] and by_loss[-3:].sum() > by_loss[:3].sum() * 2
    assert (by_loss.diff() > -150).all()                                     # rising up to sampling noise
    assert by_loss.sum() == 3000 * 6
    # a small keep favours the hardest samples strongly: percentile ** 9
    _, kept = select_hard_examples(torch.zeros(n, 1), torch.arange(n), losses, 0.1,
                                   generator=torch.Generator().manual_seed(1))
    assert kept.tolist() == [int(losses.argmax())]


def test_per_sample_losses_accept_both_target_kinds():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    images, targets = torch.randn(6, 3, 8, 8), torch.randint(5, (6,))
    small = F.interpolate(images, scale_factor=0.5, mode="bilinear", align_corners=False)
    losses = per_sample_losses(model, images, targets, scale_factor=0.5)
    torch.testing.assert_close(losses, F.cross_entropy(model(small), targets, reduction="none"))
    torch.testing.assert_close(per_sample_losses(model, images, F.one_hot(targets, 5).float(), 0.5), losses)
    assert not losses.requires_grad


def batch_sizes(tmp_path, algorithm, *overrides):
    before, after = batch_recorder(Event.AFTER_DATALOADER), batch_recorder(Event.AFTER_DATALOADER)
    tiny_trainer(tmp_path, [before, algorithm, after], *overrides).fit()
    for (images, targets), (kept_images, kept_targets) in zip(before.seen, after.seen):
        # every kept sample is one of the batch's, with its own target
        match = (kept_images.flatten(1)[:, None] == images.flatten(1)[None]).all(2)
        assert (match.sum(1) == 1).all()
        assert torch.equal(targets[match.float().argmax(1)], kept_targets)
    return [images.shape[0] for images, _ in after.seen]


def test_hook_active_between_start_and_end(tmp_path):
    # 8 steps: progress step/8 is in [0.5, 0.9) for steps 4..7; interrupt=2 gives steps 5 and 7 full batches
    assert batch_sizes(tmp_path / "a", SelectiveBackprop()) == [8, 8, 8, 8, 4, 8, 4, 8]
    assert batch_sizes(tmp_path / "b", SelectiveBackprop(start=0.0, end=0.5, keep=0.25, interrupt=0)) == \
        [2, 2, 2, 2, 8, 8, 8, 8]
    assert batch_sizes(tmp_path / "c", SelectiveBackprop(keep=1.0)) == [8] * 8


def test_hook_keeps_multiples_of_grad_accum(tmp_path):
    # keep=0.4 of 8 would be 3; with 2 micro-batches the kept batch must split evenly: 4
    sizes = batch_sizes(tmp_path, SelectiveBackprop(start=0.0, end=1.0, keep=0.4, interrupt=0, scale_factor=0.5),
                        "grad_accum=2")
    assert sizes == [4] * 8
