"""One figure of `benchmarks/loaders.py`, measured in a process of its own, so that no backend pays
for another's threads or memory: a loader's warm-up epoch and timed epochs (img/s, the machine's
CPU use, the peak memory of the process and its workers, the engine's stage times, and from a
URL what was fetched), or a decode bound or floor (`benchmarks/bare_loaders.py`).

    python -m benchmarks.loader_run CONFIG_JSON     # prints the figures as one JSON line
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.hardware import pin_to_cpus
from benchmarks.memory import PeakMemory
from benchmarks.remote_figures import FetchCounters

BOUNDS = ("decode_bound", "gpu_decode_bound")     # once per split
FLOORS = ("decode_floor",)                        # per split, resolution and worker count


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in jiffies."""
    with open("/proc/stat", encoding="utf-8") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def build(config: dict):
    kind = config["kind"]
    if kind.endswith("-bare"):
        from benchmarks.bare_loaders import BARE
        return BARE[kind](config)
    from pipeline import LoaderSpec, build_loader
    return build_loader(LoaderSpec(kind, path=config["path"], split=config["split"],
                                   batch_size=config["batch_size"], resolution=config["resolution"],
                                   val_resolution=config["resolution"], num_workers=config["workers"],
                                   synthetic_size=config["synthetic_size"], device=config.get("device", "cpu"),
                                   **config["options"]))


def measure(config: dict) -> dict:
    """Runs in its own process: warm-up epoch, then timed epochs of one loader, or a bound."""
    if config.get("cores"):
        pin_to_cpus(config["cores"])            # before torch, DALI or a worker starts a thread
    if config["kind"] == "decode_bound":        # without torch: the process starts in a fraction of the time
        from benchmarks import bare_loaders
        return bare_loaders.decode_bound(config["path"], config["split"])
    import torch
    torch.set_num_threads(config["workers"])
    if config["kind"] in FLOORS:
        from benchmarks import bare_loaders
        return bare_loaders.decode_floor(config["path"], config["split"], config["resolution"], config["workers"],
                                         config["batch_size"], config["epochs"])
    if config["kind"] == "gpu_decode_bound":
        from benchmarks import bare_loaders
        return bare_loaders.gpu_decode_bound(config["path"], config["split"], config["batch_size"])
    remote = config.get("remote")
    if remote:
        os.environ.update(remote["environment"])
        config["options"] = {**config["options"], "cache_dir": tempfile.mkdtemp(prefix="bench-cache-"),
                             "cache_limit": remote["cache_limit"]}
    memory = PeakMemory()
    memory.start()
    # The full collection that importing torch leaves due (170k objects, 0.15 s on a 2-core EPYC) is
    # paid before the clock starts, not in the first batch of whichever loader allocates enough to start it
    gc.collect()
    built = time.perf_counter()
    loader = build(config)
    seconds, busy, total, stages_after_warmup, first_batch = [], 0, 0, None, None
    counters = FetchCounters(loader, remote["server_cpu_ids"]) if remote else None
    for epoch in range(config["epochs"] + 1):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        if counters:
            counters.epoch_started()
        busy0, total0 = busy_jiffies()
        started = time.perf_counter()
        images = 0
        for batch in loader:
            if first_batch is None:
                first_batch = time.perf_counter() - built
            images += len(batch[0]["labels"] if isinstance(batch, list) else batch[1])
        if config.get("device", "cpu").startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if epoch == 0 and hasattr(loader, "engine_seconds"):
            stages_after_warmup = dict(loader.engine_seconds), loader.engine_samples
        if epoch:
            busy1, total1 = busy_jiffies()
            busy, total = busy + busy1 - busy0, total + total1 - total0
        if counters:
            counters.epoch_ended()
    memory.running = False
    figures = {"img_per_s": images / statistics.median(seconds[1:]), "images_per_epoch": images,
               "epoch_seconds": seconds[1:], "warmup_seconds": seconds[0], "cpu_util": busy / total if total else None,
               "peak_rss_mb": memory.peak_mb, "first_batch_seconds": first_batch}
    if counters:
        figures.update(counters.figures(config["epochs"], config["options"]["cache_limit"]))
        shutil.rmtree(config["options"]["cache_dir"], ignore_errors=True)
    if stages_after_warmup and loader.engine_samples > stages_after_warmup[1]:
        # CPU microseconds per image in each stage of the decode engine, over the timed epochs
        samples = loader.engine_samples - stages_after_warmup[1]
        figures["engine_us_per_image"] = {stage: 1e6 * (seconds - stages_after_warmup[0][stage]) / samples
                                          for stage, seconds in loader.engine_seconds.items()}
    return figures


def first_epoch_rate(figures: dict) -> float:
    """img/s of the warm-up epoch: from the loader built to its last batch."""
    return figures["images_per_epoch"] / figures["warmup_seconds"]


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
