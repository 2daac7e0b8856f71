"""The whole GPU path checked by one command, unattended, leaving its figures in the repo.

    make gpu-check        (= python tools/gpu_check.py)
    python tools/gpu_check.py [--stages tests,data,loaders,models,diagnose,e2e,e2e-variants,e2e-compare,train,report]
                              [--results-dir benchmarks/results] [--work runs/gpu-check] [--deadline-at UNIX_SECONDS]

Stages, each a subprocess with its own time limit (a hang fails one stage, the rest go on):
- tests: `pytest -m cuda` (tests/test_cuda.py): DALI `mixed` against DALI's CPU graph and
  `folder`, every backend onto the device from pinned memory, bf16 and fp16 train steps with
  channels-last under torchrun (NCCL), checkpoints between CUDA and the CPU, NCCL all-reduce;
- data: the photos-large decode set (46,000 train JPEGs; tools/make_sample_data.py), since
  the 2,875-image photos sample is over in a fraction of a second on a GPU, and its WebDataset
  conversion, which the later stages read (made here too, so that any of them can run alone);
- loaders: benchmarks/loaders.py on it to the GPU: the CPU and GPU decode bounds, DALI
  `mixed` and the webdataset engine at train 224/176/160/128 and val 224, and DALI at
  hardware-decoder shares 0 and 1 at 176;
- models: benchmarks/models.py: ResNet-50 train and eval steps at the four resolutions in
  bf16 and fp16 with channels-last; without it at 224 and 176; compiled at 176; ResNet-18
  train steps;
- diagnose: tools/diagnose.py on resnet50_mild and resnet50_hot fed by DALI from photos-large;
- e2e: end to end against model-bound, compiled: resnet50_mild's last epoch (176 px), its
  ramp (132 px) and its first epoch (88 px), each by tools/diagnose.py; the report checks 176
  against the 95% target and projects the recipe's time on 8 such GPUs from the three sides
  (tools/project_time.py); e2e-variants: 176 px eager, with every JPEG on the hardware
  decoder, and fed by the webdataset engine (decode on the CPU cores, which leaves the GPU to
  the step: DALI's own GPU work cost the step 8-28% on the H100) (a stage of its own, so that
  each stage fits in 10 minutes: on a node you have for a few minutes at a time, run a few
  stages at a time with --stages); e2e-compare: at 176 px, compiled, the hardware
  decoder's share 0.65 and 1, each with the step on the default and on a high-priority CUDA
  stream, and the webdataset engine, side by side in 3 alternating rounds in one process
  (tools/compare_settings.py): paired figures, where separate runs drifted up to 15% on an H100;
  e2e-remote: the same way, the webdataset engine fed from local disk, from loopback nginx
  (benchmarks/loopback_servers.py) through the node's block cache, and from it streamed through
  memory as a dataset larger than the cache is; the report checks each against 97% of local
  disk's share. Under `taskset -c 0-7` every stage sizes its workers to those 8 cores, and this
  one's figures are kept per core count;
- scaling: the engine and DALI `mixed` at train 176 pinned to 2, 4, 8 and 16 vCPUs
  (benchmarks/loaders.py --cores), then resnet50_mild's last epoch end to end (eager, the
  engine) with the whole run pinned to 4, 8 and 16; the report sets each against what
  tools/instance_cost.py projects from the curve and the model-bound rate (target: within 10%);
- train: a short resnet50_mild run on photos-large (2 epochs, then resumed to a 3rd): the
  loss must fall and the resumed run must continue from the checkpoint;
- report: a summary of all of it in RESULTS_DIR/report/gpu-check-<machine>.md, also printed.
Figures go to this machine's results file (benchmarks/hardware.py) as every benchmark's do;
logs and run directories to --work; --stages may be given again with the same --work, and the
report covers every stage run there. Without CUDA it says so in one line and exits 0, unless
GPU_CHECK_WITHOUT_CUDA=1: then it runs the stages' CPU halves (data, tests' collection and
skips, report), a dry run of the check in a stand-in for the GPU image, offline, before the
GPU node is at hand.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import RESULTS, cpu_words, cpus_by_core, signature, slug
from benchmarks.loaders import CONVERSIONS
from pipeline.storage.atomic_files import write_bytes_atomic

PY = sys.executable
LARGE = "data/sample/photos-large"
LARGE_WDS = "data/bench/photos-large-wds"      # where benchmarks/loaders.py keeps its conversion
TRAIN_RESOLUTIONS = "224,176,160,128"
RECIPES = "algorithms/recipes"
PYTEST_SUMMARY = re.compile(r"^(\d+ (passed|failed|skipped|errors?)(, )?)+.* in [\d.]+s")
# pytest -v's line per test, with xdist ("[gw0] [ 50%] PASSED tests/x.py::t") or without ("tests/x.py::t PASSED")
TEST_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR)\s+tests/\S+::(\S+)"
                          r"|tests/\S+::(\S+)\s+(PASSED|FAILED|SKIPPED|ERROR)\b")
STAGE_NAMES = ("tests", "data", "loaders", "models", "diagnose", "e2e", "e2e-variants", "e2e-compare", "e2e-remote",
               "scaling", "train", "report")
# The loader's rate per vCPU count, and end to end with the whole run pinned to each of these
SCALING_CORES = (4, 8, 16)
SCALING_TARGET = 0.10       # a projection from the scaling curve and the model-bound rate within 10%
# The target: end to end at 176 px (resnet50_mild's final side) reaches 95% of the
# model's img/s alone, i.e. the loader costs the train step at most 5%.
E2E_TARGET = 0.95
# Fed over HTTP, end to end stays within 3% of the same fed from local disk.
REMOTE_TARGET = 0.97
REMOTE_STREAMED_LIMIT = "512MiB"    # under photos-large's train split (about 1.3 GB): it streams
MIN_COMMAND_SECONDS = 10    # before a --deadline-at, a command with less left is not started
# resnet50_mild's 36 epochs (0.4 x 90) train at 176 px from epoch 29 to the last, 35, at 132 px
# at epoch 21 (the ramp's middle) and at 88 px from epoch 0 (pipeline/schedules.ComposerRamp);
# the JSONs record the side each measured, and the projection reads that, not these numbers;
# tests/test_gpu_check.py checks these epochs against the trainer's own schedule.
E2E_EPOCHS = {176: 35, 132: 21, 88: 0}
COMPARED_SETTINGS = ("data.hw_decoder_load=0.65", "data.hw_decoder_load=1",
                     "data.hw_decoder_load=0.65 step_stream=high_priority",
                     "data.hw_decoder_load=1 step_stream=high_priority", "data.backend=webdataset")


def stages(work: Path, results: Path) -> dict:
    """name -> [(command, seconds allowed)]; commands run in the repository root."""
    cores = str(len(os.sched_getaffinity(0)))    # the cores this check may use (taskset -c 0-7 ..., say)
    on_large = [f"data.path={LARGE_WDS}", "data.backend=dali", f"data.num_workers={cores}"]
    loaders = [PY, "benchmarks/loaders.py", "--source", LARGE, "--device", "cuda", "--workers", cores,
               "--batch-size", "256", "--epochs", "1", "--results-dir", str(results)]
    models = [PY, "benchmarks/models.py", "--device", "cuda", "--warmup", "8", "--iters", "20",
              "--steps", "train", "--results-dir", str(results)]
    end_to_end = [PY, "tools/diagnose.py", "--config", f"{RECIPES}/resnet50_mild.yaml", *on_large,
                  "--steps", "100", "--warmup", "20"]
    e2e_runs = [(f"e2e-{side}", ["--epoch", str(epoch), "compile=true"]) for side, epoch in E2E_EPOCHS.items()]
    e2e_variants = [("e2e-176-eager", ["--epoch", "35"]),
                    ("e2e-176-hw1", ["--epoch", "35", "compile=true", "data.hw_decoder_load=1"]),
                    ("e2e-176-webdataset", ["--epoch", "35", "compile=true", "data.backend=webdataset"])]
    # The settings that might bring 176 px to the target, side by side in alternating rounds
    # (tools/compare_settings.py); 20 + 150 steps stay within photos-large's 179-batch epoch.
    def rounds_at_176(backend: str) -> list[str]:
        return [PY, "tools/compare_settings.py", "--config", f"{RECIPES}/resnet50_mild.yaml", f"data.path={LARGE_WDS}",
                f"data.backend={backend}", f"data.num_workers={cores}", "compile=true", "--epoch", "35",
                "--rounds", "3", "--steps", "150", "--warmup", "20"]
    compare = [*rounds_at_176("dali"), *[arg for setting in COMPARED_SETTINGS for arg in ("--setting", setting)],
               "--json", str(work / "e2e-compare.json")]
    # The same conversion from loopback nginx (benchmarks/loopback_servers.py): kept in the node's
    # cache after the first pass (B), and streamed through memory every pass as a dataset larger
    # than the cache is (C), beside local disk (A); named by the cores it had.
    served = f"{{url}}/{Path(LARGE_WDS).name}"
    remote = [PY, "benchmarks/loopback_servers.py", "--serve", str(Path(LARGE_WDS).parent), "--",
              *rounds_at_176("webdataset"), f"data.cache_dir={work / 'remote-cache'}",
              "--setting", "data.backend=webdataset",
              "--setting", f"data.backend=webdataset data.path={served}",
              "--setting", f"data.backend=webdataset data.path={served} data.cache_limit={REMOTE_STREAMED_LIMIT}",
              "--json", str(work / f"e2e-remote-{cores}c.json")]
    # How the loaders scale with vCPUs (benchmarks/loaders.py --cores), then resnet50_mild's last
    # epoch end to end with the whole process pinned to 4, 8 and 16 of them, eager, fed by the engine.
    pinned = [n for n in SCALING_CORES if n <= int(cores)]
    curve = sorted({2, *pinned})
    scaling = [([PY, "benchmarks/loaders.py", "--source", LARGE, "--device", "cuda", "--batch-size", "256",
                 "--epochs", "1", "--results-dir", str(results), "--backends", "webdataset,dali-wds",
                 "--splits", "train", "--resolutions", "176", "--cores", ",".join(map(str, curve))], 540)]
    scaling += [(["taskset", "-c", ",".join(map(str, cpus_by_core()[:n])), *end_to_end, "--epoch", "35",
                  "data.backend=webdataset", f"data.num_workers={n}", "--json", str(work / f"scaling-{n}c.json")], 240)
                for n in pinned]
    short_run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "training/main.py",
                 "--config", f"{RECIPES}/resnet50_mild.yaml", *on_large, "algorithms.scale_schedule.ratio=1.0",
                 "log.progress=false", "log.interval=20", f"run_dir={work / 'resnet50_mild'}"]
    return {
        "tests": [([PY, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-n", "2", "-rs", "-v"], 540)],
        "data": [([PY, "tools/make_sample_data.py", "photos-large", "--out", "data/sample"], 300),
                 ([PY, "tools/convert_wds.py", LARGE, LARGE_WDS, *CONVERSIONS["wds"][1], "--num-workers", cores], 300)],
        "loaders": [([*loaders, "--backends", "decode_bound,gpu_decode_bound,dali-wds,webdataset",
                      "--resolutions", TRAIN_RESOLUTIONS, "--val-resolutions", "224"], 420),
                    ([*loaders, "--backends", "dali-wds", "--splits", "train", "--resolutions", "176",
                      "--hw-decoder-loads", "0,1"], 120)],
        "models": [([*models, "--models", "resnet50", "--resolutions", TRAIN_RESOLUTIONS, "--precisions", "bf16,fp16",
                     "--channels-last", "on", "--compile", "off", "--steps", "train,eval"], 300),
                   ([*models, "--models", "resnet50", "--resolutions", "224,176", "--precisions", "bf16",
                     "--channels-last", "off", "--compile", "off"], 90),
                   ([*models, "--models", "resnet50", "--resolutions", "176", "--precisions", "bf16",
                     "--channels-last", "on", "--compile", "on", "--warmup", "15"], 240),
                   ([*models, "--models", "resnet18", "--resolutions", TRAIN_RESOLUTIONS, "--precisions", "bf16",
                     "--channels-last", "on", "--compile", "off"], 120)],
        "diagnose": [([PY, "tools/diagnose.py", "--config", f"{RECIPES}/{recipe}.yaml", *on_large, "--steps", "60",
                       "--json", str(work / f"diagnose-{recipe}.json")], 240)
                     for recipe in ("resnet50_mild", "resnet50_hot")],
        "e2e": [([*end_to_end, *extra, "--json", str(work / f"{name}.json")], 240) for name, extra in e2e_runs],
        "e2e-variants": [([*end_to_end, *extra, "--json", str(work / f"{name}.json")], 240)
                         for name, extra in e2e_variants],
        "e2e-compare": [(compare, 540)],
        "e2e-remote": [(remote, 540)],
        "scaling": scaling,
        "train": [([*short_run, "max_duration=2ep"], 300), ([*short_run, "max_duration=3ep"], 200)],
    }


def run_stage(name: str, commands: list, work: Path, deadline: float = math.inf) -> dict:
    """Runs a stage's commands in order, its output to the terminal and to WORK/<name>.log; none
    runs past `deadline` (a time.time()), and one that would have under MIN_COMMAND_SECONDS left
    is not started."""
    started, status = time.time(), "ok"
    with open(work / f"{name}.log", "w", encoding="utf-8") as log:
        for command, limit in commands:
            left = deadline - time.time()
            if left < MIN_COMMAND_SECONDS:
                status = f"not run (the deadline was {max(left, 0):.0f} s away)" if status == "ok" else status
                log.write(f"# {status}\n")
                break
            allowed = round(min(limit, left))
            cut = " (the deadline)" if allowed < limit else ""
            print(f"$ {' '.join(command)}   (limit {allowed} s{cut})", flush=True)
            log.write(f"$ {' '.join(command)}\n")
            process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            # A watchdog, not a check between lines: a child that hangs silently prints none.
            killed = threading.Event()

            def kill(group=process.pid):
                killed.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            watchdog = threading.Timer(allowed, kill)
            watchdog.start()
            for line in process.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = process.wait()
            watchdog.cancel()
            if code != 0:
                what = command[2] if command[1] == "-m" else Path(command[1]).name
                status = f"timeout ({what} after {allowed} s{cut})" if killed.is_set() else f"failed ({what} exit {code})"
                log.write(f"# {status}\n")
    return {"stage": name, "status": status, "seconds": round(time.time() - started, 1)}


def rows_of(results: Path, machine: str, since: float, benchmark: str) -> list[dict]:
    path = results / f"{machine}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("benchmark") == benchmark and r.get("unix_time", since) >= since]


def report(work: Path, results: Path, hardware: dict) -> str:
    """The summary: stage outcomes, then the figures this check wrote, in markdown."""
    record = json.loads((work / "stages.json").read_text()) if (work / "stages.json").exists() else {}
    since = record.get("started", 0)
    machine = slug(hardware)
    lines = [f"# GPU check on {hardware.get('gpu_model')} x{hardware.get('gpu_count')}, "
             f"{cpu_words(hardware)}, {hardware['cpu_cores']} cores", "",
             "| stage | outcome | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds']:.0f} |" for s in record.get("stages", [])]
    test_log = work / "tests.log"
    if test_log.exists():
        lines += ["", *cuda_test_lines(test_log.read_text().splitlines())]
    loaders = rows_of(results, machine, since, "loaders")
    if loaders:
        lines += ["", "## Loaders, img/s delivered on the GPU (photos-large)", "",
                  "| loader | split | res | img/s | share of CPU decode bound |", "|---|---|---|---|---|"]
        for r in loaders:
            name = r["backend"] + (f" hw {r['hw_decoder_load']:g}" if r.get("hw_decoder_load") is not None else "")
            share = f"{r['share_of_decode_bound']:.2f}" if r.get("share_of_decode_bound") else ""
            lines.append(f"| {name} | {r['split']} | {r['resolution']} | {r['img_per_s']:,.0f} | {share} |")
    models = rows_of(results, machine, since, "models")
    if models:
        lines += ["", "## Model-bound img/s (synthetic batches on the GPU)", "",
                  "| model | res | step | precision | channels-last | compile | img/s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['resolution']} | {r['step']} | {r['precision']} | "
                  f"{'on' if r['channels_last'] else 'off'} | {'on' if r['compile'] else 'off'} | {r['img_per_s']:,.0f} |"
                  for r in models]
    for path in sorted(work.glob("diagnose-*.json")):
        figures = json.loads(path.read_text())
        lines += ["", f"Diagnose {path.stem[9:]} ({figures['backend']}, {figures['num_workers']} workers): "
                      f"**{figures['verdict']}**: loader alone {figures['loader_img_per_s']:,.0f} img/s, model alone "
                      f"{figures['model_img_per_s']:,.0f}, together {figures['together_img_per_s']:,.0f}, waiting for "
                      f"data {figures['wait_share']:.0%} of the time. {figures['verdict_text']}"]
    lines += end_to_end_lines(work, results, machine) + compare_lines(work) + remote_lines(work)
    lines += scaling_lines(work, results, hardware)
    run = work / "resnet50_mild"
    if (run / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [m["train_loss"] for m in metrics if "train_loss" in m]
        rates = [m["img_per_s"] for m in metrics if "img_per_s" in m]
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        resumed = "resumed from" in (work / "train.log").read_text() if (work / "train.log").exists() else False
        if losses:
            lines += ["", f"Short resnet50_mild run: train loss {losses[0]:.3f} -> {losses[-1]:.3f} over "
                          f"{len(losses)} logged intervals; img/s per interval min {min(rates):,.0f}, "
                          f"median {sorted(rates)[len(rates) // 2]:,.0f}, max {max(rates):,.0f}; "
                          f"resumed from a checkpoint: {'yes' if resumed else 'no'}; "
                          f"final top-1 {summary.get('last_val_top1', float('nan')):.2f}% after "
                          f"{summary.get('epochs', '?')} epochs"]
    return "\n".join(lines) + "\n"


def cuda_test_lines(log: list[str]) -> list[str]:
    """pytest's summary line, and each test's outcome from -v's lines: a run the deadline cut
    has no summary, and the names say what ran."""
    summaries = [line.strip("= ") for line in log if PYTEST_SUMMARY.match(line.strip("= "))]
    outcomes = {}
    for line in log:
        if match := TEST_OUTCOME.search(line):
            first, name, later_name, later = match.groups()
            outcomes[name or later_name] = first or later
    lines = [f"Tests (`pytest -m cuda`): {summaries[-1] if summaries else 'no summary line (cut short?)'}"]
    if outcomes:
        by_outcome = {}
        for name, outcome in outcomes.items():
            by_outcome.setdefault(outcome.lower(), []).append(name)
        lines.append("Per test: " + "; ".join(f"{outcome} {len(names)}: {', '.join(names)}"
                                              for outcome, names in sorted(by_outcome.items())))
    return lines


def end_to_end_lines(work: Path, results: Path, machine: str) -> list[str]:
    """The e2e stage's runs, the 95% check at 176 px, and the projection to 8 GPUs."""
    runs = {path.stem[4:]: json.loads(path.read_text()) for path in work.glob("e2e-*.json")
            if not path.stem.startswith(("e2e-compare", "e2e-remote"))}
    if not runs:
        return []
    lines = ["", "## End to end against model-bound (resnet50_mild from photos-large, one GPU)", "",
             "img/s; synced: a sync after every step (diagnose's verdict); as training: none (free-running).", "",
             "| run | side | compile | loader | loader alone | model synced | together synced | "
             "model as training | together as training | together / model as training |", "|" + "---|" * 10]
    for name, f in sorted(runs.items(), key=lambda item: (-item[1]["side"], item[0])):
        free = f.get("free_running")
        loader = f"{f['backend']}, {f['num_workers']} threads" + (
            f", hw decoder {f['hw_decoder_load']:g}" if f["backend"] == "dali" else "")
        lines.append(f"| {name} | {f['side']} | {'on' if f['compile'] else 'off'} | {loader} | "
                     f"{f['loader_img_per_s']:,.0f} | {f['model_img_per_s']:,.0f} | {f['together_img_per_s']:,.0f} | "
                     + (f"{free['model_img_per_s']:,.0f} | {free['together_img_per_s']:,.0f} | "
                        f"{free['together_img_per_s'] / free['model_img_per_s']:.1%} |" if free else "| | |"))
    if "176" in runs:
        free = runs["176"].get("free_running")
        how, figures = ("as training runs", free) if free else \
            ("with a sync per step (no free-running figures)", runs["176"])
        share = figures["together_img_per_s"] / figures["model_img_per_s"]
        lines += ["", f"At 176 px, compiled, {how}: end to end is {share:.1%} of model-bound; the target is "
                      f"{E2E_TARGET:.0%}: **{'met' if share >= E2E_TARGET else 'not met'}**."]
    return lines + projection_lines(work, results, machine)


