"""What every source gives the converters (`Source`): its labelled splits and classes, and per split
its samples as `Entries` (pipeline/convert/sources/entries.py), in a deterministic order, each with
its label and where its bytes lie (a whole file, a byte range of a file or object, a parquet cell);
a fingerprint that changes when the source does; and `read`, which fetches a block of samples'
bytes with as few reads as it can. A scan keeps no object per sample: its columns go to files
under `scratch` where the converter gives one, and names of tar members are read again on demand
(`name`) for the few messages that need them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.entries import CHUNK, Entries, EntriesBuilder
from pipeline.convert.sources.files import SourceFiles

BLOCK_BYTES = 4 << 20        # a block of neighbouring samples read at once
BLOCK_SAMPLES = 64
FILE_BLOCK_SAMPLES = 16      # a block of samples that are files of their own: one read each anyway
SPLIT_ALIASES = {"validation": "val", "valid": "val"}


@dataclass(frozen=True)
class SourceOptions:
    """How to read SRC: the form (None: detected from what SRC holds) and the options of some forms."""
    form: str | None = None
    split_paths: tuple[tuple[str, str], ...] = ()   # (split, pattern): WebDataset and parquet files by split
    label_key: str | None = None                    # a WebDataset sample's label, under this key of its .json
    strict: bool = False                            # a damaged source tar is an error, not skipped samples

    def recorded(self) -> dict:
        """What the manifest keeps, for --repair to read the source as it was read."""
        return {key: value for key, value in (("split_paths", dict(self.split_paths)), ("label_key", self.label_key))
                if value}


class Source:
    """One form of data on disk or at a URL; a subclass reads one form (one file each in
    pipeline/convert/sources/). Errors about the source as a whole are ConversionErrors (one line, exit 2)."""
    form = ""               # the name --source-format takes
    title = ""              # what the form is, in the first line of output
    remote_ok = False       # whether SRC may be a URL
    whole_files = False     # each sample is a file of its own (else a byte range of a larger file)
    sample_reads = True     # a sample is read without its neighbours (a parquet cell is not: its row group is)

    def __init__(self, files: SourceFiles, options: SourceOptions):
        self.files, self.options = files, options
        self._entries: dict[str, Entries] = {}
        self.used_classes: list[str] | None = None
        self.scratch: Path | None = None     # where a scan keeps its columns (None: in memory)
        self._numbers: dict[str, np.ndarray] = {}   # a restricted split's samples' indices in the whole split

    def builder(self, split: str) -> EntriesBuilder:
        return EntriesBuilder(self.scratch / split if self.scratch is not None else None)

    def use_classes(self, classes: list[str]) -> None:
        """Label samples by their class's place in `classes` (this conversion's, or a manifest's)."""
        self.used_classes = list(classes)
        self._entries.clear()
        self._numbers.clear()

    @classmethod
    def found(cls, files: SourceFiles, splits: list[str]) -> str | None:
        """What in SRC shows this form (a few words), or None where nothing does."""
        raise NotImplementedError

    def describe(self) -> str:
        """The first line of a conversion's output: SRC, the form found and what it holds."""
        return f"{self.files.root}: {self.title}"

    def splits(self) -> list[str]:
        """The labelled splits the source holds."""
        raise NotImplementedError

    def notes(self) -> list[str]:
        """What the source holds and no conversion takes (a test split without labels), one line each."""
        return []

    def classes(self, splits: list[str]) -> list[str]:
        """The class list (index = label) for a conversion of `splits`."""
        raise NotImplementedError

    def class_names(self, splits: list[str]) -> list[str] | None:
        """Readable names of the classes, where the source has them (ImageNet's words)."""
        return None

    def restrict(self, split: str, entries: Entries, numbers: np.ndarray) -> None:
        """Read only `entries` of `split` (`Entries.subset`), whose indices in the whole split are
        `numbers`: a task given a few samples reads them without scanning the source again."""
        self._entries[split], self._numbers[split] = entries, np.asarray(numbers)

    def entry_number(self, split: str, index: int) -> int:
        """The sample's index in the whole split."""
        numbers = self._numbers.get(split)
        return int(index) if numbers is None else int(numbers[index])

    def entries(self, split: str) -> Entries:
        if split not in self._entries:
            self._entries[split] = self.scan(split)
        return self._entries[split]

    def scan(self, split: str) -> Entries:
        raise NotImplementedError

    def fingerprint(self, split: str) -> str:
        """Changes when anything the split is read from changes (files_fingerprint for a form of files)."""
        raise NotImplementedError

    def name(self, split: str, index: int) -> str:
        """The sample's name for messages: a path, or a tar and member, or a parquet file and row."""
        entries = self.entries(split)
        return self.files.shown(entries.files[int(entries.file[index])])

    def blocks(self, split: str) -> Iterator[np.ndarray]:
        """Every sample's index, in source order, in blocks that are read at once."""
        entries = self.entries(split)
        if self.whole_files:
            for start in range(0, len(entries), FILE_BLOCK_SAMPLES):
                yield np.arange(start, min(start + FILE_BLOCK_SAMPLES, len(entries)))
        else:
            yield from neighbour_blocks(entries)

    def read(self, split: str, indices: np.ndarray) -> list:
        """The bytes of each sample of `indices`, in that order; where a sample cannot be read,
        a `Missing` with the reason instead."""
        entries = self.entries(split)
        if self.whole_files:
            return [self._whole(entries.files[int(entries.file[index])]) for index in indices]
        out: list = [None] * len(indices)
        by_file: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            by_file.setdefault(int(entries.file[index]), []).append(position)
        for file, positions in by_file.items():
            ranges = [(int(entries.offset[indices[p]]), int(entries.offset[indices[p]] + entries.size[indices[p]]))
                      for p in positions]
            try:
                pieces = self.files.read_ranges(entries.files[file], ranges)
            except OSError as error:
                pieces = [Missing(f"unreadable ({error.strerror or error})")] * len(positions)
            for p, piece, (start, end) in zip(positions, pieces, ranges):
                out[p] = piece if isinstance(piece, Missing) or len(piece) == end - start else \
                    Missing(f"{len(piece):,} of its {end - start:,} bytes are there: the file ends early")
        return out

    def _whole(self, name: str):
        try:
            return self.files.read(name)
        except FileNotFoundError:
            return Missing("no such file")
        except OSError as error:
            return Missing(f"unreadable ({error.strerror or error})")

    def check_splits(self, splits: list[str]) -> None:
        """A ConversionError unless the source holds each split asked for."""
        have = self.splits()
        missing = [split for split in splits if split not in have]
        if missing:
            raise ConversionError(f"{self.files.root}: no {', '.join(missing)} split in this {self.title} source "
                                  f"(it holds: {', '.join(have) or 'none'}); choose with --splits")


