"""Loader throughput: images/s of each backend on one dataset, in steady state.

    python benchmarks/loaders.py [--data data] [--dataset photos] [--backends ...]
                                 [--train-res 160] [--val-res 224] [--workers 2] [--epochs 3]

Each (backend, split) runs in a fresh process, so that no backend pays for another's
threads or memory: one warm-up epoch (worker start-up, FFCV's compilation), then `--epochs`
timed epochs; the figure is the median epoch's images/s. Also recorded: the whole machine's
CPU utilisation during the timed epochs (from /proc/stat, so run it on a quiet machine) and
the peak RSS of the main process. Prints a table with each backend's ratio to `folder`,
and appends one JSON line per figure to benchmarks/results/loaders.jsonl.

Data: `DATA/sample/NAME` (raw folder), `DATA/ffcv/NAME` and `DATA/wds/NAME`, as `make demo` makes them.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.hardware import signature  # noqa: E402

# name -> (backend, data form)
CONFIGURATIONS = {"folder": ("folder", "sample"), "webdataset": ("webdataset", "wds"), "ffcv": ("ffcv", "ffcv"),
                  "dali-folder": ("dali", "sample"), "dali-wds": ("dali", "wds"), "synthetic": ("synthetic", None)}


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in jiffies."""
    with open("/proc/stat", encoding="utf-8") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def measure(config: dict) -> dict:
    """Runs in its own process: warm-up epoch, then timed epochs of one loader."""
    import torch
    from pipeline import LoaderSpec, build_loader
    torch.set_num_threads(config["workers"])
    spec = LoaderSpec(config["backend"], path=config["path"], split=config["split"], batch_size=config["batch_size"],
                      resolution=config["resolution"], val_resolution=config["resolution"],
                      num_workers=config["workers"], synthetic_size=config["synthetic_size"])
    loader = build_loader(spec)
    seconds, images = [], 0
    for epoch in range(config["epochs"] + 1):
        loader.set_epoch(epoch)
        busy0, total0 = busy_jiffies()
        started = time.perf_counter()
        images = sum(len(labels) for _, labels in loader)
        seconds.append(time.perf_counter() - started)
        if epoch == 0:
            busy, total = 0, 0
        else:
            busy1, total1 = busy_jiffies()
            busy, total = busy + busy1 - busy0, total + total1 - total0
    median = statistics.median(seconds[1:])
    return {"img_per_s": images / median, "images_per_epoch": images, "epoch_seconds": seconds[1:],
            "warmup_seconds": seconds[0], "cpu_util": busy / total if total else None,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--dataset", default="photos")
    parser.add_argument("--backends", default="folder,webdataset,ffcv,dali-folder,dali-wds",
                        help="comma-separated: " + ", ".join(CONFIGURATIONS))
    parser.add_argument("--train-res", type=int, default=160)
    parser.add_argument("--val-res", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up one")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure one configuration
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return 0

    hardware = signature()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"# {hardware['cpu']}, {hardware['cores']} cores; dataset {args.dataset}, {args.workers} workers, "
          f"batch {args.batch_size}, median of {args.epochs} epochs after a warm-up")
    print(f"{'backend':<12} {'split':<5} {'res':>4} {'img/s':>7} {'x folder':>8} {'cpu':>5} {'rss MiB':>8}")
    rows = []
    with open(ROOT / "benchmarks" / "results" / "loaders.jsonl", "a", encoding="utf-8") as results:
        for split, resolution in (("train", args.train_res), ("val", args.val_res)):
            baseline = None
            for name in args.backends.split(","):
                backend, form = CONFIGURATIONS[name]
                path = str(args.data / form / args.dataset) if form else None
                config = {"backend": backend, "path": path, "split": split, "resolution": resolution,
                          "workers": args.workers, "batch_size": args.batch_size, "epochs": args.epochs,
                          "synthetic_size": 2300 if split == "train" else 575}
                run = subprocess.run([sys.executable, __file__, "--one", json.dumps(config)], capture_output=True,
                                     text=True, cwd=ROOT)
                if run.returncode != 0:
                    print(f"{name:<12} {split:<5} failed: {run.stderr.strip().splitlines()[-1]}")
                    continue
                figures = json.loads(run.stdout.strip().splitlines()[-1])
                baseline = figures["img_per_s"] if name == "folder" else baseline
                ratio = figures["img_per_s"] / baseline if baseline else float("nan")
                print(f"{name:<12} {split:<5} {resolution:>4} {figures['img_per_s']:>7.0f} {ratio:>8.2f} "
                      f"{figures['cpu_util'] or 0:>5.0%} {figures['peak_rss_mb']:>8.0f}")
                row = {"benchmark": "loaders", "backend": name, "split": split, "resolution": resolution,
                       "workers": args.workers, "batch_size": args.batch_size, "dataset": f"{args.dataset} ({form})",
                       **figures, "ratio_to_folder": ratio, "hardware": hardware, "commit": commit,
                       "date": time.strftime("%Y-%m-%d")}
                results.write(json.dumps(row) + "\n")
                rows.append(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
