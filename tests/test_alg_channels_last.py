"""ChannelsLast: every 4-D parameter ends channels_last contiguous, the same Parameter objects."""
from __future__ import annotations

import torch

from algorithms.channels_last import ChannelsLast, channels_last_model
from training.models import build_model
from conftest import tiny_trainer


def four_d(model):
    return [p for p in model.parameters() if p.dim() == 4]


def is_channels_last(tensor):
    return tensor.is_contiguous(memory_format=torch.channels_last)


def test_pure_function_converts_in_place_and_keeps_outputs():
    torch.manual_seed(0)
    model = build_model("small_resnet", 10, width=8).eval()
    assert not all(map(is_channels_last, four_d(model)))            # 3x3 conv weights start NCHW
    parameters, x = list(model.parameters()), torch.randn(2, 3, 16, 16)
    before = model(x)
    assert channels_last_model(model) is model
    assert all(map(is_channels_last, four_d(model)))
    assert [id(p) for p in model.parameters()] == [id(p) for p in parameters]
    torch.testing.assert_close(model(x), before)


def test_hook_converts_a_run_that_set_channels_last_false(tmp_path):
    plain = tiny_trainer(tmp_path / "plain", [], "channels_last=false")
    assert not all(map(is_channels_last, four_d(plain.state.model)))
    trainer = tiny_trainer(tmp_path / "hooked", [ChannelsLast()], "channels_last=false")
    assert all(map(is_channels_last, four_d(trainer.state.model)))  # done at INIT
    summary = trainer.fit()
    assert summary["steps"] == 8
    assert all(map(is_channels_last, four_d(trainer.state.model)))  # the optimizer kept the format
