"""Which machine this is: the hardware signature every benchmark figure is stored with, and the
name of the results file it goes to (`benchmarks/results/<slug>.jsonl`), which `backend: auto`
reads to pick a loader (`pipeline/auto_backend.py`).
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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


def results_path(hardware: dict, directory: Path = RESULTS) -> Path:
    return Path(directory) / f"{slug(hardware)}.jsonl"
