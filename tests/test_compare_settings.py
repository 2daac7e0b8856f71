"""`tools/compare_settings.py` as users run it: every setting's loader really built as asked,
the rounds alternating, the median and the best as documented; settings it cannot compare
refused in one line; and `step_stream` (training/step_stream.py) refused on a CPU. The
high-priority stream itself is a CUDA test (tests/test_cuda.py). Tiny settings: each run is
a few seconds on 2 cores."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TOOLS, run_tool_here
from runs import main_in_process

from training.step_stream import StepStream

RECIPE = ROOT / "algorithms" / "recipes" / "fashion_baseline.yaml"


def tiny(path) -> list[str]:
    return ["data.backend=folder", f"data.path={path}", "data.batch_size=16", "data.num_workers=1",
            "model.width=4", "model.blocks_per_stage=1", "precision=fp32"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")     # conftest.py: steady tiny steps


def test_each_setting_gets_its_loader_rounds_alternate_and_the_best_is_the_top_median(converted_sets, tmp_path,
                                                                                      capsys):
    fashion = converted_sets["fashion"]
    settings = ["data.num_workers=0", f"data.backend=webdataset data.path={fashion['webdataset']}"]
    result = run_tool_here(capsys, "compare_settings.py", "--config", RECIPE, *tiny(fashion["folder"]),
                           *[arg for setting in settings for arg in ("--setting", setting)],
                           "--rounds", "3", "--steps", "4", "--warmup", "1", "--json", tmp_path / "out.json",
                           "--results-dir", tmp_path / "results")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "out.json").read_text())
    a, b = saved["settings"]
    # each setting's median also goes to this machine's results file, as the planner reads it
    [results] = (tmp_path / "results").glob("*.jsonl")
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert f"end-to-end figures added to {results}" in result.stdout
    assert [(r["benchmark"], r["tool"], r["backend"], r["num_workers"]) for r in rows] == \
        [("e2e", "compare_settings", "folder", 0), ("e2e", "compare_settings", "webdataset", 1)]
    for row, setting in zip(rows, (a, b)):
        assert row["share_of_model"] == setting["median_share_of_model"] and row["rounds"] == 3
        assert row["together_img_per_s"] == setting["median_img_per_s"] and row["data_from"] == "local"
        assert row["model_img_per_s"] == statistics.median(r["model_img_per_s"] for r in saved["rounds"])
        assert row["resolution"] == saved["side"] and row["hardware"]["cpu_cores"] == os.cpu_count()
    assert a["loader"] == {"backend": "folder", "path": str(fashion["folder"]), "num_workers": 0,
                           "hw_decoder_load": 0.65, "cache_limit": "16GiB"}, a
    assert b["loader"]["backend"] == "webdataset" and b["loader"]["path"] == str(fashion["webdataset"]), b
    assert b["loader"]["num_workers"] == 1 and a["step_stream"] == b["step_stream"] == "default"
    assert [r["order"] for r in saved["rounds"]] == [["A", "B"], ["B", "A"], ["A", "B"]]
    for setting in saved["settings"]:
        shares = [r["together"][setting["name"]]["img_per_s"] / r["model_img_per_s"] for r in saved["rounds"]]
        assert setting["shares_of_model"] == pytest.approx(shares, abs=2e-3)
        assert setting["median_share_of_model"] == pytest.approx(statistics.median(shares), abs=2e-3)
        assert setting["loader_img_per_s"] > 0
    best = max(saved["settings"], key=lambda s: s["median_share_of_model"])["name"]
    other = "B" if best == "A" else "A"
    mine, theirs = (next(s["shares_of_model"] for s in saved["settings"] if s["name"] == n) for n in (best, other))
    assert saved["best"] == best and saved["best_wins"] == {other: sum(m > t for m, t in zip(mine, theirs))}
    assert f"best: {best} by median share" in result.stdout and "data.num_workers=0" in result.stdout
    assert saved["rounds_planned"] == 3 and "cut short" not in result.stdout


def test_a_run_killed_after_its_first_round_leaves_that_round_and_says_it_was_cut(converted_sets, tmp_path):
    """As a job killed at its time limit is ended (SIGKILL: nothing at exit runs)."""
    fashion = converted_sets["fashion"]
    out = tmp_path / "out.json"
    command = [sys.executable, str(TOOLS / "compare_settings.py"), "--config", str(RECIPE), *tiny(fashion["folder"]),
               "--setting", "data.num_workers=0", "--setting", "data.num_workers=1", "--rounds", "3",
               "--steps", "4", "--warmup", "1", "--json", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        for line in process.stdout:
            if line.startswith("round 1/3"):
                saved = json.loads(out.read_text())     # written before the second round starts
                os.killpg(process.pid, signal.SIGKILL)
                break
    finally:
        process.kill()
        process.wait(timeout=60)
    assert len(saved["rounds"]) == 1 and saved["rounds_planned"] == 3 and saved["recipe"] == str(RECIPE), saved
    assert [s["loader"]["num_workers"] for s in saved["settings"]] == [0, 1]
    import compare_settings
    assert "cut short: 1 of 3 rounds finished" in compare_settings.report(saved)
    assert json.loads(out.read_text()) == saved                 # the kill lost nothing written


@pytest.mark.parametrize("setting,named", [
    ("optim.lr=0.2", "'optim.lr' cannot change between settings"),
    ("step_stream=high_priority", "step_stream=high_priority needs CUDA"),
    ("data.hw_decoder_load=2", "hw_decoder_load must be in [0, 1]"),
])
def test_a_setting_it_cannot_compare_is_one_line_before_anything_is_measured(sample_sets, setting, named, capsys):
    result = run_tool_here(capsys, "compare_settings.py", "--config", RECIPE, *tiny(sample_sets / "fashion"),
                           "--setting", "data.num_workers=1", "--setting", setting, "--steps", "2")
    assert result.returncode == 2 and named in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "round" not in result.stdout, result.stderr


def test_one_setting_is_not_a_comparison(capsys):
    result = run_tool_here(capsys, "compare_settings.py", "--config", RECIPE, "--setting", "data.num_workers=1")
    assert result.returncode == 2 and "give 2 to 26 --setting options, got 1" in result.stderr


def test_the_step_stream_is_a_gpu_setting(tmp_path, capsys):
    """`default` makes no stream and runs the block as it is; anything else on a CPU is refused, in the
    trainer as a one-line config error naming the key."""
    stream, ran = StepStream(torch.device("cpu")), []
    with stream.around(torch.zeros(2)):
        ran.append(True)
    assert stream.stream is None and ran == [True]
    with pytest.raises(ValueError, match="step_stream must be one of default, high_priority"):
        StepStream(torch.device("cpu"), "high")
    code, stderr = main_in_process(capsys, "device=cpu", "data.backend=synthetic", "data.num_classes=4",
                                   "data.synthetic_size=32", "data.batch_size=8", "data.resolution=16",
                                   "model.name=small_resnet", "step_stream=high_priority", f"run_dir={tmp_path / 'run'}")
    assert code == 2, stderr[-2000:]
    assert stderr.strip() == "error: step_stream=high_priority needs CUDA (streams are a GPU's); this run is on cpu"
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
