"""Durations in MosaicML Composer's time units, for config settings that may count epochs or
batches: `90ep` (epochs, fractions allowed), `1000ba` (batches) or `0.5dur` (a fraction of the
run's max_duration). The trainer turns each into a batch count with `to_batches` once it knows the
batches per epoch, so that schedules, warmups and intervals all step in batches. It lives in
`algorithms` because both the algorithms (EMA's half-life, ScaleSchedule) and the trainer's
config read durations, and imports point one way: training -> algorithms -> pipeline.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

UNITS = ("ep", "ba", "dur")
HOW_TO_WRITE = ("write a number followed by ep (epochs), ba (batches) or dur (fraction of max_duration), "
                "e.g. 90ep, 1000ba, 0.5dur")
# The sign is accepted by the syntax so that a negative value gets its own message.
_SYNTAX = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(ep|ba|dur)")


@dataclass(frozen=True)
class Duration:
    value: float
    unit: str

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"bad duration unit {self.unit!r}: {HOW_TO_WRITE}")
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"bad duration '{self}': must be a finite number >= 0")
        if self.unit == "ba" and not float(self.value).is_integer():
            raise ValueError(f"bad duration '{self}': a count of batches must be a whole number")
        if self.unit == "dur" and self.value > 1:
            raise ValueError(f"bad duration '{self}': a fraction of max_duration must be between 0 and 1")

    @classmethod
    def parse(cls, text: str | Duration) -> Duration:
        if isinstance(text, Duration):
            return text
        match = _SYNTAX.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"bad duration {text!r}: {HOW_TO_WRITE}")
        return cls(float(match[1]), match[2])

    def __str__(self) -> str:
        number = int(self.value) if float(self.value).is_integer() else self.value
        return f"{number}{self.unit}"

    def to_batches(self, batches_per_epoch: int, total_batches: int | None = None) -> int:
        """This duration in batches; `total_batches` (the run's max_duration in batches) is needed for dur."""
        if self.unit == "ep":
            return round(self.value * batches_per_epoch)
        if self.unit == "ba":
            return int(self.value)
        if total_batches is None:
            raise ValueError(f"'{self}' is a fraction of max_duration, which is not known here "
                             f"(max_duration cannot be given in dur)")
        return round(self.value * total_batches)