@dataclass(frozen=True)
class Missing:
    """A sample whose bytes could not be read, and why."""
    reason: str


def files_fingerprint(source: Source, split: str, extra: list[str] = ()) -> str:
    """For samples that are files of their own: changes when a file is added, removed, relabelled,
    resized or touched, or any of the `extra` files (a label list) changes."""
    entries, files = source.entries(split), source.files
    digest = hashlib.sha256()
    for name in extra:
        digest.update(f"{name}\0{files.signature(name)}\n".encode())
    labels = (label for at in range(0, len(entries), CHUNK) for label in entries.labels[at:at + CHUNK].tolist())
    for name, label in zip(entries.files, labels):
        digest.update(f"{name}\0{label}\0{files.signature(name)}\n".encode())
    return digest.hexdigest()


def neighbour_blocks(entries: Entries) -> Iterator[np.ndarray]:
    """Runs of consecutive samples of one file, each up to BLOCK_BYTES and BLOCK_SAMPLES."""
    start, total = 0, 0
    for at in range(0, len(entries), CHUNK):
        sizes = entries.size[at:at + CHUNK].tolist()
        files = entries.file[at:at + CHUNK + 1].tolist()
        for offset, size in enumerate(sizes):
            index, total = at + offset, total + max(0, size)
            if (offset + 1 == len(files) or files[offset + 1] != files[offset]
                    or index + 1 - start >= BLOCK_SAMPLES or total >= BLOCK_BYTES):
                yield np.arange(start, index + 1)
                start, total = index + 1, 0


def canonical_split(name: str) -> str:
    return SPLIT_ALIASES.get(name, name)


def class_list(numbers: set[int], names: set[str], where: str) -> list[str]:
    """The classes of labels given as integers (kept as they are: the classes are their numbers) or
    as class names (the sorted names); a mix is an error."""
    if numbers and names:
        raise ConversionError(f"{where}: labels mix integers and class names")
    if any(number < 0 for number in numbers):
        raise ConversionError(f"{where}: negative label {min(numbers)}")
    return sorted(names) if names else [str(i) for i in range(max(numbers, default=-1) + 1)]
