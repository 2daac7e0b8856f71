"""A list of images per split: `SRC/train.csv` and `SRC/val.csv` (columns `path` and `label`), or
`.jsonl` with those keys, each path relative to the list (or absolute). A label is an integer or a
class name; an optional `SRC/classes.txt` (one name a line) gives the classes, which integers index
and names must be in. Without it, integer labels are kept as they are and names are labelled by
their place in the sorted names."""
from __future__ import annotations

import csv
import json
import os
from typing import Iterator

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source, canonical_split, class_list, files_fingerprint
from pipeline.formats.imagefolder import Skipped

EXTENSIONS = (".csv", ".jsonl")
SPLIT_STEMS = ("train", "val", "validation", "valid")
CLASSES = "classes.txt"


class ListSource(Source):
    form = "list"
    title = "lists of images and labels (SPLIT.csv or SPLIT.jsonl)"
    whole_files = True

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        lists = cls._lists(files)
        return ", ".join(sorted(lists.values())) if lists and not files.remote else None

    @staticmethod
    def _lists(files) -> dict[str, str]:
        """{split: list file name}."""
        found = {}
        for stem in SPLIT_STEMS:
            for extension in EXTENSIONS:
                if not files.remote and files.exists(stem + extension):
                    found[canonical_split(stem)] = stem + extension
        return found

    def splits(self) -> list[str]:
        return sorted(self._lists(self.files))

    def _rows(self, split: str) -> Iterator[tuple[int, str, object]]:
        """(line, path, label) per row of the split's list, labels as given (int or str), one at a time."""
        name = self._lists(self.files)[split]
        where = self.files.shown(name)
        with open(self.files.full(name), encoding="utf-8-sig", newline="") as text:
            if name.endswith(".csv"):
                reader = csv.DictReader(text)
                columns = reader.fieldnames or []
                if not {"path", "label"} <= set(columns):
                    raise ConversionError(f"{where}: columns {columns}; a list needs 'path' and 'label'")
                for row in reader:
                    label = (row["label"] or "").strip()
                    yield reader.line_num, row["path"], int(label) if label.lstrip("-").isdigit() else label
                return
            for number, line in enumerate(text, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    yield number, row["path"], row["label"]
                except (ValueError, KeyError, TypeError) as error:
                    raise ConversionError(f"{where}: line {number}: not an object with 'path' and 'label' "
                                          f"({type(error).__name__}: {error})") from None

    def _named_classes(self) -> list[str] | None:
        if not self.files.exists(CLASSES):
            return None
        return [line.strip() for line in self.files.read(CLASSES).decode("utf-8").splitlines() if line.strip()]

    def classes(self, splits: list[str]) -> list[str]:
        named = self._named_classes()
        if named is not None:
            return named
        numbers, names = set(), set()
        for split in splits:
            for _, _, label in self._rows(split):
                (numbers if isinstance(label, int) else names).add(label)
        return class_list(numbers, names, f"{self.files.root}: the lists of {', '.join(splits)}")

    def scan(self, split: str) -> Entries:
        where = self.files.shown(self._lists(self.files)[split])
        place = {name: label for label, name in enumerate(self.used_classes)}
        builder = self.builder(split)
        for line, path, label in self._rows(split):
            if isinstance(label, int) and not 0 <= label < len(self.used_classes):
                raise ConversionError(f"{where}: line {line}: label {label} is out of range (the classes number "
                                      f"{len(self.used_classes)})")
            if isinstance(label, str) and label not in place:
                raise ConversionError(f"{where}: line {line}: class {label!r} is not in the class list")
            full = self.files.full(path)
            try:
                size = os.stat(full).st_size
            except OSError as error:
                builder.skipped.append(Skipped(str(full), f"listed on line {line} of {where}, but "
                                                          f"{error.strerror.lower()}"))
                continue
            builder.add_file(path, label if isinstance(label, int) else place[label], size)
        return builder.build()

    def fingerprint(self, split: str) -> str:
        extra = [self._lists(self.files)[split]] + ([CLASSES] if self.files.exists(CLASSES) else [])
        return files_fingerprint(self, split, extra)
