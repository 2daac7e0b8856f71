"""`training/main.py` as users run it: config errors (its `main` in this process: they need no
process of their own), the run directory, multi-node rendezvous, and exact resume after SIGKILL
of a real 2-process torchrun (gloo, CPU)."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from runs import (MAIN, MID_EPOCH_CHECKPOINTS, RECIPE, ROOT, TORCHRUN, assert_ends_alike, flip_a_tensor_byte, free_port,
                  kill_tree, main_here, main_in_process, read_jsonl, tiny_run, torchrun_2, wait_until)


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=0.1"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["optim.lr=fast"], "config key 'optim.lr': expected a float, got 'fast'"),
    (["precision=fp8"], "config key 'precision': expected one of 'fp32', 'bf16', 'fp16'"),
    (["max_duration=3 epochs"], "bad duration '3 epochs'"),
    (["data.path=/no/such/dir"], "/no/such/dir: no such directory"),
    (["algorithms.mixupp={}"], "unknown algorithm 'mixupp'"),
])
def test_config_errors_are_one_line_and_exit_2(overrides, message, tmp_path, capsys):
    code, stderr = main_in_process(capsys, "--config", RECIPE, f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 2, stderr
    assert stderr.strip().splitlines() == [stderr.strip()], stderr  # one line
    assert message in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


def test_a_failed_torchrun_ends_with_the_one_line_error(tmp_path):
    """torchrun's failure summary, the last thing it prints, names the error in its root cause."""
    result = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", str(MAIN), "--config", str(RECIPE),
                             f"run_dir={tmp_path / 'run'}", "data.bakend=webdataset"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode != 0
    last = "\n".join(result.stderr.strip().splitlines()[-5:])
    assert "error: unknown config key 'data.bakend'; did you mean 'data.backend'?" in last, result.stderr[-2000:]
    assert "<N/A>" not in last


