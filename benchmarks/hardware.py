"""The hardware signature stored with every benchmark figure, and the results file it names.

Every benchmark appends its figures, one JSON object a line, to
`benchmarks/results/<hardware-slug>.jsonl` through `append_results`, which adds the
hardware, library versions, git commit and date to each row. The slug names the CPU, its
vector extension, its core count and the GPUs (e.g. `amd-epyc-avx2-2c`, `amd-epyc-avx512-2c`,
`intel-xeon-processor-avx512-16c-1x-nvidia-h100-80gb-hbm3`),
so figures from one kind of machine gather in one file whatever the benchmark. The signature
itself is `pipeline/machine.py`'s; the folder, RESULTS, is the benchmarks' own: `backend: auto`
reads this machine's file there when a recipe names the folder (`data.measured_results`).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path

from pipeline import machine
from pipeline.machine import cpu_model, cpu_words, gpus, memory_gib, signature, slug  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LIBRARIES = ("torch", "numpy", "ffcv", "nvidia-dali-cuda120", "nvidia-dali-cuda130", "webdataset", "pillow-simd",
             "simplejpeg", "numba", "opencv-python")


def library_versions() -> dict:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"


def results_path(hardware: dict, directory: Path = RESULTS) -> Path:
    """This machine's results file, in RESULTS unless told otherwise."""
    return machine.results_path(hardware, directory)


def add_results_options(parser) -> None:
    """--save and --results-dir: a benchmark writes its rows only where it is told to; told neither,
    they stay in its printed output."""
    parser.add_argument("--save", action="store_true",
                        help=f"append the rows to this machine's file in {RESULTS.relative_to(ROOT)}/")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="append the rows to this machine's file in this folder instead")


def results_folder(args) -> Path | None:
    """Where the rows go (add_results_options): --results-dir, else RESULTS with --save, else None."""
    return args.results_dir if args.results_dir is not None else RESULTS if args.save else None


def append_results(rows: list[dict], hardware: dict, directory: Path | None, quiet: bool = False) -> Path | None:
    """Appends rows (each with its `benchmark` name) to this machine's results file in `directory`,
    each completed with hardware, versions, commit and date, and says where (unless `quiet`);
    returns the file. With no directory, writes nothing and says how to keep them."""
    if directory is None:
        if not quiet:
            print(f"# {len(rows)} row{'s' * (len(rows) != 1)} not saved: --save appends them to "
                  f"{results_path(hardware).relative_to(ROOT)}, --results-dir DIR to a file in DIR")
        return None
    context = {"hardware": hardware, "versions": library_versions(), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d"), "unix_time": round(time.time(), 3)}
    path = results_path(hardware, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as results:
        for row in rows:
            results.write(json.dumps({**row, **context}) + "\n")
    if not quiet:
        print(f"# {len(rows)} row{'s' * (len(rows) != 1)} appended to {path}")
    return path


def cpus_by_core(allowed: set[int] | None = None) -> list[int]:
    """This process's CPUs, hyperthread siblings next to each other, so that the first N are
    N vCPUs as a cloud counts them (on a node with SMT, N/2 cores and their siblings)."""
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    ordered: list[int] = []
    for cpu in allowed:
        if cpu in ordered:
            continue
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            group = sorted(int(n) for n in parse_cpu_list(siblings) if n in allowed)
        except OSError:
            group = [cpu]
        ordered += [n for n in group if n not in ordered]
    return ordered


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8], as the kernel writes CPU lists."""
    cpus = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def pin_to_cpus(count: int) -> list[int]:
    """Restricts this process, and the threads and processes it starts later, to `count` vCPUs."""
    ordered = cpus_by_core()
    if not 1 <= count <= len(ordered):
        raise ValueError(f"cannot pin to {count} CPUs: this process may run on {len(ordered)}")
    os.sched_setaffinity(0, ordered[:count])
    return ordered[:count]
