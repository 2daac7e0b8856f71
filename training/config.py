"""The training config: every key a recipe may set, its type and default, in one place.

A run's config is a recipe YAML (which may name a `base:` recipe and hold only what it changes)
plus dotted command-line overrides (`optim.lr=0.2`), parsed and validated by
training/typed_config.py against the dataclasses below: an unknown key or a bad value is a
one-line `ConfigError` naming the key.
"""
from __future__ import annotations

import difflib

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import algorithms
from algorithms import check_algorithm_names
from pipeline import LoaderSpec
from pipeline.spec import IMAGENET_MEAN, IMAGENET_STD
from pipeline.storage.urls import redact
from algorithms.durations import Duration
from training.typed_config import ConfigError, apply_overrides, from_mapping, load_recipe, to_plain

Backend = Literal["ffcv", "dali", "webdataset", "folder", "synthetic", "auto"]   # auto: the fastest here
ModelName = Literal["resnet18", "resnet50", "small_resnet"]


@dataclass
class DataConfig:
    backend: Backend = "ffcv"
    path: str = ""                        # the converted dataset (ffcv, webdataset) or ImageNet-layout folder
    batch_size: int = 256                 # per rank, per optimizer step (when global_batch_size is unset)
    global_batch_size: Optional[int] = None   # per optimizer step over all ranks; default batch_size x world size
    val_batch_size: Optional[int] = None  # default: batch_size
    resolution: Union[int, dict[str, Any]] = 224   # an int or a schedule (pipeline/schedules.py)
    val_resolution: int = 224
    val_crop_ratio: float = 224 / 256     # val center crop's share of the shorter side (timm's crop_pct)
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    colout: Optional[tuple[float, float]] = None
    randaugment: Optional[tuple[int, int]] = None   # (depth, severity); webdataset, folder and dali
    num_workers: int = 2
    hw_decoder_load: float = 0.65         # dali on CUDA: the share of JPEGs for the hardware decoder (A100, H100)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    on_corrupt: Literal["skip", "raise"] = "skip"
    # on: each webdataset sample checked against its recorded CRC-32; full: also a local .beton, at open; off: none
    verify: Union[bool, Literal["full"]] = True
    num_classes: Optional[int] = None     # synthetic only
    synthetic_size: int = 10_000          # synthetic only
    measured_results: str = ""            # auto: the folder of per-machine loader figures ('': probe)
    cache_dir: str = ""                   # path is a URL: the node's cache ('': ~/.cache/fastpipe/datasets)
    cache_limit: Union[int, str] = "16GiB"   # bytes, or a size such as "500GiB"; past it, the least recently used blocks go
    fetch_size: Union[int, str] = "1MiB"    # the most one range request fetches: larger for a distant store
    fetch_timeout: float = 30.0             # seconds before a request that gets no answer is tried again

    def loader_spec(self, split: str, **placement) -> LoaderSpec:
        batch_size = self.batch_size if split == "train" else (self.val_batch_size or self.batch_size)
        return LoaderSpec(backend=self.backend, path=self.path or None, split=split, batch_size=batch_size,
                          resolution=self.resolution, val_resolution=self.val_resolution,
                          val_crop_ratio=self.val_crop_ratio, scale=self.scale,
                          ratio=self.ratio, colout=self.colout, randaugment=self.randaugment,
                          num_workers=self.num_workers, hw_decoder_load=self.hw_decoder_load, mean=self.mean,
                          std=self.std, on_corrupt=self.on_corrupt, verify=self.verify, num_classes=self.num_classes,
                          synthetic_size=self.synthetic_size,
                          measured_results=self.measured_results or None, cache_dir=self.cache_dir or None,
                          cache_limit=self.cache_limit, fetch_size=self.fetch_size,
                          fetch_timeout=self.fetch_timeout, **placement)


@dataclass
class ModelConfig:
    name: ModelName = "resnet50"
    zero_init_residual: bool = True       # each block starts as the identity
    bce_bias_init: bool = False           # logits start at -log(num_classes), for BCE
    width: int = 16                       # small_resnet only
    blocks_per_stage: int = 2             # small_resnet only


@dataclass
class OptimizerConfig:
    lr: float = 0.1                       # at a global batch of lr_reference_batch; scaled linearly
    lr_reference_batch: int = 256
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-5            # decoupled from the LR's size, follows its schedule
    decay_bn_and_bias: bool = False
    schedule: Literal["cosine", "linear", "step", "constant"] = "cosine"
    warmup: Duration = Duration(0, "ep")  # linear from 0 to the peak LR
    final_lr_fraction: float = 0.0        # cosine and linear end here, as a share of the peak
    milestones: list[Duration] = field(default_factory=list)   # step: multiply by gamma at each
    gamma: float = 0.1

    def __post_init__(self):
        if self.lr <= 0 or self.lr_reference_batch < 1 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError("need lr > 0, lr_reference_batch >= 1, 0 <= momentum < 1, weight_decay >= 0")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")


