"""Where and what: the training loop's events, and the `Algorithm` base class that hooks them.

Before anything is built, the trainer settles the run: each algorithm in turn may stretch
the run's plan (`run_plan`: its length) and then change the loaders' settings (`loader_spec`:
a new LoaderSpec per split, e.g. a resolution ramp, ColOut, RandAugment, the eval
resolution); only then is each loader built, once. `settle_loader_specs` is that pass.
The loop (training/trainer.py) then fires the events below, in this order; an algorithm says in
`match(event, state)` whether it acts, and in `apply(event, state)` what it does, by
changing the loop's `State` (training/state.py: model, optimizer, loaders, the batch in
`images`/`targets`, `outputs`, `loss`, the counters). Each method in this package also
exists as a pure function that needs no loop at all.

Per optimizer step, with gradient accumulation, the events from BEFORE_FORWARD to
AFTER_BACKWARD fire once per micro-batch; `state.images`/`state.targets` then hold the
micro-batch.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

from algorithms.durations import Duration
from pipeline.spec import LoaderSpec


class Event(str, enum.Enum):
    INIT = "init"                                        # model and loaders built; no DDP, optimizer or
                                                         # total_steps yet: model surgery, config records
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


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What an algorithm may need to know of the run before any loader or model is built. The
    split a loader setting is for is its spec's (`spec.split`, `spec.train`)."""
    max_duration: Duration          # in ep or ba
    steps_per_epoch: int            # train batches per epoch on each rank (pipeline.batches_per_epoch)

    def __post_init__(self):
        if self.max_duration.unit == "dur" or self.steps_per_epoch < 1:
            raise ValueError(f"a run plan needs max_duration in ep or ba and steps_per_epoch >= 1, "
                             f"got {self.max_duration}, {self.steps_per_epoch}")

    @property
    def total_steps(self) -> int:
        return self.max_duration.to_batches(self.steps_per_epoch)

    @property
    def total_epochs(self) -> int:
        """Epochs the run starts, the last one perhaps partial."""
        return math.ceil(self.total_steps / self.steps_per_epoch)


class Algorithm:
    """A speed-up method as hooks: `run_plan` and `loader_spec` settle the run before anything is
    built; during the run, `match` says when and `apply` says what.

    Algorithms with state (an EMA copy of the weights, a step counter) return it from
    `state_dict` as tensors and plain Python values, so checkpoints load with
    `weights_only=True`.
    """

    def run_plan(self, plan: RunPlan) -> RunPlan:
        """The run as this algorithm leaves it (ScaleSchedule stretches it); the algorithms after
        it, and this one's `loader_spec`, see what it returns."""
        return plan

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        """The spec a loader is built from, with this algorithm's settings (a new spec, made with
        dataclasses.replace, which checks it); called once per split, in the recipe's order,
        before any loader exists."""
        return spec

    def match(self, event: Event, state) -> bool:
        return False        # an algorithm that only settles the run acts at no event

    def apply(self, event: Event, state) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        settings = ", ".join(f"{key}={value!r}" for key, value in vars(self).items() if not key.startswith("_"))
        return f"{type(self).__name__}({settings})"


def weights_copy(loaded: dict | None, model: dict, what: str) -> dict:
    """A copy of the model's tensors that an algorithm keeps (an average, a slow copy): `loaded`
    from a checkpoint (kept on the CPU by load_state_dict), its names checked against the model's
    and moved to their devices and dtypes; on a fresh run (None), the model's own, cloned."""
    if loaded is None:
        return {name: t.detach().clone() for name, t in model.items()}
    if set(loaded) != set(model):
        raise ValueError(f"{what} does not match the model's parameters and buffers")
    return {name: loaded[name].to(t.device, t.dtype) for name, t in model.items()}


def settle_loader_specs(algorithms: Sequence[Algorithm], specs: Sequence[LoaderSpec],
                        plan: RunPlan) -> tuple[list[LoaderSpec], RunPlan]:
    """The specs and the plan as the algorithms leave them, each in the recipe's order seeing what
    the ones before it made: its `run_plan` first, then its `loader_spec` for each spec. A setting
    a spec refuses (RandAugment in the ffcv backend) is a ValueError."""
    specs = list(specs)
    for algorithm in algorithms:
        plan = algorithm.run_plan(plan)
        specs = [algorithm.loader_spec(spec, plan) for spec in specs]
    return specs, plan
