"""training/step_phases.py in real (in-process) training runs: the phases tile the step time,
and each phase gets what happens in it: what a loader does in the training process lands in
`data`, the model's forward in `forward`, a hook's work in `hooks`.

What lands where is checked with a clock that moves only when the run's own components say so
(`ChargingClock`): a hook, the loader and the model's forward each charge it a known amount, so
every phase's seconds are exact counts, whatever else runs on the machine. The tiling is checked
on the real clock, against the trainer's own epoch timer."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Algorithm, Event
from conftest import tiny_trainer
from training import checkpoints
from training.step_phases import PHASES, StepPhases


class ChargingClock:
    """Seconds that pass only when `charge`d."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, seconds: float) -> None:
        self.now += seconds


class ChargingHook(Algorithm):
    """Charges the clock 1 s at every AFTER_BACKWARD, and counts its calls."""

    def __init__(self, clock: ChargingClock):
        self.clock, self.calls = clock, 0

    def match(self, event, state):
        return event == Event.AFTER_BACKWARD

    def apply(self, event, state):
        self.clock.charge(1.0)
        self.calls += 1


class ChargingLoader:
    """A real loader whose batches charge the clock 1 s an image as it hands them over (after
    making them: decoding, here), counting the images; everything else is the loader's own."""

    def __init__(self, loader, clock: ChargingClock):
        self._loader, self._clock, self.images = loader, clock, 0

    def __iter__(self):
        for images, labels in self._loader:
            self._clock.charge(float(len(labels)))
            self.images += len(labels)
            yield images, labels

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def on_the_clock(trainer, clock: ChargingClock):
    """The trainer with its phases read from `clock`."""
    trainer.phases = StepPhases(True, clock=clock)
    return trainer


def seconds_in(phases: dict, phase: str) -> float:
    return phases[phase] * phases["seconds"]


def test_phases_add_up_to_the_step_time_and_a_hook_s_work_lands_in_hooks(tmp_path):
    """On the real clock the phases cover the epochs' training time, each phase some of it. On
    the charging clock, the 8 seconds a hook charges land in `hooks`, and nothing elsewhere."""
    trainer = tiny_trainer(tmp_path / "plain", [])
    summary = trainer.fit()
    plain = summary["step_phases"]
    assert plain["steps"] == summary["steps"] == 8
    assert sum(plain[name] for name in PHASES) == pytest.approx(1, abs=0.002)
    assert plain["seconds"] == pytest.approx(trainer.state.train_seconds, rel=0.10)
    assert all(plain[name] > 0 for name in ("data", "forward", "loss", "backward", "optimizer", "other"))

    clock = ChargingClock()
    hook = ChargingHook(clock)
    charged = on_the_clock(tiny_trainer(tmp_path / "charged", [hook]), clock).fit()["step_phases"]
    assert hook.calls == charged["steps"] == 8
    assert charged["seconds"] == seconds_in(charged, "hooks") == 8.0, charged
    assert all(charged[name] == 0 for name in PHASES if name != "hooks"), charged


def test_a_loader_that_decodes_in_the_training_process_shows_as_data(sample_sets, tmp_path):
    """16 photos of about 400x350 px decoded a step with no workers: the loader's time (1 s an
    image handed over) lands in `data`, the model's forward (100 s a training forward) in
    `forward`, and neither anywhere else."""
    clock = ChargingClock()
    trainer = on_the_clock(tiny_trainer(tmp_path / "photos", [], "data.backend=folder",
                                        f"data.path={sample_sets / 'photos'}", "data.num_workers=0",
                                        "data.num_classes=23", "data.batch_size=16", "max_duration=5ba"), clock)
    loader = trainer.state.train_loader = ChargingLoader(trainer.state.train_loader, clock)
    trainer.state.model.register_forward_hook(lambda module, *_: clock.charge(100.0) if module.training else None)
    phases = trainer.fit()["step_phases"]
    assert phases["steps"] == 5 and loader.images == 5 * 16
    assert seconds_in(phases, "data") == pytest.approx(5 * 16, abs=0.03)      # shares have 4 digits
    assert seconds_in(phases, "forward") == pytest.approx(500, abs=0.03)
    assert phases["seconds"] == pytest.approx(5 * 16 + 500), phases
    assert all(phases[name] == 0 for name in PHASES if name not in ("data", "forward")), phases


def test_a_resumed_run_s_phases_cover_the_whole_run(tmp_path):
    """Checkpoints at each epoch; the last one deleted, the run resumes from epoch 1 and trains its
    second: the summary's phases cover all 8 steps, not only the 4 after the resume. A hook
    charges 1 s a step, and the epoch-1 checkpoint is given 100 s more of `forward`, so that both
    sessions' seconds are told apart exactly."""
    clock = ChargingClock()
    on_the_clock(tiny_trainer(tmp_path, [ChargingHook(clock)], "checkpoint.interval=1ep"), clock).fit()
    (tmp_path / "checkpoints" / "ep2-ba8.pt").unlink()
    first_epoch = tmp_path / "checkpoints" / "ep1-ba4.pt"
    checkpoint = checkpoints.load(first_epoch)
    carried = checkpoint["counters"]["step_phases"]
    assert carried["steps"] == 4 and carried["seconds"]["hooks"] == 4.0
    carried["seconds"]["forward"] += 100.0
    torch.save(checkpoint, first_epoch)
    clock = ChargingClock()
    resumed = on_the_clock(tiny_trainer(tmp_path, [ChargingHook(clock)], "checkpoint.interval=1ep", "resume=auto"),
                           clock).fit()["step_phases"]
    assert resumed["steps"] == 8
    assert resumed["seconds"] == pytest.approx(sum(carried["seconds"].values()) + 4.0), (carried, resumed)
    # forward holds the carried 100 s, hooks both sessions' 4; shares are rounded to 4 digits
    assert seconds_in(resumed, "forward") == pytest.approx(100.0, abs=0.02), (carried, resumed)
    assert seconds_in(resumed, "hooks") == pytest.approx(8.0, abs=0.02), (carried, resumed)


def test_off_records_nothing(tmp_path):
    assert tiny_trainer(tmp_path, [], "log.step_phases=off").fit()["step_phases"] == {}
