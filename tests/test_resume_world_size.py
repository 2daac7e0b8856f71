"""Real torchrun runs stopped mid-epoch and resumed on another number of processes: every global
step trains on the samples an uninterrupted run's would, each sample of an epoch once. On the
own-class set (tests/test_global_order.py), labels are sample ids; tests/recorded_run.py writes
the labels each rank trained on."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from runs import RECIPE, ROOT, TORCHRUN, main_here, main_in_process, read_jsonl, tiny_run
from test_global_order import GLOBAL_BATCH, global_steps, own_class_sets  # noqa: F401 (a fixture)

RECORDED = Path(__file__).with_name("recorded_run.py")
STEPS_PER_EPOCH = 120 // GLOBAL_BATCH
COMMON = ["max_duration=2ep", f"data.global_batch_size={GLOBAL_BATCH}", "checkpoint.interval=3ba", "checkpoint.keep=10", "seed=5",
          "data.resolution=16", "data.val_resolution=16", "log.interval=1"]


def launch(world_size: int, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={world_size}", str(RECORDED), "--config", str(RECIPE),
            *tiny_run(data, "webdataset", run_dir, *COMMON, *extra)]


def run_to_the_end(world_size: int, data: Path, run_dir: Path) -> str:
    result = subprocess.run(launch(world_size, data, run_dir), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def stop_at(run_dir: Path, step: int) -> None:
    """Leave the run as a job preempted just after its checkpoint at `step` leaves it: what came
    after that checkpoint is lost. (Each part runs to its end first, so the stop is at the same step
    on a loaded machine; tests/test_training_runs.py stops a run with SIGKILL.)"""
    stop = run_dir / "checkpoints" / f"ep{step // STEPS_PER_EPOCH}-ba{step}.pt"
    for later in (path for path in (run_dir / "checkpoints").iterdir() if path.stat().st_mtime > stop.stat().st_mtime):
        later.unlink()
    (run_dir / "summary.json").unlink()


def trained_steps(run_dir: Path, parts: list[tuple[int, int]]) -> dict:
    """(epoch, step in epoch) -> sorted labels over all ranks, each step from the part of the run
    that kept it. parts: (world size, first step) of each, in order; what a part trained past the
    checkpoint the next resumed from was lost with it."""
    steps = defaultdict(list)
    for path in run_dir.glob("labels-rank*.jsonl"):
        for line in read_jsonl(path):
            step = line["epoch"] * STEPS_PER_EPOCH + line["batch"]
            kept_by = [size for size, first in parts if first <= step][-1]
            if line["world_size"] == kept_by:
                steps[(line["epoch"], line["batch"])] += line["labels"]
    return {step: sorted(labels) for step, labels in steps.items()}


@pytest.mark.timeout(400)
def test_stopped_mid_epoch_and_resumed_on_more_processes_then_on_fewer(own_class_sets, tmp_path):
    """2 processes, stopped mid-epoch and resumed on 3, stopped again and resumed on 1: every
    global step trains on the samples of an uninterrupted run's."""
    data, run_dir = own_class_sets["webdataset"], tmp_path / "run"
    # resumed at steps 12 and 15 of 20, both mid-epoch; a checkpoint every 3 steps
    parts = [(2, 0), (3, STEPS_PER_EPOCH + 2), (1, STEPS_PER_EPOCH + 5)]
    run_to_the_end(2, data, run_dir)
    for (before, _), (after, step) in zip(parts, parts[1:]):
        stop_at(run_dir, step)
        stdout = run_to_the_end(after, data, run_dir)
        assert f"on {after} process{'es' if after > 1 else ''} where it had {before}" in stdout
        assert int(re.search(r"resumed from \S+-ba(\d+)\.pt", stdout)[1]) == step

    steps = trained_steps(run_dir, parts)
    expected = {(epoch, batch): labels for epoch in (0, 1)
                for batch, labels in enumerate(global_steps("webdataset", data, 1, epoch=epoch))}
    assert steps == expected                        # every step of both epochs, each the uninterrupted run's
    for epoch in (0, 1):
        seen = sum((steps[(epoch, batch)] for batch in range(STEPS_PER_EPOCH)), [])
        assert sorted(seen) == list(range(120))     # each sample of the epoch once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 * STEPS_PER_EPOCH and summary["world_size"] == 1
    lines = [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl") if "train_loss" in line]
    assert lines == list(range(1, 2 * STEPS_PER_EPOCH + 1))      # each step's line once, across both resumes


@pytest.mark.timeout(300)
def test_a_changed_global_batch_is_refused_unless_allowed(own_class_sets, tmp_path, capsys):
    data, run_dir = own_class_sets["webdataset"], tmp_path / "run"
    first = main_here(capsys, "--config", RECIPE, *tiny_run(data, "webdataset", run_dir, *COMMON, "max_duration=13ba"))
    assert first.returncode == 0, first.stderr[-3000:]
    saved = run_dir / "checkpoints" / "ep1-ba13.pt"           # the run's end: 3 steps into epoch 1
    assert saved.exists()
    changed = [*tiny_run(data, "webdataset", run_dir, *COMMON, "data.global_batch_size=8")]
    code, refused = main_in_process(capsys, "--config", RECIPE, *changed)    # refused before training: no process needed
    assert code == 2 and refused.strip().count("\n") == 0, refused[-3000:]
    assert f"checkpoint {saved}: global batch 12 -> 8 since it was taken" in refused
    assert "resume_allow_changes=true" in refused

    allowed = main_here(capsys, "--config", RECIPE, *changed, "resume_allow_changes=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "global batch 12 -> 8" in allowed.stderr             # the warning
    records = [line for line in read_jsonl(run_dir / "metrics.jsonl") if "resume_changes" in line]
    # 3 of 10 steps of epoch 1 done at 12 a step: 36 samples, 4 steps of 8 in an epoch of 15
    assert records == [{"epoch": 1, "step": 15 + 4, "resume_changes": ["global batch 12 -> 8"]}]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2 * (120 // 8)
    shutil.rmtree(run_dir)
