"""One converter at a time in an OUT folder (`out_lock`), and what killed runs left there cleared.

A run holds an exclusive `flock` on the OUT folder itself (so no lock file is left behind); the
parts of a run across machines (`--part I/N`) hold it shared, since they write side by side, so a
whole run cannot start while a part writes, nor a part while a whole run does. The kernel drops the lock of a process that dies,
SIGKILL included. (flock on NFS is the client's: parts on several hosts of one NFS share do not see
each other's lock, and need none.)
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from pipeline.convert.errors import ConversionError

LEFT_BY_KILLED_RUNS = (".scan-*", ".*.tmp-*", ".*.old-*")      # scratch, staging, a replaced output
_held: set[int] = set()     # this process's lock descriptors


def _close_in_child() -> None:
    """A forked worker closes the lock it inherits: the lock then ends with the process that took
    it, not with its last worker (which a SIGKILL of the converter leaves alive a moment)."""
    for handle in _held:
        os.close(handle)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def out_lock(out: Path, shared: bool = False):
    """Hold OUT's lock (OUT made where missing); a ConversionError where another converter holds
    it. Held alone, it first removes what killed runs left in OUT."""
    out.mkdir(parents=True, exist_ok=True)
    handle = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise ConversionError(f"{out}: another conversion is writing there; wait for it to end, or give another "
                              "OUT") from None
    _held.add(handle)
    try:
        if not shared:
            for pattern in LEFT_BY_KILLED_RUNS:
                for leftover in out.glob(pattern):
                    shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        yield
    finally:
        _held.discard(handle)
        os.close(handle)
