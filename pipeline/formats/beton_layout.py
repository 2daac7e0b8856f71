"""An FFCV `.beton` rewritten in one canonical layout (`canonical_copy`), so that a conversion's file is
a function of its samples alone.

FFCV's writer gives each of its processes pages of the file as they ask for them, so with more than
one process where a sample's bytes land, and so the file, changes from run to run (the samples, their
order and their bytes do not). The canonical layout is the one FFCV's writer makes with a single
process: samples packed in order into pages, a sample that does not fit in what is left of a page
starting the next one, the allocation table in sample order, and zeros in the metadata rows'
padding (where FFCV's writer leaves whatever its shared memory held). The copy reads the file once and
writes it once, a page at a time.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.formats.beton_checksums import MappedFile, read_layout

POINTER_FIELDS = ("ptr", "data_ptr")     # where FFCV's fields keep a sample's place in the file


def canonical_copy(source: Path, destination: Path) -> None:
    """Write `source`'s samples to `destination` in the canonical layout, fsynced."""
    import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
    from ffcv.types import ALLOC_TABLE_TYPE, FieldDescType, HeaderType, get_handlers, get_metadata_type
    with MappedFile(source) as buffer, open(destination, "wb") as out:
        layout = read_layout(buffer)
        header = np.frombuffer(bytes(buffer[:HeaderType.itemsize]), HeaderType, count=1).copy()
        page = int(header[0]["page_size"])
        descriptors = np.frombuffer(buffer[HeaderType.itemsize:layout.metadata_at], FieldDescType)
        row_type = get_metadata_type(get_handlers(descriptors))
        found = np.frombuffer(buffer[layout.metadata_at:layout.metadata_at + layout.count * layout.row_bytes], row_type)
        rows = np.zeros(layout.count, row_type)      # the padding between fields zero, where FFCV leaves what was there
        for name in row_type.names:
            rows[name] = found[name]
        data_at = layout.metadata_at + layout.count * layout.row_bytes
        base = -(-data_at // page) * page
        table = layout.allocations.copy()
        pages = _packed(table, layout.first_allocation, layout.count, page)
        moved = dict(zip(zip(layout.allocations["sample_id"].tolist(), layout.allocations["ptr"].tolist()),
                         (base + pages).tolist()))
        _repoint(rows, moved)
        table["ptr"] = base + pages
        header[0]["alloc_table_ptr"] = base + (-(-int(pages.max(initial=-1) + 1) // page) * page if len(table) else 0)
        out.write(header.tobytes())
        out.write(bytes(buffer[HeaderType.itemsize:layout.metadata_at]))
        out.write(rows.tobytes())
        out.write(bytes(base - data_at))
        _write_pages(out, buffer, layout.allocations, pages, page)
        out.write(table.astype(ALLOC_TABLE_TYPE).tobytes())
        out.flush()
        os.fsync(out.fileno())


def _packed(table: np.ndarray, first: np.ndarray, count: int, page: int) -> np.ndarray:
    """Each allocation's new offset from the data region's start, as one writer process packs them."""
    sizes = table["size"].astype(np.int64).tolist()
    offsets = np.zeros(len(sizes), np.int64)
    page_start, used = -page, page          # no page yet: the first allocation opens one
    for sample in range(count):
        lo, hi = int(first[sample]), int(first[sample + 1])
        for _ in range(2):                  # a sample that overflows its page starts again on a fresh one
            at, fits = used, True
            for slot in range(lo, hi):
                if sizes[slot] > page - at:
                    if slot > lo or at == 0:
                        fits = False
                        break
                    page_start, at = page_start + page, 0
                offsets[slot] = page_start + at
                at += sizes[slot]
            if fits:
                used = at
                break
            page_start, used = page_start + page, 0
        else:
            raise ValueError(f"sample {sample}'s {sum(sizes[lo:hi]):,} bytes do not fit in a {page:,}-byte page")
    return offsets


def _repoint(rows: np.ndarray, moved: dict[tuple[int, int], int]) -> None:
    """Point each sample's metadata at its allocations' new places."""
    for name in rows.dtype.names:
        column = rows[name]
        leaves = [leaf for leaf in (column.dtype.names or ()) if leaf in POINTER_FIELDS]
        for leaf in leaves:
            values = column[leaf]
            for sample, old in enumerate(values.tolist()):
                values[sample] = moved.get((sample, old), old)


def _write_pages(out, buffer, allocations: np.ndarray, offsets: np.ndarray, page: int) -> None:
    """The data region, a page at a time, each whole (zeros where nothing lies) as FFCV writes it."""
    if not len(offsets):
        return
    order = np.argsort(offsets, kind="stable")
    pointers, sizes = allocations["ptr"].tolist(), allocations["size"].tolist()
    current, data = 0, bytearray(page)
    for slot in order.tolist():
        number = int(offsets[slot]) // page
        while number > current:
            out.write(data)
            current, data = current + 1, bytearray(page)
        at = int(offsets[slot]) - number * page
        data[at:at + sizes[slot]] = buffer[pointers[slot]:pointers[slot] + sizes[slot]]
    out.write(data)
