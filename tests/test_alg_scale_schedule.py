"""ScaleSchedule: durations scaled by unit, and every schedule of a real run stretched with it
(length, warmup, milestones, the resolution ramp, EMA's half-life)."""
from __future__ import annotations

import dataclasses

import pytest

from algorithms.base import Algorithm, RunPlan, settle_loader_specs
from algorithms.ema import EMA
from algorithms.scale_schedule import ScaleSchedule, scale_duration, scale_resolution_schedule
from pipeline import LoaderSpec
from pipeline.schedules import ComposerRamp, FFCVRamp, resolution_schedule
from algorithms.durations import Duration
from conftest import tiny_trainer


RUN = ["max_duration=4ep", "optim.warmup=2ep", "optim.schedule=step", "optim.milestones=[2ep, 12ba]",
       "data.resolution.form=ffcv", "data.resolution.min_res=16", "data.resolution.max_res=32",
       "data.resolution.start_ramp=2", "data.resolution.end_ramp=4", "data.resolution.multiple=8"]


@pytest.mark.parametrize("text, ratio, expected", [("3ep", 0.5, "1.5ep"), ("7ba", 0.5, "4ba"),
                                                   ("100ba", 2.0, "200ba"), ("0.3dur", 0.5, "0.3dur")])
def test_scale_duration(text, ratio, expected):
    assert scale_duration(Duration.parse(text), ratio) == Duration.parse(expected)


def test_scaled_resolution_schedules_are_the_originals_squeezed():
    ffcv = {"form": "ffcv", "min_res": 160, "max_res": 192, "start_ramp": 11, "end_ramp": 13, "multiple": 8}
    scaled = resolution_schedule(scale_resolution_schedule(ffcv, 0.5))
    assert [scaled(e) for e in range(9)] == [resolution_schedule(ffcv)(2 * e) for e in range(9)]
    # The Composer ramp is given in shares of the run: the same ramp, over half the epochs.
    composer = {"form": "composer", "final_res": 224, "total_epochs": 16, "initial_scale": 0.5}
    assert resolution_schedule(scale_resolution_schedule(composer, 0.5)) == resolution_schedule(
        {**composer, "total_epochs": 8})
    assert scale_resolution_schedule(224, 0.5) == 224
    # A schedule object (as an algorithm puts in a spec) is scaled as its mapping is.
    assert scale_resolution_schedule(resolution_schedule(ffcv), 0.5) == scaled
    assert scale_resolution_schedule(ComposerRamp(224, 16, 0.5), 0.5) == ComposerRamp(224, 8, 0.5)
    assert isinstance(scaled, FFCVRamp)


class Periodic(Algorithm):
    scaled_durations = ("period", "unset")

    def __init__(self):
        self.period, self.unset = "10ba", None

    def match(self, event, state):
        return False


def test_every_schedule_of_a_run_is_scaled(tmp_path):
    ema, periodic = EMA(half_life="4ba"), Periodic()
    full = tiny_trainer(tmp_path / "full", [], *RUN).state
    half_trainer = tiny_trainer(tmp_path / "half", [ScaleSchedule(0.5, scale_warmup=True), ema, periodic], *RUN)
    half = half_trainer.state
    assert (full.total_steps, half.total_steps) == (16, 8)
    assert half.config.max_duration == Duration(2, "ep") and half.config.optim.warmup == Duration(1, "ep")
    assert half.config.optim.milestones == [Duration(1, "ep"), Duration(6, "ba")]
    assert (half.train_loader.spec.schedule.start_ramp, half.train_loader.spec.schedule.end_ramp) == (1, 2)
    assert half.config.data.resolution["end_ramp"] == 2
    assert ema.half_life == Duration(2, "ba") and periodic.period == "5ba" and periodic.unset is None
    # the LR at step t of the scaled run is the full run's at step 2t (warmup and milestones included)
    full_lr, half_lr = full.scheduler.lr_lambdas[0], half.scheduler.lr_lambdas[0]
    assert [half_lr(t) for t in range(4, 8)] == [full_lr(2 * t) for t in range(4, 8)]
    assert [half_lr(t) for t in range(4)] == pytest.approx([full_lr(2 * t + 1) for t in range(4)])
    half_trainer.fit()                                     # the run is that long, at those resolutions
    assert half.step == 8 and ema._smoothing == pytest.approx(0.5 ** (1 / 2))


def test_warmup_is_left_alone_by_default_and_ratio_one_changes_nothing(tmp_path):
    state = tiny_trainer(tmp_path / "a", [ScaleSchedule(0.5)], *RUN).state
    assert state.config.optim.warmup == Duration(2, "ep") and state.total_steps == 8
    state = tiny_trainer(tmp_path / "b", [ScaleSchedule(1.0)], *RUN).state
    assert state.config.optim.milestones == [Duration(2, "ep"), Duration(12, "ba")] and state.total_steps == 16


class RampFromMaxDuration(Algorithm):
    """Like loader-mode progressive resizing: sets a composer ramp over the run's epochs in the train spec."""

    def loader_spec(self, spec, plan):
        return dataclasses.replace(spec, resolution=ComposerRamp(16, plan.total_epochs)) if spec.train else spec


def test_a_loader_schedule_set_before_the_loaders_is_scaled_in_either_order(tmp_path):
    for i, algorithms in enumerate([[ScaleSchedule(0.5), RampFromMaxDuration()],
                                    [RampFromMaxDuration(), ScaleSchedule(0.5)]]):
        state = tiny_trainer(tmp_path / str(i), algorithms, "max_duration=4ep").state
        assert state.total_steps == 8 and state.train_loader.spec.schedule.total_epochs == 2


def test_the_plan_is_stretched_for_the_algorithms_after_it_only():
    plan = RunPlan(Duration(4, "ep"), steps_per_epoch=3)
    seen = []

    class Recorder(Algorithm):
        def run_plan(self, plan):
            seen.append(plan.total_epochs)
            return plan

    specs, settled = settle_loader_specs([Recorder(), ScaleSchedule(0.5), Recorder()],
                                         [LoaderSpec("synthetic"), LoaderSpec("synthetic", split="val")], plan)
    assert seen == [4, 2] and settled.max_duration == Duration(2, "ep") and settled.total_steps == 6
    assert [spec.split for spec in specs] == ["train", "val"]
    with pytest.raises(ValueError, match="max_duration of 0"):
        ScaleSchedule(0.1).run_plan(RunPlan(Duration(4, "ba"), 3))
