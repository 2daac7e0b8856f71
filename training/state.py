"""The loop's state: what algorithms read and change when an event fires.

Counters follow one convention: `epoch` is the epoch in progress (or the next one, between
epochs), `batch_in_epoch` the optimizer steps already taken in it (the train loader's
position), `step` the optimizer steps taken since the start of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from training.config import Config
from training.distributed import World


@dataclass
class State:
    config: Config                         # at INIT algorithms may still change schedules and records
    world: World
    model: nn.Module                       # the bare model (algorithms change its modules at INIT)
    train_loader: Any                      # built once, from the specs the algorithms settled
    val_loader: Any
    num_classes: int
    steps_per_epoch: int                   # train batches per epoch on each rank
    algorithms: list = field(default_factory=list)
    autocast: Callable[[], Any] = None     # the run's autocast context (what the loop runs forward under)
    # made after INIT
    train_model: Optional[nn.Module] = None                     # DDP / torch.compile around `model`
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    scaler: Optional[torch.amp.GradScaler] = None
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    total_steps: int = 0
    # counters
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    samples_seen: int = 0                  # over all ranks
    train_seconds: float = 0.0             # time spent in training epochs, over all sessions
    evaluated_step: int = -1               # the step of the latest evaluation
    # the batch in flight (a micro-batch between BEFORE_FORWARD and AFTER_BACKWARD)
    images: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    outputs: Optional[torch.Tensor] = None
    loss: Optional[torch.Tensor] = None
    # results
    metrics: dict = field(default_factory=dict)      # the latest evaluation: val_top1, val_top5, val_loss
    best_val_top1: Optional[float] = None

    @property
    def epochs(self) -> int:
        return -(-self.total_steps // self.steps_per_epoch)

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def counters(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                "samples_seen": self.samples_seen, "train_seconds": self.train_seconds,
                "evaluated_step": self.evaluated_step,
                "best_val_top1": self.best_val_top1, "metrics": dict(self.metrics)}

    def load_counters(self, counters: dict) -> None:
        for key, value in counters.items():
            setattr(self, key, value)
