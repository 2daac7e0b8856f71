"""Conversion throughput of tools/convert_ffcv.py and tools/convert_wds.py, and output sizes.

    python benchmarks/conversion.py SRC [--workers 1,2] [--repeats 3]

Runs each converter as a user does (a subprocess, --force, into a temporary folder) with
each worker count, and prints the median wall-clock images/s (start-up and imports
included) and the size of each output. Appends one JSON line per figure to this machine's
file in benchmarks/results/ (benchmarks/hardware.py).
Run it on a quiet machine: anything else on the cores changes the figures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import append_results, cpu_words, signature
from pipeline.formats.manifest import MANIFEST, read_manifest

CONVERTERS = {"ffcv": "convert_ffcv.py", "webdataset": "convert_wds.py"}


def run_once(script: str, src: Path, workers: int) -> tuple[float, dict, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "tools" / script), str(src), str(out), "--force",
                        "--num-workers", str(workers)], check=True, capture_output=True)
        seconds = time.perf_counter() - started
        manifest = read_manifest(out)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
        return seconds, manifest["counts"], size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--formats", default=",".join(CONVERTERS), help="comma-separated: ffcv, webdataset")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hardware = signature()
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores, {hardware['ram_gb']} GiB; source {args.src}")
    print(f"{'format':<11} {'workers':>7} {'images':>7} {'median s':>9} {'img/s':>7} {'MiB':>7}")
    rows = []
    for name in args.formats.split(","):
        script = CONVERTERS[name]
        for workers in map(int, args.workers.split(",")):
            runs = [run_once(script, args.src, workers) for _ in range(args.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            images, size = sum(runs[0][1].values()), runs[0][2]
            print(f"{name:<11} {workers:>7} {images:>7} {seconds:>9.2f} {images / seconds:>7.0f} {size / 2**20:>7.1f}")
            rows.append({"benchmark": "conversion", "format": name, "workers": workers, "source": str(args.src),
                         "images": images, "seconds_median": seconds, "seconds_all": [r[0] for r in runs],
                         "img_per_s": images / seconds, "output_bytes": size})
    append_results(rows, hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
