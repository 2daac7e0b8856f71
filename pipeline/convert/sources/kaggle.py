"""ImageNet as Kaggle hands it out (the `imagenet-object-localization-challenge` download, unzipped):
`ILSVRC/Data/CLS-LOC/train/<wnid>/*.JPEG`, a flat `val/` labelled by `LOC_val_solution.csv` (the
first WNID of each row's `PredictionString`), class words in `LOC_synset_mapping.txt`. Labels are
the sorted WNIDs' places, as the folder form and torchvision's `ImageNet` give them; `test/` has no
labels and is left out."""
from __future__ import annotations

import csv
import io
import os
import re

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source, files_fingerprint
from pipeline.formats.imagefolder import IMAGE_EXTENSIONS, Skipped

DATA = "ILSVRC/Data/CLS-LOC"
MAPPING = "LOC_synset_mapping.txt"
VAL_LABELS = "LOC_val_solution.csv"
WNID = re.compile(r"^n\d{8}$")


class KaggleSource(Source):
    form = "kaggle"
    title = "ImageNet in Kaggle's layout (ILSVRC/Data/CLS-LOC, LOC_val_solution.csv)"
    whole_files = True

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        if files.remote or not files.is_dir(DATA):
            return None
        return f"{DATA}/"

    def splits(self) -> list[str]:
        return [split for split in ("train", "val") if self.files.is_dir(f"{DATA}/{split}")]

    def notes(self) -> list[str]:
        if not self.files.is_dir(f"{DATA}/test"):
            return []
        count = sum(1 for _ in os.scandir(self.files.full(f"{DATA}/test")))
        return [f"{self.files.shown(DATA + '/test')}: {count:,} images without labels (a test split): skipped"]

    def _mapping(self) -> list[tuple[str, str]]:
        if not hasattr(self, "_words"):
            path = self.files.shown(MAPPING)
            try:
                lines = self.files.read(MAPPING).decode("utf-8").splitlines()
            except FileNotFoundError:
                raise ConversionError(f"{path}: missing; Kaggle's download has it beside ILSVRC/ (the class "
                                      f"list)") from None
            pairs = []
            for number, line in enumerate(lines, 1):
                wnid, _, words = line.strip().partition(" ")
                if line.strip() and not WNID.match(wnid):
                    raise ConversionError(f"{path}: line {number} does not start with a WNID: {line[:60]!r}")
                if line.strip():
                    pairs.append((wnid, words))
            self._words = sorted(pairs)
        return self._words

    def classes(self, splits: list[str]) -> list[str]:
        return [wnid for wnid, _ in self._mapping()]

    def class_names(self, splits: list[str]) -> list[str] | None:
        return [words for _, words in self._mapping()]

    def scan(self, split: str) -> Entries:
        place = {wnid: label for label, wnid in enumerate(self.used_classes)}
        root = self.files.full(f"{DATA}/{split}")
        builder = self.builder(split)
        if split == "train":
            for folder in sorted(os.scandir(root), key=lambda e: e.name):
                if not folder.is_dir():
                    builder.skipped.append(Skipped(folder.path, "not inside a class folder"))
                    continue
                if folder.name not in place:
                    raise ConversionError(f"{folder.path}: {folder.name} is not a class of {self.files.shown(MAPPING)}")
                self._add_folder(folder.path, place[folder.name], builder)
        else:
            truth = self._val_truth(place)
            self._add_folder(str(root), None, builder, truth)
            if truth:
                extra = sorted(truth)[:3]
                raise ConversionError(f"{self.files.shown(VAL_LABELS)}: {len(truth):,} rows name images that are not "
                                      f"in {root} (e.g. {', '.join(extra)})")
        return builder.build()

    def _add_folder(self, folder: str, label: int | None, builder, truth=None) -> None:
        for path in sorted(os.path.join(folder, name) for name in os.listdir(folder)):
            stem, extension = os.path.splitext(os.path.basename(path))
            if extension.lower() not in IMAGE_EXTENSIONS or not os.path.isfile(path):
                builder.skipped.append(Skipped(path, f"not an image file name (extension {extension or 'none'!r})"))
                continue
            if truth is not None:
                if stem not in truth:
                    raise ConversionError(f"{self.files.shown(VAL_LABELS)}: no row for {stem} ({path})")
                label = truth.pop(stem)
            builder.add_file(os.path.relpath(path, self.files.path), label, os.path.getsize(path))

    def _val_truth(self, place: dict[str, int]) -> dict[str, int]:
        """{ImageId: label} from the val solution: the first WNID of each PredictionString."""
        path = self.files.shown(VAL_LABELS)
        try:
            text = self.files.read(VAL_LABELS).decode("utf-8")
        except FileNotFoundError:
            raise ConversionError(f"{path}: missing; Kaggle's download has it beside ILSVRC/ (the val "
                                  f"labels)") from None
        reader = csv.DictReader(io.StringIO(text))
        if not {"ImageId", "PredictionString"} <= set(reader.fieldnames or ()):
            raise ConversionError(f"{path}: columns {reader.fieldnames}, not ImageId and PredictionString")
        truth = {}
        for row in reader:
            wnid = (row["PredictionString"] or "").split()[:1]
            if not wnid or wnid[0] not in place:
                raise ConversionError(f"{path}: line {reader.line_num}: {wnid[0] if wnid else 'no WNID'} is not a "
                                      f"class of {self.files.shown(MAPPING)}")
            truth[row["ImageId"]] = place[wnid[0]]
        return truth

    def fingerprint(self, split: str) -> str:
        extra = [MAPPING] + ([VAL_LABELS] if split == "val" else [])
        return files_fingerprint(self, split, extra)