def test_a_misspelled_recipe_name_suggests_the_right_one_and_lists_the_shipped_ones(tmp_path, capsys):
    code, stderr = main_in_process(capsys, "--config", "fashion_basline", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and stderr.strip().count("\n") == 0, stderr
    assert "no recipe 'fashion_basline'" in stderr and "did you mean 'fashion_baseline'?" in stderr
    assert "shipped recipes: " in stderr and "resnet50_mild" in stderr


def test_missing_recipe_file_exits_2(tmp_path, capsys):
    code, stderr = main_in_process(capsys, "--config", tmp_path / "nope.yaml")
    assert code == 2 and "nope.yaml" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("base, message", [("gone", "base recipe 'gone' not found"),
                                           ("loop", "recipe bases form a cycle")])
def test_a_missing_base_or_a_cycle_exits_2_in_one_line(base, message, tmp_path, capsys):
    (tmp_path / "loop.yaml").write_text("base: recipe\n")
    (tmp_path / "recipe.yaml").write_text(f"base: {base}\nseed: 3\n")
    code, stderr = main_in_process(capsys, "--config", tmp_path / "recipe.yaml", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and stderr.strip().count("\n") == 0, stderr
    assert message in stderr and "Traceback" not in stderr


def test_multi_node_rendezvous_and_run_directory(sample_sets, tmp_path):
    """Two torchrun 'nodes' of one process each meet at a c10d rendezvous on this machine."""
    run_dir = tmp_path / "run"
    port = free_port()
    overrides = tiny_run(sample_sets / "fashion", "folder", run_dir, "max_duration=2ep",
                         "checkpoint.interval=1ba", "checkpoint.keep=2", "log.progress=true", "log.tensorboard=true")
    nodes = [subprocess.Popen([*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test",
                               str(MAIN), "--config", str(RECIPE), *overrides],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env={**os.environ, "PROGRESS_EVERY_S": "0"})           # a progress line every step
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "eval after" in outputs[0] and "eval after" not in outputs[1]        # other ranks are quiet
    # Output to a pipe, as to a log file: progress as lines, no carriage-return redraws.
    assert "\r" not in outputs[0] and re.search(r"^epoch 2/2: 7/7 ba \(100%\), .* img_s \d+", outputs[0], re.M)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 2
    for key in ("best_val_top1", "last_val_top1", "wall_s", "train_img_per_s"):
        assert isinstance(summary[key], float), key
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["backend"] == "folder" and saved["max_duration"] == "2ep"
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert all("epoch" in line and "step" in line for line in lines)
    evals = [line for line in lines if "val_top1" in line]
    steps_per_epoch = 120 // 16                                   # 12 images per class, 10 classes
    assert [(e["epoch"], e["step"]) for e in evals] == [(0, steps_per_epoch), (1, 2 * steps_per_epoch)]
    assert all(0 <= e["val_top1"] <= e["val_top5"] <= 100 for e in evals)
    assert evals[-1]["val_top1"] == summary["last_val_top1"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        [f"ep1-ba{2 * steps_per_epoch - 1}.pt", f"ep2-ba{2 * steps_per_epoch}.pt"]   # keep=2

    # TensorBoard (installed by the set-up beside Pillow-SIMD): rank 0's metrics, step by step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val_top1")] == \
        [(e["step"], pytest.approx(e["val_top1"])) for e in evals]
    assert len(events.Scalars("train_loss")) == sum("train_loss" in line for line in lines)


def test_sigkill_mid_epoch_then_resume_ends_bitwise_equal(sample_sets, straight_run, tmp_path):
    data = sample_sets / "fashion"
    common = MID_EPOCH_CHECKPOINTS
    straight, killed = straight_run(common), tmp_path / "killed"

    command = torchrun_2(data, killed, common)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                               start_new_session=True)
    wait_until((killed / "checkpoints" / "ep1-ba10.pt").exists, process, "checkpoint ep1-ba10.pt")
    kill_tree(process.pid)                                       # torchrun and both workers, no clean-up
    process.wait()
    assert not (killed / "summary.json").exists()

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    resumed_step = int(re.search(r"resumed from \S+-ba(\d+)\.pt", resumed.stdout)[1])
    assert resumed_step % 7 and resumed_step < 42               # mid-epoch, before the end

    assert_ends_alike(straight, killed, 42)
    steps = [line["step"] for line in read_jsonl(killed / "metrics.jsonl") if "train_loss" in line]
    assert steps == sorted(set(steps)), "metrics lines repeated after the resume"


def test_the_header_states_the_steps_a_stretched_run_takes_and_a_resume_its_fractional_epoch(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=64", "data.batch_size=16",
                 "data.resolution=16", "data.val_resolution=16", "model.width=4", "model.blocks_per_stage=1",
                 "log.progress=false", f"run_dir={run_dir}", "checkpoint.interval=1ba",
                 "algorithms.scale_schedule={ratio: 2}"]
    first = main_here(capsys, "--config", RECIPE, *overrides, "max_duration=3ba")
    assert first.returncode == 0, first.stderr[-3000:]
    assert ": 6 steps (1.5 epochs of 4; max_duration 3ba stretched to 6ba by algorithms.scale_schedule)" in first.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
    longer = main_here(capsys, "--config", RECIPE, *overrides, "max_duration=4ba")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "ep1-ba6.pt: step 6 of 8, epoch 1.5 of 2" in longer.stdout, longer.stdout


def test_resume_skips_a_truncated_checkpoint_and_a_finished_run_stays_finished(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=64", "data.batch_size=16",
                 "data.resolution=16", "data.val_resolution=16", "model.width=4", "model.blocks_per_stage=1",
                 "log.progress=false", f"run_dir={run_dir}", "checkpoint.interval=1ep"]
    first = main_here(capsys, "--config", RECIPE, *overrides, "max_duration=2ep")
    assert first.returncode == 0, first.stderr[-3000:]
    again = main_here(capsys, "--config", RECIPE, *overrides, "max_duration=2ep")
    assert "resumed from" in again.stdout and "ep2-ba8.pt" in again.stdout and "epoch 1/2:" not in again.stdout

    flip_a_tensor_byte(run_dir / "checkpoints" / "ep2-ba8.pt")   # it loads; its checksum tells
    longer = main_here(capsys, "--config", RECIPE, *overrides, "max_duration=3ep")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "ep2-ba8.pt does not load (its contents fail the sha256" in longer.stderr and "resumed from" in longer.stdout
    assert "ep1-ba4.pt" in longer.stdout and "max_duration" in longer.stdout     # the changed key is named
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12

    code, stderr = main_in_process(capsys, "--config", RECIPE, *overrides, "resume=never")   # met building the run
    assert code == 2 and "already has checkpoints" in stderr
