"""Muon: the Newton-Schulz iteration on hand-computed singular values, one step on a tiny filter
bank, the hook taking the convolutions (not the stem) from the run's SGD, and an exact resume
with its momentum from a checkpoint taken mid-epoch."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Algorithm, Event
from algorithms.muon import NEWTON_SCHULZ, Muon, muon_step, muon_weights, orthogonalize
from conftest import tiny_trainer
from test_alg_lookahead import assert_resume_mid_epoch_is_exact


def newton_schulz_by_hand(value: float, steps: int) -> float:
    a, b, c = NEWTON_SCHULZ
    for _ in range(steps):
        value = a * value + b * value ** 3 + c * value ** 5
    return value


def test_orthogonalize_keeps_the_singular_vectors_and_lifts_the_values_toward_one():
    rotation = torch.tensor([[0.6, -0.8], [0.8, 0.6]])
    singular = torch.tensor([3.0, 1.0])
    matrix = rotation @ torch.diag(singular) @ torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])   # 2 x 3
    got = orthogonalize(matrix, steps=3)
    # each singular value s / ||M|| goes through the quintic alone; the vectors stay
    expected = [newton_schulz_by_hand(s / 10 ** 0.5, 3) for s in (3.0, 1.0)]
    want = rotation @ torch.diag(torch.tensor(expected)) @ torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(got, want, atol=1e-5)
    assert 0.6 < min(expected) and max(expected) < 1.3            # near 1 from 0.95 and 0.32
    assert torch.allclose(orthogonalize(matrix.T, steps=3), want.T, atol=1e-5)      # tall: the same, transposed
    with pytest.raises(ValueError, match="needs a matrix"):
        orthogonalize(torch.ones(2, 2, 2))


def test_a_step_rescales_the_filters_and_moves_them_by_the_orthogonalised_momentum():
    weight = torch.tensor([[3.0, 0.0], [0.0, 4.0]]).view(2, 2, 1, 1)
    grad = torch.tensor([[2.0, 0.0], [0.0, 1.0]]).view(2, 2, 1, 1)
    buffer = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(2, 2, 1, 1)
    muon_step(weight, grad, buffer, lr=0.1, momentum=0.5, nesterov=False, steps=2)
    assert torch.equal(buffer.view(2, 2), torch.tensor([[2.5, 0.0], [0.0, 1.5]]))   # 0.5 * 1 + g
    norm = (2.5 ** 2 + 1.5 ** 2) ** 0.5
    lifted = [newton_schulz_by_hand(v / norm, 2) for v in (2.5, 1.5)]
    scale = 2 ** 0.5 / 5                                   # the weights' norm 5 brought to sqrt(2 filters)
    want = torch.tensor([[3 * scale - 0.1 * lifted[0], 0.0], [0.0, 4 * scale - 0.1 * lifted[1]]])
    assert torch.allclose(weight.view(2, 2), want, atol=1e-6)


class GradientsSeen(Algorithm):
    """Which parameters still have a gradient when the optimizer steps (after Muon, listed before it)."""

    def __init__(self):
        self.with_grad: set[str] = set()

    def match(self, event, state):
        return event == Event.BEFORE_OPTIMIZER_STEP

    def apply(self, event, state):
        self.with_grad = {name for name, p in state.model.named_parameters() if p.grad is not None}


def test_the_convolutions_but_the_stem_are_muons_and_the_rest_stays_with_sgd(tmp_path):
    muon, seen = Muon(), GradientsSeen()
    trainer = tiny_trainer(tmp_path, [muon, seen], "max_duration=2ba")
    before = {name: p.detach().clone() for name, p in trainer.state.model.named_parameters()}
    trainer.fit()
    convolutions = [name for name, p in trainer.state.model.named_parameters() if p.ndim == 4]
    assert set(muon_weights(trainer.state.model)) == set(convolutions[1:])
    assert not seen.with_grad & set(convolutions[1:]) and convolutions[0] in seen.with_grad
    for name, weight in muon_weights(trainer.state.model).items():
        assert not torch.equal(weight, before[name]), name
        assert muon.state_dict()["momentum"][name].abs().sum() > 0


def test_a_run_resumed_mid_epoch_ends_as_an_uninterrupted_one(tmp_path):
    assert_resume_mid_epoch_is_exact(tmp_path, lambda: Muon(lr=0.1), "momentum")
