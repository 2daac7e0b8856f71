"""Per-sample checksums of an FFCV `.beton`: what tools/convert_ffcv.py records beside it
(`SPLIT.crc32`: per sample, a little-endian uint32) and what `data.verify=full` and
tools/verify_dataset.py check a `.beton` against.

A sample's checksum is the CRC-32 of its metadata row (its label, and its image's mode, size and
place) and then of each region the allocation table gives it (the image bytes), in table order:
every byte FFCV reads for that sample. The rest of the file's layout (header, field descriptors,
allocation table) has one CRC-32 of its own (`layout_crc32` in the manifest), since a damaged table
would send every lookup astray. The file is parsed from a buffer (a memory map, or bytes fetched from
a URL) with FFCV's own record types, so nothing here opens FFCV's reader. CRC-32 as zlib computes it,
the webdataset checksum's function (docs/loaders.md says why); zlib drops the GIL on large
buffers, so threads check samples side by side.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.progress import Progress
from pipeline.storage.atomic_files import write_bytes_atomic

SAMPLE_CHECKSUM = "crc32 of metadata row then allocations"   # the split record's `sample_checksum`
SAMPLES_PER_TASK = 4096
MIB = 1 << 20


class BetonLayoutError(ValueError):
    """The header, field descriptors or allocation table do not parse, or fail their checksum."""


@dataclass
class BetonLayout:
    count: int
    metadata_at: int                 # offset of the metadata rows
    row_bytes: int
    allocations: np.ndarray          # ALLOC_TABLE_TYPE rows, sorted by sample (stable)
    first_allocation: np.ndarray     # per sample, then the end: its rows in `allocations`
    layout_crc32: int


def read_layout(buffer) -> BetonLayout:
    """The layout of the .beton in `buffer`; BetonLayoutError where it does not parse."""
    import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
    from ffcv.types import ALLOC_TABLE_TYPE, CURRENT_VERSION, FieldDescType, HeaderType, get_handlers, \
        get_metadata_type
    size = len(buffer)
    try:        # copies, not views: a view of a memory map would keep it from closing
        header = np.frombuffer(bytes(buffer[:HeaderType.itemsize]), HeaderType, count=1)[0]
        if header["version"] != CURRENT_VERSION:
            raise BetonLayoutError(f"format version {header['version']}, FFCV reads {CURRENT_VERSION}")
        fields_at, table_at = HeaderType.itemsize, int(header["alloc_table_ptr"])
        if not fields_at < table_at <= size or (size - table_at) % ALLOC_TABLE_TYPE.itemsize:
            raise BetonLayoutError(f"its allocation table at {table_at:,} does not fit its {size:,} bytes")
        descriptors = np.frombuffer(bytes(buffer[fields_at:fields_at + int(header["num_fields"]) * FieldDescType.itemsize]),
                                    FieldDescType)
        row_type = get_metadata_type(get_handlers(descriptors))
        count, metadata_at = int(header["num_samples"]), fields_at + descriptors.nbytes
        if metadata_at + count * row_type.itemsize > table_at:
            raise BetonLayoutError(f"{count:,} samples' metadata do not fit before its allocation table")
        table = np.frombuffer(bytes(buffer[table_at:size]), ALLOC_TABLE_TYPE)
    except BetonLayoutError:
        raise
    except Exception as error:  # noqa: BLE001 - numpy's and FFCV's assorted errors on bytes that are no .beton
        raise BetonLayoutError(f"not a readable .beton ({type(error).__name__}: {error})") from None
    layout_crc32 = zlib.crc32(buffer[table_at:size], zlib.crc32(buffer[:metadata_at]))
    order = np.argsort(table["sample_id"], kind="stable")
    allocations = table[order]
    first = np.searchsorted(allocations["sample_id"], np.arange(count + 1, dtype=np.uint64))
    return BetonLayout(count, metadata_at, row_type.itemsize, allocations, first, layout_crc32)


def _checksums(buffer, layout: BetonLayout, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """Samples [lo, hi)'s checksums, and the bytes they cover; a region past the end reads as empty,
    so its sample fails its checksum."""
    found, covered = np.empty(hi - lo, np.uint32), 0
    first = (layout.first_allocation[lo:hi + 1] - layout.first_allocation[lo]).tolist()
    rows = layout.allocations[int(layout.first_allocation[lo]):int(layout.first_allocation[hi])]
    pointers, sizes = rows["ptr"].tolist(), rows["size"].tolist()
    for sample in range(lo, hi):
        row = layout.metadata_at + sample * layout.row_bytes
        value = zlib.crc32(buffer[row:row + layout.row_bytes])
        for slot in range(first[sample - lo], first[sample - lo + 1]):
            value = zlib.crc32(buffer[pointers[slot]:pointers[slot] + sizes[slot]], value)
            covered += sizes[slot]
        found[sample - lo] = value
    return found, covered


def sample_checksums(buffer, layout: BetonLayout | None = None, progress=None, threads: int | None = None) -> np.ndarray:
    """Every sample's checksum (uint32), `progress.update`d in MiB as they are computed."""
    layout = layout or read_layout(buffer)
    starts = range(0, layout.count, SAMPLES_PER_TASK)
    result = np.empty(layout.count, np.uint32)
    with memoryview(buffer) as view, \
            ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1), thread_name_prefix="crc32") as pool:
        tasks = [pool.submit(_checksums, view, layout, lo, min(lo + SAMPLES_PER_TASK, layout.count)) for lo in starts]
        done = 0
        for lo, task in zip(starts, tasks):
            found, covered = task.result()
            result[lo:lo + len(found)] = found
            if progress is not None:
                progress.update((done + covered) // MIB - done // MIB)
            done += covered
    return result


def damaged_samples(buffer, recorded: np.ndarray, layout_crc32: int, progress=None) -> list[int]:
    """The ids of the samples whose bytes differ from those recorded at conversion; BetonLayoutError
    where the file's layout does (then no sample can be trusted)."""
    layout = read_layout(buffer)
    if layout.layout_crc32 != layout_crc32:
        raise BetonLayoutError("its header or allocation table fails the checksum recorded at conversion")
    if layout.count != len(recorded):
        raise BetonLayoutError(f"{layout.count:,} samples where its checksums file has {len(recorded):,}")
    return np.flatnonzero(sample_checksums(buffer, layout, progress) != recorded).tolist()


class MappedFile:
    """A file's bytes as a read-only memory map (an empty file as b''), for `with`."""

    def __init__(self, path: str | Path):
        self.file = open(path, "rb")
        size = os.fstat(self.file.fileno()).st_size
        self.buffer = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def __enter__(self):
        return self.buffer

    def __exit__(self, *exc) -> None:
        if isinstance(self.buffer, mmap.mmap):
            self.buffer.close()
        self.file.close()


def recorded_checksums(beton: Path, record: dict) -> np.ndarray:
    """The per-sample checksums the manifest `record` names for `beton`, checked against the
    record's sha256; BetonLayoutError where they do not match (then nothing can be checked)."""
    path = beton.parent / record["checksums"]
    try:
        table = path.read_bytes()
    except OSError as error:
        raise BetonLayoutError(f"its checksums file {path.name} is unreadable ({error.strerror})") from None
    if hashlib.sha256(table).hexdigest() != record.get("checksums_sha256") or len(table) != 4 * record["count"]:
        raise BetonLayoutError(f"its checksums file {path.name} differs from the one its manifest records")
    return np.frombuffer(table, "<u4")


def check_once(beton: Path, record: dict, results: Path) -> list[int]:
    """The damaged samples of the local `beton`, as its manifest `record` tells them, checked with
    progress by the first process of this node that asks, while the others wait: the result is
    kept in the folder `results`, keyed by the file's place, size and modification time, so the
    ranks of a job (and later jobs) share one read of a file that may be larger than memory."""
    status = os.stat(beton)
    identity = f"{os.path.realpath(beton)}\0{status.st_ino}\0{status.st_size}\0{status.st_mtime_ns}\0" \
               f"{record.get('checksums_sha256')}\0{record.get('layout_crc32')}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    results.mkdir(parents=True, exist_ok=True)
    result = results / f"{key}.json"
    with open(results / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return json.loads(result.read_text())["damaged"]
        recorded = recorded_checksums(beton, record)
        with MappedFile(beton) as buffer, Progress(-(-status.st_size // MIB), f"checking {beton}", unit="MiB") as progress:
            damaged = damaged_samples(buffer, recorded, record["layout_crc32"], progress)
        write_bytes_atomic(result, json.dumps({"beton": str(beton), "damaged": damaged}).encode(), durable=False)
    return damaged
