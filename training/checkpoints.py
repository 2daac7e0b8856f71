"""Checkpoints on disk: written atomically, the newest K kept, the newest readable one found.

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

log = logging.getLogger("training")
_NAME = re.compile(r"^ep(\d+)-ba(\d+)\.pt$")


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
                log.warning("checkpoint %s does not load (%s: %s); trying the one before it",
                            path, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
        return None


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
