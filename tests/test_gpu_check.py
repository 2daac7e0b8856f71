"""tools/gpu_check.py where there is no GPU: its one-line answer, a stage's time limit and
outcome, and the summary it writes from a check's logs and results (the GPU stages
themselves run in tests/test_cuda.py and on a GPU machine)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TOOLS

import gpu_check
import gpu_check_report
from benchmarks.hardware import append_results

H100 = {"cpu_model": "Test Xeon", "cpu_cores": 16, "ram_gb": 128, "gpu_model": "NVIDIA H100", "gpu_count": 1,
        "driver": "580", "instance_type": ""}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA answer")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    result = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py")], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().startswith("gpu-check: no CUDA device here"), result
    assert len(result.stdout.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--stages", "tests,gpus"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown stage 'gpus'" in bad.stderr.strip().splitlines()[-1]


def test_a_dry_run_without_cuda_goes_on_to_the_stages(tmp_path):
    """GPU_CHECK_WITHOUT_CUDA=1 (a dry run in a stand-in for the GPU image): it goes on to the stages
    and the report."""
    env = {**os.environ, "GPU_CHECK_WITHOUT_CUDA": "1"}
    result = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--stages", "report", "--work",
                             str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not result.stdout.startswith("gpu-check: no CUDA device here") and (tmp_path / "work").is_dir()
    assert len(list((tmp_path / "results" / "report").glob("gpu-check-*.md"))) == 1


# A child that prints nothing and never ends on its own: a stage that returns was killed.
HANG = [sys.executable, "-c", "import threading; threading.Event().wait()"]


def test_a_stage_past_its_limit_is_killed_and_each_outcome_named(tmp_path):
    silent_hang = gpu_check.run_stage("hang", [(HANG, 2)], tmp_path)
    assert silent_hang["status"] == "timeout (-c after 2 s)"
    failing = gpu_check.run_stage("fail", [([sys.executable, str(TOOLS / "gpu_check.py"), "--stages", "x"], 60)],
                                  tmp_path)
    assert failing["status"] == "failed (gpu_check.py exit 2)"
    assert "unknown stage" in (tmp_path / "fail.log").read_text()
    assert gpu_check.run_stage("fine", [([sys.executable, "-c", "print(1)"], 60)], tmp_path)["status"] == "ok"


def test_no_command_runs_past_the_deadline_and_the_next_is_not_started(tmp_path, monkeypatch):
    # On a node you have until a given time, a command still running then is cut, so that the
    # report is written before the node goes. The least time a command needs, scaled down: the
    # test waits out the deadline.
    monkeypatch.setattr(gpu_check, "MIN_COMMAND_SECONDS", 2)
    started = tmp_path / "started"
    second = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]     # leaves a file if it runs
    cut = gpu_check.run_stage("hang", [(HANG, 300), (second, 300)], tmp_path, deadline=time.time() + 4)
    assert cut["status"] == "timeout (-c after 4 s (the deadline))", cut
    assert (tmp_path / "hang.log").read_text().count("$ ") == 1 and not started.exists()
    late = gpu_check.run_stage("late", [(second, 300)], tmp_path, deadline=time.time() + 1)
    assert late["status"] == "not run (the deadline was 1 s away)" and not started.exists()
    assert "$ " not in (tmp_path / "late.log").read_text()


def test_report_summarises_the_tests_and_only_this_checks_figures(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    old = {"benchmark": "models", "model": "resnet50", "resolution": 176, "step": "train", "precision": "bf16",
           "channels_last": True, "compile": False, "img_per_s": 1111.0}
    # a row of a check a minute before this one began
    path = append_results([old], H100, results)
    earlier = {**json.loads(path.read_text()), "unix_time": time.time() - 60}
    path.write_text(json.dumps(earlier) + "\n")
    started = earlier["unix_time"] + 30
    (work / "stages.json").write_text(json.dumps({"started": started, "stages": [
        {"stage": "tests", "status": "failed (pytest exit 1)", "seconds": 100.0}]}))
    (work / "tests.log").write_text("FAILED tests/test_cuda.py::x\n# failed (pytest exit 1)\n"
                                    "==== 1 failed, 9 passed, 2 skipped in 114.57s (0:01:54) ====\n")
    append_results([{**old, "img_per_s": 5856.0}, {
        "benchmark": "loaders", "backend": "dali-wds", "split": "train", "resolution": 176, "img_per_s": 16583.0,
        "hw_decoder_load": 0.0, "share_of_decode_bound": 1.0}], H100, results)
    (work / "diagnose-resnet50_hot.json").write_text(json.dumps({
        "backend": "dali", "num_workers": 16, "verdict": "DATA-BOUND", "loader_img_per_s": 8272.0,
        "model_img_per_s": 6200.0, "together_img_per_s": 3782.0, "wait_share": 0.13, "verdict_text": "Waits.",
        "suggestions": ["x"]}))
    text = gpu_check.report(work, results, H100)
    assert "| tests | failed (pytest exit 1) | 100 |" in text
    assert "Tests (`pytest -m cuda`): 1 failed, 9 passed, 2 skipped in 114.57s (0:01:54)" in text
    assert "| resnet50 | 176 | train | bf16 | on | off | 5,856 |" in text and "1,111" not in text
    assert "| dali-wds hw 0 | train | 176 | 16,583 | 1.00 |" in text
    assert ("Diagnose resnet50_hot (dali, 16 workers): **DATA-BOUND**: loader alone 8,272 img/s, model alone 6,200, "
            "together 3,782, waiting for data 13% of the time. Waits.") in text


def test_a_test_run_the_deadline_cut_still_names_each_outcome():
    log = ["[gw0] [  6%] PASSED tests/test_cuda.py::test_bf16_step[2] ",
           "[gw1] [ 12%] SKIPPED tests/test_cuda.py::test_nccl_two_ranks ",
           "tests/test_cuda.py::test_dali_mixed_matches_cpu FAILED                      [ 18%]",
           "FAILED tests/test_cuda.py::test_dali_mixed_matches_cpu - AssertionError: pixels",
           "SKIPPED [1] tests/test_cuda.py:40: needs 2 GPUs", "# timeout (pytest after 130 s (the deadline))"]
    assert gpu_check_report.cuda_test_lines(log) == [
        "Tests (`pytest -m cuda`): no summary line (cut short?)",
        "Per test: failed 1: test_dali_mixed_matches_cpu; passed 1: test_bf16_step[2]; "
        "skipped 1: test_nccl_two_ranks"]
    assert gpu_check_report.cuda_test_lines([*log, "==== 1 failed, 1 passed, 1 skipped in 20.01s ===="])[0] == \
        "Tests (`pytest -m cuda`): 1 failed, 1 passed, 1 skipped in 20.01s"


def test_report_checks_176_against_the_target_and_projects_8_gpus(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    mild = {"model": "resnet50", "batch_size": 256, "algorithms": ["scale_schedule", "bce", "blurpool", "channels_last",
            "label_smoothing", "progressive_resizing", "ema"], "backend": "dali", "num_workers": 16,
            "hw_decoder_load": 0.65, "loader_img_per_s": 16000.0}
    # as training runs, one rate at every side: the projection is then 36 epochs at 5,000 img/s per GPU
    for name, side, compiled, model in (("176", 176, True, 5400.0), ("132", 132, True, 6000.0),
                                        ("88", 88, True, 7000.0), ("176-eager", 176, False, 5100.0),
                                        ("176-webdataset", 176, True, 5300.0)):
        free = {"model_img_per_s": model, "together_img_per_s": 5000.0} if compiled else None
        (work / f"e2e-{name}.json").write_text(json.dumps({
            **mild, "side": side, "compile": compiled, "model_img_per_s": model - 400,
            "together_img_per_s": 4000.0, **({"free_running": free} if free else {}),
            **({"backend": "webdataset"} if name.endswith("webdataset") else {})}))
    append_results([{"benchmark": "models", "model": "resnet50", "resolution": 224, "step": "eval", "precision": "bf16",
                     "channels_last": True, "compile": False, "img_per_s": 12000.0},
                    {"benchmark": "loaders", "backend": "dali-wds", "split": "val", "resolution": 224,
                     "img_per_s": 9000.0}], H100, results)
    text = gpu_check.report(work, results, H100)
    dali = "dali, 16 threads, hw decoder 0.65"
    assert f"| 176 | 176 | on | {dali} | 16,000 | 5,000 | 4,000 | 5,400 | 5,000 | 92.6% |" in text
    assert f"| 176-eager | 176 | off | {dali} | 16,000 | 4,700 | 4,000 | | | |" in text
    assert "| 176-webdataset | 176 | on | webdataset, 16 threads | 16,000 | 4,900 | 4,000 | 5,300 | 5,000 | 94.3% |" \
        in text
    assert text.index("| 176 |") < text.index("| 132 |") < text.index("| 88 |")
    assert "At 176 px, compiled, as training runs: end to end is 92.6% of model-bound; the target is 95%: " \
           "**not met**" in text
    train, evaluation = 36 * 1_281_167 / (8 * 5000) / 60, 36 * 50_000 / (8 * 9000) / 60
    assert (f"train {train:.1f} min; eval {evaluation:.1f} min (36 evaluations of 50,000 images at 9,000 img/s "
            f"per GPU); total {train + evaluation:.1f} min") in text
    assert "Eval rate: 9,000 img/s per GPU, DALI's val loader's: the lower" in text
    synced_only = json.loads((work / "e2e-176.json").read_text())
    del synced_only["free_running"]
    (work / "e2e-176.json").write_text(json.dumps({**synced_only, "together_img_per_s": 4800.0}))
    assert "At 176 px, compiled, with a sync per step (no free-running figures): end to end is 96.0% of " \
           "model-bound; the target is 95%: **met**" in gpu_check.report(work, results, H100)
    (work / "e2e-132.json").unlink()
    (work / "e2e-88.json").unlink()
    assert "Projection to 8 GPUs: not made, fewer than two sides measured end to end." in \
        gpu_check.report(work, results, H100)


def test_the_e2e_epochs_are_where_resnet50_mild_trains_at_those_sides():
    """The e2e stage names its runs by side but asks diagnose for epochs: if the recipe's schedule
    moves, the run called 176 would measure another side."""
    import project_time
    mild = project_time.recipe_schedule(str(ROOT / gpu_check.RECIPES / "resnet50_mild.yaml"), [], 1, 2560, 256)
    assert {side: mild["sides"][epoch] for side, epoch in gpu_check.E2E_EPOCHS.items()} == \
        {side: side for side in gpu_check.E2E_EPOCHS}


def test_every_stage_command_parses_with_the_tool_it_runs(tmp_path):
    """A misspelt option or override would cost that stage on the GPU node; each command is
    parsed here by the parser of the tool it runs, and every override (put after the tools'
    options: compile=true after --epoch) loads into the recipe's config as the run would."""
    import compare_settings, diagnose, make_sample_data  # noqa: E401
    from pipeline.convert import wds as convert_wds
    from benchmarks import loaders, loopback_servers, models
    from training import main as training_main
    from training.config import load_config
    from training.run import algorithms_from_config
    parsers = {"benchmarks/loaders.py": loaders.build_parser().parse_args,
               "benchmarks/models.py": models.build_parser().parse_args,
               "tools/make_sample_data.py": make_sample_data.build_parser().parse_args,
               "tools/convert_wds.py": convert_wds.build_parser().parse_args,
               "tools/diagnose.py": diagnose.parse_args, "tools/compare_settings.py": compare_settings.parse_args,
               "training/main.py": training_main.parse_args}
    commands = [command for stage in gpu_check.stages(tmp_path, tmp_path).values() for command, _ in stage]
    tools_run = []
    for command in commands:
        if command[1:3] == ["-m", "pytest"]:
            assert "tests/test_cuda.py" in command and (ROOT / "tests/test_cuda.py").is_file()
            continue
        if "benchmarks/loopback_servers.py" in command:    # serves a folder while the command after -- runs
            served = loopback_servers.build_parser().parse_args(command[command.index("--serve"):])
            assert (tmp_path / served.serve).parent == tmp_path / "data", served
            command = served.command[1:]
        script = next(arg for arg in command if arg in parsers or arg.endswith(".py"))
        assert script in parsers, f"{script}: a stage runs a tool this test does not parse"
        arguments = command[command.index(script) + 1:]
        args = parsers[script](arguments)
        tools_run.append(script)
        if hasattr(args, "overrides"):
            assert args.overrides == [a for before, a in zip(["", *arguments], arguments)
                                      if "=" in a and a[0] != "-" and before != "--setting"], command
            config = load_config(str(ROOT / args.config), args.overrides)
            algorithms_from_config(config.algorithms)
    assert set(tools_run) == set(parsers) and tools_run.count("tools/diagnose.py") == 8


