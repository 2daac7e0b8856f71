"""`training/main.py` with one observer added: each rank appends the labels of every batch it
trains on to RUN_DIR/labels-rank<r>.jsonl, with the epoch, the step in the epoch and the world
size. On a set whose every sample is its own class, the labels are the sample ids, so a test
can check which samples made up each global step of a real torchrun run, stopped and resumed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from algorithms.base import Algorithm, Event  # noqa: E402
from training import main as entry  # noqa: E402
from training import run  # noqa: E402


class LabelsOfEachStep(Algorithm):
    def match(self, event, state) -> bool:
        return event == Event.AFTER_DATALOADER

    def apply(self, event, state) -> None:
        path = Path(state.config.run_dir) / f"labels-rank{state.world.rank}.jsonl"
        line = {"epoch": state.epoch, "batch": state.batch_in_epoch, "world_size": state.world.size,
                "labels": state.targets.tolist()}
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")


def with_observer(settings: dict) -> list[Algorithm]:
    return [*configured(settings), LabelsOfEachStep()]


configured, run.algorithms_from_config = run.algorithms_from_config, with_observer

if __name__ == "__main__":
    code = entry.main()
    if code == 0:
        entry.exit_after_success()
    sys.exit(code)
