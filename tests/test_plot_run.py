"""tools/plot_run.py on real runs (two in-process trainers): the panels hold the logged figures,
several runs are overlaid, and a bad run directory or a missing matplotlib is a one-line error
that writes nothing."""
from __future__ import annotations

import json

import numpy as np
from PIL import Image

from algorithms.progressive_resizing import ProgressiveResizing
from conftest import run_tool, run_tool_without, tiny_trainer

import plot_run

FIRST_TWO_COLORS = [(0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e)]     # matplotlib's C0 and C1


def colors_drawn(png) -> list[bool]:
    pixels = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    return [bool((np.abs(pixels.astype(int) - color).sum(1) < 12).any()) for color in FIRST_TWO_COLORS]


def test_plots_of_runs_hold_what_they_logged(tmp_path):
    runs = [tmp_path / "lr0.1", tmp_path / "lr0.4"]
    for run_dir, lr, algorithms in zip(runs, ("0.1", "0.4"), ([], [ProgressiveResizing(mode="batch", size_increment=2)])):
        tiny_trainer(run_dir, algorithms, f"optim.lr={lr}", "log.interval=1").fit()
    records = plot_run.read_metrics(runs[0])
    evals = [r for r in records if "val_top1" in r]
    assert plot_run.series(records, "val_top1", "step") == ([r["step"] for r in evals], [r["val_top1"] for r in evals])
    times, _ = plot_run.series(records, "train_loss", "wall_s")
    assert len(times) == 8 and times == sorted(times) and times[-1] <= json.loads(
        (runs[0] / "summary.json").read_text())["wall_s"]
    assert plot_run.series(records, "resolution", "step")[1] == [16] * 8
    resized = plot_run.series(plot_run.read_metrics(runs[1]), "resolution", "step")[1]   # the size trained at
    assert resized[0] == 8 and resized[-1] == 16 and resized == sorted(resized)

    one = run_tool("plot_run.py", runs[0], check=True)
    assert one.stdout.strip() == f"{runs[0] / 'plot.png'}: 1 run (lr0.1)"
    assert Image.open(runs[0] / "plot.png").size == (1440, 1170) and colors_drawn(runs[0] / "plot.png") == [True, False]
    both = run_tool("plot_run.py", *runs, "--out", tmp_path / "both.png", check=True)
    assert "2 runs (lr0.1, lr0.4)" in both.stdout and colors_drawn(tmp_path / "both.png") == [True, True]


def test_a_bad_run_directory_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"epoch": 0, "st')
    (tmp_path / "plot.png").write_bytes(b"an earlier plot")
    for args, message in [([tmp_path / "empty"], "empty/metrics.jsonl: no such file"),
                          ([tmp_path / "torn"], "torn/metrics.jsonl: no metrics lines yet"),
                          ([tmp_path / "torn", tmp_path / "empty"], "several runs: say where the plot goes with --out")]:
        result = run_tool("plot_run.py", *args, "--out", tmp_path / "plot.png") if len(args) == 1 else \
            run_tool("plot_run.py", *args)
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and message in result.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 0, "step": 1, "wall_s": 0.5, "train_loss": 2.3}\n')
    result = run_tool_without(("matplotlib",), "plot_run.py", tmp_path / "run", "--out", tmp_path / "plot.png")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "matplotlib is not installed; run `bash tools/bootstrap.sh`" in result.stderr
    assert (tmp_path / "plot.png").read_bytes() == b"an earlier plot"
