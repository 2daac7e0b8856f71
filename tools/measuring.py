"""What the measuring tools (diagnose.py, compare_settings.py) share: the real train step and
loaders timed in one process, one rank's view, and their main.

`measured_run` builds the run as training does (training/run.py) and starts it as fit does;
`measure` times a loader alone or feeding its train step (`Trainer.train_step`: the step fit
takes, events and step stream included), pass after pass over one epoch so that a resolution
schedule stays at that epoch's size; `synthetic_twin` is the model-alone feed. `run_one_rank`
is the tools' main: a throw-away run directory, one-line errors, the report printed and the
figures written atomically; with --results-dir, the end-to-end figures also go to this machine's
results file as `e2e` rows (the step's share of the model alone beside a loader), which
tools/instance_cost.py reads as it reads the benchmarks' rows.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.hardware import append_results, signature
from pipeline import build_loader
from pipeline.storage.atomic_files import write_bytes_atomic
from pipeline.errors import DatasetError
from pipeline.storage.urls import is_url
from training.config import ConfigError, load_config, shareable_overrides
from training.distributed import World
from training.run import USAGE_ERROR, build_run
from training.trainer import Trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def passes(loader, epoch: int):
    """The loader's batches, pass after pass over epoch `epoch`."""
    while True:
        loader.set_epoch(epoch)
        yield from loader


def measured_run(config, world: World | None = None) -> Trainer:
    """The run as training builds it (loaders and model, INIT fired; in `world`, else this
    process's), started as fit starts it: FIT_START fired (EMA and SAM set themselves up there).
    Its steps: `trainer.train_step`; nothing is evaluated or saved."""
    trainer = build_run(config, world)
    trainer.start()
    return trainer


def measure(loader, epoch: int, warmup: int, steps: int, device: torch.device, train_step=None,
            sync_each_step: bool = True) -> dict:
    """img/s over `steps` batches after `warmup`, and the seconds spent waiting for batches vs in steps
    (`train_step(images, targets)`: a Trainer's; None fetches batches alone). Without `sync_each_step`
    the host runs ahead of the device as in training, fetching the next batch while the GPU works:
    img/s is then the training rate, and the wait is not GPU idle time."""
    batches = passes(loader, epoch)
    try:
        for _ in range(warmup):
            images, targets = next(batches)
            if train_step:
                train_step(images, targets)
        sync(device)
        count, waiting, stepping = 0, 0.0, 0.0
        for _ in range(steps):
            start = time.perf_counter()
            images, targets = next(batches)
            fetched = time.perf_counter()
            if train_step:
                train_step(images, targets)
                if sync_each_step:
                    sync(device)   # the GPU's work counts as step time, not as the next wait
            count, waiting, stepping = (count + targets.shape[0], waiting + fetched - start,
                                        stepping + time.perf_counter() - fetched)
        start = time.perf_counter()
        sync(device)           # the loader's last asynchronous copies belong to loading
        waiting += time.perf_counter() - start
    finally:
        batches.close()
    return {"img_per_s": count / (waiting + stepping), "wait_share": waiting / (waiting + stepping)}


def synthetic_twin(loader, **changes):
    """A synthetic loader with the real one's spec as the algorithms settled it (batch, schedule, ColOut, device, dtype)."""
    return build_loader(dataclasses.replace(loader.spec, backend="synthetic", path=None, num_classes=loader.num_classes,
                                            synthetic_size=100 * loader.spec.batch_size, **changes))


def load_measuring_config(recipe: str | None, overrides: list[str], run_dir: str):
    """The run as training would build it, minus what a measurement must not do: resume, draw, keep files."""
    return load_config(recipe, [*overrides, f"run_dir={run_dir}", "resume=never", "log.progress=false",
                                "log.tensorboard=false"])


def run_one_rank(tool: str, args, measure_run, report_of, hint: str = "", e2e_rows_of=None) -> int:
    """The measuring tools' main: one rank in one process, in a run directory thrown away after;
    a config or dataset fault is one line on stderr and exit 2; the report printed, and the
    figures written atomically to --json with the recipe and overrides they came from, and as
    `e2e_rows_of(figures)` to --results-dir. `measure_run(run_dir)` returns the figures."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError(f"{tool} measures one rank in one process: run it with python, not torchrun{hint}")
        with tempfile.TemporaryDirectory(prefix=f"{Path(tool).stem}-") as run_dir:   # Trainer wants one
            figures = measure_run(run_dir)
    except (ConfigError, DatasetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(report_of(figures), flush=True)
    write_figures(args, figures)
    if e2e_rows_of and args.results_dir:
        rows = [{"benchmark": "e2e", "cores": len(os.sched_getaffinity(0)), **row} for row in e2e_rows_of(figures)]
        path = append_results(rows, signature(), args.results_dir, quiet=True)
        print(f"end-to-end figures added to {path}", flush=True)
    return 0


def add_results_dir_option(parser) -> None:
    parser.add_argument("--results-dir", type=Path, help="also add the end-to-end figures, as `e2e` rows, to this "
                        "machine's results file in this folder (benchmarks/results: tools/instance_cost.py reads it)")


def e2e_row(about: dict, loader: dict, model_img_per_s: float, together_img_per_s: float) -> dict:
    """One `e2e` row: what was run (`about`: the step's settings; `loader`: its spec's fields, where
    it read from and its rate alone), and the step's rate beside it as a share of the model alone."""
    return {**{key: about[key] for key in ("device", "model", "precision", "channels_last", "compile", "batch_size",
                                            "steps", "step_stream")},
            "resolution": about["side"], "backend": loader["backend"], "num_workers": loader["num_workers"],
            "hw_decoder_load": loader["hw_decoder_load"], "data_from": loader["data_from"],
            "loader_img_per_s": loader["img_per_s"], "model_img_per_s": model_img_per_s,
            "together_img_per_s": together_img_per_s, "share_of_model": round(together_img_per_s / model_img_per_s, 4)}


def write_figures(args, figures: dict) -> None:
    """The figures to --json, if given, atomically, with the recipe and overrides they came from."""
    if args.json:
        figures = {**figures, "recipe": args.config, "overrides": shareable_overrides(args.overrides)}
        write_bytes_atomic(args.json, (json.dumps(figures, indent=2) + "\n").encode())
        print(f"wrote {args.json}")


def data_from(path) -> str:
    """Where a loader reads: `url` (object store or HTTP) or `local`."""
    return "url" if is_url(path) else "local"
