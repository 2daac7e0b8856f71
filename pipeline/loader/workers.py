"""The DataLoader worker processes of the Pillow-based backends (folder, webdataset's worker
path), from start to end: the DataLoader that runs them, what each does when it starts
(`prepare_worker`), and how they are stopped however their loader goes away (freed, garbage
collected, at interpreter exit, inherited by a fork).

Signals: torchrun and Slurm signal a rank's whole process group, workers included. The
process that decides what a signal means (a trainer stopping at a checkpoint) names the ones
it handles with `leave_to_main_process`; workers started after that ignore them, and their
rank stops them itself.

Workers that never start: Python before 3.12 can fork a child that waits forever in its first
step (`PyOS_AfterFork_Child`), for a lock of the interpreter that another thread of the parent
held at the moment of the fork (CPython gh-112275). Its DataLoader would then wait for it
forever, rarely but for good on a busy machine. So each
worker reports its start (`prepare_worker`), and a loader whose workers have not all reported
within START_PATIENCE_S stops them and starts them again, with one line saying so; the random
state is put back, so the run is the one it would have been.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import select
import signal
import sys
import time
import weakref
from contextlib import contextmanager
from typing import Iterable

import torch
from torch.utils.data import DataLoader

from pipeline.spec import LoaderSpec

PREFETCH_FACTOR = 4      # batches each DataLoader worker makes ahead
START_PATIENCE_S = 30.0  # for a worker just forked to report its start; it takes well under a second
START_TRIES = 3
_ID_BYTES = 4

log = logging.getLogger(__name__)

# The write end of the pipe that the workers being started report to (`_start_reports`)
_STARTED_PIPE: int | None = None

# The signals workers leave to their main process (`leave_to_main_process`). Read by each worker
# as it starts: workers are forked (the fork hook below relies on it too), so a worker sees the
# set as it was when its loader started them.
_LEFT_TO_MAIN_PROCESS: frozenset[int] = frozenset()


def leave_to_main_process(signals: Iterable[int]) -> None:
    """Workers started from now on ignore `signals` (this set replaces an earlier one; () for
    none): the main process handles them and stops its workers itself. A worker ended by one
    would fail the batches its rank still takes before its checkpoint."""
    global _LEFT_TO_MAIN_PROCESS
    _LEFT_TO_MAIN_PROCESS = frozenset(int(number) for number in signals)


# The iterators of our DataLoaders that have worker processes, for the fork and exit hooks below.
_LIVE_WORKER_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()


def _disown_inherited_workers() -> None:
    # A forked worker inherits the parent's other DataLoaders, and with persistent workers
    # their live iterators; without this, each one's __del__ tries to stop processes that
    # are not its children when the worker exits ("AssertionError: can only test a child
    # process", seen whenever a train and a val loader are alive together).
    for iterator in list(_LIVE_WORKER_ITERATORS):
        iterator._shutdown = True
    _LIVE_WORKER_ITERATORS.clear()


os.register_at_fork(after_in_child=_disown_inherited_workers)


class _WorkersStopWhenFreed(DataLoader):
    """A DataLoader whose persistent workers are stopped as soon as it is freed, however it is.

    torch stops them from its iterator's __del__. When the garbage collector frees a DataLoader
    (it sat in a reference cycle: a trainer's, or an exception's traceback), those __del__ run in
    no set order, the stop message never reaches the workers, and each one sits out torch's 5 s
    join timeout.
    A weakref finalizer runs before the collector touches anything, so the stop gets through."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        random_state = torch.random.get_rng_state()      # an iterator draws its workers' base seed from it
        for _ in range(START_TRIES):
            with _start_reports() as reports:
                iterator = super()._get_iterator()
                stuck = reports.missing(self.num_workers, START_PATIENCE_S)
            if not stuck:
                break
            pids = ", ".join(str(iterator._workers[worker].pid) for worker in stuck)
            log.warning("DataLoader worker %s did not start within %g s (a child forked while another thread held "
                        "an interpreter lock, CPython gh-112275): starting the workers again", pids, START_PATIENCE_S)
            _end_workers(iterator)
            torch.random.set_rng_state(random_state)
        else:
            raise RuntimeError(f"DataLoader workers did not start in {START_TRIES} tries of {START_PATIENCE_S:g} s")
        finalizer = weakref.finalize(self, _stop_workers, iterator)
        finalizer.atexit = False          # at exit, _stop_workers_at_exit ends them all
        _LIVE_WORKER_ITERATORS.add(iterator)
        return iterator


