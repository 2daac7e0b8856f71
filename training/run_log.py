"""What a run leaves behind and shows: the run directory's files, and rank 0's progress.

The run directory is an interface (tests and tools read it):
    config.yaml     the resolved config
    metrics.jsonl   one JSON object per line, each with `epoch` (0-based, the epoch the line
                    is about), `step` (optimizer steps so far) and `wall_s` (the run's seconds so
                    far, over resumed sessions, as summary.json's); training lines carry
                    `train_loss`, `lr`, `img_per_s`, `resolution` (as trained, after the
                    batch's hooks); evaluation lines `val_top1`,
                    `val_top5` (percent) and `val_loss` (tools/plot_run.py draws them)
    checkpoints/    see training/checkpoints.py
    summary.json    at the end: best_val_top1, last_val_top1, wall_s, train_img_per_s, epochs, ...
    tensorboard/    when the tensorboard package is installed
Only rank 0 writes or prints; on other ranks every method is a no-op.

A run directory that cannot be written at the start (no permission, a read-only or full file
system, a file in the way) fails `check_writable()`; a metrics line that cannot be written
later is kept in `fault`, the file cut back to its last whole line, and the trainer stops all
ranks after the step (training/stop_requests.py).
"""
from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import yaml
from pipeline.storage.atomic_files import check_writable, write_bytes_atomic
from pipeline.progress import Progress


class RunLog:
    def __init__(self, run_dir: Path, active: bool, progress: bool, tensorboard: bool):
        self.run_dir, self.active, self.show_progress = Path(run_dir), active, progress and active
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._bar = None
        self._tensorboard = None
        self.fault: str | None = None
        self._tensorboard_wanted = tensorboard and active

    def check_writable(self) -> None:
        """Create and remove a file in the run directory and in checkpoints/ (OSError if that
        fails); then start TensorBoard, now that the place is known good."""
        if not self.active:
            return
        for folder in (self.run_dir, self.run_dir / "checkpoints"):
            check_writable(folder)
        if self._tensorboard_wanted:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                pass

    def write_config(self, plain_config: dict) -> None:
        if self.active:
            text = yaml.safe_dump(plain_config, sort_keys=False)
            write_bytes_atomic(self.run_dir / "config.yaml", text.encode())
            self.print("config:\n  " + text.rstrip().replace("\n", "\n  "))

    def rewind(self, step: int) -> None:
        """Drop the metrics lines a resumed run will write again (those after `step`)."""
        if not (self.active and self.metrics_path.exists()):
            return
        kept = [line for line in self.metrics_path.read_text().splitlines(keepends=True)
                if line.strip() and _step_of(line) <= step]
        write_bytes_atomic(self.metrics_path, "".join(kept).encode())

    def metrics(self, record: dict) -> None:
        if not self.active or self.fault:
            return
        line, fd, whole = (json.dumps(record) + "\n").encode(), None, None
        try:
            fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            whole = os.lseek(fd, 0, os.SEEK_END)
            if os.write(fd, line) != len(line):              # a short write: the disk filled
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.metrics_path))
        except OSError as error:
            if whole is not None:
                os.ftruncate(fd, whole)          # no torn line that a reader could take for a record
            self.fault = cannot_write(error, self.metrics_path)
            return
        finally:
            if fd is not None:
                os.close(fd)
        if self._tensorboard:
            for key, value in record.items():
                if key not in ("epoch", "step", "wall_s") and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if self.show_progress:
            # No closing line: the trainer prints one per epoch (a bar on a terminal, lines in a file).
            self._bar = Progress(steps, f"epoch {epoch + 1}/{epochs}", unit="ba", initial=done, closing_line=False)

    def advance(self, steps: int = 1, **postfix) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(**postfix)
            self._bar.update(steps)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def print(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def write_summary(self, summary: dict) -> None:
        """summary.json marks a finished run; OSError when it cannot be written."""
        if self.active:
            if self._tensorboard:
                self._tensorboard.close()
            write_bytes_atomic(self.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def cannot_write(error: OSError, path) -> str:
    """One line for a write that failed: the path and the system's reason."""
    return f"cannot write {error.filename or path} ({error.strerror or error})"


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return sys.maxsize  # a torn last line from a killed run: dropped
