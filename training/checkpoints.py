"""Checkpoints: what one holds (`snapshot`, `restore`), and on disk: written atomically, the
newest K kept, the newest readable one found (`CheckpointStore`).

A checkpoint is one file, `checkpoints/ep{epoch}-ba{step}.pt` (epoch and optimizer steps
when it was taken). It holds only tensors and plain Python values and is always loaded
with `weights_only=True`, so a checkpoint from elsewhere cannot run code. It records the
sha256 of its own contents (every tensor's bytes, every value), checked when it is loaded:
a file that does not load (truncated by a crash) or whose bytes changed since it was
written (a bad sector, a flipped bit in a copy) is skipped with a warning in favour of the
one before it, instead of training on from damaged weights.
"""
from __future__ import annotations

import hashlib
import io
import logging
import re
from pathlib import Path
from typing import Optional

import torch

from pipeline.storage.atomic_files import write_bytes_atomic
from training import data_order
from training.config import Config, ConfigError, shareable
from training.engine import Engine
from training.rng import set_rng_state
from training.state import State

log = logging.getLogger("training")
_NAME = re.compile(r"^ep(\d+)-ba(\d+)\.pt$")
FORMAT = 1
CHECKSUM = "sha256"


class DamagedCheckpoint(ValueError):
    """A checkpoint that loads but whose contents are not those it was written with."""


def content_digest(state) -> str:
    """sha256 over a checkpoint's contents in order: keys, every tensor's dtype, shape and bytes, and
    every other value; independent of how torch lays the file out."""
    digest = hashlib.sha256()

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            digest.update(f"D{len(value)}".encode())
            for key, item in value.items():
                feed(key)
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(f"V{type(value).__name__}:{value!r};".encode())
    feed(state)
    return digest.hexdigest()


def snapshot(state: State, engine: Engine, config: Config, rng_states: list, earlier: dict, data_order: dict) -> dict:
    """Everything a run needs to go on at exactly this step, on any number of ranks (`rng_states`: one
    per rank); `earlier`: what the trainer adds up over sessions (`wall_seconds`, `step_phases`);
    `data_order`: what the order of samples rests on (training/data_order.py)."""
    return {"format": FORMAT, "world_size": len(rng_states), "config": shareable(config), "data_order": data_order,
            "counters": state.counters() | earlier, "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict(), "algorithms": engine.state_dict(),
            "loader": state.train_loader.state_dict(), "rng": rng_states}


def restore(checkpoint: dict, path: Path, state: State, engine: Engine, config: Config, rank: int,
            data_order_now: dict) -> tuple[dict, list[str], list[str]]:
    """Put this rank's run back at the checkpoint's step, at any world size; what the sessions before
    added up (snapshot's `earlier`), the config keys changed since, and what changed in the order of
    samples (`data_order.changes`: refused unless `config.resume_allow_changes`, and then the epoch
    in progress goes on from the same share of it, drawn afresh)."""
    counters, saved_world = checkpoint["counters"], checkpoint["world_size"]
    order_changes = data_order.changes(data_order.saved_order(checkpoint), data_order_now)
    if order_changes and not config.resume_allow_changes:
        raise ConfigError(f"checkpoint {path}: {'; '.join(order_changes)} since it was taken, so the run cannot "
                          f"go on with the samples it had left; resume_allow_changes=true goes on anyway")
    state.model.load_state_dict(checkpoint["model"])
    state.optimizer.load_state_dict(checkpoint["optimizer"])
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    state.scaler.load_state_dict(checkpoint["scaler"])
    engine.load_state_dict(checkpoint["algorithms"])
    earlier = {key: counters.pop(key) for key in ("wall_seconds", "step_phases") if key in counters}
    counters.setdefault("evaluated_step", counters["step"])   # checkpoints from before the field
    state.load_counters(counters)
    if order_changes:
        _same_share_of_epoch(state, checkpoint["counters"]["batch_in_epoch"], checkpoint)
    if state.batch_in_epoch:
        state.train_loader.load_state_dict({**checkpoint["loader"], "backend": state.train_loader.spec.backend,
                                            "position": state.batch_in_epoch})
    set_rng_state(checkpoint["rng"][rank % saved_world])
    changed = changed_keys(checkpoint["config"], shareable(config))
    if not order_changes:       # the same global batch, another share of it per rank: what the resume line says
        changed = [key for key in changed if key not in ("data.batch_size", "data.global_batch_size")]
    return earlier, changed, order_changes


