"""The trainer's public way in for code that builds a run and takes steps itself (tools/measuring.py):
`Trainer.train_step` takes one batch through the events fit fires for it and advances the
counters, and fit's epochs are made of that very step; `build_run` (training/run.py) builds the
algorithms the config names and refuses a wrong one as a config error. In-process tiny trainers
(tests/conftest.py); the tools themselves run as subprocesses in test_diagnose.py and
test_compare_settings.py."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_trainer

from algorithms import build_algorithms
from algorithms.base import Algorithm, Event
from algorithms.durations import Duration
from algorithms.label_smoothing import LabelSmoothing
from training.config import ConfigError
from training.distributed import World
from training.run import build_run
from training.trainer import Trainer

MICRO_BATCH = [Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS, Event.AFTER_BACKWARD]


class EventLog(Algorithm):
    """Every event fired, with the step counter as the algorithms see it then."""

    def __init__(self):
        self.fired = []

    def match(self, event, state):
        return True

    def apply(self, event, state):
        self.fired.append((event, state.step))


def test_one_step_fires_the_batch_events_in_order_and_advances_the_counters(tmp_path):
    events = EventLog()
    trainer = tiny_trainer(tmp_path, [events], "grad_accum=2")
    state = trainer.state
    before = {name: value.detach().clone() for name, value in state.model.named_parameters()}
    state.train_loader.set_epoch(0)
    batches = iter(state.train_loader)
    images, targets = next(batches)
    events.fired.clear()                                    # INIT's
    loss = trainer.train_step(images, targets)
    batches.close()
    assert [event for event, _ in events.fired] == [Event.AFTER_DATALOADER, *MICRO_BATCH * 2,
                                                    Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END]
    assert [step for _, step in events.fired] == [0] * 10 + [1]     # counters advanced before BATCH_END
    assert state.step == 1 and state.batch_in_epoch == 1 and state.samples_seen == targets.shape[0] == 8
    assert loss.shape == () and torch.isfinite(loss)
    assert any(not torch.equal(value, before[name]) for name, value in state.model.named_parameters())


def test_fit_trains_with_that_same_step(tmp_path):
    """An epoch of train_step over the train loader leaves the weights bitwise where fit's epoch does."""
    settings = ["deterministic=true", "max_duration=1ep"]
    fitted = tiny_trainer(tmp_path / "fit", [], *settings)
    fitted.fit()
    stepped = tiny_trainer(tmp_path / "steps", [], *settings)
    stepped.state.train_loader.set_epoch(0)
    losses = [stepped.train_step(images, targets) for images, targets in stepped.state.train_loader]
    assert len(losses) == stepped.state.step == fitted.state.step == 4
    assert stepped.state.samples_seen == fitted.state.samples_seen
    expected, got = fitted.state.model.state_dict(), stepped.state.model.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_build_run_builds_the_configs_algorithms_and_refuses_a_wrong_one(tmp_path):
    config = tiny_trainer(tmp_path, [], "algorithms.label_smoothing={smoothing: 0.1}").config
    trainer = build_run(config)                             # a plain process: a world of one, on the CPU
    assert [type(algorithm) for algorithm in trainer.state.algorithms] == [LabelSmoothing]
    assert trainer.state.algorithms[0].smoothing == 0.1 and trainer.world.size == 1
    config.algorithms = {"label_smoothing": {"smoothin": 0.1}}
    with pytest.raises(ConfigError, match=r"^config key 'algorithms': "):
        build_run(config)


def test_build_run_settles_its_own_copy_of_the_config(tmp_path):
    """The scale schedule stretches the run it builds, not the caller's config: two runs built from one
    config are the same run."""
    config = tiny_trainer(tmp_path, [], "algorithms.scale_schedule={ratio: 2.0}").config
    before = config.max_duration
    first, second = build_run(config), build_run(config)
    assert config.max_duration == before
    assert first.config.max_duration == second.config.max_duration != before
    assert first.state.total_steps == second.state.total_steps == 2 * before.to_batches(first.state.steps_per_epoch)


def test_a_trainer_settles_a_copy_and_leaves_the_config_it_is_given_as_it_was(tmp_path):
    """What the run settles (precision=auto's choice, the global batch, the scale schedule's stretch,
    what algorithms record at INIT) is in `trainer.config`; the caller's config stays as it was."""
    plain = tiny_trainer(tmp_path / "plain", []).config
    given = dataclasses.replace(plain, run_dir=str(tmp_path / "run"), precision="auto",
                                data=dataclasses.replace(plain.data, global_batch_size=None),
                                optim=dataclasses.replace(plain.optim, warmup=Duration(1, "ep")),
                                algorithms={"scale_schedule": {"ratio": 2.0, "scale_warmup": True},
                                            "fixres": {"eval_resolution": 24}, "bce": {}})
    before = copy.deepcopy(given)
    trainer = Trainer(given, World(0, 0, 1, torch.device("cpu")), build_algorithms(given.algorithms))
    assert given == before
    settled = trainer.config
    assert settled.precision in ("fp32", "bf16") and settled.data.global_batch_size == 8
    assert settled.max_duration == Duration(4, "ep") and settled.optim.warmup == Duration(2, "ep")
    assert settled.data.val_resolution == 24 and settled.loss.kind == "bce"
