"""Hugging Face image-classification parquet, read in place by row group: the layout of `imagenet-1k`
on the Hub and what `push_to_hub` and `to_parquet` write, `data/<split>-NNNNN-of-NNNNN.parquet`,
`<split>.parquet` (or `--split-path SPLIT=PATTERN`), with columns `image` (a struct of `bytes` and `path`) and an integer
`label`, on disk or under an s3://, gs:// or https:// prefix.

Labels are kept as the parquet gives them (for `imagenet-1k` already the sorted-WNID order); class
names come from the dataset card's `class_label` names (`README.md`) where it has them. Split
`validation` becomes val; rows labelled -1 (a test split's) are skipped, and the skip is said.
"""
from __future__ import annotations

import hashlib
import os
import re
from bisect import bisect_right
from typing import Iterator

import numpy as np

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Missing, Source, canonical_split
from pipeline.formats.imagefolder import Skipped
from pipeline.storage.range_file import RangeFile

SHARD = re.compile(r"^(?:.*/)?([A-Za-z0-9_]+?)(?:-\d{5}-of-\d{5})?\.parquet$")   # one file a split: to_parquet's
PATTERNS = ("data/*.parquet", "*.parquet")
CARD = "README.md"
OPEN_FILES = 8
UNLABELLED = "test"


def schema_problem(schema) -> str | None:
    """What keeps a parquet schema from being an image-classification one, or None."""
    import pyarrow as pa
    names = schema.names
    if "image" not in names or "label" not in names:
        return f"columns {names}"
    image, label = schema.field("image").type, schema.field("label").type
    if not (pa.types.is_struct(image) and image.get_field_index("bytes") >= 0
            and (pa.types.is_binary(image.field("bytes").type) or pa.types.is_large_binary(image.field("bytes").type))):
        return f"column image is {image}"
    if not pa.types.is_integer(label):
        return f"column label is {label}"
    return None


