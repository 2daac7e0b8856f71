"""A split's samples as columns of numbers (`Entries`), built part by part as a source is scanned
(`EntriesBuilder`): in memory, or, for a conversion, in files under a scratch folder in OUT that are
then memory-mapped, so that the converter's own memory does not grow with the dataset's count (the
pages are the kernel's cache, dropped and read again as it needs). Per sample: 28 bytes, and a file
form's name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from pipeline.formats.imagefolder import Skipped

COLUMNS = {"labels": np.int32, "file": np.int32, "offset": np.int64, "size": np.int64, "header_back": np.int32}
CHUNK = 1 << 14              # samples a column is read or rewritten by
PART = 4096                  # files of their own held before they go to the columns


@dataclass
class Entries:
    """A split's samples in the source's order: per sample its label, its file (an index into
    `files`), the offset of its bytes there (a parquet file: its row) and their size (a parquet
    cell: its row group's mean); `header_back`, for tar members, how far before its data its
    headers start. `skipped`: what the scan found that cannot be a sample. Columns may be
    memory-mapped files (np.memmap)."""
    labels: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    files: Sequence[str]
    skipped: list[Skipped] = field(default_factory=list)
    header_back: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> Entries:
        """The samples at `indices` (ascending) alone, in memory, with only the files they lie in:
        what a task that reads a few of them elsewhere is given."""
        indices = np.asarray(indices, np.int64)
        used, file = np.unique(np.asarray(self.file[indices]), return_inverse=True)
        return Entries(np.array(self.labels[indices]), file.astype(np.int32), np.array(self.offset[indices]),
                       np.array(self.size[indices]), [self.files[int(number)] for number in used], [],
                       None if self.header_back is None else np.array(self.header_back[indices]))

    def mean_size(self, default: int = 128 << 10) -> int:
        total = sum(int(self.size[at:at + CHUNK].sum()) for at in range(0, len(self), CHUNK))
        return total // len(self) if len(self) and total > 0 else default

    def distinct_labels(self) -> set[int]:
        found: set[int] = set()
        for at in range(0, len(self), CHUNK):
            found.update(np.unique(self.labels[at:at + CHUNK]).tolist())
        return found

    def label_counts(self, classes: int) -> np.ndarray:
        counts = np.zeros(classes, np.int64)
        for at in range(0, len(self), CHUNK):
            counts += np.bincount(self.labels[at:at + CHUNK], minlength=classes)[:classes]
        return counts


class Names(Sequence):
    """One name a sample, kept as one blob of UTF-8 and the offsets where each starts."""

    def __init__(self, blob, starts):
        self.blob, self.starts = blob, starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> str:
        return bytes(self.blob[self.starts[index]:self.starts[index + 1]]).decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        for at in range(0, len(self), CHUNK):
            starts = self.starts[at:at + CHUNK + 1].tolist()
            chunk = bytes(self.blob[starts[0]:starts[-1]])
            base = starts[0]
            for begin, end in zip(starts, starts[1:]):
                yield chunk[begin - base:end - base].decode("utf-8", "surrogateescape")


class EntriesBuilder:
    """Appends a split's samples in source order, a part at a time, to columns in memory or in
    files under `folder`; `build` gives the Entries."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.parts: dict[str, list] = {name: [] for name in COLUMNS}
        self.handles: dict[str, object] = {}
        self.count, self.names_bytes = 0, 0
        self.name_parts: list[str] = []          # names kept in memory, where there is no folder
        self.skipped: list[Skipped] = []
        self.with_headers: bool | None = None
        self.pending: list[tuple[str, int, int]] = []

    def _append(self, column: str, values) -> None:
        values = np.asarray(values, COLUMNS[column])
        if self.folder is None:
            self.parts[column].append(values)
            return
        if column not in self.handles:
            self.handles[column] = open(self.folder / f"{column}.bin", "wb", buffering=256 << 10)
        self.handles[column].write(values.tobytes())

    def add(self, labels, file, offset, size, header_back=None, names: list[str] | None = None) -> None:
        """A part's samples: per sample its label, file, offset and size (`file` may be one number
        for all), and for tar members their `header_back`, for a file form their names."""
        count = len(labels)
        if self.with_headers is None:
            self.with_headers = header_back is not None
        self._append("labels", labels)
        self._append("file", np.broadcast_to(np.asarray(file, np.int32), (count,)))
        self._append("offset", offset)
        self._append("size", size)
        if self.with_headers:
            self._append("header_back", header_back)
        if names is not None:
            self._add_names(names)
        self.count += count

    def add_file(self, name: str, label: int, size: int) -> None:
        """A sample that is a file of its own (its own `file`, read whole); held back a part at a time."""
        self.pending.append((name, label, size))
        if len(self.pending) >= PART:
            self._flush_files()

    def _flush_files(self) -> None:
        if self.pending:
            names, labels, sizes = zip(*self.pending)
            self.pending = []
            self.add(labels, np.arange(self.count, self.count + len(names)), np.zeros(len(names), np.int64), sizes,
                     names=list(names))

    def _add_names(self, names: list[str]) -> None:
        encoded = [name.encode("utf-8", "surrogateescape") for name in names]
        ends = self.names_bytes + np.cumsum([len(name) for name in encoded], dtype=np.int64)
        self.names_bytes = int(ends[-1]) if len(ends) else self.names_bytes
        if self.folder is None:
            self.name_parts.extend(names)
            return
        if "names" not in self.handles:
            self.handles["names"] = open(self.folder / "names.bin", "wb", buffering=256 << 10)
            self.handles["name_starts"] = open(self.folder / "name_starts.bin", "wb", buffering=256 << 10)
            self.handles["name_starts"].write(np.zeros(1, np.int64).tobytes())     # the first name's start
        self.handles["names"].write(b"".join(encoded))
        self.handles["name_starts"].write(ends.tobytes())

    def build(self, files: Sequence[str] | None = None) -> Entries:
        """The Entries; `files` for a form whose samples lie in a few files (None: each sample is
        the file its name names)."""
        self._flush_files()
        for handle in self.handles.values():
            handle.close()
        columns = {name: self._column(name) for name in COLUMNS if name != "header_back" or self.with_headers}
        if files is None:
            files = self._names()
        return Entries(columns["labels"], columns["file"], columns["offset"], columns["size"], files, self.skipped,
                       columns.get("header_back"))

    def _column(self, name: str) -> np.ndarray:
        if self.folder is None:
            parts = self.parts[name]
            return np.concatenate(parts) if parts else np.empty(0, COLUMNS[name])
        return _mapped(self.folder / f"{name}.bin", COLUMNS[name])

    def _names(self) -> Sequence[str]:
        if self.folder is None or "names" not in self.handles:
            return self.name_parts
        return Names(_mapped(self.folder / "names.bin", np.uint8), _mapped(self.folder / "name_starts.bin", np.int64))


def _mapped(path: Path, dtype) -> np.ndarray:
    """The file as a read-only column (an empty array for an empty or missing file)."""
    if not path.exists() or os.path.getsize(path) == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype, mode="r")


def relabelled(labels: np.ndarray, mapping: np.ndarray, folder: Path | None) -> np.ndarray:
    """The labels column with each value v replaced by mapping[v], chunk by chunk (a mapped column
    is rewritten in place in its file)."""
    if folder is None or not isinstance(labels, np.memmap):
        return mapping[labels].astype(np.int32)
    writable = np.memmap(labels.filename, np.int32, mode="r+")
    for at in range(0, len(writable), CHUNK):
        writable[at:at + CHUNK] = mapping[writable[at:at + CHUNK]]
    writable.flush()
    return np.memmap(labels.filename, np.int32, mode="r")