def test_the_compare_stage_parses_and_each_setting_is_one_the_recipe_takes(tmp_path):
    """Checked here, not first on a GPU: compare_settings reads the stage's command and accepts every
    setting (the keys it may change, values the recipe's config takes)."""
    import compare_settings
    [(command, allowed)] = gpu_check.stages(tmp_path, tmp_path)["e2e-compare"]
    args = compare_settings.parse_args(command[2:])
    assert args.setting == list(gpu_check.COMPARED_SETTINGS) and args.steps + args.warmup <= 179 and allowed <= 540
    settings = compare_settings.read_settings(args.setting, args.config, args.overrides, str(tmp_path))
    assert [(s.loader_changes, s.step_stream) for s in settings] == [
        ({}, "default"), ({"hw_decoder_load": 1.0}, "default"), ({}, "high_priority"),
        ({"hw_decoder_load": 1.0}, "high_priority"), ({"backend": "webdataset"}, "default")]


def test_the_remote_stage_compares_local_disk_with_the_same_shards_over_http(tmp_path):
    import compare_settings
    [(command, allowed)] = gpu_check.stages(tmp_path, tmp_path)["e2e-remote"]
    command = command[command.index("--") + 1:]
    url = "http://127.0.0.1:8080"
    args = compare_settings.parse_args([arg.replace("{url}", url) for arg in command[2:]])
    settings = compare_settings.read_settings(args.setting, args.config, args.overrides, str(tmp_path))
    served = f"{url}/{Path(gpu_check.LARGE_WDS).name}"
    assert [s.loader_changes for s in settings] == [
        {}, {"path": served}, {"path": served, "cache_limit": gpu_check.REMOTE_STREAMED_LIMIT}]
    assert "data.backend=webdataset" in args.overrides     # the trainer builds the recipe's loader too
    assert args.json.name == f"e2e-remote-{len(os.sched_getaffinity(0))}c.json" and allowed <= 540


