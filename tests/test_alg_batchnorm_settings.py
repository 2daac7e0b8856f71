"""Batch-norm settings: every layer's momentum and epsilon set, and its scale fixed at 1 through a
run (a zero-initialised residual scale included) while its bias trains."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from algorithms.batchnorm_settings import BatchNormSettings, set_batchnorm
from conftest import tiny_trainer


def test_every_batchnorm_layer_is_set():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)), nn.Linear(2, 2))
    nn.init.zeros_(model[1].weight)                   # as a zero-initialised residual scale starts
    assert set_batchnorm(model, momentum=0.25, eps=1e-9) == 2
    for layer in (model[1], model[2][0]):
        assert (layer.momentum, layer.eps) == (0.25, 1e-9) and torch.equal(layer.weight, torch.ones_like(layer.weight))
        assert not layer.weight.requires_grad and layer.bias.requires_grad
    trained = nn.BatchNorm2d(3)
    nn.init.zeros_(trained.weight)
    set_batchnorm(trained, train_weight=True)          # a trained scale keeps its start
    assert trained.weight.requires_grad and not trained.weight.any()
    with pytest.raises(ValueError, match="0 < momentum <= 1"):
        BatchNormSettings(momentum=0)


def test_the_scales_stay_at_one_while_the_biases_train(tmp_path):
    trainer = tiny_trainer(tmp_path, [BatchNormSettings()])
    before = {name: t.clone() for name, t in trainer.state.model.state_dict().items()}
    trainer.fit()
    layers = [m for m in trainer.state.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert layers and all(layer.momentum == 0.4 and layer.eps == 1e-12 for layer in layers)
    after = trainer.state.model.state_dict()
    scales = [name for name in before if name.endswith(".weight") and before[name].ndim == 1 and "fc" not in name]
    assert scales and all(torch.equal(after[name], torch.ones_like(after[name])) for name in scales)     # fixed at 1
    for kind in ("bias", "running_mean"):
        assert any(not torch.equal(before[name], after[name]) for name in before if name.endswith(kind))
