"""Lookahead: the trained weights pulled back to a slow copy every few steps, the copy moving
part of the way toward them (Zhang et al., 2019, "Lookahead Optimizer: k steps forward, 1 step
back"; airbench trains CIFAR-10 with it).

What: a slow copy of the model's floating tensors (parameters and batch-norm statistics, as
airbench keeps them). Every `every` optimizer steps, `slow = decay * slow + (1 - decay) * fast`,
then `fast = slow`; at FIT_END once more with decay 1, so the trained model is the slow copy.
The decay follows airbench's schedule, `most_decay * (step / total_steps) ** power`: near 0 early
(the slow copy simply follows), rising to `most_decay` at the end, where averaging damps the
noise of a still-large learning rate. `power=0` is the constant decay of Zhang et al.'s Lookahead
(their alpha is 1 - decay). The optimizer's state (momentum) is left as it is.
When: short runs at a high learning rate; it averages inside training, where EMA averages beside
it, so the next steps start from the average.
Cost: one copy of the weights; a lerp and a copy every `every` steps.
Settings: every=5, most_decay=0.95 ** 5, power=3 (airbench94's). ScaleSchedule needs nothing:
the schedule is in fractions of the run.
"""
from __future__ import annotations

import torch

from algorithms.base import Algorithm, Event, weights_copy


def lookahead_decay(step: int, total_steps: int, most_decay: float = 0.95 ** 5, power: float = 3.0) -> float:
    """The slow copy's decay at `step` of `total_steps`: most_decay * (step / total_steps) ** power."""
    return most_decay * (min(step, total_steps) / max(total_steps, 1)) ** power


@torch.no_grad()
def lookahead_update(slow: list[torch.Tensor], fast: list[torch.Tensor], decay: float) -> None:
    """In place, for each floating pair: slow = decay * slow + (1 - decay) * fast, then fast = slow;
    other tensors (batch counts) are left alone."""
    pairs = [(s, f) for s, f in zip(slow, fast) if f.is_floating_point()]
    if pairs:
        torch._foreach_lerp_([s for s, _ in pairs], [f for _, f in pairs], 1.0 - decay)
        torch._foreach_copy_([f for _, f in pairs], [s for s, _ in pairs])


def _floating_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}


class Lookahead(Algorithm):
    def __init__(self, every: int = 5, most_decay: float = 0.95 ** 5, power: float = 3.0):
        if every < 1 or not 0 <= most_decay < 1 or power < 0:
            raise ValueError(f"Lookahead needs every >= 1, 0 <= most_decay < 1 and power >= 0; got every={every}, "
                             f"most_decay={most_decay}, power={power}")
        self.every, self.most_decay, self.power = int(every), float(most_decay), float(power)
        self._slow: dict[str, torch.Tensor] | None = None

    def match(self, event: Event, state) -> bool:
        if event == Event.FIT_START:
            return True
        if self._slow is None:
            return False
        return (event == Event.BATCH_END and state.step % self.every == 0) or event == Event.FIT_END

    def apply(self, event: Event, state) -> None:
        fast = _floating_tensors(state.model)
        if event == Event.FIT_START:      # a resumed run loaded its slow copy already
            self._slow = weights_copy(self._slow, fast, "Lookahead state")
            return
        decay = 1.0 if event == Event.FIT_END else lookahead_decay(state.step, state.total_steps, self.most_decay,
                                                                     self.power)
        lookahead_update(list(self._slow.values()), list(fast.values()), decay)

    def state_dict(self) -> dict:
        return {} if self._slow is None else {"slow": dict(self._slow)}

    def load_state_dict(self, state: dict) -> None:
        # Kept as loaded (on the CPU); FIT_START checks the names and moves it to the model's device.
        self._slow = dict(state["slow"]) if "slow" in state else None
