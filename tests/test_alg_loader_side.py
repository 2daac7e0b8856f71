"""The loader-side algorithms (progressive resizing, ColOut) and their batch-side twins, in a
real in-process run, and the clash warnings."""
from __future__ import annotations

import logging

import pytest
import torch

from algorithms import build_algorithms, clashes
from algorithms.base import Algorithm, Event
from algorithms.durations import Duration
from algorithms.progressive_resizing import ramp_scale, resize_batch
from conftest import tiny_trainer
from pipeline.schedules import ComposerRamp
from training.config import load_config
from training.distributed import World
from training.trainer import Trainer


class Shapes(Algorithm):
    """Records the batch's spatial shape at each step's first forward."""

    def __init__(self):
        self.seen = []

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state):
        self.seen.append(tuple(state.images.shape[-2:]))


def run(tmp_path, settings: dict, *overrides) -> list:
    config = load_config(None, ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=16",
                                "data.batch_size=8", "data.resolution=32", "data.val_resolution=32",
                                "model.name=small_resnet", "model.width=4", "model.blocks_per_stage=1",
                                "max_duration=10ep", "precision=fp32", "log.progress=false",
                                "log.tensorboard=false", f"run_dir={tmp_path}", *overrides])
    shapes = Shapes()
    Trainer(config, World(0, 0, 1, torch.device("cpu")), build_algorithms(settings) + [shapes]).fit()
    return shapes.seen


def test_ramp_and_resize():
    assert ramp_scale(0.1, 0.5, 0.4, 0.2) == 0.5
    assert ramp_scale(0.6, 0.5, 0.4, 0.2) == pytest.approx(0.75)
    assert ramp_scale(0.85, 0.5, 0.4, 0.2) == 1.0
    images = torch.rand(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    out = resize_batch(images, 16)
    assert out.shape == (2, 3, 16, 16) and out.is_contiguous(memory_format=torch.channels_last)


def test_progressive_resizing_loader_and_batch_follow_the_same_ramp(tmp_path):
    options = {"initial_scale": 0.5, "delay_fraction": 0.4, "finetune_fraction": 0.2, "size_increment": 4}
    loader = run(tmp_path / "loader", {"progressive_resizing": {"mode": "loader", **options}})
    batch = run(tmp_path / "batch", {"progressive_resizing": {"mode": "batch", **options}})
    # Ten epochs of two steps. Batch mode follows the ramp step by step; the loader holds one side
    # an epoch, the ramp's at the epoch's middle, which is where batch mode's second step sits.
    assert [side for side, _ in batch[::2]] == [16] * 5 + [20, 24, 28, 32, 32]
    assert [side for side, _ in loader[::2]] == [16] * 5 + [24, 24, 32, 32, 32]
    assert loader[::2] == loader[1::2] and loader[::2] == batch[1::2]


def test_colout_loader_and_batch_side(tmp_path):
    for mode in ("loader", "batch"):
        seen = run(tmp_path / mode, {"colout": {"p_row": 0.25, "p_col": 0.5, "mode": mode}}, "max_duration=1ep")
        assert set(seen) == {(24, 16)}, mode


def test_the_trainer_builds_each_loader_once_from_its_settled_spec(tmp_path, monkeypatch):
    """Every loader-side setting is in the spec a loader is built from, before any iteration, and
    each loader is built exactly once: the algorithms change specs, never built loaders."""
    import training.run_setup
    built, build = [], training.run_setup.build_loader
    monkeypatch.setattr(training.run_setup, "build_loader", lambda spec: built.append(build(spec)) or built[-1])
    trainer = tiny_trainer(tmp_path, build_algorithms({
        "scale_schedule": {"ratio": 2.0}, "progressive_resizing": {"initial_scale": 0.5},
        "colout": {"p_row": 0.25, "p_col": 0.25}, "fixres": {"eval_resolution": 24, "eval_crop_ratio": 0.5}}))
    state = trainer.state
    assert built == [state.train_loader, state.val_loader]
    train, val = state.train_loader.spec, state.val_loader.spec
    assert train.schedule == ComposerRamp(16, 4, initial_scale=0.5)      # over the stretched run: 2ep x 2
    assert train.colout == (0.25, 0.25) and val.colout is None
    assert (val.val_resolution, val.val_crop_ratio) == (24, 0.5) and state.val_loader.resolution == (24, 24)
    assert state.config.max_duration == Duration(4, "ep") and state.total_steps == 16
    trainer.fit()
    assert len(built) == 2 and state.step == 16


def test_clash_warnings(tmp_path, caplog):
    assert clashes(["mixup"], label_smoothing=0.1) and clashes(["mixup", "cutmix"])
    assert clashes(["colout", "progressive_resizing"]) == []
    with caplog.at_level(logging.WARNING, logger="training"):
        run(tmp_path, {}, "max_duration=1ep", "loss.label_smoothing=0.1", "algorithms.colout={}")
    assert "clash" not in caplog.text
