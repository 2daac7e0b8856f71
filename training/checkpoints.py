"""Checkpoints: what one holds (`snapshot`, `restore`), and on disk: written atomically, the
newest K kept, the newest readable one found (`CheckpointStore`).

A checkpoint is one file, `checkpoints/ep{epoch}-ba{step}.pt` (epoch and optimizer steps
when it was taken). It holds only tensors and plain Python values and is always loaded
with `weights_only=True`, so a checkpoint from elsewhere cannot run code. A file that
does not load (truncated by a crash, damaged on disk) is skipped with a warning in favour
of the one before it.
"""
from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Optional

import torch

from pipeline.atomic_files import write_bytes_atomic
from training.config import Config, ConfigError
from training.engine import Engine
from training.rng import set_rng_state
from training.state import State
from training.typed_config import to_plain

log = logging.getLogger("training")
_NAME = re.compile(r"^ep(\d+)-ba(\d+)\.pt$")
FORMAT = 1


def snapshot(state: State, engine: Engine, config: Config, rng_states: list, earlier: dict) -> dict:
    """Everything a run needs to go on at exactly this step, on as many ranks (`rng_states`: one per
    rank); `earlier`: what the trainer adds up over sessions (`wall_seconds`, `step_phases`)."""
    return {"format": FORMAT, "world_size": len(rng_states), "config": to_plain(config),
            "counters": state.counters() | earlier, "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict(), "algorithms": engine.state_dict(),
            "loader": state.train_loader.state_dict(), "rng": rng_states}


def restore(checkpoint: dict, path: Path, state: State, engine: Engine, config: Config, rank: int,
            world_size: int) -> tuple[dict, list[str]]:
    """Put this rank's run back at the checkpoint's step; what the sessions before added up (snapshot's
    `earlier`; `step_phases` absent in checkpoints from before it), and the config keys changed since.
    Mid-epoch, the loader's position needs the same number of ranks."""
    counters, saved_world = checkpoint["counters"], checkpoint["world_size"]
    if saved_world != world_size and counters["batch_in_epoch"]:
        raise ConfigError(f"checkpoint {path} was taken mid-epoch with {saved_world} processes; "
                          f"resume it with {saved_world}")
    state.model.load_state_dict(checkpoint["model"])
    state.optimizer.load_state_dict(checkpoint["optimizer"])
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    state.scaler.load_state_dict(checkpoint["scaler"])
    engine.load_state_dict(checkpoint["algorithms"])
    earlier = {key: counters.pop(key) for key in ("wall_seconds", "step_phases") if key in counters}
    counters.setdefault("evaluated_step", counters["step"])   # checkpoints from before the field
    state.load_counters(counters)
    if state.batch_in_epoch:
        state.train_loader.load_state_dict(checkpoint["loader"])
    set_rng_state(checkpoint["rng"][rank % saved_world])
    return earlier, changed_keys(checkpoint["config"], to_plain(config))


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
        torch.save(state, buffer)
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
    return torch.load(path, map_location="cpu", weights_only=True)


def _why_not_loaded(error: Exception) -> str:
    """Why a file did not load, in one line. torch's messages run to a dozen lines; for a file
    holding objects other than tensors and plain values, they advise `weights_only=False`,
    which would let the file run code: say what it holds instead."""
    text = str(error)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if text.startswith("Weights only load failed") and refused:
        return (f"it holds a {refused[1]} object, and checkpoints load weights-only: tensors and plain "
                "values, never code; not a checkpoint of ours")
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
