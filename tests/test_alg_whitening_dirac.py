"""Whitening and Dirac initialisation: the filters decorrelate a known batch's patches, the stem
is set from the first batch and held for its frozen epochs, and Dirac convolutions pass their
input through."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from algorithms.base import Algorithm, Event
from algorithms.dirac_init import DiracInit, dirac_init
from algorithms.whitening_init import (WhiteningInit, init_whitening, patch_covariance, stem_convolution,
                                       whitening_filters)
from conftest import tiny_trainer


def smooth_images(count=16, side=12, seed=0):
    """Correlated neighbours, as in photographs: noise averaged over 3x3 windows, 2 channels mixed."""
    noise = torch.randn(count, 2, side + 2, side + 2, generator=torch.Generator().manual_seed(seed))
    smooth = nn.functional.avg_pool2d(noise, 3, stride=1)
    return torch.stack([smooth[:, 0], 0.5 * smooth[:, 0] + smooth[:, 1]], 1)


def test_the_filters_decorrelate_the_patches_at_unit_variance():
    images = smooth_images()
    conv = nn.Conv2d(2, 16, 2, bias=False)            # 2 x 2 x 2 = 8 directions, each with its negative
    init_whitening(conv, images, eps=1e-12)
    responses = conv(images).permute(0, 2, 3, 1).reshape(-1, 16).double()
    kept = responses[:, 0::2]
    covariance = kept.T @ kept / len(kept)
    torch.testing.assert_close(covariance, torch.eye(8, dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(conv.weight[1::2], -conv.weight[0::2])
    raw = nn.functional.unfold(images.double(), 2).transpose(1, 2).reshape(-1, 8)
    assert (raw.T @ raw / len(raw) - torch.diag(torch.diag(raw.T @ raw / len(raw)))).abs().max() > 0.1  # they were not


def test_fewer_filters_take_the_largest_variance_first_and_too_many_are_refused():
    covariance = torch.diag(torch.tensor([1.0, 9.0, 4.0], dtype=torch.float64))     # axes by hand
    filters = whitening_filters(covariance, (4, 3, 1, 1), eps=0.0).reshape(4, 3)
    expected = torch.tensor([[0, 1 / 3, 0], [0, -1 / 3, 0], [0, 0, 1 / 2], [0, 0, -1 / 2]], dtype=torch.float64)
    torch.testing.assert_close(filters.abs(), expected.abs())
    torch.testing.assert_close(filters[1::2], -filters[0::2])
    with pytest.raises(ValueError, match="needs 4 patch directions, its patches have 3"):
        whitening_filters(covariance, (8, 3, 1, 1))
    total, count = patch_covariance(torch.ones(2, 1, 3, 3), (2, 2))
    assert count == 8 and torch.equal(total, torch.full((4, 4), 8.0, dtype=torch.float64))


class Probe(Algorithm):
    def __init__(self):
        self.first_images, self.stems = None, {}

    def match(self, event, state):
        return event in (Event.AFTER_DATALOADER, Event.BATCH_END)

    def apply(self, event, state):
        stem = stem_convolution(state.model).weight.detach().clone()
        if event == Event.AFTER_DATALOADER and self.first_images is None:
            self.first_images, self.stems[0] = state.images.clone(), stem
        elif event == Event.BATCH_END:
            self.stems[state.step] = stem


def test_the_stem_is_set_from_the_first_batch_and_held_for_its_frozen_epochs(tmp_path):
    probe = Probe()
    trainer = tiny_trainer(tmp_path, [WhiteningInit(frozen_epochs=1), probe])
    trainer.fit()
    stem = stem_convolution(trainer.state.model)
    covariance, count = patch_covariance(probe.first_images, stem.kernel_size)
    torch.testing.assert_close(probe.stems[0], whitening_filters(covariance / count, tuple(stem.weight.shape)).float())
    assert all(torch.equal(probe.stems[step], probe.stems[0]) for step in (1, 2, 3, 4))      # epoch 1: frozen
    assert not torch.equal(probe.stems[8], probe.stems[0])                                     # epoch 2: trained


def test_dirac_convolutions_pass_their_input_through():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 12, 3, padding=1, bias=False),
                          nn.Conv2d(12, 12, 1, bias=False))
    stem_before = model[0].weight.clone()
    assert dirac_init(model) == 2
    assert torch.equal(model[0].weight, stem_before)                  # the stem is left alone
    x = torch.randn(2, 8, 5, 5)
    torch.testing.assert_close(model[1](x)[:, :8], x)                 # the first 8 filters: identity
    assert model[1](x)[:, 8:].abs().sum() > 0                          # the others keep their random start
    y = torch.randn(2, 12, 5, 5)
    torch.testing.assert_close(model[2](y), y)
    hooked = nn.Sequential(nn.Conv2d(1, 2, 1), nn.Conv2d(2, 2, 3, padding=1, bias=False))
    DiracInit().apply(Event.INIT, type("State", (), {"model": hooked})())
    assert DiracInit().match(Event.INIT, None) and torch.equal(hooked[1].weight[:, :, 1, 1], torch.eye(2))
