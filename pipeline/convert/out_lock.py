"""One converter at a time in an OUT folder (`out_lock`), and what killed runs left there cleared.

A run holds an exclusive `flock` on OUT/.converting.lock; the parts of a run across machines
(`--part I/N`) hold it shared, since they write side by side, so a whole run cannot start while a
part writes, nor a part while a whole run does. The kernel drops the lock of a process that dies,
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

LOCK = ".converting.lock"
LEFT_BY_KILLED_RUNS = (".scan-*", ".*.tmp-*", ".*.old-*")      # scratch, staging, a replaced output


@contextlib.contextmanager
def out_lock(out: Path, shared: bool = False):
    """Hold OUT's lock (made, with OUT, where missing); a ConversionError where another converter
    holds it. Held alone, it first removes what killed runs left in OUT, and the lock file at the
    end."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConversionError(f"{out}: another conversion is writing there (it holds {path}); wait for it "
                                  "to end, or give another OUT") from None
        try:        # the file may have been removed by a run that held it just before: lock the one there now
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        if not shared:
            for pattern in LEFT_BY_KILLED_RUNS:
                for leftover in out.glob(pattern):
                    shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        yield
    finally:
        if not shared:
            path.unlink(missing_ok=True)
        handle.close()
