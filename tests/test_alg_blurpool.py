"""BlurPool: shapes kept, the right modules replaced, aliasing suppressed, the hook in a real run."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from algorithms.blurpool import BlurConv2d, BlurMaxPool2d, BlurPool, blurpool_model
from training.models import build_model
from conftest import tiny_trainer


def feature_shapes(model: nn.Module, x: torch.Tensor) -> list[torch.Size]:
    """The stem's and each stage's output shape."""
    shapes, out = [], model.stem(x)
    shapes.append(out.shape)
    for stage in model.stages:
        out = stage(out)
        shapes.append(out.shape)
    return shapes


@pytest.mark.parametrize("name, size, replaced", [("resnet18", 64, 7), ("small_resnet", 32, 4)])
@pytest.mark.parametrize("blur_first", [True, False])
def test_shapes_unchanged_and_modules_counted(name, size, replaced, blur_first):
    torch.manual_seed(0)
    model = build_model(name, 10).eval()
    x = torch.randn(2, 3, size + 1, size + 1)            # odd size: padding/rounding must match too
    before = feature_shapes(model, x)
    conv_weights = {id(p) for p in model.parameters()}
    assert blurpool_model(model, blur_first=blur_first) == replaced
    # resnet18: 3 strided 3x3 + 3 strided 1x1 shortcuts (the 3-channel stem conv is kept) + maxpool;
    # small_resnet: 2 + 2, no pool.
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(BlurMaxPool2d) == (name == "resnet18")
    assert kinds.count(BlurConv2d) == replaced - (name == "resnet18")
    assert feature_shapes(model, x) == before
    assert model(x).shape == (2, 10)
    assert {id(p) for p in model.parameters()} == conv_weights      # same Parameters, none added
    keys = model.state_dict().keys()
    assert "stages.1.0.conv1.conv.weight" in keys and not any("blur_filter" in key for key in keys)
    with pytest.warns(UserWarning, match="changed nothing"):
        assert blurpool_model(model, blur_first=blur_first) == 0       # nothing is blurred twice


def checkerboard(size: int) -> torch.Tensor:
    i = torch.arange(size)
    return ((i[:, None] + i[None, :]) % 2 * 2 - 1).float()[None, None]   # +-1, highest frequency


@pytest.mark.parametrize("blur_first", [True, False])
def test_blur_suppresses_aliasing_of_a_checkerboard(blur_first):
    conv = nn.Conv2d(1, 1, 3, stride=2, padding=1, bias=False)
    nn.init.ones_(conv.weight)
    x = checkerboard(32)
    plain = conv(x)                                   # each output sums a 3x3 patch: +-1, pure aliasing
    blurred = BlurConv2d(conv, blur_first=blur_first)(x)
    assert plain.shape == blurred.shape == (1, 1, 16, 16)
    assert plain.pow(2).sum() > 200
    assert blurred.pow(2).sum() < 0.05 * plain.pow(2).sum()   # only the zero-padded border is left
    assert blurred[..., 1:-1, 1:-1].abs().max() < 1e-6


def test_blur_passes_a_constant_input_unchanged_away_from_borders():
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 8, 3, stride=2, padding=1)
    x = torch.full((1, 16, 20, 20), 0.7)
    expected = conv(x)
    blurred = BlurConv2d(conv)(x)
    torch.testing.assert_close(blurred[..., 1:-1, 1:-1], expected[..., 1:-1, 1:-1])
    pool = nn.MaxPool2d(3, stride=2, padding=1)
    ramp = torch.arange(20.0).repeat(20, 1)[None, None]  # linear along x: the blur leaves it as is
    torch.testing.assert_close(BlurMaxPool2d(pool, ramp)(ramp)[..., 1:-1, 1:-1], pool(ramp)[..., 1:-1, 1:-1])


def test_hook_in_a_trainer_run(tmp_path):
    trainer = tiny_trainer(tmp_path, [BlurPool(min_channels=4)])
    model = trainer.state.model
    assert sum(isinstance(m, BlurConv2d) for m in model.modules()) == 4      # surgery at INIT
    assert {id(p) for p in trainer.state.optimizer.param_groups[0]["params"]} <= {id(p) for p in model.parameters()}
    summary = trainer.fit()
    assert summary["steps"] == 8 and summary["last_val_top1"] is not None
    # the run's checkpoint loads into a fresh model given the same surgery
    fresh = build_model("small_resnet", 4, width=4, blocks_per_stage=1)
    blurpool_model(fresh, min_channels=4)
    checkpoint = torch.load(next((tmp_path / "checkpoints").glob("*.pt")), weights_only=True)
    fresh.load_state_dict(checkpoint["model"])
