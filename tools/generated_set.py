"""Keep a folder of generated files in step with a plan, idempotently and resumably.

A set folder holds SPLIT/CLASS/FILE files plus two markers: PARAMS_FILE, written first
(what the files on disk were made with), and DONE_FILE, written last (the set is complete
for these params and counts). A rerun with the same params only counts files; a killed run
resumes, and every file is written under a temporary name and renamed, so none is partial.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from pipeline.storage.atomic_files import write_bytes_atomic
from pipeline.progress import Progress
from pipeline.convert.worker_pool import WorkerDied, forked_map

SPLITS = ("train", "val")
DONE_FILE = ".done.json"      # written last: the set is complete for these params
PARAMS_FILE = ".params.json"  # written first: what the files on disk were made with
_work = None                  # (set_dir, plan, render) of the write_missing running: its forked workers read it


class GeneratedSetError(Exception):
    """The folder cannot be made the set's (it holds files we did not write)."""


def atomic_write(path: Path, data: bytes) -> None:
    # Not fsynced: a crash costs a rerun, which rewrites whatever is missing.
    write_bytes_atomic(path, data, durable=False)


def count_files(set_dir: Path) -> dict:
    """{split: {class: number of .JPEG files}} as found on disk."""
    counts = {}
    for split in SPLITS:
        split_dir = set_dir / split
        counts[split] = {
            d.name: sum(1 for e in os.scandir(d) if e.name.endswith(".JPEG"))
            for d in sorted(split_dir.iterdir()) if d.is_dir()
        } if split_dir.is_dir() else {}
    return counts


def disk_usage_mb(path: Path) -> float:
    """Space the files take on disk (allocated blocks, not apparent size)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total / 1e6


def finished_counts(set_dir: Path, params: dict) -> dict | None:
    """Counts of a set finished with these params and intact on disk, else None."""
    try:
        done = json.loads((set_dir / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if done.get("params") != params or count_files(set_dir) != done.get("counts"):
        return None
    return done["counts"]


def claim_set_dir(set_dir: Path, content_params: dict) -> None:
    """Make set_dir ours for content_params: JPEGs made with other params are removed."""
    params_file = set_dir / PARAMS_FILE
    if params_file.exists():
        try:
            same = json.loads(params_file.read_text()) == content_params
        except ValueError:
            same = False
        if not same:  # another seed or generator version: every file would differ
            for split in SPLITS:
                shutil.rmtree(set_dir / split, ignore_errors=True)
    elif any((set_dir / s).exists() for s in SPLITS):
        raise GeneratedSetError(f"{set_dir} holds files this script did not write (no {PARAMS_FILE});"
                              f" remove it or choose another --out")
    set_dir.mkdir(parents=True, exist_ok=True)
    (set_dir / DONE_FILE).unlink(missing_ok=True)
    atomic_write(params_file, json.dumps(content_params, sort_keys=True).encode())


def write_missing(set_dir: Path, plan: dict, render, desc: str, progress: bool, jobs: int = 1) -> int:
    """Make set_dir hold exactly the files in plan ({'split/class/name': job}).

    Files already there are kept (same params give the same bytes); files not in the plan
    (a larger --limit before, temporary files of a killed run) are removed. `jobs` > 1
    renders in that many forked processes, not threads: Pillow's crops, resizes and encodes
    hardly overlapped in threads (photos-large at 822 img/s on one thread and 882 on two, on
    2 cores; 687 on a 16-core Xeon), since each gives up and takes back the GIL many times a
    tile. render runs in the workers, so a cache it keeps is per process; the bytes do not
    depend on jobs. Returns the number of files written."""
    global _work
    planned_dirs = {rel.rsplit("/", 1)[0] for rel in plan}
    present = set()
    for split in SPLITS:
        split_dir = set_dir / split
        for entry in (sorted(split_dir.iterdir()) if split_dir.is_dir() else ()):
            rel_dir = f"{split}/{entry.name}"
            if rel_dir not in planned_dirs:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                continue
            for file in os.scandir(entry):
                if f"{rel_dir}/{file.name}" in plan:
                    present.add(f"{rel_dir}/{file.name}")
                else:
                    os.unlink(file.path)
    for rel_dir in planned_dirs:
        (set_dir / rel_dir).mkdir(parents=True, exist_ok=True)
    missing = [rel for rel in plan if rel not in present]

    bar = Progress(len(missing), desc, unit="img", enabled=progress and bool(missing))
    _work = (set_dir, plan, render)
    try:
        with contextlib.closing(forked_map(_write, missing, jobs, chunksize=32)) as written:
            for _ in written:
                bar.update()
    except WorkerDied:
        raise GeneratedSetError(f"{desc}: a worker process died (its traceback, if it crashed, is above); "
                                "--jobs 1 renders in this process") from None
    finally:
        bar.close()
        _work = None
    return len(missing)


def _write(rel: str) -> None:
    set_dir, plan, render = _work
    atomic_write(set_dir / rel, render(plan[rel]))


def finish_set(set_dir: Path, params: dict, written: int) -> dict:
    counts = count_files(set_dir)
    atomic_write(set_dir / DONE_FILE, json.dumps({"params": params, "counts": counts},
                                                 indent=1, sort_keys=True).encode())
    return summarize(set_dir, counts, written)


def summarize(set_dir: Path, counts: dict, written: int) -> dict:
    return {"path": str(set_dir), "classes": len(counts["train"]), "written": written,
            **{split: sum(counts[split].values()) for split in SPLITS},
            "per_class": counts}
