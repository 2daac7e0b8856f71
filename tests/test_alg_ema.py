"""EMA: the half-life property of the update, evaluation on the averaged weights, the model
left holding them at the end, and exact resume of the average."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Algorithm, Event
from algorithms.ema import EMA, ema_update, smoothing_for_half_life
from conftest import tiny_trainer


@pytest.mark.parametrize("half_life, interval", [(10, 1), (12, 3), (1, 1)])
def test_after_a_half_life_of_constant_input_the_average_is_half_way(half_life, interval):
    smoothing = smoothing_for_half_life(half_life, interval)
    ema, target = [torch.zeros(5)], [torch.ones(5)]
    for _ in range(half_life // interval):
        ema_update(ema, target, smoothing)
    torch.testing.assert_close(ema[0], torch.full((5,), 0.5))
    for _ in range(half_life // interval):
        ema_update(ema, target, smoothing)
    torch.testing.assert_close(ema[0], torch.full((5,), 0.75))


def test_float_tensors_are_averaged_integer_ones_copied():
    ema, model = [torch.zeros(2), torch.tensor(3)], [torch.ones(2), torch.tensor(10)]
    ema_update(ema, model, smoothing_for_half_life(0))      # half-life 0: no averaging
    assert torch.equal(ema[0], torch.ones(2)) and ema[1].item() == 10 and ema[1].dtype == torch.int64


class Probe(Algorithm):
    """Records the model's tensors at each event it sees (placed after EMA in the list)."""

    def __init__(self, ema: EMA):
        self.ema, self.seen = ema, []

    def match(self, event, state):
        return event in (Event.EPOCH_START, Event.EPOCH_END, Event.EVAL_START, Event.EVAL_END)

    def apply(self, event, state):
        model = {name: t.clone() for name, t in state.model.state_dict().items()}
        self.seen.append((event, state.step, model, {k: v.clone() for k, v in self.ema.state_dict()["ema"].items()}))


def test_evaluation_runs_on_the_average_and_training_resumes_on_its_own_weights(tmp_path):
    ema = EMA(half_life="2ba")
    probe = Probe(ema)
    trainer = tiny_trainer(tmp_path, [ema, probe])
    trainer.fit()
    assert ema._smoothing == pytest.approx(0.5 ** 0.5)
    seen = {(event, step): (model, average) for event, step, model, average in probe.seen}
    for event in (Event.EVAL_START, Event.EVAL_END):       # both evaluations saw the average
        for step in (4, 8):
            model, average = seen[event, step]
            assert all(torch.equal(model[name], average[name]) for name in average)
    trained, _ = seen[Event.EPOCH_END, 4]
    _, average = seen[Event.EVAL_START, 4]
    assert not all(torch.equal(trained[name], average[name]) for name in average)   # the two do differ
    resumed, _ = seen[Event.EPOCH_START, 4]                # epoch 2 starts from the training weights
    assert all(torch.equal(trained[name], resumed[name]) for name in trained)
    final = trainer.state.model.state_dict()               # FIT_END: the model holds the average
    assert all(torch.equal(final[name], tensor) for name, tensor in ema.state_dict()["ema"].items())


def test_half_life_in_epochs_and_update_interval():
    from types import SimpleNamespace
    ema = EMA(half_life="1ep", update_interval="2ba")
    state = SimpleNamespace(model=torch.nn.Linear(2, 2), steps_per_epoch=8, total_steps=16, step=0)
    ema.apply(Event.FIT_START, state)
    assert ema._smoothing == pytest.approx(0.5 ** (2 / 8))
    assert [ema.match(Event.BATCH_END, SimpleNamespace(step=s)) for s in (1, 2, 3, 4)] == [False, True, False, True]


def test_resumed_run_has_the_same_average_as_an_uninterrupted_one(tmp_path):
    settings = ["optim.schedule=constant", "checkpoint.interval=1ep", "deterministic=true"]   # bitwise below
    whole = EMA(half_life="3ba")
    tiny_trainer(tmp_path / "whole", [whole], *settings).fit()
    tiny_trainer(tmp_path / "parts", [EMA(half_life="3ba")], *settings, "max_duration=1ep").fit()
    resumed = EMA(half_life="3ba")
    trainer = tiny_trainer(tmp_path / "parts", [resumed], *settings)
    trainer.fit()
    assert trainer.state.step == 8
    expected, got = whole.state_dict()["ema"], resumed.state_dict()["ema"]
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    # and a state_dict round trip through a fresh hook reproduces it
    copy = EMA(half_life="3ba")
    copy.load_state_dict(resumed.state_dict())
    copy.apply(Event.FIT_START, trainer.state)
    assert all(torch.equal(copy.state_dict()["ema"][name], got[name]) for name in got)
