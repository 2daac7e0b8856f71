"""The ImageNet folder layout, `SRC/<split>/<class>/<image>` (pipeline/formats/imagefolder.py reads
it for the whole project): a class's label is its place in the sorted class folders of the splits
converted."""
from __future__ import annotations

import hashlib
import os

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source
from pipeline.formats.imagefolder import LayoutError, Skipped, find_classes, walk_split


USUAL_SPLITS = ("train", "val")


class ImageFolderSource(Source):
    form = "imagefolder"
    title = "an ImageNet-layout folder (SPLIT/CLASS/IMAGE)"
    whole_files = True

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        if files.remote:
            return None
        held = [split for split in dict.fromkeys([*splits, *USUAL_SPLITS]) if files.is_dir(split)
                and any(entry.is_dir() for entry in os.scandir(files.full(split)))]
        return f"class folders under {', '.join(split + '/' for split in held)}" if held else None

    def splits(self) -> list[str]:
        return sorted(entry.name for entry in os.scandir(self.files.path) if entry.is_dir())

    def check_splits(self, splits: list[str]) -> None:
        try:
            find_classes(self.files.path, splits)
        except LayoutError as error:
            raise ConversionError(str(error)) from None
        for split in splits:
            entries = list(os.scandir(self.files.full(split)))
            if entries and not any(entry.is_dir() for entry in entries):
                # Kaggle's CLS-LOC folder given as SRC: its val is flat, labelled by a CSV one level up
                raise ConversionError(f"{self.files.full(split)}: {len(entries):,} files and no class folders; a flat "
                                      f"split is labelled by a list (SPLIT.csv) or, for Kaggle's ImageNet, give the "
                                      f"folder holding LOC_val_solution.csv")

    def classes(self, splits: list[str]) -> list[str]:
        return find_classes(self.files.path, splits)

    def scan(self, split: str) -> Entries:
        builder, digest = self.builder(split), hashlib.sha256()
        try:
            for found in walk_split(self.files.path, split, self.used_classes):
                if isinstance(found, Skipped):
                    builder.skipped.append(found)
                    continue
                stat = os.stat(found.path)
                # The fingerprint converters before sources wrote: their outputs stay up to date
                digest.update(f"{found.relpath}\0{found.label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
                builder.add_file(found.relpath, found.label, stat.st_size)
        except KeyError as error:
            raise ConversionError(f"{self.files.path / split}: class folder {error.args[0]!r} is not one of the "
                                  f"dataset's classes") from None
        self._fingerprints = {**getattr(self, "_fingerprints", {}), split: digest.hexdigest()}
        return builder.build()

    def fingerprint(self, split: str) -> str:
        self.entries(split)
        return self._fingerprints[split]