def compare_lines(work: Path) -> list[str]:
    """The e2e-compare stage: its table, and whether its best setting meets the target at 176 px."""
    path = work / "e2e-compare.json"
    if not path.exists():
        return []
    import compare_settings
    result = json.loads(path.read_text())
    best = next(s for s in result["settings"] if s["name"] == result["best"])
    share = best["median_share_of_model"]
    return ["", f"## Settings compared at {result['side']} px in alternating rounds (tools/compare_settings.py)", "",
            "```", compare_settings.report(result), "```", "",
            f"Best: {' '.join(best['overrides'])}, a median {share:.1%} of the model alone as training runs; the "
            f"target is {E2E_TARGET:.0%}: **{'met' if share >= E2E_TARGET else 'not met'}**."]


def remote_lines(work: Path) -> list[str]:
    """The e2e-remote stage, per core count it ran with: each remote setting's median share of
    the model alone against local disk's (A), and the 3% target."""
    import compare_settings
    lines = []
    for path in sorted(work.glob("e2e-remote-*c.json"), key=lambda p: -int(p.stem.split("-")[-1][:-1])):
        result = json.loads(path.read_text())
        shares = {s["name"]: s["median_share_of_model"] for s in result["settings"]}
        local = shares.pop("A")
        local_overrides = result["settings"][0]["overrides"]
        lines += ["", f"## Fed over HTTP from loopback nginx against local disk, {result['cpu_cores']} cores "
                      f"({result['side']} px)", "", "```", compare_settings.report(result), "```", ""]
        for s in result["settings"]:
            if s["name"] in shares:
                ratio = shares[s["name"]] / local
                changes = " ".join(o for o in s["overrides"] if o not in local_overrides)
                verdict = "met" if ratio >= REMOTE_TARGET else "not met"
                lines.append(f"- {s['name']} ({changes}): {ratio:.3f}x local disk's share; "
                             f"the target is {REMOTE_TARGET:.2f}x: **{verdict}**.")
    return lines


