"""The hardware signature stored with every benchmark figure: CPU model, cores, memory, GPUs.

An instance-type name can be given with the environment variable FASTPIPE_INSTANCE_TYPE.
"""
from __future__ import annotations

import os
import platform
import subprocess


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


def gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        return []


def signature() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(), "gpus": gpus(),
            "instance_type": os.environ.get("FASTPIPE_INSTANCE_TYPE", ""), "python": platform.python_version()}
