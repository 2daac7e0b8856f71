"""The converters' per-image work on several processes (pipeline/convert/worker_pool.py), in order, with
a progress bar (pipeline/progress.py); a worker that dies is a ConversionFault, not a hang.

`map_samples` runs a function on every sample of a source's split: each worker reads a block of
neighbouring samples at once (pipeline/convert/sources/) and works on its samples' bytes, so that
reading stays in the source's order (a tar read front to back, a parquet row group once) whatever
order the output is written in.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import numpy as np

from pipeline.convert.errors import ConversionFault
from pipeline.convert.sources.base import Missing, Source
from pipeline.convert.worker_pool import WorkerDied, forked_map
from pipeline.progress import Progress

_job: tuple | None = None          # (source, split, work), set before the workers fork


def map_samples(source: Source, split: str, work: Callable, num_workers: int, desc: str,
                blocks: Iterable[np.ndarray] | None = None, total: int | None = None,
                progress: Progress | None = None) -> Iterator[tuple[int, object]]:
    """(index, work(bytes)) for each sample of the split, in the order of `blocks` (default: the
    source's own blocks, in source order); where a sample's bytes cannot be read, work is not
    called and its result is the `Missing` with the reason. The progress bar is `progress` where
    given (the caller's, closed by it), else one of `total` samples (default: the split's)."""
    global _job
    blocks = source.blocks(split) if blocks is None else blocks
    own = progress is None
    if own:
        progress = Progress(len(source.entries(split)) if total is None else total, desc, unit="img")
    _job = (source, split, work)
    try:
        with _worker_death_said(desc):
            with contextlib.closing(forked_map(_block_work, blocks, num_workers, chunksize=1)) as results:
                for indices, outcomes in results:
                    for index, outcome in zip(indices.tolist(), outcomes):
                        yield index, outcome
                    progress.update(len(indices))
    finally:
        _job = None
    if own:
        progress.close()


def _block_work(indices: np.ndarray) -> tuple[np.ndarray, list]:
    source, split, work = _job
    return indices, [data if isinstance(data, Missing) else work(data) for data in source.read(split, indices)]


@contextlib.contextmanager
def _worker_death_said(desc: str):
    try:
        yield
    except WorkerDied:
        raise ConversionFault(f"{desc}: a worker process died (its traceback, if it crashed, is above); "
                              "--num-workers 1 runs the same work in this process") from None
