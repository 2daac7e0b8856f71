"""ScaleSchedule: train for `ratio` times as long, with every schedule stretched to fit
(MosaicML Composer's `scale_schedule_ratio`).

What: before anything is built it stretches the run's plan (max_duration, which the trainer
records in the config) and the train loader's resolution schedule as set so far (ffcv form:
start_ramp/end_ramp; composer form: total_epochs, its other keys being shares of the run);
at INIT it multiplies the LR milestones (and the warmup, if `scale_warmup`), the config's
resolution schedule, and the durations other algorithms list in a class attribute
`scaled_durations` (EMA: half_life). Durations in ep and ba are multiplied (ba rounded to
whole batches); those in dur are shares of the run and follow it by themselves. The
cosine/linear decay spans the run, so it stretches with it.
When: the simplest way to trade quality for time: a shortened run still goes through its
whole LR decay, which beats stopping a long schedule early (Composer's method card).
Cost: none; the run is `ratio` times as long.
Settings: ratio=1.0; scale_warmup=False, as Composer, whose warmups are not scaled unless
asked (a warmup in dur scales regardless). eval_interval and checkpoint.interval are left
alone. Put it first in a recipe, so that the algorithms after it see the stretched run (a
loader resolution schedule set before it, by progressive resizing, is stretched either way).
"""
from __future__ import annotations

import dataclasses

from algorithms.base import Algorithm, Event, RunPlan
from algorithms.durations import Duration
from pipeline.schedules import EPOCH_FIELDS, stretched
from pipeline.spec import LoaderSpec


def scale_duration(duration, ratio: float):
    """A Duration `ratio` times as long: ep multiplied, ba multiplied and rounded, dur unchanged."""
    if duration.unit == "dur":
        return duration
    value = duration.value * ratio
    return type(duration)(round(value) if duration.unit == "ba" else value, duration.unit)


def scale_resolution_schedule(resolution, ratio: float):
    """The train resolution (an int, a schedule mapping as in a config, or a schedule) over a run
    `ratio` times as long: its epoch counts scaled (pipeline.schedules.stretched)."""
    if not isinstance(resolution, dict):
        return stretched(resolution, ratio) if callable(resolution) else resolution
    keys = EPOCH_FIELDS.get(resolution.get("form"), ())
    return {**resolution, **{key: resolution[key] * ratio for key in keys if key in resolution}}


class ScaleSchedule(Algorithm):
    def __init__(self, ratio: float = 1.0, scale_warmup: bool = False):
        if ratio <= 0:
            raise ValueError(f"ScaleSchedule ratio must be > 0, got {ratio}")
        self.ratio, self.scale_warmup = ratio, scale_warmup

    def run_plan(self, plan: RunPlan) -> RunPlan:
        if self.ratio == 1.0:
            return plan
        duration = scale_duration(plan.max_duration, self.ratio)
        if duration.value == 0:
            raise ValueError(f"ScaleSchedule({self.ratio}) leaves a max_duration of 0")
        return dataclasses.replace(plan, max_duration=duration)

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        # The schedule as the config and the algorithms before this one left it (progressive
        # resizing's, made over the unscaled run); those after it make theirs over the scaled one.
        if self.ratio == 1.0 or not spec.train:
            return spec
        return dataclasses.replace(spec, resolution=scale_resolution_schedule(spec.resolution, self.ratio))

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT and self.ratio != 1.0

    def apply(self, event: Event, state) -> None:
        config, ratio = state.config, self.ratio
        if self.scale_warmup:
            config.optim.warmup = scale_duration(config.optim.warmup, ratio)
        config.optim.milestones = [scale_duration(m, ratio) for m in config.optim.milestones]
        config.data.resolution = scale_resolution_schedule(config.data.resolution, ratio)
        for algorithm in state.algorithms:
            for name in getattr(algorithm, "scaled_durations", ()):
                setattr(algorithm, name, self._scaled(getattr(algorithm, name)))

    def _scaled(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            return str(scale_duration(Duration.parse(value), self.ratio))
        return scale_duration(value, self.ratio)
