"""What a run's order of samples rests on, and whether a checkpoint's order can go on here.

The loaders make each global step of an epoch from the same samples at any world size, for a
fixed global batch (`pipeline/loader/sharding.py`). So a run keeps its global batch for life: set by
`data.global_batch_size`, else `data.batch_size` x the world size of the run's first start,
and a run resumed on another number of processes takes global_batch / world_size samples per
process. A checkpoint records what its order rests on (`record`): the global batch, the
backend and the train split's size and classes; `changes` names what differs at a resume,
which the trainer refuses unless `resume_allow_changes` is set.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from training.config import Config, ConfigError


def settle_global_batch(config: Config, world_size: int, checkpoint: Optional[dict]) -> tuple[Config, dict]:
    """A copy of `config` whose `data.batch_size` is this process's share of the run's global batch
    and `data.global_batch_size` that batch, and the record of the global batch and of the
    `data.batch_size` it was asked by (what a later resume compares with). A resumed run keeps
    its checkpoint's unless the config asks for another: an explicit `data.global_batch_size`,
    or a `data.batch_size` other than the one the run started with."""
    data = config.data
    saved = checkpoint and saved_order(checkpoint)
    if data.global_batch_size:
        size = data.global_batch_size
    elif saved and data.batch_size == saved["requested_batch_size"]:
        size = saved["global_batch_size"]
    else:
        size = data.batch_size * world_size
    if size % world_size or (size // world_size) % config.grad_accum:
        raise ConfigError(f"the global batch of {size} samples does not divide among {world_size} processes"
                          + (f" into {config.grad_accum} micro-batches each" if config.grad_accum > 1 else "")
                          + ": run on a number of processes that divides it, or set data.global_batch_size")
    requested = saved["requested_batch_size"] if saved and size == saved["global_batch_size"] else data.batch_size
    settled = replace(config, data=replace(data, batch_size=size // world_size, global_batch_size=size))
    return settled, {"global_batch_size": size, "requested_batch_size": requested}


def record(global_batch: dict, backend: str, train_samples: int, classes: int) -> dict:
    """What this run's order of samples rests on, for its checkpoints (`global_batch`: what
    `settle_global_batch` gave)."""
    return {**global_batch, "backend": backend, "train_samples": train_samples, "classes": classes}


def saved_order(checkpoint: dict) -> dict:
    """A checkpoint's `record`; for one written before it was kept, what its config and world size say."""
    if "data_order" in checkpoint:
        return checkpoint["data_order"]
    data = checkpoint["config"]["data"]
    return {"global_batch_size": data["batch_size"] * checkpoint["world_size"], "requested_batch_size": data["batch_size"],
            "backend": data["backend"], "train_samples": None, "classes": None}


def changes(saved: dict, now: dict) -> list[str]:
    """What differs between a checkpoint's order and this run's, one phrase each."""
    found = []
    if saved["global_batch_size"] != now["global_batch_size"]:
        found.append(f"global batch {saved['global_batch_size']} -> {now['global_batch_size']}")
    if saved["backend"] != now["backend"]:
        found.append(f"backend {saved['backend']} -> {now['backend']}")
    if saved["train_samples"] is not None and (saved["train_samples"], saved["classes"]) != \
            (now["train_samples"], now["classes"]):
        found.append(f"dataset of {saved['train_samples']} train samples in {saved['classes']} classes -> "
                     f"{now['train_samples']} in {now['classes']}")
    return found
