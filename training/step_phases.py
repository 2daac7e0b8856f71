"""Where a train step's time goes: waiting for data, forward, loss, backward, optimizer, the
algorithms' hooks, and the rest (counters, metrics, progress). Amdahl's law for speed-up
methods: a method that shrinks one phase can win at most that phase's share, and methods that
shrink the same phase compose to less than the sum of their gains.

The trainer calls `lap(phase)` at each boundary of the step; the time since the previous lap is
charged to `phase`. The laps tile the epoch's training time (the trainer's epoch timer starts and
stops with them, checkpoint writes are left out of both), so the phases sum to the step time.
On a CPU every kernel is done when its call returns, so a lap is two clock reads. On CUDA the
host runs ahead of the device: `sync=True` waits for the device at every boundary, which makes
the split true but costs the overlap of host and device, so it is off unless asked for
(`log.step_phases=on`); `log.step_phases=off` makes every lap a no-op.
"""
from __future__ import annotations

import time

PHASES = ("data", "forward", "loss", "backward", "optimizer", "hooks", "other")


class StepPhases:
    def __init__(self, enabled: bool, sync=None, clock=time.perf_counter):
        self.enabled = enabled
        self._sync = sync                       # e.g. torch.cuda.synchronize, or None
        self._clock = clock                     # seconds; a test gives one that counts what it charges
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0                          # optimizer laps, over all sessions of a resumed run
        self._last = 0.0

    def start(self) -> None:
        """Where the laps start: the epoch timer's start, and again after a checkpoint write."""
        if self.enabled:
            if self._sync:
                self._sync()
            self._last = self._clock()

    def lap(self, phase: str) -> None:
        if self.enabled:
            if self._sync:
                self._sync()
            now = self._clock()
            self.seconds[phase] += now - self._last
            self._last = now
            self.steps += phase == "optimizer"

    def state_dict(self) -> dict:
        """What a checkpoint carries, so that a resumed run's phases cover the whole run, as its
        training time does: without it they held only the last session's steps, the largest ones
        under progressive resizing."""
        return {"seconds": dict(self.seconds), "steps": self.steps}

    def load_state_dict(self, saved: dict) -> None:
        self.seconds, self.steps = dict(saved["seconds"]), saved["steps"]

    def shares(self) -> dict:
        """{phase: share of the step time}, with the `seconds` and `steps` they cover; {} when off."""
        total = sum(self.seconds.values())
        if not self.enabled or total <= 0:
            return {}
        return {"seconds": round(total, 3), "steps": self.steps,
                **{phase: round(s / total, 4) for phase, s in self.seconds.items()}}
