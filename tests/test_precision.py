"""precision=auto: the probe leaves the model and the RNG as they were, a 2-rank torchrun run in
auto trains exactly as one given the precision it picked, and a resumed run keeps its
checkpoint's precision instead of measuring again."""
from __future__ import annotations

import json
import subprocess

import torch

from runs import MAIN, RECIPE, ROOT, TORCHRUN, main_here, read_jsonl, tiny_run
from algorithms.stochastic_depth import stochastic_depth_model
from training.models import build_model
from training.precision import NOISE, probe_cpu_precision


def test_the_probe_measures_both_and_leaves_the_model_and_the_rng_untouched():
    torch.manual_seed(0)
    model = build_model("small_resnet", 10, width=4, blocks_per_stage=1).to(memory_format=torch.channels_last)
    stochastic_depth_model(model, drop_rate=0.5)    # a forward that draws from torch's RNG
    before = {key: value.clone() for key, value in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    choice = probe_cpu_precision(model, batch_size=16, size=(16, 16), num_classes=10, channels_last=True)
    assert choice["fp32_img_per_s"] > 0 and choice["bf16_img_per_s"] > 0
    bf16_faster = choice["bf16_img_per_s"] > (1 + NOISE) * choice["fp32_img_per_s"]
    assert choice["precision"] == ("bf16" if bf16_faster else "fp32")
    assert torch.equal(torch.get_rng_state(), rng_before)
    after = model.state_dict()
    for key, value in before.items():               # BatchNorm's running statistics included
        assert torch.equal(after[key], value), key
    assert all(p.grad is None for p in model.parameters())


def test_auto_on_two_ranks_trains_as_the_precision_it_picked(converted_sets, tmp_path):
    data = converted_sets["fashion"]["folder"]

    def torchrun(run_dir, precision):
        command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(MAIN), "--config", str(RECIPE),
                   *tiny_run(data, "folder", run_dir, "max_duration=1ep", "log.interval=1", f"precision={precision}")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout, json.loads((run_dir / "summary.json").read_text())

    stdout, auto = torchrun(tmp_path / "auto", "auto")
    picked = auto["precision"]
    assert picked in ("fp32", "bf16") and auto["precision_auto"]["precision"] == picked
    assert f"precision auto: {picked} (the model's train step here: " in stdout
    _, given = torchrun(tmp_path / "given", picked)
    assert "precision_auto" not in given
    losses = [[line["train_loss"] for line in read_jsonl(run / "metrics.jsonl") if "train_loss" in line]
              for run in (tmp_path / "auto", tmp_path / "given")]
    assert len(losses[0]) == 7 and losses[0] == losses[1]        # both ranks picked alike, the RNG untouched
    assert auto["last_val_top1"] == given["last_val_top1"]


def test_a_resumed_auto_run_keeps_its_checkpoints_precision(tmp_path, capsys):
    overrides = ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=64", "data.batch_size=16",
                 "data.resolution=16", "data.val_resolution=16", "model.width=4", "model.blocks_per_stage=1",
                 "log.progress=false", "log.tensorboard=false", "checkpoint.interval=1ep"]
    for precision in ("fp32", "bf16"):               # whichever this machine would measure faster
        first = main_here(capsys, "--config", RECIPE, *overrides, f"run_dir={tmp_path / precision}",
                          "max_duration=1ep", f"precision={precision}")
        assert first.returncode == 0, first.stderr[-3000:]
        longer = main_here(capsys, "--config", RECIPE, *overrides, f"run_dir={tmp_path / precision}",
                           "max_duration=2ep", "precision=auto")
        assert longer.returncode == 0, longer.stderr[-3000:]
        assert f"precision auto: {precision} (as trained before, by checkpoint ep1-ba4.pt)" in longer.stdout
        assert "train step here" not in longer.stdout
        changed = longer.stdout.split("config keys changed since: ")[1].splitlines()[0]
        assert "precision" not in changed and "max_duration" in changed
        summary = json.loads((tmp_path / precision / "summary.json").read_text())
        assert summary["precision"] == precision and summary["steps"] == 8


def test_auto_measures_at_the_first_side_of_a_resolution_schedule(tmp_path, capsys):
    """A recipe whose data.resolution is a schedule (a mapping, not a side) probes at the size the
    loader starts with."""
    ramp = "data.resolution={form: ffcv, min_res: 16, max_res: 24, start_ramp: 0, end_ramp: 1, multiple: 8}"
    run = main_here(capsys, "--config", RECIPE, "data.backend=synthetic", "data.num_classes=4",
                    "data.synthetic_size=64", "data.batch_size=16", ramp, "data.val_resolution=16", "model.width=4",
                    "model.blocks_per_stage=1", "log.progress=false", "log.tensorboard=false", f"run_dir={tmp_path}",
                    "max_duration=1ep", "precision=auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "precision auto: " in run.stdout and "train step here" in run.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["precision"] in ("fp32", "bf16")