def test_report_checks_each_remote_setting_against_local_disk(tmp_path):
    import compare_settings
    settings = [compare_settings.Setting(name, ["data.backend=webdataset", *extra], {}, "default")
                for name, extra in (("A", []), ("B", ["data.path=http://x/d"]),
                                    ("C", ["data.path=http://x/d", "data.cache_limit=512MiB"]))]
    rounds = [{"order": ["A", "B", "C"], "model_img_per_s": 7500.0,
               "together": {name: {"img_per_s": 7500.0 * share, "wait_share": 0.01, "share_of_model": share}
                            for name, share in (("A", 0.98), ("B", 0.97), ("C", 0.90))}}]
    result = compare_settings.summarise(rounds, settings, {"A": 22000.0, "B": 21000.0, "C": 15000.0}) | {
        "device": "cuda:0", "cpu_cores": 8, "model": "resnet50", "precision": "bf16", "compile": True,
        "channels_last": True, "batch_size": 256, "side": 176, "epoch": 35, "steps": 150, "warmup": 20}
    work = tmp_path / "work"
    work.mkdir()
    (work / "e2e-remote-8c.json").write_text(json.dumps(result))
    (work / "e2e-remote-16c.json").write_text(json.dumps(result | {"cpu_cores": 16}))
    text = gpu_check.report(work, tmp_path / "results", H100)
    assert text.index("local disk, 16 cores (176 px)") < text.index("local disk, 8 cores (176 px)")
    assert "## End to end" not in text
    assert "- B (data.path=http://x/d): 0.990x local disk's share; the target is 0.97x: **met**." in text
    assert ("- C (data.path=http://x/d data.cache_limit=512MiB): 0.918x local disk's share; the target is 0.97x: "
            "**not met**.") in text


