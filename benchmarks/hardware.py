"""The hardware signature stored with every benchmark figure, and the results file it names.

Every benchmark appends its figures, one JSON object a line, to
`benchmarks/results/<hardware-slug>.jsonl` through `append_results`, which adds the
hardware, library versions, git commit and date to each row. The slug names the CPU, its
core count and the GPUs (e.g. `intel-xeon-processor-2c`, `...-16c-1x-nvidia-h100-80gb-hbm3`),
so figures from one kind of machine gather in one file whatever the benchmark.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LIBRARIES = ("torch", "numpy", "ffcv", "nvidia-dali-cuda120", "nvidia-dali-cuda130", "webdataset", "pillow-simd",
             "simplejpeg", "numba", "opencv-python")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return 0.0


def gpus() -> tuple[list[str], str]:
    """(GPU names, driver version) from nvidia-smi; ([], "") without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return [], ""
    rows = [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return ([row[0] for row in rows], rows[0][1] if rows and len(rows[0]) > 1 else "") if out.returncode == 0 \
        else ([], "")


def signature(instance_type: str | None = None) -> dict:
    """The machine, as every result row records it. `instance_type` (e.g. p4d.24xlarge) may also
    come from the environment variable FASTPIPE_INSTANCE_TYPE."""
    names, driver = gpus()
    return {"cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "ram_gb": memory_gib(),
            "gpu_model": names[0] if names else "", "gpu_count": len(names), "driver": driver,
            "instance_type": instance_type or os.environ.get("FASTPIPE_INSTANCE_TYPE", ""),
            "python": platform.python_version()}


def slug(hardware: dict) -> str:
    """A file name for this kind of machine: the instance type if given, else CPU, cores and GPUs."""
    if hardware.get("instance_type"):
        name = hardware["instance_type"]
    else:
        cpu = re.sub(r"\((r|tm)\)|cpu|@.*", "", hardware["cpu_model"], flags=re.IGNORECASE)
        name = f"{cpu}-{hardware['cpu_cores']}c"
        if hardware.get("gpu_count"):
            name += f"-{hardware['gpu_count']}x-{hardware['gpu_model']}"
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


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
    return Path(directory) / f"{slug(hardware)}.jsonl"


def append_results(rows: list[dict], hardware: dict, directory: Path = RESULTS) -> Path:
    """Appends rows (each with its `benchmark` name) to this machine's results file, each
    completed with hardware, versions, commit and date; returns the file."""
    context = {"hardware": hardware, "versions": library_versions(), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d")}
    path = results_path(hardware, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as results:
        for row in rows:
            results.write(json.dumps({**row, **context}) + "\n")
    return path
