"""`backend: auto`: the fastest backend that can read the given data, on this machine.

Which backends can read it follows from the data (a converter's manifest says ffcv or
webdataset, anything else is an ImageNet-layout folder; DALI reads shards and folders) and
from the packages installed. Among those, the pick is, in this order:
1. this machine's results file (`<slug>.jsonl`, pipeline/machine.py) in the folder of measured
   figures the spec names (`measured_results`: the recipes name the loader benchmark's), when
   it has a figure for every candidate at this split: the newest figure at the resolution
   nearest the one asked for;
2. otherwise a short probe: each candidate loads a few batches of the real data, timed after
   a warm-up batch.
Under torch.distributed, rank 0 decides and every rank takes its answer, so ranks never
disagree. The choice and its reason are logged at start (`choose_backend` returns both).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from pathlib import Path

import torch

from pipeline.backends import open_backend
from pipeline.formats.converted import converted_format
from pipeline.machine import results_path, signature
from pipeline.spec import LoaderSpec

log = logging.getLogger(__name__)

# data form -> the backends that read it, and the name the loader benchmark files each under
READERS = {"webdataset": {"webdataset": "webdataset", "dali": "dali-wds"},
           "ffcv": {"ffcv": "ffcv"},
           "folder": {"folder": "folder", "dali": "dali-folder"}}
PACKAGES = {"ffcv": "ffcv", "dali": "nvidia.dali", "webdataset": "webdataset", "folder": "PIL"}
PROBE_BATCHES, PROBE_SECONDS = 6, 4.0


def data_form(path: str) -> str:
    """The format a converter's manifest names, else "folder"; a broken or newer manifest is a
    one-line DatasetError here, before any backend is tried on it."""
    return converted_format(path) or "folder"


def candidates(spec: LoaderSpec) -> dict[str, str]:
    """backend -> its name in the results file, for the installed backends that read spec.path."""
    found = {}
    for backend, name in READERS.get(data_form(spec.path), {}).items():
        if backend == "ffcv" and spec.randaugment:
            continue        # FFCV cannot run RandAugment
        if importlib.util.find_spec(PACKAGES[backend].split(".")[0]) is not None:
            found[backend] = name
    return found


def from_results(spec: LoaderSpec, choices: dict[str, str], results_file: Path) -> tuple[str, str] | None:
    """(backend, reason) from the results file, if it has a figure for every candidate."""
    try:
        rows = [json.loads(line) for line in results_file.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    target = spec.resolution_at(0)
    best: dict[str, dict] = {}
    for index, row in enumerate(rows):
        if row.get("benchmark") != "loaders" or row.get("split") != spec.split or row.get("backend") not in choices.values():
            continue
        key = (abs(row.get("resolution", 0) - target), -index)          # nearest resolution, then newest
        if row["backend"] not in best or key < best[row["backend"]]["key"]:
            best[row["backend"]] = {"key": key, **row}
    if set(best) != set(choices.values()):
        return None
    backend = max(choices, key=lambda b: best[choices[b]]["img_per_s"])
    figures = ", ".join(f"{name} {best[name]['img_per_s']:,.0f} img/s at {best[name]['resolution']}"
                        for name in sorted(best, key=lambda n: -best[n]["img_per_s"]))
    return backend, f"fastest for {spec.split} in {results_file.name} ({figures})"


def probe(spec: LoaderSpec, choices: dict[str, str], why_probe: str) -> tuple[str, str]:
    """(backend, reason) from timing a few batches of each candidate; `why_probe` ends the reason."""
    rates = {}
    for backend in choices:
        loader = open_backend(dataclasses.replace(spec, backend=backend, rank=0, world_size=1))
        batches, images, started = iter(loader), 0, None
        try:
            next(batches)                                         # warm-up: workers, compilation
            started = time.perf_counter()
            for count, (_, labels) in enumerate(batches, 1):
                images += len(labels)
                if count >= PROBE_BATCHES or time.perf_counter() - started > PROBE_SECONDS:
                    break
        except StopIteration:
            pass
        finally:
            batches.close()
            del batches, loader
        rates[backend] = images / (time.perf_counter() - started) if started and images else 0.0
    backend = max(rates, key=rates.get)
    figures = ", ".join(f"{b} {rate:,.0f} img/s" for b, rate in sorted(rates.items(), key=lambda item: -item[1]))
    return backend, f"fastest in a short probe ({figures}); {why_probe}"


def choose_backend(spec: LoaderSpec, results_dir: str | Path | None = None) -> tuple[str, str]:
    """(backend, why) for a spec whose backend is "auto", by the figures in `results_dir` (default:
    spec.measured_results; none: a probe decides)."""
    results_dir = results_dir or spec.measured_results
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    answer = [None]
    if not distributed or torch.distributed.get_rank() == 0:
        choices = candidates(spec)
        if not choices:
            answer = [("", f"{spec.path}: no installed backend reads this {data_form(spec.path)} data")]
        elif len(choices) == 1:
            answer = [(next(iter(choices)), f"the only installed backend that reads {data_form(spec.path)} data")]
        else:
            measured = from_results(spec, choices, results_path(signature(), results_dir)) if results_dir else None
            if not results_dir:
                why_probe = "no folder of measured figures named (measured_results)"
            elif not Path(results_dir).is_dir():
                why_probe = f"measured_results {results_dir}: no such folder (relative to {Path.cwd()})"
            else:
                why_probe = "no figure for every candidate in this machine's results"
            answer = [measured or probe(spec, choices, why_probe)]
    if distributed:
        torch.distributed.broadcast_object_list(answer, src=0)
    backend, reason = answer[0]
    if not backend:
        raise ValueError(reason)
    log.info("loader backend auto -> %s (%s split): %s", backend, spec.split, reason)
    return backend, reason
