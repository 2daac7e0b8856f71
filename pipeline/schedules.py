"""Resolution schedules: epoch -> training resolution, applied by the loaders at `set_epoch`.

Two published forms, each a small frozen dataclass callable on the epoch:
- `FFCVRamp` (ffcv-imagenet): `min_res` until `start_ramp`, a linear ramp rounded to a
  multiple of `multiple` (32) until `end_ramp`, then `max_res`;
- `ComposerRamp` (MosaicML's ProgressiveResizing, at epoch granularity): the scale stays at
  `initial_scale` for the first `delay_fraction` of training, rises linearly to 1 at the start
  of the last `finetune_fraction`, and the side is rounded to a multiple of `size_increment`.
  An epoch takes the ramp's value at its middle (the mean of Composer's per-step ramp over it),
  and with a finetune the last epoch is at full size: the ramp taken at each epoch's start
  left runs of 1-3 epochs never trained at the size they are evaluated at (fashion sample,
  1 epoch at 20 px, evaluated at 28: 57% top-1 against 86.5% without the ramp).
`resolution_schedule(value)` builds one from an int or a mapping, as found in a config, and
`stretched(schedule, ratio)` gives the same schedule over a run `ratio` times as long.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Mapping, Union

Schedule = Callable[[int], int]


@dataclass(frozen=True)
class ConstantResolution:
    resolution: int

    def __post_init__(self):
        _check(self.resolution >= 8, f"resolution must be >= 8, got {self.resolution}")

    def __call__(self, epoch: int) -> int:
        return self.resolution


@dataclass(frozen=True)
class FFCVRamp:
    min_res: int
    max_res: int
    start_ramp: int
    end_ramp: int
    multiple: int = 32

    def __post_init__(self):
        _check(8 <= self.min_res <= self.max_res, f"need 8 <= min_res <= max_res, got {self.min_res}, {self.max_res}")
        _check(0 <= self.start_ramp <= self.end_ramp,
               f"need 0 <= start_ramp <= end_ramp, got {self.start_ramp}, {self.end_ramp}")
        _check(self.multiple >= 1, f"multiple must be >= 1, got {self.multiple}")

    def __call__(self, epoch: int) -> int:
        if epoch <= self.start_ramp:
            return self.min_res
        if epoch >= self.end_ramp:
            return self.max_res
        fraction = (epoch - self.start_ramp) / (self.end_ramp - self.start_ramp)
        resolution = self.min_res + fraction * (self.max_res - self.min_res)
        return int(round(resolution / self.multiple)) * self.multiple


@dataclass(frozen=True)
class ComposerRamp:
    final_res: int
    total_epochs: int
    initial_scale: float = 0.5
    delay_fraction: float = 0.5
    finetune_fraction: float = 0.2
    size_increment: int = 4

    def __post_init__(self):
        _check(self.final_res >= 8, f"final_res must be >= 8, got {self.final_res}")
        _check(self.total_epochs >= 1, f"total_epochs must be >= 1, got {self.total_epochs}")
        _check(0 < self.initial_scale <= 1, f"initial_scale must be in (0, 1], got {self.initial_scale}")
        _check(0 <= self.delay_fraction and 0 <= self.finetune_fraction
               and self.delay_fraction + self.finetune_fraction <= 1,
               f"need delay_fraction, finetune_fraction >= 0 with a sum <= 1, "
               f"got {self.delay_fraction}, {self.finetune_fraction}")
        _check(self.size_increment >= 1, f"size_increment must be >= 1, got {self.size_increment}")

    def side_at(self, elapsed: float) -> int:
        """The side when a share `elapsed` (0..1) of training is done: at any granularity."""
        scale = ramp_scale(elapsed, self.initial_scale, self.delay_fraction, self.finetune_fraction)
        side = round(self.final_res * scale / self.size_increment) * self.size_increment
        return max(self.size_increment, min(side, self.final_res))

    def __call__(self, epoch: int) -> int:
        # total_epochs may be fractional (ScaleSchedule scales it): the last epoch is the one it ends in.
        if self.finetune_fraction > 0 and epoch + 1 >= self.total_epochs:
            return self.final_res
        middle = (epoch + min(epoch + 1, self.total_epochs)) / 2
        return self.side_at(middle / self.total_epochs)


def ramp_scale(elapsed: float, initial_scale: float, delay_fraction: float, finetune_fraction: float) -> float:
    """The side's share of full size when a share `elapsed` of training is done (Composer's ramp)."""
    ramp = 1 - delay_fraction - finetune_fraction
    if elapsed < delay_fraction:
        return initial_scale
    if ramp <= 0 or elapsed >= 1 - finetune_fraction:
        return 1.0
    return initial_scale + (1 - initial_scale) * (elapsed - delay_fraction) / ramp


FORMS = {"ffcv": FFCVRamp, "composer": ComposerRamp}
EPOCH_FIELDS = {"ffcv": ("start_ramp", "end_ramp"), "composer": ("total_epochs",)}   # the fields counting epochs


def stretched(schedule: Schedule, ratio: float) -> Schedule:
    """`schedule` over a run `ratio` times as long: its epoch counts multiplied and kept
    fractional, so an FFCVRamp's stretched value at epoch e is exactly the original's at
    e / ratio, and a ComposerRamp (given in shares of the run) is the same ramp over the
    longer or shorter run, ending in the epoch it says. A constant, or a schedule of another
    kind, is left as it is."""
    for form, kind in FORMS.items():
        if type(schedule) is kind:
            return replace(schedule, **{name: getattr(schedule, name) * ratio for name in EPOCH_FIELDS[form]})
    return schedule


def resolution_schedule(value: Union[int, Schedule, Mapping]) -> Schedule:
    """An int (constant), a schedule, or a mapping with `form: ffcv|composer` and its fields."""
    if isinstance(value, bool):
        raise ValueError(f"resolution must be an int or a schedule, got {value!r}")
    if isinstance(value, int):
        return ConstantResolution(value)
    if callable(value):
        return value
    if isinstance(value, Mapping):
        options = dict(value)
        form = options.pop("form", None)
        if form not in FORMS:
            raise ValueError(f"resolution schedule needs form: one of {sorted(FORMS)}, got {form!r}")
        known = {f.name for f in fields(FORMS[form])}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"resolution schedule ({form}): unknown keys {unknown}; valid keys: {sorted(known)}")
        try:
            return FORMS[form](**options)
        except TypeError as error:
            raise ValueError(f"resolution schedule ({form}): {error}") from None
    raise ValueError(f"resolution must be an int, a schedule or a mapping, got {type(value).__name__}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
