"""The training loop: builds a run from a Config, trains with DDP, AMP and channels-last,
fires the events (algorithms/base.py) at the points they name, evaluates, checkpoints and
resumes exactly. `Trainer(config, world, algorithms).fit()` returns the run's summary
(training/run.py builds one from a config alone); `train_step(images, targets)` is the one step
fit takes per batch, for code that drives steps itself (tools/measuring.py).

It stops every rank at the same step when asked (SIGTERM, SIGUSR1: a checkpoint of that step,
then `Preempted`) or when rank 0 cannot write the run directory (`RunFault`, earlier
checkpoints intact); training/stop_requests.py says how the ranks agree.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from algorithms.base import Event
from pipeline.storage.urls import redact
from training import distributed as dist
from training.precision import describe
from training.run_records import RunRecords
from training.run_setup import RunSetup

log = logging.getLogger("training")


class Trainer(RunSetup, RunRecords):
    """A run: built by RunSetup (training/run_setup.py), kept and resumed by RunRecords
    (training/run_records.py); `fit` trains it, `train_step` and `evaluate` are its parts."""

    def fit(self) -> dict:
        self.stops.install()
        try:
            return self._fit()
        finally:
            self.stops.uninstall()

    def _stretch(self) -> str:
        """Where the run's length differs from max_duration's: by how much, and what stretched it."""
        asked, settled = self.asked_duration, self.config.max_duration
        if asked == settled:
            return ""
        by = " by algorithms.scale_schedule" if "scale_schedule" in self.config.algorithms else ""
        return f"; max_duration {asked} stretched to {settled}{by}"

    def _fit(self) -> dict:
        state, config = self.state, self.config
        self._resume()                              # may refuse before anything is written
        self._prepare_run_dir()
        if self._resume_changes:
            self.log.metrics(self._resume_changes)
        if self._precision_choice:
            self.log.print(describe(self._precision_choice))
        source = config.data.backend + (f":{redact(config.data.path)}" if config.data.backend != "synthetic" else "")
        self.log.print(f"training {config.model.name} on {source}: {state.total_steps} steps "
                       f"({state.total_steps / state.steps_per_epoch:.4g} epochs of {state.steps_per_epoch}"
                       f"{self._stretch()}), {self.world.size} process(es) on {self.world.device}, global batch "
                       f"{config.data.batch_size * self.world.size}, peak lr "
                       f"{state.optimizer.param_groups[0]['initial_lr']:.4g}")
        if self.step_stream.stream is not None:
            self.log.print(f"train step on a CUDA stream of priority {self.step_stream.stream.priority} (the highest "
                           f"this GPU has; the default stream's is 0)")
        self.start()
        eval_every = config.eval_interval.to_batches(state.steps_per_epoch, state.total_steps)
        save_every = config.checkpoint.interval.to_batches(state.steps_per_epoch, state.total_steps)
        if state.step and state.evaluated_step != state.step and _due(state.step, eval_every):
            self.evaluate()                         # a stop on a signal came before this evaluation
        last_save = state.step if state.step else -1
        while not state.finished:
            if state.batch_in_epoch == 0:
                state.train_loader.set_epoch(state.epoch)
            self.engine.fire(Event.EPOCH_START, state)
            self._train_epoch(save_every)
            if state.batch_in_epoch == state.steps_per_epoch:
                self.engine.fire(Event.EPOCH_END, state)
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if self.stop:
                self._stop_now()
            if _due(state.step, eval_every) or state.finished:
                self.evaluate()
            if _due(state.step, save_every) or state.finished:
                self.save_checkpoint()
                last_save = state.step
        self.stops.drain()
        if state.evaluated_step != state.step:      # a resumed run that was already complete
            self.evaluate()
        if last_save != state.step:
            self.save_checkpoint()
        self.engine.fire(Event.FIT_END, state)
        skipped = torch.tensor([float(state.train_loader.corrupt_total), float(state.val_loader.corrupt_total)],
                               device=self.world.device)
        self._damaged_skipped = [int(n) for n in dist.all_reduce_sum(skipped, self.world).tolist()]
        return self._summary()

    def _train_epoch(self, save_every: int) -> None:
        state, world, config = self.state, self.world, self.config
        self.log.start_epoch(state.epoch, state.epochs, state.steps_per_epoch, state.batch_in_epoch)
        timer, phases = _Timer(), self.phases
        phases.start()
        interval_start, interval_samples, interval_steps, epoch_samples = time.perf_counter(), 0, 0, 0
        loss_sum = torch.zeros((), device=world.device)
        skipped_before = state.train_loader.corrupt_total      # damaged samples the loader skipped
        for images, targets in state.train_loader:
            phases.lap("data")
            loss_sum += self.train_step(images, targets)
            samples = targets.shape[0] * world.size
            interval_samples, interval_steps, epoch_samples = (interval_samples + samples, interval_steps + 1,
                                                               epoch_samples + samples)
            if state.step % config.log.interval == 0 or state.batch_in_epoch == state.steps_per_epoch:
                skipped = torch.tensor(float(state.train_loader.corrupt_total - skipped_before), device=world.device)
                loss, skipped = dist.all_reduce_sum(torch.stack([loss_sum, skipped]), world).tolist()
                loss /= world.size * interval_steps
                now = time.perf_counter()
                record = {"epoch": state.epoch, "step": state.step, "wall_s": round(self._wall_seconds(), 3),
                          "train_loss": round(loss, 5), "lr": state.lr,
                          "img_per_s": round(interval_samples / (now - interval_start), 1),
                          "resolution": list(state.images.shape[-2:]),   # as trained: after the batch's hooks
                          **({"damaged_samples_skipped": int(skipped)} if skipped else {})}   # this epoch, all ranks
                self.log.metrics(record)
                self.log.advance(0, loss=f"{loss:.3f}", img_s=f"{record['img_per_s']:.0f}", lr=f"{state.lr:.3g}",
                                 res="x".join(map(str, record["resolution"])))
                loss_sum.zero_()
                interval_start, interval_samples, interval_steps = now, 0, 0
            self.log.advance()
            if self.log.fault:
                self.stops.fault()
            self.stop = self.stops.agreed()
            phases.lap("other")
            if self.stop:
                break
            if _due(state.step, save_every) and not state.finished and state.batch_in_epoch < state.steps_per_epoch:
                with timer.paused():
                    self.save_checkpoint()
                phases.start()
            if state.finished:
                break
        phases.lap("data")                          # the loader's end of epoch (nothing after a break)
        self.log.end_epoch()
        seconds = timer.seconds()
        state.train_seconds += seconds
        if epoch_samples:
            self.log.print(f"epoch {state.epoch + 1}/{state.epochs}: {epoch_samples / seconds:,.0f} img/s, "
                           f"lr {state.lr:.4g}, resolution {state.train_loader.resolution}")

    def start(self) -> None:
        """Fire FIT_START, where algorithms such as EMA and SAM set themselves up: fit does it after
        resuming; code that drives `train_step` itself calls it once, before the first step."""
        self.engine.fire(Event.FIT_START, self.state)

    def train_step(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step on a batch from the train loader, as fit takes every one: AFTER_DATALOADER,
        the optimizer step, the counters, BATCH_END, on the step stream, its phases lapped (fit laps
        "data" before it). Returns the batch's mean loss, on the device (reading it waits for the
        step). The loop around it (epochs, metrics, checkpoints, evaluation) is fit's; the tools that
        time training steps (tools/measuring.py) call `start()` once, then this."""
        state, phases = self.state, self.phases
        dist.doing(f"training step {state.step + 1}")
        with self.step_stream.around(images, targets):
            state.images, state.targets = images, targets
            self.engine.fire(Event.AFTER_DATALOADER, state)
            phases.lap("hooks")
            loss = self.optimizer_step()
            state.step, state.batch_in_epoch = state.step + 1, state.train_loader.position
            state.samples_seen += targets.shape[0] * self.world.size
            phases.lap("other")
            self.engine.fire(Event.BATCH_END, state)
            phases.lap("hooks")
        return loss

    def optimizer_step(self) -> torch.Tensor:
        """One optimizer step over the batch in state, in `grad_accum` micro-batches; the batch's mean loss."""
        state, accum, phases = self.state, self.config.grad_accum, self.phases
        images, targets = state.images, state.targets
        state.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.world.device)
        for i, (micro_images, micro_targets) in enumerate(zip(images.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            with self.ddp.no_sync() if (self.ddp and not last) else contextlib.nullcontext():
                state.images, state.targets = micro_images, micro_targets
                self.engine.fire(Event.BEFORE_FORWARD, state)
                phases.lap("hooks")
                with self.autocast():
                    state.outputs = state.train_model(state.images)
                    phases.lap("forward")
                    self.engine.fire(Event.BEFORE_LOSS, state)
                    phases.lap("hooks")
                    state.loss = state.loss_fn(state.outputs, state.targets)
                phases.lap("loss")
                self.engine.fire(Event.AFTER_LOSS, state)
                phases.lap("hooks")
                state.scaler.scale(state.loss / accum).backward()      # DDP's all-reduce overlaps it
                phases.lap("backward")
                self.engine.fire(Event.AFTER_BACKWARD, state)
                total += state.loss.detach().float() / accum
                phases.lap("hooks")
        if state.scaler.is_enabled():
            state.scaler.unscale_(state.optimizer)     # algorithms see true gradients
        self.engine.fire(Event.BEFORE_OPTIMIZER_STEP, state)
        phases.lap("hooks")
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        phases.lap("optimizer")
        return total

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Top-1/top-5 over the whole val split: every sample counted once over all ranks."""
        state, world = self.state, self.world
        dist.doing(f"the evaluation after step {state.step}")
        self.engine.fire(Event.EVAL_START, state)
        state.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=world.device)   # top-1, top-5, loss, count
        state.val_loader.set_epoch(0)
        for images, targets in state.val_loader:
            with self.autocast():
                logits = state.model(images)
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices
            totals[:3] += torch.stack([(top[:, 0] == targets).sum(), (top == targets[:, None]).any(1).sum(),
                                       F.cross_entropy(logits.float(), targets, reduction="sum")]).double()
            totals[3] += targets.shape[0]
        correct1, correct5, loss, count = dist.all_reduce_sum(totals, world).tolist()
        state.model.train()
        state.metrics = {"val_top1": round(100 * correct1 / count, 3), "val_top5": round(100 * correct5 / count, 3),
                         "val_loss": round(loss / count, 5)}
        state.best_val_top1 = max(state.best_val_top1 or 0.0, state.metrics["val_top1"])
        state.evaluated_step = state.step
        self.engine.fire(Event.EVAL_END, state)
        self.log.metrics({"epoch": state.epoch - (state.batch_in_epoch == 0), "step": state.step,
                          "wall_s": round(self._wall_seconds(), 3), **state.metrics})
        self.log.print(f"  eval after {state.step} steps: top-1 {state.metrics['val_top1']:.2f}%, "
                       f"top-5 {state.metrics['val_top5']:.2f}%, loss {state.metrics['val_loss']:.4f}")
        return state.metrics


class _Timer:
    """Seconds since creation, less the spans spent inside `paused()` (checkpoint writes)."""

    def __init__(self):
        self._start, self._paused = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        yield
        self._paused += time.perf_counter() - start

    def seconds(self) -> float:
        return time.perf_counter() - self._start - self._paused


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