class ParquetSource(Source):
    form = "parquet"
    title = "Hugging Face image-classification parquet (image.bytes, label)"
    remote_ok = True
    sample_reads = False

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        if not files.listable:
            return None
        found = cls._by_split(files, ())
        return ", ".join(f"{split}: {len(names)} files" for split, names in sorted(found.items())) or None

    @staticmethod
    def _by_split(files, split_paths) -> dict[str, list[str]]:
        if split_paths:
            return {canonical_split(split): files.list(pattern) for split, pattern in split_paths
                    if pattern.endswith(".parquet")}
        for pattern in PATTERNS:
            names = files.list(pattern)
            found: dict[str, list[str]] = {}
            for name in names:
                match = SHARD.match(name)
                if match:
                    found.setdefault(canonical_split(match[1]), []).append(name)
            if found:
                return found
        return {}

    def _files(self) -> dict[str, list[str]]:
        if not hasattr(self, "_found"):
            self._found = self._by_split(self.files, self.options.split_paths)
        return self._found

    def splits(self) -> list[str]:
        return sorted(split for split, names in self._files().items() if names and split != UNLABELLED)

    def notes(self) -> list[str]:
        test = self._files().get(UNLABELLED)
        return [f"{self.files.root}: {len(test)} {UNLABELLED} files, labelled -1 (not a labelled split): skipped"] \
            if test else []

    def describe(self) -> str:
        held = ", ".join(f"{split} {len(names)} files" for split, names in sorted(self._files().items()))
        return f"{self.files.root}: {self.title}: {held}"

    def parquet(self, name: str):
        """The file's pyarrow ParquetFile, one open per process (a forked worker opens its own)."""
        import pyarrow.parquet as pq
        if getattr(self, "_pid", None) != os.getpid():
            self._open, self._pid = {}, os.getpid()
        if name not in self._open:
            if len(self._open) >= OPEN_FILES:
                self._open.pop(next(iter(self._open)))
            where = self.files.shown(name)
            source = RangeFile(lambda at, size: self.files.read_at(name, at, size), 0, self.files.size(name)) \
                if self.files.remote else str(self.files.full(name))
            try:
                opened = pq.ParquetFile(source, pre_buffer=True)
            except Exception as error:  # noqa: BLE001 - pyarrow's ArrowInvalid and OSError
                raise ConversionError(f"{where}: not a readable parquet file ({error})") from None
            problem = schema_problem(opened.schema_arrow)
            if problem:
                raise ConversionError(f"{where}: {problem}; an image-classification parquet has image (a struct of "
                                      f"bytes and path) and label (an integer)")
            self._open[name] = opened
        return self._open[name]

    def _card_names(self) -> list[str] | None:
        if not hasattr(self, "_names"):
            self._names = None
            if self.files.exists(CARD):
                self._names = card_class_names(self.files.read(CARD).decode("utf-8", "replace"))
        return self._names

    def classes(self, splits: list[str]) -> list[str]:
        names = self._card_names()
        if names:
            return names
        top = max((int(labels.max()) for split in splits for _, labels in self._labels(split) if len(labels)),
                  default=-1)
        return [str(i) for i in range(top + 1)]

    def class_names(self, splits: list[str]) -> list[str] | None:
        return self._card_names()

    def _labels(self, split: str) -> Iterator[tuple[str, np.ndarray]]:
        """(file, its label column), a file at a time."""
        for name in self._files()[split]:
            table = self.parquet(name).read(columns=["label"])
            yield name, table.column("label").to_numpy(zero_copy_only=False).astype(np.int64)

    def scan(self, split: str) -> Entries:
        builder = self.builder(split)
        for number, (name, labels) in enumerate(self._labels(split)):
            where = self.files.shown(name)
            unlabelled = labels == -1
            if unlabelled.any():
                builder.skipped.append(Skipped(where, f"{int(unlabelled.sum()):,} rows labelled -1 (a test split's): "
                                                      f"skipped"))
            bad = np.flatnonzero((labels < -1) | (labels >= len(self.used_classes)))
            if len(bad):
                raise ConversionError(f"{where}: row {bad[0]}: label {labels[bad[0]]} is out of range (the classes "
                                      f"number {len(self.used_classes)})")
            rows = np.flatnonzero(~unlabelled)
            builder.add(labels[rows], number, rows, self._mean_sizes(name)[self._row_group_of(name, rows)])
        return builder.build(list(self._files()[split]))

    def _row_starts(self, name: str) -> list[int]:
        """The first row of each row group of the file."""
        if not hasattr(self, "_starts"):
            self._starts = {}
        if name not in self._starts:
            counts = [self.parquet(name).metadata.row_group(g).num_rows
                      for g in range(self.parquet(name).metadata.num_row_groups)]
            self._starts[name] = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        return self._starts[name]

    def _row_group_of(self, name: str, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self._row_starts(name)), rows, side="right") - 1

    def _mean_sizes(self, name: str) -> np.ndarray:
        """Per row group, its images' mean stored size: what a sample of it costs to read."""
        metadata, sizes = self.parquet(name).metadata, []
        for number in range(metadata.num_row_groups):
            group = metadata.row_group(number)
            image = next(group.column(i) for i in range(group.num_columns)
                         if group.column(i).path_in_schema == "image.bytes")
            sizes.append(image.total_compressed_size // max(1, group.num_rows))
        return np.array(sizes or [0], np.int64)

    def blocks(self, split: str) -> Iterator[np.ndarray]:
        """One block a row group: what the file is read by."""
        entries = self.entries(split)
        bounds = np.searchsorted(entries.file, np.arange(len(entries.files) + 1))   # a file's samples are neighbours
        for number, name in enumerate(entries.files):
            where = np.arange(bounds[number], bounds[number + 1])
            if len(where):
                groups = self._row_group_of(name, np.asarray(entries.offset[where]))
                yield from np.split(where, np.flatnonzero(np.diff(groups)) + 1)

    def read(self, split: str, indices: np.ndarray) -> list:
        entries = self.entries(split)
        out: list = [None] * len(indices)
        wanted: dict[tuple[int, int], list[int]] = {}
        for position, index in enumerate(indices):
            number, row = int(entries.file[index]), int(entries.offset[index])
            group = bisect_right(self._row_starts(entries.files[number]), row) - 1
            wanted.setdefault((number, group), []).append(position)
        for (number, group), positions in wanted.items():
            name = entries.files[number]
            first = self._row_starts(name)[group]
            column = self.parquet(name).read_row_group(group, columns=["image.bytes"]).column("image")
            images = column.combine_chunks().field("bytes")
            for position in positions:
                value = images[int(entries.offset[indices[position]]) - first].as_py()
                out[position] = value if value is not None else Missing("its image has no bytes (null)")
        return out

    def fingerprint(self, split: str) -> str:
        """Each file's size and footer (its schema, row groups and their statistics)."""
        digest = hashlib.sha256()
        for name in self._files()[split]:
            size = self.files.size(name)
            tail = self.files.read_at(name, size - 8, 8)
            length = int.from_bytes(tail[:4], "little")
            footer = self.files.read_at(name, max(0, size - 8 - length), length)
            digest.update(f"{name}\0{size}\0{hashlib.sha256(footer).hexdigest()}\n".encode())
        return digest.hexdigest()

    def name(self, split: str, index: int) -> str:
        entries = self.entries(split)
        return f"{self.files.shown(entries.files[int(entries.file[index])])}:row {int(entries.offset[index])}"


def card_class_names(card: str) -> list[str] | None:
    """The label feature's class names from a dataset card's YAML header (`dataset_info.features`),
    or None where it has none."""
    import yaml
    found = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", card, re.S)
    if not found:
        return None
    try:
        header = yaml.safe_load(found[1]) or {}
    except yaml.YAMLError:
        return None
    infos = header.get("dataset_info") if isinstance(header, dict) else None
    for info in infos if isinstance(infos, list) else [infos]:
        for feature in (info or {}).get("features", []) or []:
            names = ((feature or {}).get("dtype") or {}) if isinstance(feature, dict) else {}
            names = names.get("class_label", {}).get("names") if isinstance(names, dict) else None
            if feature.get("name") == "label" and names:
                if isinstance(names, dict):
                    return [str(names[key]) for key in sorted(names, key=lambda k: int(k))]
                return [str(name) for name in names]
    return None
