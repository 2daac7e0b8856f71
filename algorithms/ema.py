"""EMA: evaluate with an exponential moving average of the weights (MosaicML Composer's EMA).

What: a shadow copy of the model's parameters and buffers moves toward the trained ones
every `update_interval`, by `ema = s * ema + (1 - s) * weights` with the smoothing
`s = 0.5 ** (update_interval / half_life)`: an old weight's share halves every `half_life`.
Evaluation swaps the averaged weights in (EVAL_START) and back out (EVAL_END); at FIT_END
the model is left holding them, so the trained model a caller gets is the average (Composer
saves the average in its checkpoints and hands it out via `get_ema_model`; here the run's
checkpoints keep the training weights, which exact resume needs, and the EMA state beside them).
When: it smooths the noise of the last steps' SGD, which helps most with short schedules
and a still-high LR at the end; Composer reports better speed/accuracy trade-offs.
Cost: one more copy of the weights in memory (two during evaluation) and a lerp per update.
Buffers: floating ones (BN running mean/var) are averaged like parameters, as Composer does;
integer ones (BN's num_batches_tracked) are copied, since an average of counts means nothing.
Settings: half_life="1000ba", update_interval="1ba" (Composer's defaults); durations in ep,
ba or dur, converted to batches at FIT_START. ScaleSchedule scales `half_life`.
"""
from __future__ import annotations

import torch

from algorithms.base import Algorithm, Event, weights_copy
from algorithms.durations import Duration


def smoothing_for_half_life(half_life_steps: float, update_interval_steps: float = 1) -> float:
    """The per-update smoothing under which an old value's weight halves every `half_life_steps`
    when an update happens every `update_interval_steps` (0 half-life: no averaging)."""
    return 0.5 ** (update_interval_steps / half_life_steps) if half_life_steps > 0 else 0.0


@torch.no_grad()
def ema_update(ema_tensors: list[torch.Tensor], model_tensors: list[torch.Tensor], smoothing: float) -> None:
    """In place: each floating `ema = smoothing * ema + (1 - smoothing) * model`; others are copied."""
    averaged = [(e, m) for e, m in zip(ema_tensors, model_tensors) if e.is_floating_point()]
    copied = [(e, m) for e, m in zip(ema_tensors, model_tensors) if not e.is_floating_point()]
    if averaged:
        torch._foreach_lerp_([e for e, _ in averaged], [m for _, m in averaged], 1.0 - smoothing)
    for e, m in copied:
        e.copy_(m)


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class EMA(Algorithm):
    scaled_durations = ("half_life",)      # what ScaleSchedule multiplies

    def __init__(self, half_life="1000ba", update_interval="1ba"):
        self.half_life, self.update_interval = Duration.parse(half_life), Duration.parse(update_interval)
        self._ema: dict[str, torch.Tensor] | None = None   # name -> averaged tensor
        self._training: list[torch.Tensor] | None = None    # the training weights while EMA's are swapped in
        self._every, self._smoothing = 1, 0.0

    def match(self, event: Event, state) -> bool:
        if event == Event.FIT_START:
            return True
        if self._ema is None:
            return False
        if event == Event.BATCH_END:
            return state.step % self._every == 0
        return event in (Event.EVAL_START, Event.EVAL_END, Event.FIT_END)

    @torch.no_grad()
    def apply(self, event: Event, state) -> None:
        model = _named_tensors(state.model)
        if event == Event.FIT_START:
            self._start(model, state)
        elif event == Event.BATCH_END:
            ema_update(list(self._ema.values()), list(model.values()), self._smoothing)
        elif event == Event.EVAL_START:
            self._training = [t.clone() for t in model.values()]
            torch._foreach_copy_(list(model.values()), list(self._ema.values()))
        elif event == Event.EVAL_END:
            torch._foreach_copy_(list(model.values()), self._training)
            self._training = None
        else:   # FIT_END: the trained model is the average
            torch._foreach_copy_(list(model.values()), list(self._ema.values()))

    def _start(self, model: dict[str, torch.Tensor], state) -> None:
        self._every = self.update_interval.to_batches(state.steps_per_epoch, state.total_steps)
        if self._every < 1:
            raise ValueError(f"EMA update_interval={self.update_interval} is less than one batch")
        half_life = self.half_life.to_batches(state.steps_per_epoch, state.total_steps)
        self._smoothing = smoothing_for_half_life(half_life, self._every)
        self._ema = weights_copy(self._ema, model, "EMA state")   # a resumed run loaded its average already

    def state_dict(self) -> dict:
        return {} if self._ema is None else {"ema": dict(self._ema)}

    def load_state_dict(self, state: dict) -> None:
        # Kept as loaded (on the CPU); FIT_START checks the names and moves it to the model's device.
        self._ema = dict(state["ema"]) if "ema" in state else None