def _same_share_of_epoch(state: State, saved_batch_in_epoch: int, checkpoint: dict) -> None:
    """After a change of the order of samples, the counters in this run's steps: the epoch in
    progress resumes at the same share of its samples, and the LR schedule at the same point."""
    saved = data_order.saved_order(checkpoint)
    done = saved_batch_in_epoch * saved["global_batch_size"]
    batch_in_epoch = min(done // (state.train_loader.spec.batch_size * state.world.size), state.steps_per_epoch)
    step = state.epoch * state.steps_per_epoch + batch_in_epoch
    if state.evaluated_step == state.step:
        state.evaluated_step = step
    state.batch_in_epoch, state.step = batch_in_epoch, step
    scheduler = state.scheduler              # a LambdaLR (training/optim.py), set to that point of this run's schedule
    scheduler.last_epoch = step
    scheduler._last_lr = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(state.optimizer.param_groups, scheduler._last_lr):
        group["lr"] = lr


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted config keys whose values differ (where the run is kept, and resume itself, aside)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b and key not in ("resume", "run_dir"):
            keys.append(prefix + key)
    return keys


def find(store: "CheckpointStore", resume: str) -> Optional[tuple[Path, dict]]:
    """(path, checkpoint) that resume= names (auto: the newest that loads in `store`), or None
    (never, or auto in a new run)."""
    if resume == "never":
        return None
    if resume == "auto":
        return store.load_newest()
    try:
        return Path(resume), load(Path(resume))
    except Exception as error:      # torch raises many kinds for damaged files
        raise ConfigError(f"resume={resume}: cannot load it ({_why_not_loaded(error)})") from None


class CheckpointStore:
    def __init__(self, directory: Path, keep: int):
        self.directory, self.keep = Path(directory), keep

    def checkpoints(self) -> list[Path]:
        """Finished checkpoints, oldest first (by optimizer step)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m[2]), path) for path in self.directory.iterdir() if (m := _NAME.match(path.name))]
        return [path for _, path in sorted(found)]

    def path(self, epoch: int, step: int) -> Path:
        return self.directory / f"ep{epoch}-ba{step}.pt"

    def save(self, state: dict, epoch: int, step: int) -> Path:
        """Write `state` (temporary file, fsync, rename, fsync the folder), then drop all but the newest K."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(epoch, step)
        buffer = io.BytesIO()
        torch.save({**state, CHECKSUM: content_digest(state)}, buffer)
        write_bytes_atomic(path, buffer.getbuffer())
        for old in self.checkpoints()[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def load_newest(self) -> Optional[tuple[Path, dict]]:
        """The newest checkpoint that loads, or None when there is none."""
        for path in reversed(self.checkpoints()):
            try:
                return path, load(path)
            except Exception as error:  # torch raises many kinds for damaged files
                log.warning("checkpoint %s does not load (%s); trying the one before it", path, _why_not_loaded(error))
        return None


def load(path: Path) -> dict:
    """The checkpoint at `path`, checked against the checksum it records (one written before
    checkpoints recorded it is taken as it is); DamagedCheckpoint when they differ."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    recorded = checkpoint.pop(CHECKSUM, None) if isinstance(checkpoint, dict) else None
    if recorded is not None and recorded != content_digest(checkpoint):
        raise DamagedCheckpoint("its contents fail the sha256 it records: its bytes changed since it was written")
    return checkpoint


def _why_not_loaded(error: Exception) -> str:
    """Why a file did not load, in one line. torch's messages run to a dozen lines; for a file
    holding objects other than tensors and plain values, they advise `weights_only=False`,
    which would let the file run code: say what it holds instead."""
    text = str(error)
    if isinstance(error, DamagedCheckpoint):
        return text
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if text.startswith("Weights only load failed") and refused:
        return (f"it holds a {refused[1]} object, and checkpoints load weights-only: tensors and plain "
                "values, never code; not a checkpoint of ours")
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