def scaling_lines(work: Path, results: Path, hardware: dict) -> list[str]:
    """The scaling stage: end to end at 176 px with 4, 8 and 16 vCPUs against what tools/instance_cost.py
    predicts for them from this machine's loader curve and model-bound rate; the errors also go to
    WORK/scaling-check.json."""
    from benchmarks.measured_figures import LoaderRates, ModelRates, NoFigure, gpu_model, result_rows
    measured = {n: json.loads(path.read_text()) for n in SCALING_CORES if (path := work / f"scaling-{n}c.json").exists()}
    if not measured:
        return []
    mine = [row for row in result_rows(results) if row["_file"] == f"{slug(hardware)}.jsonl"]
    loaders, models = LoaderRates(mine), ModelRates(mine)
    gpu, cpu = gpu_model(hardware.get("gpu_model", "")), hardware["cpu_model"]
    lines = ["", "## Scaling with vCPUs: end to end at 176 px against the projection", "",
             "| vCPUs | measured img/s | projected (binds) | error | from the 2-vCPU figure alone | error |",
             "|---|---|---|---|---|---|"]
    checks = []
    for n, figures in sorted(measured.items()):
        actual = (figures.get("free_running") or figures)["together_img_per_s"]
        try:
            model = models.rate(gpu, "resnet50", "train", 176, "bf16", True, False).img_per_s
            loader = loaders.rate(cpu, hardware.get("cpu_isa", ""), "webdataset", "train", 176, n).img_per_s
            two = LoaderRates([r for r in mine if r.get("cores") == 2]).rate(
                cpu, hardware.get("cpu_isa", ""), "webdataset", "train", 176, n).img_per_s
        except NoFigure as missing:
            lines.append(f"| {n} | {actual:,.0f} | not made: {missing} | | | |")
            continue
        projected, from_two = min(model, loader), min(model, two)
        check = {"vcpus": n, "measured": actual, "projected": projected, "error": projected / actual - 1,
                 "binds": "GPU" if model <= loader else "data", "from_two_vcpus": from_two,
                 "error_from_two": from_two / actual - 1}
        checks.append(check)
        lines.append(f"| {n} | {actual:,.0f} | {projected:,.0f} ({check['binds']}) | {check['error']:+.1%} | "
                     f"{from_two:,.0f} | {check['error_from_two']:+.1%} |")
    if checks:
        worst = max(abs(c["error"]) for c in checks)
        lines.append(f"The target: every projection within {SCALING_TARGET:.0%}: **{'met' if worst <= SCALING_TARGET else 'missed'}** "
                     f"(worst {worst:.1%}).")
        write_bytes_atomic(work / "scaling-check.json", json.dumps(checks, indent=1).encode())
    return lines


