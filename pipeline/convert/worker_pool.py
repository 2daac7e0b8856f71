"""Work on forked processes where a worker that dies is an error, not a hang.

multiprocessing.Pool replaces a dead worker (a crash in native code, the out-of-memory killer)
and waits for its lost task forever; a ProcessPoolExecutor notices instead. The converters (pipeline/convert/parallel.py)
and the generated sets (tools/generated_set.py) both run their work through forked_map.
"""
from __future__ import annotations

import ctypes
import faulthandler
import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool


TASKS_AHEAD = 4        # tasks queued per worker: enough that none waits, few enough that memory stays flat


PR_SET_PDEATHSIG = 1
_forker = 0        # the pid of the process that forks, as the child sees it


def die_with_parent() -> None:
    """In a forked child: have the kernel kill it when its parent ends (even by SIGKILL, when no
    code of the parent's runs), so that no worker outlives a killed converter. Linux only; the
    signal comes when the thread that forked ends, so fork from a thread that lives as long."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if _forker and os.getppid() != _forker:       # the parent died before the request took
        os._exit(1)


def _note_forker() -> None:
    global _forker
    _forker = os.getpid()


_registered = False


def children_die_with_this_process() -> None:
    """Every process forked from here on, by this code or a library's (FFCV's writer), gets
    `die_with_parent`."""
    global _registered
    if not _registered:
        os.register_at_fork(before=_note_forker, after_in_child=die_with_parent)
        _registered = True


class WorkerDied(Exception):
    """A worker process ended without finishing its work (its traceback, if it crashed, is on stderr)."""


def _worker_start() -> None:
    """A worker dies with its parent, and prints a crash's traceback: faulthandler on sys.stderr, or
    on file descriptor 2 where sys.stderr is no file (a notebook's, a captured one), on which
    faulthandler.enable() raises and every worker would die."""
    die_with_parent()
    try:
        faulthandler.enable()
    except (AttributeError, OSError, ValueError):
        faulthandler.enable(file=2)


def _run_chunk(function: Callable, chunk: list) -> list:
    return [function(item) for item in chunk]


def forked_map(function: Callable, items: Iterable, workers: int, chunksize: int = 16) -> Iterator:
    """function(item) for each item, in order: in this process when workers <= 1, else on that
    many forked processes, `chunksize` items a task. function goes to them pickled, so by name: a
    module-level function, not a closure; what it needs beyond the item it can read from module
    state set before this call, which the forked workers inherit (generated_set's _work). Items are
    taken from `items` as workers need them, a few tasks ahead, so a long iterable is never held
    whole, nor its results. Workers die with this process and print a crash's traceback; leaving early, by an
    error or Ctrl-C, cancels the rest."""
    if workers <= 1:
        yield from map(function, items)
        return
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), initializer=_worker_start)
    pending: deque = deque()
    items = iter(items)
    try:
        while chunk := list(itertools.islice(items, chunksize)):
            pending.append(pool.submit(_run_chunk, function, chunk))
            if len(pending) >= TASKS_AHEAD * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool:
        raise WorkerDied() from None
    finally:
        pool.shutdown(cancel_futures=True)
