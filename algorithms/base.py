"""Where and what: the training loop's events, and the `Algorithm` base class that hooks them.

The loop (training/trainer.py) fires the events below, in this order; an algorithm says in
`match(event, state)` whether it acts, and in `apply(event, state)` what it does, by
changing the loop's `State` (training/state.py: model, optimizer, loaders, the batch in
`images`/`targets`, `outputs`, `loss`, the counters). Each method in this package also
exists as a pure function that needs no loop at all.

Per optimizer step, with gradient accumulation, the events from BEFORE_FORWARD to
AFTER_BACKWARD fire once per micro-batch; `state.images`/`state.targets` then hold the
micro-batch.
"""
from __future__ import annotations

import enum


class Event(str, enum.Enum):
    INIT = "init"                                        # model and loaders built; no DDP, optimizer or
                                                         # total_steps yet: model surgery, loader settings
    FIT_START = "fit_start"                              # checkpoint (if any) loaded
    EPOCH_START = "epoch_start"                          # after loader.set_epoch(epoch)
    AFTER_DATALOADER = "after_dataloader"                # the whole batch, on the device
    BEFORE_FORWARD = "before_forward"                    # per micro-batch from here ...
    BEFORE_LOSS = "before_loss"                          # outputs computed
    AFTER_LOSS = "after_loss"
    AFTER_BACKWARD = "after_backward"                    # ... to here
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"      # gradients reduced over ranks
    BATCH_END = "batch_end"                              # counters already advanced
    EPOCH_END = "epoch_end"
    EVAL_START = "eval_start"
    EVAL_END = "eval_end"                                # state.metrics has the new val_top1/5
    FIT_END = "fit_end"

    @property
    def closes(self) -> bool:
        """Events that end a span some earlier event opened: algorithms run on them in reverse
        order, so that two which both wrap a span (e.g. swap weights in at EVAL_START and
        back at EVAL_END) unwind like nested context managers."""
        return self in _CLOSING


_CLOSING = {Event.AFTER_LOSS, Event.AFTER_BACKWARD, Event.BATCH_END, Event.EPOCH_END, Event.EVAL_END,
            Event.FIT_END}


class Algorithm:
    """A speed-up method as a hook: `match` says when, `apply` says what.

    Algorithms with state (an EMA copy of the weights, a step counter) return it from
    `state_dict` as tensors and plain Python values, so checkpoints load with
    `weights_only=True`.
    """

    def match(self, event: Event, state) -> bool:
        raise NotImplementedError

    def apply(self, event: Event, state) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        settings = ", ".join(f"{key}={value!r}" for key, value in vars(self).items() if not key.startswith("_"))
        return f"{type(self).__name__}({settings})"
