"""A list of images per split: `SRC/train.csv` and `SRC/val.csv` (columns `path` and `label`), or
`.jsonl` with those keys, each path relative to the list (or absolute). A label is an integer or a
class name; an optional `SRC/classes.txt` (one name a line) gives the classes, which integers index
and names must be in. Without it, integer labels are kept as they are and names are labelled by
their place in the sorted names."""
from __future__ import annotations

import csv
import io
import json
import os

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source, canonical_split, files_fingerprint, label_list
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

    def _rows(self, split: str) -> list[tuple[int, str, object]]:
        """(line, path, label) per row of the split's list, labels as given (int or str)."""
        if not hasattr(self, "_read"):
            self._read: dict[str, list] = {}
        if split in self._read:
            return self._read[split]
        name = self._lists(self.files)[split]
        where = self.files.shown(name)
        text = self.files.read(name).decode("utf-8-sig")
        rows = []
        if name.endswith(".csv"):
            reader = csv.DictReader(io.StringIO(text))
            columns = reader.fieldnames or []
            if not {"path", "label"} <= set(columns):
                raise ConversionError(f"{where}: columns {columns}; a list needs 'path' and 'label'")
            for row in reader:
                label = row["label"].strip()
                rows.append((reader.line_num, row["path"], int(label) if label.lstrip("-").isdigit() else label))
        else:
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append((number, row["path"], row["label"]))
                except (ValueError, KeyError, TypeError) as error:
                    raise ConversionError(f"{where}: line {number}: not an object with 'path' and 'label' "
                                          f"({type(error).__name__}: {error})") from None
        self._read[split] = rows
        return rows

    def _named_classes(self) -> list[str] | None:
        if not self.files.exists(CLASSES):
            return None
        return [line.strip() for line in self.files.read(CLASSES).decode("utf-8").splitlines() if line.strip()]

    def classes(self, splits: list[str]) -> list[str]:
        named = self._named_classes()
        if named is not None:
            return named
        labels = [label for split in splits for _, _, label in self._rows(split)]
        return label_list(labels, f"{self.files.root}: the lists of {', '.join(splits)}")[0]

    def scan(self, split: str) -> Entries:
        where = self.files.shown(self._lists(self.files)[split])
        place = {name: label for label, name in enumerate(self.used_classes)}
        names, labels, sizes, skipped = [], [], [], []
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
                skipped.append(Skipped(str(full), f"listed on line {line} of {where}, but {error.strerror.lower()}"))
                continue
            names.append(path)
            labels.append(label if isinstance(label, int) else place[label])
            sizes.append(size)
        return Entries.of_files(names, labels, sizes, skipped)

    def fingerprint(self, split: str) -> str:
        extra = [self._lists(self.files)[split]] + ([CLASSES] if self.files.exists(CLASSES) else [])
        return files_fingerprint(self, split, extra)
