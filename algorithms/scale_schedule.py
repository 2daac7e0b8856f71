"""ScaleSchedule: train for `ratio` times as long, with every schedule stretched to fit
(MosaicML Composer's `scale_schedule_ratio`).

What: at INIT it multiplies max_duration, the LR milestones (and the warmup, if
`scale_warmup`), the train resolution schedule's epochs (ffcv form: start_ramp/end_ramp;
composer form: total_epochs, its other keys being shares of the run) and the durations other
algorithms list in a class attribute `scaled_durations` (EMA: half_life). Durations in ep and
ba are multiplied (ba rounded to whole batches); those in dur are shares of the run and
follow it by themselves. The cosine/linear decay spans the run, so it stretches with it.
When: the simplest way to trade quality for time: a shortened run still goes through its
whole LR decay, which beats stopping a long schedule early (Composer's method card).
Cost: none; the run is `ratio` times as long.
Settings: ratio=1.0; scale_warmup=False, as Composer, whose warmups are not scaled unless
asked (a warmup in dur scales regardless). eval_interval and checkpoint.interval are left
alone. Put it first in a recipe, so that algorithms reading durations at INIT see the
scaled ones (a loader resolution schedule set before it is scaled either way).
"""
from __future__ import annotations

from algorithms.base import Algorithm, Event
from algorithms.durations import Duration


def scale_duration(duration, ratio: float):
    """A Duration `ratio` times as long: ep multiplied, ba multiplied and rounded, dur unchanged."""
    if duration.unit == "dur":
        return duration
    value = duration.value * ratio
    return type(duration)(round(value) if duration.unit == "ba" else value, duration.unit)


def scale_resolution_schedule(resolution, ratio: float):
    """The config's train resolution (an int or a schedule mapping) with its epoch counts scaled."""
    if not isinstance(resolution, dict):
        return resolution
    keys = {"ffcv": ("start_ramp", "end_ramp"), "composer": ("total_epochs",)}.get(resolution.get("form"), ())
    # Kept fractional: FFCVRamp's scaled schedule at epoch e is exactly the original at e / ratio,
    # and ComposerRamp's is the same ramp over the shorter run (it ends in the epoch it says).
    return {**resolution, **{key: resolution[key] * ratio for key in keys if key in resolution}}


class ScaleSchedule(Algorithm):
    def __init__(self, ratio: float = 1.0, scale_warmup: bool = False):
        if ratio <= 0:
            raise ValueError(f"ScaleSchedule ratio must be > 0, got {ratio}")
        self.ratio, self.scale_warmup = ratio, scale_warmup

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT and self.ratio != 1.0

    def apply(self, event: Event, state) -> None:
        config, ratio = state.config, self.ratio
        config.max_duration = scale_duration(config.max_duration, ratio)
        if config.max_duration.value == 0:
            raise ValueError(f"ScaleSchedule({ratio}) leaves a max_duration of 0")
        if self.scale_warmup:
            config.optim.warmup = scale_duration(config.optim.warmup, ratio)
        config.optim.milestones = [scale_duration(m, ratio) for m in config.optim.milestones]
        config.data.resolution = scale_resolution_schedule(config.data.resolution, ratio)
        # The loader's own schedule is scaled too: an algorithm before this one may have set it
        # (progressive resizing, from the unscaled max_duration).
        resolution = state.train_loader.spec.resolution
        if isinstance(resolution, dict):
            state.train_loader.reconfigure(resolution=scale_resolution_schedule(resolution, ratio))
        for algorithm in state.algorithms:
            for name in getattr(algorithm, "scaled_durations", ()):
                setattr(algorithm, name, self._scaled(getattr(algorithm, name)))

    def _scaled(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            return str(scale_duration(Duration.parse(value), self.ratio))
        return scale_duration(value, self.ratio)
