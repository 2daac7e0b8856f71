"""How a run is built from its config, step by step, each step from what the steps before it
settled (`RunSetup.__init__` lists them, in order): the checkpoint it resumes from, precision, the
loaders from their settled specs, the model (the same on every rank), INIT fired on the loop's state,
DDP and compile, the optimizer and schedule, the run's log. The Trainer (training/trainer.py) is one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from algorithms import clashes
from algorithms.base import Event, RunPlan, settle_loader_specs
from pipeline import batches_per_epoch, build_loader, split_samples
from training import distributed as dist
from training import checkpoints, data_order
from training.config import Config, ConfigError
from training.engine import Engine
from training.losses import build_loss
from training.models import build_model
from training.optim import build_optimizer, build_scheduler
from training.precision import autocast_for, gpu_precision, probe_cpu_precision
from training.rng import seed_everything
from training.run_log import RunLog
from training.state import State
from training.step_phases import StepPhases
from training.step_stream import StepStream
from training.stop_requests import StopRequests

log = logging.getLogger("training")


class RunSetup:
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
            # only where it changes something: the call also imports torch._inductor, at every rank's start
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
        placement = dict(device=str(world.device), rank=world.rank, world_size=world.size, local_rank=world.local_rank,
                         seed=config.seed)
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
        self.asked_duration = config.max_duration      # before an algorithm stretched it, for the header
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
        self._wall_before = 0.0               # wall time of this run's earlier starts (resumed)
        self.phases = StepPhases(config.log.step_phases is True or (config.log.step_phases == "auto" and not on_cuda),
                                 sync=torch.cuda.synchronize if on_cuda else None)
        self._started_at = time.perf_counter()


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
