"""The converters' per-image work on several processes (pipeline/convert/worker_pool.py), in order, with
a progress bar (pipeline/progress.py); a worker that dies is a ConversionFault, not a hang."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from pipeline.convert.errors import ConversionFault
from pipeline.progress import Progress
from pipeline.convert.worker_pool import WorkerDied, forked_map


def parallel_map(function: Callable, items: list, num_workers: int, desc: str,
                 chunksize: int = 16) -> Iterator:
    """function(item) for each item, in order, on num_workers processes (pipeline/convert/worker_pool.py),
    with a progress bar; a worker that dies is a ConversionFault, not a hang."""
    progress = Progress(len(items), desc, unit="img")
    workers = num_workers if len(items) >= 2 * chunksize else 1
    try:
        with contextlib.closing(forked_map(function, items, workers, chunksize)) as results:
            for done, result in enumerate(results, 1):
                progress.update()
                if done == len(items):      # a caller may stop at the last item, before this generator ends
                    progress.close()
                yield result
    except WorkerDied:
        raise ConversionFault(f"{desc}: a worker process died (its traceback, if it crashed, is above); "
                              "--num-workers 1 runs the same work in this process") from None
    progress.close()
