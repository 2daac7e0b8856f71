"""Model-bound throughput: images/s of a train step and an eval step on synthetic data, per
model x resolution x precision x channels-last x torch.compile.

    python benchmarks/models.py [--models resnet18,resnet50,small_resnet] [--resolutions 128,160,224]
        [--precisions fp32,bf16,fp16] [--channels-last on,off] [--compile off,on] [--steps train,eval]
        [--batch-size N] [--device cuda|cpu] [--warmup 3] [--iters 10] [--timeout 1800]
        [--instance-type NAME] [--save | --results-dir DIR]

The images come from the `synthetic` loader (one normalized batch made once on the device), so
the figure is what the model alone allows: the ceiling a real loader is compared against. A
train step is what training/trainer.py does per batch: zero_grad, forward under autocast,
cross-entropy, backward, the project's SGD step (DecoupledSGDW), with a GradScaler for fp16;
an eval step is a forward in eval mode under torch.no_grad and autocast. After `--warmup`
untimed steps (torch.compile compiles in the first), each of the `--iters` steps is timed on
its own, CUDA synchronised before every clock read; the figure is the median of the per-step
rates (batch / step seconds), which one slow step (a GC pause, a neighbour process) does not move.

Each measurement runs in a fresh process: torch.compile's caches, the CUDA allocator's pool and
cuDNN's autotuned choices would otherwise carry from one configuration into the next, and an
out-of-memory error can leave a process slower than a new one. That costs a few seconds of
start-up per figure. A configuration that fails (compile unavailable, out of memory, timeout)
prints one line and the run goes on. fp16 needs CUDA and is skipped elsewhere with a note.

Defaults: batch 256 on CUDA, 32 on CPU; 3 warm-up and 10 timed steps, so that a small model
on a CPU takes seconds; on a GPU ask for more (e.g. --warmup 20 --iters 50, compile needs the
longer warm-up). The default grid is 144 figures: narrow it on a CPU. One JSON line per figure
goes, with --save or --results-dir, to this machine's file there (benchmarks/hardware.py), with `threads`, torch's
intra-op thread count (OMP_NUM_THREADS sets it). Run it on a quiet machine: on busy cores
torch's threads wait for each other and small models' figures drop many times over.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from training.models import MODELS

PRECISIONS = ("fp32", "bf16", "fp16")
STEPS = ("train", "eval")
SWITCH = {"on": True, "off": False}
NUM_CLASSES = 1000


def listed(valid, convert=str):
    """An argparse type: a comma-separated list of `valid` values (any value `convert` takes if
    `valid` is None), in the order given, without repeats."""
    def parse(text: str) -> list:
        values = []
        for item in (part.strip() for part in text.split(",")):
            try:
                value = convert(item)
            except ValueError:
                value = None
            if value is None or (valid is not None and item not in valid):
                raise argparse.ArgumentTypeError(
                    f"bad value {item!r}" + (f"; choose from {', '.join(valid)}" if valid else ""))
            if value not in values:
                values.append(value)
        return values
    return parse


def positive_int(text: str) -> int | None:
    return int(text) if int(text) > 0 else None


def measure(config: dict) -> dict:
    """Runs in its own process: builds the model and a synthetic batch, then times one kind of step."""
    import torch
    import torch.nn.functional as F
    from pipeline import LoaderSpec, build_loader
    from training.config import OptimizerConfig
    from training.models import build_model
    from training.optim import build_optimizer
    from training.precision import autocast_for

    device = torch.device(config["device"])
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True             # as the trainer does when not deterministic
    torch.manual_seed(0)
    batch, side = config["batch_size"], config["resolution"]
    split = "train" if config["step"] == "train" else "val"
    loader = build_loader(LoaderSpec("synthetic", split=split, batch_size=batch, resolution=side,
                                     val_resolution=side, num_classes=NUM_CLASSES, synthetic_size=batch,
                                     device=str(device), dtype=torch.float32))
    # The synthetic loader yields the same batch every time: take it once, so that the loop
    # below times the model and nothing of the loader.
    images, labels = next(iter(loader))
    memory_format = torch.channels_last if config["channels_last"] else torch.contiguous_format
    images = images.contiguous(memory_format=memory_format)
    model = build_model(config["model"], NUM_CLASSES).to(device, memory_format=memory_format)
    model.train(config["step"] == "train")
    run = torch.compile(model) if config["compile"] else model
    autocast = autocast_for(device, config["precision"])
    if config["step"] == "train":
        optimizer = build_optimizer(model, OptimizerConfig(), batch)
        scaler = torch.amp.GradScaler(device.type, enabled=config["precision"] == "fp16")

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = F.cross_entropy(run(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    else:
        def step():
            with torch.no_grad(), autocast():
                run(images)

    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)   # the clock waits for the GPU
    started = time.perf_counter()
    for _ in range(config["warmup"]):
        step()
    sync()
    warmup_seconds = time.perf_counter() - started
    seconds = []
    for _ in range(config["iters"]):
        started = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - started)
    return {"img_per_s": statistics.median(batch / s for s in seconds), "threads": torch.get_num_threads(),
            "step_seconds": seconds, "warmup_seconds": warmup_seconds,
            "peak_gpu_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}


def run_isolated(config: dict, timeout: float) -> tuple[dict | None, str]:
    """measure(config) in a fresh Python process: (figures, "") or (None, one line saying why not)."""
    try:
        run = subprocess.run([sys.executable, __file__, "--one", json.dumps(config)], capture_output=True,
                             text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        if run.returncode < 0:                        # killed: the kernel's OOM killer, usually
            return None, f"killed by signal {-run.returncode}" + (f" ({lines[-1].strip()})" if lines else "")
        return None, lines[-1].strip() if lines else f"exited {run.returncode}"
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    if not (isinstance(figures.get("img_per_s"), (int, float)) and math.isfinite(figures["img_per_s"])
            and figures["img_per_s"] > 0):
        return None, f"no usable rate measured ({figures.get('img_per_s')!r})"
    return figures, ""


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=listed(MODELS), default=list(MODELS))
    parser.add_argument("--resolutions", type=listed(None, positive_int), default=[128, 160, 224])
    parser.add_argument("--precisions", type=listed(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--channels-last", type=listed(SWITCH, SWITCH.get), default=[True, False], help="on,off")
    parser.add_argument("--compile", type=listed(SWITCH, SWITCH.get), default=[False, True], help="off,on")
    parser.add_argument("--steps", type=listed(STEPS), default=list(STEPS))
    parser.add_argument("--batch-size", type=int, help="default: 256 on CUDA, 32 on CPU")
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps; the figure is their median rate")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    parser.add_argument("--instance-type", help="names this machine in the results (e.g. p4d.24xlarge)")
    add_results_options(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure one configuration, print JSON
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.one:
        try:
            print(json.dumps(measure(json.loads(args.one))))
        except Exception as error:                   # the parent prints this line and goes on
            print(one_line(error), file=sys.stderr)
            return 1
        return 0
    if args.warmup < 0 or args.iters < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("need --warmup >= 0, --iters >= 1 and --batch-size >= 1")

    import torch
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device name (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    batch = args.batch_size or (256 if device.type == "cuda" else 32)
    precisions = args.precisions
    if device.type != "cuda" and "fp16" in precisions:
        print(f"# fp16 skipped: it needs CUDA (a GradScaler, and {device.type} has no fast fp16); bf16 is the "
              f"reduced precision here")
        precisions = [p for p in precisions if p != "fp16"]
    grid = list(itertools.product(args.models, args.resolutions, precisions, args.channels_last, args.compile,
                                  args.steps))
    if not grid:
        print("nothing to measure: every configuration asked for was skipped", file=sys.stderr)
        return 1

    hardware = signature(args.instance_type)
    gpu = f", {hardware['gpu_count']}x {hardware['gpu_model']}" if hardware["gpu_count"] else ""
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores{gpu}; device {device}, batch {batch}, "
          f"median per-step rate of {args.iters} steps after {args.warmup} warm-up, {len(grid)} configurations")
    print(f"{'model':<13} {'res':>4} {'prec':<5} {'layout':<13} {'compile':<7} {'step':<5} {'img/s':>9} "
          f"{'ms/step':>8}")   # ms/step: at the median rate
    written, failed, path = 0, 0, None
    for model, resolution, precision, channels_last, compiled, step in grid:
        config = {"model": model, "resolution": resolution, "precision": precision, "channels_last": channels_last,
                  "compile": compiled, "step": step, "batch_size": batch, "device": str(device),
                  "warmup": args.warmup, "iters": args.iters}
        label = (f"{model:<13} {resolution:>4} {precision:<5} {'channels_last' if channels_last else 'contiguous':<13} "
                 f"{'on' if compiled else 'off':<7} {step:<5}")
        figures, error = run_isolated(config, args.timeout)
        if figures is None:
            print(f"{label} failed: {error}", flush=True)
            failed += 1
            continue
        print(f"{label} {figures['img_per_s']:>9.1f} {1000 * batch / figures['img_per_s']:>8.1f}", flush=True)
        # Written at once, so that an interrupted long run keeps what it measured.
        path = append_results([{"benchmark": "models", **config, **figures}], hardware, results_folder(args), quiet=True)
        written += 1
    saved = f"appended to {path}" if path else "not saved (--save or --results-dir DIR keeps them)"
    print((f"# {written} figures {saved}" if written else "# no figures measured") +
          (f" ({failed} of {len(grid)} configurations failed)" if failed else ""))
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