class _StartReports:
    def __init__(self, read_end: int):
        self.read_end = read_end

    def missing(self, workers: int, patience_s: float) -> list[int]:
        """The workers (ids) that have not reported their start within `patience_s`."""
        deadline, got = time.monotonic() + patience_s, b""
        while len(got) < workers * _ID_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_end], [], [], left)[0]:
                break
            got += os.read(self.read_end, 4096)
        started = {int.from_bytes(got[i:i + _ID_BYTES], "little") for i in range(0, len(got), _ID_BYTES)}
        return [worker for worker in range(workers) if worker not in started]


@contextmanager
def _start_reports():
    """A pipe the workers forked while it is open report their start to (`prepare_worker`)."""
    global _STARTED_PIPE
    read_end, _STARTED_PIPE = os.pipe()
    try:
        yield _StartReports(read_end)
    finally:
        os.close(read_end)
        os.close(_STARTED_PIPE)
        _STARTED_PIPE = None


def _stop_workers(iterator) -> None:
    iterator._shutdown_workers()              # torch's own shutdown; a no-op the second time


def _end_workers(iterator) -> None:
    """torch's shutdown, then a kill for any worker still there after its join timeout: one busy,
    one that ignores SIGTERM (prepare_worker), one that never started."""
    _stop_workers(iterator)
    for worker in getattr(iterator, "_workers", []):
        if worker.is_alive():
            worker.kill()
            worker.join()


@atexit.register        # after torch's and multiprocessing's own: so it runs before both (last in, first out)
def _stop_workers_at_exit() -> None:
    """Stop the workers of every loader still alive at interpreter exit: one held by an uncaught
    exception's traceback, mid-epoch. Left to them, torch's handler only marks the exit (its
    iterators' shutdown is then a no-op), and multiprocessing's SIGTERMs its daemon children,
    which our workers may ignore (prepare_worker), then joins them: the process hung for good after
    printing its traceback. Stopped by torch's message here, and any worker still busy after
    torch's join timeout killed."""
    for iterator in list(_LIVE_WORKER_ITERATORS):
        _end_workers(iterator)


class BatchKeys:
    """A sampler of whole-batch keys: this epoch's keys from the resume point (`start`) on, read
    when iteration starts. It holds the keys itself, not the loader, so that a dropped loader is
    freed at once, workers and all, not left in a loader -> DataLoader -> sampler -> loader
    cycle for the collector."""

    def __init__(self):
        self.keys: list = []
        self.start = 0

    def __iter__(self):
        return iter(self.keys[self.start:])

    def __len__(self) -> int:
        return len(self.keys) - self.start


def prepare_worker(worker_id: int = 0) -> None:
    """In DataLoader workers: the signals left to the main process (`leave_to_main_process`)
    are ignored. A worker whose rank dies (SIGKILL, the out-of-memory killer) is killed with it
    (Linux's parent-death signal): torch's own watch of the parent takes seconds, in which an
    orphan printed tracebacks from the fd-passing thread of multiprocessing into its dead
    rank's log. Then it reports its start to the loader that forked it (`_start_reports`)."""
    for number in _LEFT_TO_MAIN_PROCESS:
        signal.signal(number, signal.SIG_IGN)
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:                   # the rank died before the line above took effect
            os._exit(1)
    if _STARTED_PIPE is not None:
        os.write(_STARTED_PIPE, worker_id.to_bytes(_ID_BYTES, "little"))


def torch_dataloader(dataset, spec: LoaderSpec, **kwargs) -> DataLoader:
    """A DataLoader whose items are whole uint8 batches made in the workers."""
    workers = spec.num_workers
    dataloader = _WorkersStopWhenFreed(dataset, batch_size=None, num_workers=workers,
                                       pin_memory=spec.device.startswith("cuda"), persistent_workers=workers > 0,
                                       prefetch_factor=PREFETCH_FACTOR if workers else None, worker_init_fn=prepare_worker,
                                       **kwargs)
    return dataloader