def projection_lines(work: Path, results: Path, machine: str) -> list[str]:
    """resnet50_mild's time on 8 GPUs like this one, from the compiled e2e runs (tools/project_time.py)."""
    import project_time
    measured = [work / f"e2e-{side}.json" for side in E2E_EPOCHS if (work / f"e2e-{side}.json").exists()]
    if len(measured) < 2:
        return ["", "Projection to 8 GPUs: not made, fewer than two sides measured end to end."]
    evals = [r for r in rows_of(results, machine, 0, "models") if (r["model"], r["step"], r["resolution"],
             r["precision"], r["channels_last"], r["compile"]) == ("resnet50", "eval", 224, "bf16", True, False)]
    vals = [r for r in rows_of(results, machine, 0, "loaders")
            if (r["backend"], r["split"], r["resolution"], r.get("hw_decoder_load")) == ("dali-wds", "val", 224, None)]
    sources = [(rows[-1]["img_per_s"], what) for rows, what in ((evals, "the model's eval step"),
                                                                  (vals, "DALI's val loader")) if rows]
    eval_rate, eval_source = min(sources) if sources else (None, "")
    try:
        schedule = project_time.recipe_schedule(str(ROOT / RECIPES / "resnet50_mild.yaml"), [], 8,
                                                project_time.IMAGENET_TRAIN, project_time.IMAGENET_VAL)
        projection = project_time.project(schedule, project_time.measured_rates(measured, schedule), 8, 1.0,
                                          eval_rate)
    except project_time.ConfigError as error:
        return ["", f"Projection to 8 GPUs: not made ({error})."]
    return ["", "## Projected: resnet50_mild on ImageNet, 8 such GPUs, ideal scaling", "", "```",
            project_time.report(projection), "```"] + (
        [f"Eval rate: {eval_rate:,.0f} img/s per GPU, {eval_source}'s: the lower of this machine's latest figures "
         f"at 224 px for {' and '.join(what for _, what in sources)}."] if sources else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default=",".join(STAGE_NAMES), help="comma-separated, from " + ", ".join(STAGE_NAMES))
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu-check", help="logs and run directories")
    parser.add_argument("--deadline-at", type=float, default=math.inf, metavar="UNIX_SECONDS",
                        help="no command runs past this time (when your time on the node ends, say): each "
                             "is cut to what is left, and the report is still written")
    args = parser.parse_args()
    wanted = args.stages.split(",")
    if unknown := [s for s in wanted if s not in STAGE_NAMES]:
        parser.error(f"unknown stage {unknown[0]!r}; choose from {', '.join(STAGE_NAMES)}")
    import torch
    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_WITHOUT_CUDA") != "1":
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    hardware = signature()
    record_path = args.work / "stages.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"started": time.time(), "stages": []}
    plan = stages(args.work.resolve(), args.results_dir.resolve())
    for name in wanted:
        if name == "report":
            continue
        outcome = run_stage(name, plan[name], args.work, args.deadline_at)
        record["stages"] = [s for s in record["stages"] if s["stage"] != name] + [outcome]
        write_bytes_atomic(record_path, json.dumps(record, indent=1).encode())
        print(f"# gpu-check stage {name}: {outcome['status']} in {outcome['seconds']:.0f} s", flush=True)
    text = report(args.work, args.results_dir, hardware)
    out = args.results_dir / "report" / f"gpu-check-{slug(hardware)}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, text.encode())
    print(text + f"# report written to {out}")
    return 0 if all(s["status"] == "ok" for s in record["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
