"""Writing files so that a crash never leaves a half-written one under its final name.

Everything goes to a temporary name beside the target first and is renamed into place:
a rename within one folder is atomic, so a reader sees the old file or the new one. With
`durable=True` the data and the folder entry are also fsynced (manifests, whose presence
means "complete"); bulk outputs that a rerun recreates skip that cost. `sha256_file` gives a
written file's sha256, as manifests record it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)      # a write's errno where the disk (or a quota) has no room


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in chunks (a .beton can be larger than memory)."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def check_writable(folder: Path) -> None:
    """Make `folder` if needed and create and remove an empty file in it: OSError if this process
    cannot write there (permission, read-only, a file in the way). An empty file needs no space,
    so a full disk passes here and is met, as a fault, where it fills."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-probe-{os.getpid()}"
    probe.touch()
    probe.unlink()


def write_bytes_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(path.parent)


def replace_atomically(tmp: Path, final: Path) -> None:
    """Put tmp (file or folder) in final's place; an old final is removed only after."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()