def test_report_shows_the_compared_settings_and_checks_the_best_against_the_target(tmp_path):
    import compare_settings
    settings = [compare_settings.Setting(name, [text], {}, "default")
                for name, text in zip("AB", ("data.hw_decoder_load=0.65", "data.hw_decoder_load=1"))]
    rounds = [{"order": ["A", "B"], "model_img_per_s": 7000.0,
               "together": {"A": {"img_per_s": 5040.0, "wait_share": 0.02, "share_of_model": 0.72},
                            "B": {"img_per_s": 6720.0, "wait_share": 0.02, "share_of_model": 0.96}}},
              {"order": ["B", "A"], "model_img_per_s": 7200.0,
               "together": {"A": {"img_per_s": 5760.0, "wait_share": 0.02, "share_of_model": 0.80},
                            "B": {"img_per_s": 6624.0, "wait_share": 0.02, "share_of_model": 0.92}}}]
    result = compare_settings.summarise(rounds, settings, {"A": 28000.0, "B": 25000.0}) | {
        "device": "cuda:0", "cpu_cores": 16, "model": "resnet50", "precision": "bf16", "compile": True,
        "channels_last": True, "batch_size": 256, "side": 176, "epoch": 35, "steps": 150, "warmup": 20}
    work = tmp_path / "work"
    work.mkdir()
    (work / "e2e-compare.json").write_text(json.dumps(result))
    text = gpu_check.report(work, tmp_path / "results", H100)
    assert "## Settings compared at 176 px in alternating rounds" in text and "## End to end" not in text
    assert "best: B by median share of the model alone; it beat the others in: 2 of 2 over A" in text
    assert "Best: data.hw_decoder_load=1, a median 94.0% of the model alone as training runs; the target is 95%: " \
           "**not met**" in text


