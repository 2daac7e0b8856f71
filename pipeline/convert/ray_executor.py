"""Writing a plan's shards on a Ray cluster (`--executor ray`): one task a shard, retried where it
fails or its worker dies, each writing its shard into the shared OUT and recording it
(pipeline/convert/in_progress.py); the driver plans, waits and writes the manifest last.

A task gets what it reads, not the scan: its samples' entries (`Entries.subset`), their indices and
places in the split, the options and the plan, and opens SRC itself (a path every node sees, or a
URL). So a task costs the cluster one shard's reading and encoding, whatever the dataset's size;
a parquet source is the exception, since a cell is read with its row group (docs/loaders.md).
Ray is an optional dependency (`pip install .[ray]`); each node needs fastpipe installed, and SRC
and OUT at the same paths (a shared file system) or SRC at a URL.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.in_progress import InProgress
from pipeline.convert.options import RunOptions, WdsOptions
from pipeline.convert.plan import ShardPlan
from pipeline.convert.shard_tasks import write_shards
from pipeline.convert.sources import Entries, Source, SourceOptions, open_source
from pipeline.formats.wds_shards import SHARD_NAME
from pipeline.progress import Progress

log = logging.getLogger(__name__)

RETRIES = 3              # a task's attempts after its first
CONNECT_TIMEOUT_S = 5
TASKS_AHEAD = 2          # tasks submitted a cluster CPU: enough that none waits, few enough to hold little


@dataclass(frozen=True)
class ShardJob:
    """All a task needs to write shard `number` of `plan`."""
    src: str
    source_options: SourceOptions
    classes: list[str]
    plan: ShardPlan
    number: int
    entries: Entries          # the shard's samples alone, in source order
    indices: np.ndarray       # their indices in the split
    places: np.ndarray        # their write positions
    options: WdsOptions
    out: str


def write_shard(job: ShardJob) -> int:
    """A task: write one shard and record it in OUT; its number."""
    source = open_source(job.src, job.source_options)
    source.use_classes(job.classes)
    source.restrict(job.plan.split, job.entries, job.indices)
    progress = InProgress(Path(job.out), job.plan.split, {})
    staging = progress.staging()
    write_shards(source, job.plan, [job.number], job.places, job.options, 1, staging,
                 partial(progress.finished, staging=staging))
    return job.number


TASK = write_shard        # what each Ray task runs


def write_shards_on_ray(source: Source, plan: ShardPlan, numbers: list[int], options: WdsOptions, run: RunOptions,
                        progress: InProgress) -> None:
    """Write the shards `numbers` of `plan` on the Ray cluster of `run` (a local one where none is
    named, or the one this process is already connected to), a task a shard; a ConversionFault
    naming the shard that kept failing. A Ray this module connected stays connected for the next
    split, until `disconnect`."""
    ray = _connect(run)
    remote = ray.remote(TASK).options(max_retries=RETRIES, retry_exceptions=True, num_cpus=1)
    order, places = plan.order_and_places(source.scratch / f"{plan.split}-order")
    base = replace(source.options, form=source.form)        # a task opens SRC as this form, not detecting it
    ahead = TASKS_AHEAD * max(1, int(ray.cluster_resources().get("CPU", 1)))
    bar = Progress(len(numbers), f"{plan.split}: shards on Ray", unit="shard")
    pending: dict = {}
    todo = iter(numbers)
    while True:
        while len(pending) < ahead and (number := next(todo, None)) is not None:
            pending[remote.remote(_job(source, plan, number, order, places, options, run, base,
                                       progress))] = number
        if not pending:
            break
        ready, _ = ray.wait(list(pending), num_returns=1)
        number = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except Exception as error:  # noqa: BLE001 - a task's own error or its worker's death, as Ray gives it
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise ConversionFault(f"{progress.out / plan.split / SHARD_NAME.format(number)}: failed "
                                  f"{RETRIES + 1} times on Ray ({message}); run again to go on") from None
        bar.update(1)
    bar.close()


_connected_here = False


def disconnect() -> None:
    """End the Ray connection `write_shards_on_ray` made (and the local Ray it started), if any."""
    global _connected_here
    if _connected_here:
        import ray
        ray.shutdown()
        _connected_here = False


def _job(source: Source, plan: ShardPlan, number: int, order: np.ndarray | None, places: np.ndarray | None,
         options: WdsOptions, run: RunOptions, base: SourceOptions, progress: InProgress) -> ShardJob:
    indices = np.sort(plan.samples(number, order))
    return ShardJob(run.src if source.files.remote else str(Path(run.src).resolve()), base, source.used_classes,
                    plan, number, source.entries(plan.split).subset(indices), indices,
                    indices if places is None else np.asarray(places[indices]), options, str(progress.out.resolve()))


def _connect(run: RunOptions):
    """Ray, connected to the cluster at `run.ray_address` (checked first, so that a wrong address is
    one line, not Ray's minute of retries) or started here with `run.num_workers` CPUs, unless this
    process is connected already."""
    global _connected_here
    try:
        import ray
    except ImportError:
        raise ConversionError("--executor ray needs Ray: pip install 'fastpipe[ray]' (or pip install ray)") from None
    if ray.is_initialized():
        return ray
    address = run.ray_address
    if address and address not in ("auto", "local"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as error:
            raise ConversionError(f"cannot reach the Ray cluster at {address} "
                                  f"({getattr(error, 'strerror', None) or error}); check --ray-address or "
                                  "RAY_ADDRESS") from None
    try:
        ray.init(address=address or "local", num_cpus=None if address else run.num_workers, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ConversionError(f"cannot reach the Ray cluster at {address or 'this machine'} ({error})") from None
    _connected_here = True
    log.info("Ray: %d CPUs on %d nodes", ray.cluster_resources().get("CPU", 0), len(ray.nodes()))
    return ray
