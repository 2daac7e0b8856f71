"""BCELogitBias: the bias value, the run's loss switched to BCE, and a first loss at the
prior's BCE (nearly) instead of C * log 2."""
from __future__ import annotations

import math

import torch

from algorithms.bce import BCELogitBias, init_logit_bias
from conftest import tiny_trainer


def bce_at(p: float, num_classes: int) -> float:
    """BCE summed over classes when every sigmoid says p (one class is the target)."""
    return -math.log(p) - (num_classes - 1) * math.log(1 - p)


def test_bias_is_minus_log_num_classes():
    linear = init_logit_bias(torch.nn.Linear(8, 1000))
    assert torch.allclose(linear.bias, torch.full((1000,), -math.log(1000)))
    assert torch.allclose(torch.sigmoid(linear.bias), torch.tensor(1 / 1001))   # about the prior 1/C
    init_logit_bias(linear, num_classes=10)
    assert torch.allclose(linear.bias, torch.full((1000,), -math.log(10)))


def test_run_switches_to_bce_and_starts_at_the_prior_loss(tmp_path):
    state = tiny_trainer(tmp_path / "bce", [BCELogitBias()]).state
    assert state.config.loss.kind == "bce"
    assert torch.allclose(state.model.fc.bias, torch.full((4,), -math.log(4)))
    images, targets = next(iter(state.train_loader))
    state.model.fc.weight.data.zero_()                     # logits exactly the bias
    loss = state.loss_fn(state.model(images), targets).item()
    assert abs(loss - bce_at(1 / 5, 4)) < 1e-5               # sigmoid(-log C) = 1/(C + 1)
    assert abs(loss - bce_at(1 / 4, 4)) < 0.02 * loss        # within 2% of the prior's entropy
    # BCE without the bias init, logits at 0: every sigmoid at 1/2, C * log 2
    plain = tiny_trainer(tmp_path / "ce", [], "loss.kind=bce").state
    plain.model.fc.weight.data.zero_()
    plain.model.fc.bias.data.zero_()
    assert abs(plain.loss_fn(plain.model(images), targets).item() - 4 * math.log(2)) < 1e-5
    assert tiny_trainer(tmp_path / "ce2", []).state.config.loss.kind == "ce"
