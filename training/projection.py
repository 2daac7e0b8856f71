"""A recipe's schedule as training walks it, and its time at given per-GPU rates: what
tools/project_time.py (from one GPU's end-to-end figures) and tools/instance_cost.py (from
model-, loader- and network-bound figures per instance) both project with, so that progressive
resizing and the scale schedule act in a projection exactly as in training.
"""
from __future__ import annotations

import math
import tempfile
from typing import Callable

from training.config import ConfigError, load_config
from training.run import build_run

IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000


def recipe_identity(config) -> dict:
    """What a measurement must share with the recipe projected."""
    return {"model": config.model.name, "algorithms": list(config.algorithms), "batch_size": config.data.batch_size}


def recipe_schedule(config_path: str, overrides: list[str], gpus: int, train_images: int, val_images: int) -> dict:
    """The recipe as the trainer runs it with `gpus` ranks: per-epoch sides and shares, evaluations.
    The run is built on the `synthetic` backend with the dataset's size split over the GPUs, so every
    effect on the schedule (scale_schedule's stretch, progressive resizing) is the trainer's own."""
    with tempfile.TemporaryDirectory(prefix="projection-") as run_dir:
        config = load_config(config_path, [*overrides, "data.backend=synthetic", "data.path=''", "device=cpu",
                                           "compile=false", "precision=fp32", "data.num_classes=1000", "data.num_workers=0",
                                           f"data.synthetic_size={train_images // gpus}", f"run_dir={run_dir}",
                                           "resume=never", "log.progress=false", "log.tensorboard=false"])
        if config.algorithms.get("progressive_resizing", {}).get("mode") == "batch":
            raise ConfigError("progressive_resizing in batch mode changes the side within an epoch: "
                              "project it with mode: loader, which costs the same for the model")
        trainer = build_run(config)
        config = trainer.config          # as the run settled it (the scale schedule's stretch)
        state = trainer.state
        epochs = state.total_steps / state.steps_per_epoch
        spec = state.train_loader.spec
        eval_every = config.eval_interval.to_batches(state.steps_per_epoch, state.total_steps)
    return {**recipe_identity(config), "epochs": epochs, "sides": [spec.resolution_at(e) for e in range(math.ceil(epochs))],
            "shares": [min(1.0, epochs - e) for e in range(math.ceil(epochs))],
            "evaluations": math.ceil(state.total_steps / eval_every) if eval_every else 1,
            "val_side": spec.val_resolution,
            "train_images": train_images, "val_images": val_images}


def seconds_per_image(side: int, rates: dict[int, float], how_to_measure: str = "") -> float:
    """1 / img/s at `side` from img/s measured at some sides, interpolated linearly in pixels
    between them (a CNN step's cost grows with the pixel count), extended beyond them along the
    nearest two points' line. One side alone answers only for itself."""
    if side in rates:
        return 1 / rates[side]
    if len(rates) < 2:
        raise ConfigError(f"the recipe needs side {side}, and only side {next(iter(rates))} is measured: "
                          "measure two or more sides" + (f" ({how_to_measure})" if how_to_measure else ""))
    sides = sorted(rates)
    upper = next((i for i, s in enumerate(sides) if s > side), len(sides) - 1)
    low, high = sides[max(0, upper - 1)], sides[max(1, upper)]
    slope = (1 / rates[high] - 1 / rates[low]) / (high ** 2 - low ** 2)
    return max(1 / rates[low] + slope * (side ** 2 - low ** 2), 1e-12)


def walk(schedule: dict, rate_at: Callable[[int], dict], gpus: int, scaling: float) -> list[dict]:
    """One row per side the recipe trains at, in order of side: its epochs, and its minutes at
    `rate_at(side)["img_per_s"]` per GPU (the dict's other keys are kept in the row), x GPUs x scaling."""
    per_side: dict[int, dict] = {}
    for side, share in zip(schedule["sides"], schedule["shares"]):
        row = per_side.get(side)
        if row is None:
            row = per_side[side] = {"side": side, "epochs": 0.0, **rate_at(side)}
        row["epochs"] += share
    for row in per_side.values():
        row["minutes"] = row["epochs"] * schedule["train_images"] / (gpus * row["img_per_s"] * scaling) / 60
    return sorted(per_side.values(), key=lambda row: row["side"])
