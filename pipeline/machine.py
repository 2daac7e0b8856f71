"""Which machine this is: the hardware signature every benchmark figure is stored with, and the
name of its results file (`<slug>.jsonl`) in the folder its caller keeps them in, which
`backend: auto` reads to pick a loader (`pipeline/backends/auto.py`) and a tradeoff sweep names
its machine by. The folder itself is the caller's: the benchmarks own where they keep theirs.

The CPU's widest vector extension is part of both: 2-core VMs named just "AMD EPYC" come with
AVX-512 or with AVX2 only, and differ by far more than noise (training ~1.5x, bf16 autocast
13-16x, oneDNN kernels that differ in correctness: docs/troubleshooting.md).
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def widest_isa(flags) -> str:
    """'avx512' or 'avx2' for an x86-64 CPU with these /proc/cpuinfo flags; '' for anything less."""
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else ""


def cpu_isa() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return widest_isa(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return ""


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
    return {"cpu_model": cpu_model(), "cpu_isa": cpu_isa(), "cpu_cores": os.cpu_count(), "ram_gb": memory_gib(),
            "gpu_model": names[0] if names else "", "gpu_count": len(names), "driver": driver,
            "instance_type": instance_type or os.environ.get("FASTPIPE_INSTANCE_TYPE", ""),
            "python": platform.python_version()}


def slug(hardware: dict) -> str:
    """A file name for this kind of machine: the instance type if given, else CPU, its vector
    extension, cores and GPUs (`amd-epyc-avx2-2c`). Rows recorded before the extension was
    (no `cpu_isa` key) keep the name they were filed under."""
    if hardware.get("instance_type"):
        name = hardware["instance_type"]
    else:
        cpu = re.sub(r"\((r|tm)\)|cpu|@.*", "", hardware["cpu_model"], flags=re.IGNORECASE)
        name = "-".join(part for part in (cpu, hardware.get("cpu_isa"), f"{hardware['cpu_cores']}c") if part)
        if hardware.get("gpu_count"):
            name += f"-{hardware['gpu_count']}x-{hardware['gpu_model']}"
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def cpu_words(hardware: dict) -> str:
    """The CPU as figures are labelled with it: 'AMD EPYC (AVX2)', 'AMD EPYC (AVX-512)'."""
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}.get(hardware.get("cpu_isa", ""), hardware.get("cpu_isa", ""))
    return f"{hardware.get('cpu_model', '?')} ({isa})" if isa else hardware.get("cpu_model", "?")


def results_path(hardware: dict, directory: str | Path) -> Path:
    """This machine's results file in `directory`."""
    return Path(directory) / f"{slug(hardware)}.jsonl"