@dataclass
class LossConfig:
    kind: Literal["ce", "bce"] = "ce"
    label_smoothing: float = 0.0
    bce_reduction: Literal["sum_over_classes", "mean"] = "sum_over_classes"  # sum/batch size, or mean

    def __post_init__(self):
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass
class CheckpointConfig:
    interval: Duration = Duration(1, "ep")   # also saved at the end of the run
    keep: int = 3                            # the newest K are kept

    def __post_init__(self):
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")


@dataclass
class LogConfig:
    progress: bool = True                 # rank 0's progress bar
    interval: int = 20                    # optimizer steps between metrics lines (and loss syncs)
    tensorboard: bool = True              # when the tensorboard package is installed
    # Shares of the step time by phase in summary.json (training/step_phases.py): auto is on for
    # CPUs and off on CUDA, where true (YAML's on) synchronizes the device at every phase boundary.
    step_phases: Union[Literal["auto"], bool] = "auto"


@dataclass
class Config:
    run_dir: str = ""                     # default: runs/<recipe>-<date>-<time>
    seed: int = 0
    max_duration: Duration = Duration(16, "ep")
    eval_interval: Duration = Duration(1, "ep")
    # fp16 (with a GradScaler) needs CUDA; auto: bf16 on a GPU that has it, else fp16; on a CPU the
    # faster of fp32 and bf16, measured at start (training/precision.py)
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "bf16"
    channels_last: bool = True
    compile: bool = False                 # torch.compile the model
    step_stream: Literal["default", "high_priority"] = "default"   # CUDA: training/step_stream.py
    deterministic: bool = False           # torch.use_deterministic_algorithms, for exact reruns
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grad_accum: int = 1                   # micro-batches per optimizer step
    resume: str = "auto"                  # auto (newest valid checkpoint in run_dir), never, or a file
    # resume despite a changed global batch, backend or dataset (training/data_order.py): the epoch in
    # progress goes on from the same share of it, its samples no longer exactly those not yet seen
    resume_allow_changes: bool = False
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    algorithms: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> settings, in order

    def __post_init__(self):
        if self.max_duration.unit == "dur":
            raise ValueError("max_duration must be in ep or ba, not dur")
        if self.max_duration.value <= 0:
            raise ValueError("max_duration must be > 0")
        if self.grad_accum < 1 or self.data.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum must be >= 1 and divide data.batch_size ({self.data.batch_size}), "
                             f"got {self.grad_accum}")
        if self.data.global_batch_size is not None and self.data.global_batch_size < 1:
            raise ValueError(f"data.global_batch_size must be >= 1, got {self.data.global_batch_size}")
        check_algorithm_names(self.algorithms)
        try:
            self.data.loader_spec("train", device="cpu", rank=0, world_size=1)  # LoaderSpec's own checks
        except ValueError as error:
            raise ValueError(f"data: {error}") from None


RECIPES = Path(algorithms.__file__).resolve().parent / "recipes"     # shipped with the package


def recipe_file(recipe: str) -> Path:
    """A recipe's file: the path given, or a bare name (`fashion_baseline`, `.yaml` optional) of a
    recipe shipped in the package, for an install where the repository's files are not at hand."""
    path = Path(recipe)
    if path.is_file() or path.parent != Path("."):
        return path
    shipped = RECIPES / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file():
        return shipped
    names = sorted(found.stem for found in RECIPES.glob("*.yaml"))
    close = difflib.get_close_matches(shipped.stem, names, n=1)
    raise ConfigError(f"no recipe {recipe!r}: not a file here nor a shipped recipe"
                      f"{f'; did you mean {close[0]!r}?' if close else ';'} shipped recipes: {', '.join(names)}")


def load_config(recipe: Optional[str], overrides: list[str]) -> Config:
    """The recipe (a file, or the name of a shipped one; if any) with the overrides applied,
    validated; a ConfigError otherwise."""
    data = load_recipe(recipe_file(recipe)) if recipe else {}
    config = from_mapping(Config, apply_overrides(data, overrides))
    if not config.run_dir:
        config.run_dir = str(Path("runs") / (Path(recipe).stem if recipe else "run"))
    return config


__all__ = ["Config", "ConfigError", "load_config"]


def shareable(config: Config) -> dict:
    """The config as plain values with the credentials any URL in it carries replaced by `***`: what a
    run writes (config.yaml, every checkpoint), which travels to shared storage, colleagues and model
    hubs. A resume takes the credentials from its own command line and environment."""
    def scrub(value):
        if isinstance(value, dict):
            return {key: scrub(item) for key, item in value.items()}
        if isinstance(value, list):
            return [scrub(item) for item in value]
        return redact(value) if isinstance(value, str) else value
    return scrub(to_plain(config))


def shareable_overrides(overrides: list[str]) -> list[str]:
    """`key=value` overrides as a record may keep them: a URL value's credentials replaced by `***`."""
    return [f"{key}={redact(value)}" if sep else key for key, sep, value in (o.partition("=") for o in overrides)]
