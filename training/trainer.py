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
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from algorithms import clashes
from algorithms.base import Event, RunPlan, settle_loader_specs
from pipeline import batches_per_epoch, build_loader, split_samples
from pipeline.storage.urls import redact
from training import distributed as dist
from training import checkpoints, data_order
from training.config import Config, ConfigError, shareable
from training.engine import Engine
from training.losses import build_loss
from training.models import build_model
from training.optim import build_optimizer, build_scheduler
from training.precision import autocast_for, describe, gpu_precision, probe_cpu_precision
from training.rng import rng_state, seed_everything
from training.run_log import RunLog, cannot_write
from training.state import State
from training.step_phases import StepPhases
from training.step_stream import StepStream
from training.stop_requests import Preempted, RunFault, StopRequests

log = logging.getLogger("training")


class Trainer:
    """A run, built by the steps `__init__` lists, in order, each from what the steps before it
    settled. The config given is left as it was: a step that settles a key (precision=auto's
    choice, each rank's share of the global batch, the run's length) puts a new Config in
    `self.config`, and the algorithms' records at INIT go into sections of the trainer's own."""

    def __init__(self, config: Config, world: dist.World, algorithms=()):
        self.config, self.world, algorithms = config, world, list(algorithms)
        self._find_checkpoint()
        self._settle_gpu_precision()
        self._validate_for_device()
        self._set_determinism()
        train_loader, val_loader = self._build_loaders(algorithms)
        model = self._build_model(train_loader.num_classes)
        self._fire_init(model, train_loader, val_loader, algorithms)
        self._settle_cpu_precision()
        self._wrap_for_training()
        self._build_optimizer()
        self._start_records()

    # --- building the run, step by step -----------------------------------------------------
    def _find_checkpoint(self) -> None:
        """(path, checkpoint) this run goes on from, or None: read once, first, because the global batch
        and precision=auto keep what it was trained with; _resume restores it and lets it go."""
        self.store = checkpoints.CheckpointStore(Path(self.config.run_dir) / "checkpoints", self.config.checkpoint.keep)
        self._resume_from = checkpoints.find(self.store, self.config.resume)

    def _settle_gpu_precision(self) -> None:
        """precision=auto on CUDA, before INIT, where algorithms check it (SAM refuses fp16); a CPU's
        is measured on the model after INIT. `_precision_choice`: what auto picked, and why."""
        auto_on_cuda = self.config.precision == "auto" and self.world.device.type == "cuda"
        self._precision_choice = gpu_precision() if auto_on_cuda else None
        self._damaged_skipped = [0, 0]          # (train, val) over all ranks, at the end of fit
        if auto_on_cuda:
            self.config = dataclasses.replace(self.config, precision=self._precision_choice["precision"])

    def _validate_for_device(self) -> None:
        """Settings this device cannot run are config errors before anything is built."""
        config, device = self.config, self.world.device
        if config.precision == "fp16" and device.type != "cuda":
            raise ConfigError("precision=fp16 needs CUDA (it needs a GradScaler and CPUs lack fast fp16); use bf16")
        try:
            self.step_stream = StepStream(device, config.step_stream)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _set_determinism(self) -> None:
        deterministic = self.config.deterministic
        if deterministic and self.world.device.type == "cuda":
            # cuBLAS is deterministic only with a fixed workspace, read when its handle is made; without
            # it torch's deterministic mode raises at the first matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if deterministic or torch.are_deterministic_algorithms_enabled():
            # only where it changes something: the call imports torch._inductor, seconds of every rank's start
            torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = not deterministic

    def _build_loaders(self, algorithms: list) -> tuple:
        """The train and val loaders, each built once, from its final spec: all that shapes them is settled first."""
        global_batch = self._settle_global_batch()
        (train_spec, val_spec), steps_per_epoch = self._settle_loader_specs(algorithms)
        train_loader, val_loader = build_loader(train_spec), build_loader(val_spec)
        if len(train_loader) != steps_per_epoch:      # the plan's schedules, and every rank's step count, rest on it
            raise ConfigError(f"the {train_spec.backend} loader gives {len(train_loader)} batches an epoch where "
                              f"{steps_per_epoch} were planned: an algorithm changed the batch size or split")
        self.data_order = data_order.record(global_batch, train_loader.spec.backend, split_samples(train_spec),
                                            train_loader.num_classes)
        return train_loader, val_loader

    def _settle_global_batch(self) -> dict:
        """The global batch is the run's for life: at another world size each rank takes another share."""
        checkpoint = self._resume_from and self._resume_from[1]
        self.config, global_batch = data_order.settle_global_batch(self.config, self.world.size, checkpoint)
        return global_batch

    def _settle_loader_specs(self, algorithms: list) -> tuple[list, int]:
        """The loaders' specs and the run's length (ScaleSchedule stretches it) as the algorithms settle
        them, and the train steps an epoch; a setting a loader cannot take (e.g. RandAugment in FFCV)
        is a config error, reported as one."""
        config, world = self.config, self.world
        placement = dict(device=str(world.device), rank=world.rank, world_size=world.size, seed=config.seed)
        specs = [config.data.loader_spec(split, **placement) for split in ("train", "val")]
        steps_per_epoch = batches_per_epoch(specs[0])
        if steps_per_epoch == 0:
            raise ConfigError(f"a global batch of {config.data.global_batch_size} samples ({world.size} ranks x "
                              f"data.batch_size={config.data.batch_size}) is more than the train split holds: "
                              f"no full batch per epoch")
        try:
            specs, plan = settle_loader_specs(algorithms, specs, RunPlan(config.max_duration, steps_per_epoch))
        except ValueError as error:
            raise ConfigError(f"config key 'algorithms': {error}") from None
        self.config = dataclasses.replace(config, max_duration=plan.max_duration)
        return specs, steps_per_epoch

    def _build_model(self, num_classes: int) -> torch.nn.Module:
        """The model, with the same initial weights on every rank; each rank's own random streams after."""
        config = self.config
        torch.manual_seed(config.seed)
        model = build_model(config.model.name, num_classes, zero_init_residual=config.model.zero_init_residual,
                            bce_bias_init=config.model.bce_bias_init, **_small_resnet_options(config))
        model = model.to(self.world.device,
                         memory_format=torch.channels_last if config.channels_last else torch.contiguous_format)
        seed_everything(config.seed, self.world.rank)
        return model

    def _fire_init(self, model: torch.nn.Module, train_loader, val_loader, algorithms: list) -> None:
        """The loop's state, and INIT fired on it: model surgery and the config's records of the settled
        run (scaled schedules, the eval resolution) come before anything holds on to the model's
        parameters. A setting the model cannot take is a config error, reported as one."""
        self.config = config = _with_own_sections(self.config)
        self.autocast = autocast_for(self.world.device, config.precision)
        self.state = State(config=config, world=self.world, model=model, train_loader=train_loader,
                           val_loader=val_loader, num_classes=train_loader.num_classes,
                           steps_per_epoch=len(train_loader), algorithms=algorithms, autocast=self.autocast)
        self.engine = Engine(algorithms)
        for warning in clashes(config.algorithms, config.loss.label_smoothing) if self.world.is_main else ():
            log.warning("algorithms clash: %s", warning)
        try:
            self.engine.fire(Event.INIT, self.state)
        except ValueError as error:
            raise ConfigError(f"config key 'algorithms': {error}") from None

    def _settle_cpu_precision(self) -> None:
        """precision=auto on a CPU: the precision of the checkpoint this run resumes from, else the
        faster of fp32 and bf16 as rank 0 measured it on the model as INIT left it (every rank measures,
        sharing the cores as in training) at the loader's first batch and image size."""
        state, found = self.state, self._resume_from
        if self.config.precision != "auto":       # chosen by now on CUDA
            return
        saved = found[1]["config"]["precision"] if found else None
        if saved in ("fp32", "bf16"):     # not fp16 from a GPU: that run's numerics cannot go on here
            self._precision_choice = {"precision": saved, "why": f"as trained before, by checkpoint {found[0].name}"}
        else:
            choice = probe_cpu_precision(state.model, self.config.data.batch_size, state.train_loader.resolution,
                                         state.num_classes, self.config.channels_last)
            self._precision_choice = dist.broadcast_from_main(choice, self.world)
        self.config = state.config = dataclasses.replace(self.config, precision=self._precision_choice["precision"])
        self.autocast = state.autocast = autocast_for(self.world.device, self.config.precision)

    def _wrap_for_training(self) -> None:
        """What the loop trains through: DDP around the model across ranks, torch.compile around that."""
        state, device = self.state, self.world.device
        self.ddp = DistributedDataParallel(state.model, device_ids=[device.index] if device.type == "cuda" else None) \
            if self.world.distributed else None
        state.train_model = self.ddp or state.model
        if self.config.compile:
            state.train_model = torch.compile(state.train_model)

    def _build_optimizer(self) -> None:
        """The optimizer, LR schedule, grad scaler and loss, from the config as INIT left it."""
        state, config, world = self.state, self.config, self.world
        state.total_steps = config.max_duration.to_batches(state.steps_per_epoch)
        state.optimizer = build_optimizer(state.model, config.optim, config.data.batch_size * world.size)
        state.scheduler = build_scheduler(state.optimizer, config.optim, state.steps_per_epoch, state.total_steps)
        state.scaler = torch.amp.GradScaler(world.device.type, enabled=config.precision == "fp16")
        state.loss_fn = build_loss(config.loss)

    def _start_records(self) -> None:
        """The run's log, stop requests, step phases and wall clock."""
        config, on_cuda = self.config, self.world.device.type == "cuda"
        self.log = RunLog(Path(config.run_dir), self.world.is_main, config.log.progress, config.log.tensorboard)
        self.stops, self.stop = StopRequests(self.world), None
        self._resume_changes: dict | None = None     # for metrics.jsonl, once the run directory is ready
        self._wall_before = 0.0               # wall time of earlier sessions of this run
        self.phases = StepPhases(config.log.step_phases is True or (config.log.step_phases == "auto" and not on_cuda),
                                 sync=torch.cuda.synchronize if on_cuda else None)
        self._session_start = time.perf_counter()

    # --- the run --------------------------------------------------------------------------
    def fit(self) -> dict:
        self.stops.install()
        try:
            return self._fit()
        finally:
            self.stops.uninstall()

    def _fit(self) -> dict:
        state, config = self.state, self.config
        self._resume()                              # may refuse before anything is written
        self._prepare_run_dir()
        if self._resume_changes:
            self.log.metrics(self._resume_changes)
        if self._precision_choice:
            self.log.print(describe(self._precision_choice))
        source = config.data.backend + (f":{redact(config.data.path)}" if config.data.backend != "synthetic" else "")
        self.log.print(f"training {config.model.name} on {source}: "
                       f"{state.epochs} epochs of {state.steps_per_epoch} steps, {self.world.size} process(es) "
                       f"on {self.world.device}, global batch {config.data.batch_size * self.world.size}, "
                       f"peak lr {state.optimizer.param_groups[0]['initial_lr']:.4g}")
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

    # --- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """All ranks call this: their RNG states are gathered; rank 0 writes the file and tells
        the others whether it could (RunFault on every rank if not). Rank 0 gets the path."""
        state, path, problem = self.state, None, None
        dist.doing(f"the checkpoint of step {state.step}")
        rng_states = dist.gather_to_main(rng_state(), self.world)
        if self.world.is_main:
            checkpoint = checkpoints.snapshot(state, self.engine, self.config, rng_states,
                                              {"wall_seconds": self._wall_seconds(),
                                               "step_phases": self.phases.state_dict()}, self.data_order)
            try:
                path = self.store.save(checkpoint, state.epoch, state.step)
            except OSError as error:
                error.filename = None                 # name the checkpoint, not its temporary file
                problem = (f"{cannot_write(error, self.store.path(state.epoch, state.step))}; "
                           f"the checkpoints before it are intact")
        problem = dist.broadcast_from_main(problem, self.world)   # the barrier: no rank runs ahead of the file
        if problem:
            raise RunFault(problem if self.world.is_main else "")
        return path

    def _stop_now(self) -> None:
        """Every rank, after the step at which they agreed to stop: a fault ends the run there; a
        signal gets a checkpoint of exactly this step first (no evaluation: the grace time
        before SIGKILL is short; a resumed run evaluates first if this step was due one)."""
        self.stops.drain()
        if self.stop.fault:
            raise RunFault(self.log.fault or "")
        path = self.save_checkpoint()
        self.log.print(f"stopped by {self.stop.signal.name} after step {self.state.step}: checkpoint {path} "
                       f"written; resume=auto continues the run")
        raise Preempted(self.stop.exit_code)

    def _prepare_run_dir(self) -> None:
        """Rank 0 checks that the run directory can be written, drops the metrics lines a resumed
        run writes again and saves the config; a place that cannot be written is a ConfigError
        on every rank (rank 0 says why)."""
        problem = None
        if self.world.is_main:
            try:
                self.log.check_writable()
                self.log.rewind(self.state.step)
                self.log.write_config(shareable(self.config))
            except OSError as error:
                problem = f"run_dir {self.config.run_dir}: {cannot_write(error, self.config.run_dir)}"
        problem = dist.broadcast_from_main(problem, self.world)
        if problem:
            raise ConfigError(problem)

    def _resume(self) -> None:
        resume = self.config.resume
        if resume == "never":
            if self.store.checkpoints():
                raise ConfigError(f"run_dir {self.config.run_dir} already has checkpoints; resume=auto continues "
                                  f"that run, or pick another run_dir")
            return
        found, self._resume_from = self._resume_from, None    # not kept in memory after this
        if found is None:
            return
        path, checkpoint = found
        state = self.state
        earlier, changed, order_changes = checkpoints.restore(checkpoint, path, state, self.engine, self.config,
                                                              self.world.rank, self.data_order)
        self._wall_before = earlier["wall_seconds"]
        if "step_phases" in earlier:
            self.phases.load_state_dict(earlier["step_phases"])
        saved_world = checkpoint["world_size"]
        self.log.print(f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}"
                       + (f", on {_processes(self.world.size)} where it had {saved_world}: {self.config.data.batch_size} "
                          f"samples each of the global batch of {self.config.data.global_batch_size}"
                          if saved_world != self.world.size else "")
                       + (f" (config keys changed since: {', '.join(changed)})" if changed else ""))
        if order_changes:
            if self.world.is_main:
                log.warning("resumed with %s (resume_allow_changes=true): epoch %d goes on from step %d of %d with "
                            "samples drawn afresh, not exactly those it had left", "; ".join(order_changes),
                            state.epoch + 1, state.batch_in_epoch, state.steps_per_epoch)
            self._resume_changes = {"epoch": state.epoch, "step": state.step, "resume_changes": order_changes}

    def _wall_seconds(self) -> float:
        return self._wall_before + time.perf_counter() - self._session_start

    def _summary(self) -> dict:
        state = self.state
        summary = {"best_val_top1": state.best_val_top1, "last_val_top1": state.metrics.get("val_top1"),
                   "last_val_top5": state.metrics.get("val_top5"), "wall_s": round(self._wall_seconds(), 2),
                   "train_img_per_s": round(state.samples_seen / max(state.train_seconds, 1e-9), 1),
                   "epochs": round(state.step / state.steps_per_epoch, 3), "steps": state.step,
                   "world_size": self.world.size, "device": str(self.world.device), "precision": self.config.precision,
                   **({"precision_auto": self._precision_choice} if self._precision_choice else {}),
                   "step_phases": self.phases.shares(),
                   # damaged samples skipped since this start of the run (train, val), over all ranks
                   "damaged_samples_skipped": dict(zip(("train", "val"), self._damaged_skipped))}
        if self.log.fault:
            raise RunFault(self.log.fault)
        try:
            self.log.write_summary(summary)
        except OSError as error:
            raise RunFault(cannot_write(error, self.config.run_dir)) from None
        self.log.print(f"done: top-1 {summary['last_val_top1']:.2f}% (best {summary['best_val_top1']:.2f}%), "
                       f"{summary['epochs']:g} epochs in {summary['wall_s']:.1f} s, "
                       f"{summary['train_img_per_s']:,.0f} train img/s, run dir {self.config.run_dir}")
        return summary


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


def _processes(count: int) -> str:
    return f"{count} process" + ("es" if count != 1 else "")


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _with_own_sections(config: Config) -> Config:
    """`config` with copies of its sections (data, optim, loss, ...), which algorithms change at INIT
    by assigning their keys: the sections of the config the trainer was given stay as they were."""
    return dataclasses.replace(config, **{field.name: dataclasses.replace(getattr(config, field.name))
                                          for field in dataclasses.fields(config)
                                          if dataclasses.is_dataclass(getattr(config, field.name))})


def _small_resnet_options(config: Config) -> dict:
    if config.model.name != "small_resnet":
        return {}
    return {"width": config.model.width, "blocks_per_stage": config.model.blocks_per_stage}
