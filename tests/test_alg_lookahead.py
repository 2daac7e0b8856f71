"""Lookahead: the update on hand-computed values, airbench's decay schedule, the hook pulling the
model back to its slow copy every `every` steps and handing out the slow copy at the end, and an
exact resume from a checkpoint taken mid-epoch."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Algorithm, Event
from algorithms.lookahead import Lookahead, lookahead_decay, lookahead_update
from conftest import tiny_trainer


def test_the_slow_copy_moves_part_way_and_the_model_goes_back_to_it():
    slow, fast = [torch.tensor([0.0, 2.0]), torch.tensor(4)], [torch.tensor([1.0, 6.0]), torch.tensor(9)]
    lookahead_update(slow, fast, decay=0.75)
    assert torch.equal(slow[0], torch.tensor([0.25, 3.0])) and torch.equal(fast[0], slow[0])
    assert slow[1].item() == 4 and fast[1].item() == 9        # counts are not averaged
    lookahead_update(slow, [torch.tensor([5.0, 3.0]), fast[1]], decay=0.0)    # decay 0: the slow copy follows
    assert torch.equal(slow[0], torch.tensor([5.0, 3.0]))


def test_the_decay_rises_as_airbench_schedules_it():
    most = 0.95 ** 5
    assert lookahead_decay(0, 100) == 0 and lookahead_decay(100, 100) == pytest.approx(most)
    assert lookahead_decay(50, 100) == pytest.approx(most / 8) and lookahead_decay(150, 100) == pytest.approx(most)
    assert lookahead_decay(10, 100, most_decay=0.5, power=0) == 0.5      # Zhang et al.'s constant alpha = 0.5
    with pytest.raises(ValueError, match="every >= 1"):
        Lookahead(every=0)


class Probe(Algorithm):
    """Records the model's tensors and the slow copy at each BATCH_END; listed before Lookahead, it runs
    after it there (a closing event runs the list in reverse)."""

    def __init__(self, lookahead: Lookahead):
        self.lookahead, self.seen = lookahead, {}

    def match(self, event, state):
        return event == Event.BATCH_END

    def apply(self, event, state):
        self.seen[state.step] = ({name: t.clone() for name, t in state.model.state_dict().items()},
                                 {name: t.clone() for name, t in self.lookahead.state_dict()["slow"].items()})


def test_every_few_steps_the_model_is_its_slow_copy_and_it_ends_holding_it(tmp_path):
    lookahead = Lookahead(every=3, most_decay=0.5, power=1)
    probe = Probe(lookahead)
    trainer = tiny_trainer(tmp_path, [probe, lookahead], "optim.schedule=constant")
    trainer.fit()
    for step, (model, slow) in probe.seen.items():
        same = all(torch.equal(model[name], slow[name]) for name in slow)
        assert same == (step % 3 == 0), step
    # between pulls the slow copy stays put; at a pull it moves toward where the model got
    assert all(torch.equal(probe.seen[4][1][name], probe.seen[5][1][name]) for name in probe.seen[4][1])
    assert not all(torch.equal(probe.seen[5][1][name], probe.seen[6][1][name]) for name in probe.seen[5][1])
    final = trainer.state.model.state_dict()        # FIT_END: the model is the slow copy
    assert all(torch.equal(final[name], t) for name, t in lookahead.state_dict()["slow"].items())


class StopAt(Algorithm):
    """Ends a run as a preemption would, once the checkpoint of `step` is written."""

    def __init__(self, step: int):
        self.step = step

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD and state.step == self.step

    def apply(self, event, state):
        raise KeyboardInterrupt


def assert_resume_mid_epoch_is_exact(tmp_path, make_algorithm, state_key: str, *settings: str) -> None:
    """A tiny run of 8 steps killed after its checkpoint of step 6 (mid-epoch 2) and resumed ends with
    the algorithm's `state_key` tensors and the model bitwise those of an uninterrupted run."""
    settings = ("checkpoint.interval=3ba", "deterministic=true", *settings)
    whole = make_algorithm()
    done = tiny_trainer(tmp_path / "whole", [whole, StopAt(99)], *settings)
    done.fit()
    with pytest.raises(KeyboardInterrupt):
        tiny_trainer(tmp_path / "parts", [make_algorithm(), StopAt(6)], *settings).fit()
    resumed = make_algorithm()
    trainer = tiny_trainer(tmp_path / "parts", [resumed, StopAt(99)], *settings)
    trainer.fit()
    assert trainer.state.step == 8
    expected, got = whole.state_dict()[state_key], resumed.state_dict()[state_key]
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)
    final, whole_final = trainer.state.model.state_dict(), done.state.model.state_dict()
    assert all(torch.equal(final[name], whole_final[name]) for name in final)


def test_a_run_resumed_mid_epoch_ends_as_an_uninterrupted_one(tmp_path):
    # step 6 of 8 lies between pulls (every 4)
    assert_resume_mid_epoch_is_exact(tmp_path, lambda: Lookahead(every=4, most_decay=0.5, power=1), "slow",
                                     "optim.schedule=constant")