def test_report_sets_the_pinned_runs_against_the_projection_from_the_scaling_curve(tmp_path):
    """The scaling stage: end to end at 176 px on 4, 8 and 16 vCPUs against min(model-bound, the engine's
    rate on that many vCPUs from this machine's curve), and against the 2-vCPU figure stretched alone."""
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    hardware = {**H100, "cpu_isa": "avx512"}
    model = 6000.0
    curve = {2: 1500.0, 4: 2900.0, 8: 5200.0, 16: 9000.0}
    append_results([{"benchmark": "models", "model": "resnet50", "resolution": 176, "step": "train",
                     "precision": "bf16", "channels_last": True, "compile": False, "device": "cuda",
                     "img_per_s": model}]
                   + [{"benchmark": "loaders", "backend": "webdataset", "split": "train", "resolution": 176,
                       "cores": cores, "workers": cores, "device": "cuda", "img_per_s": rate}
                      for cores, rate in curve.items()], hardware, results)
    measured = {4: 2800.0, 8: 5000.0, 16: 5700.0}
    for cores, together in measured.items():
        (work / f"scaling-{cores}c.json").write_text(json.dumps({"side": 176, "together_img_per_s": together - 100,
                                                                 "free_running": {"together_img_per_s": together}}))
    text = gpu_check.report(work, results, hardware)
    for cores, together in measured.items():
        projected = min(model, curve[cores])
        from_two = min(model, curve[2] * cores / 2)
        binds = "GPU" if model <= curve[cores] else "data"
        assert (f"| {cores} | {together:,.0f} | {projected:,.0f} ({binds}) | {projected / together - 1:+.1%} | "
                f"{from_two:,.0f} | {from_two / together - 1:+.1%} |") in text
    checks = json.loads((work / "scaling-check.json").read_text())
    assert [c["vcpus"] for c in checks] == [4, 8, 16]
    assert "within 10%: **met** (worst 5.3%)" in text       # 16 vCPUs: 6,000 against 5,700
