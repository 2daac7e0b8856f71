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
- scaling: ResNet-50's bf16 train step alone at 176, the engine and DALI `mixed` at train 176
  pinned to 2, 4, 8 and 16 vCPUs (benchmarks/loaders.py --cores), then resnet50_mild's last
  epoch end to end (eager, the engine) with the whole run pinned to 4, 8 and 16; the report sets
  each against what tools/instance_cost.py projects from the curve and the model-bound rate
  (target: within 10%);
- train: a short resnet50_mild run on photos-large (2 epochs, then resumed to a 3rd): the
  loss must fall and the resumed run must continue from the checkpoint;
- report: a summary of all of it in RESULTS_DIR/report/gpu-check-<machine>.md, also printed
  (tools/gpu_check_report.py).
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
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import RESULTS, cpus_by_core, signature, slug
from benchmarks.loaders import CONVERSIONS
from pipeline.storage.atomic_files import write_bytes_atomic
from gpu_check_report import E2E_EPOCHS, RECIPES, SCALING_CORES, report

PY = sys.executable
LARGE = "data/sample/photos-large"
LARGE_WDS = "data/bench/photos-large-wds"      # where benchmarks/loaders.py keeps its conversion
TRAIN_RESOLUTIONS = "224,176,160,128"
STAGE_NAMES = ("tests", "data", "loaders", "models", "diagnose", "e2e", "e2e-variants", "e2e-compare", "e2e-remote",
               "scaling", "train", "report")
REMOTE_STREAMED_LIMIT = "512MiB"    # under photos-large's train split (about 1.3 GB): it streams
MIN_COMMAND_SECONDS = 10    # before a --deadline-at, a command with less left is not started
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
    # end-to-end figures also go to the results file: tools/instance_cost.py reads DALI's share of the step there
    end_to_end = [PY, "tools/diagnose.py", "--config", f"{RECIPES}/resnet50_mild.yaml", *on_large,
                  "--steps", "100", "--warmup", "20", "--results-dir", str(results)]
    e2e_runs = [(f"e2e-{side}", ["--epoch", str(epoch), "compile=true"]) for side, epoch in E2E_EPOCHS.items()]
    e2e_variants = [("e2e-176-eager", ["--epoch", "35"]),
                    ("e2e-176-hw1", ["--epoch", "35", "compile=true", "data.hw_decoder_load=1"]),
                    ("e2e-176-webdataset", ["--epoch", "35", "compile=true", "data.backend=webdataset"])]
    # The settings that might bring 176 px to the target, side by side in alternating rounds
    # (tools/compare_settings.py); 20 + 150 steps stay within photos-large's 179-batch epoch.
    def rounds_at_176(backend: str) -> list[str]:
        return [PY, "tools/compare_settings.py", "--config", f"{RECIPES}/resnet50_mild.yaml", f"data.path={LARGE_WDS}",
                f"data.backend={backend}", f"data.num_workers={cores}", "compile=true", "--epoch", "35",
                "--rounds", "3", "--steps", "150", "--warmup", "20", "--results-dir", str(results)]
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
    # The model-bound rate the projection takes (so that the stage stands alone on a GPU never
    # measured), how the loaders scale with vCPUs (benchmarks/loaders.py --cores), then resnet50_mild's
    # last epoch end to end with the whole process pinned to 4, 8 and 16 of them, eager, fed by the engine.
    pinned = [n for n in SCALING_CORES if n <= int(cores)]
    curve = sorted({2, *pinned})
    scaling = [([*models, "--models", "resnet50", "--resolutions", "176", "--precisions", "bf16",
                 "--channels-last", "on", "--compile", "off"], 90)]
    scaling += [([PY, "benchmarks/loaders.py", "--source", LARGE, "--device", "cuda", "--batch-size", "256",
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
