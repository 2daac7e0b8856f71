"""The ImageNet folder layout: `ROOT/<split>/<class>/<image>`, scanned into labelled samples.

One reading of the layout for the whole project (converters and the `folder` loader), so
that a label means the same class everywhere: the class index is the position of the class
folder's name in the sorted union of class folders over the splits asked for, and a class
folder that is empty in one split keeps its index. Files are found recursively inside a
class folder (as torchvision's ImageFolder does) and listed in sorted order, so a scan is
deterministic. What cannot be a sample is returned as `Skipped` with its reason, never
dropped silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Extensions Pillow decodes that datasets in the wild use for photos.
IMAGE_EXTENSIONS = frozenset({".jpeg", ".jpg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".gif"})


@dataclass(frozen=True)
class Sample:
    path: str        # absolute path of the image file
    label: int       # index into the class list
    relpath: str     # path relative to ROOT, for messages and manifests


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str
    entry: int | None = None   # its place in its source's split, where a converter skipped a sample

    def as_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason, **({"entry": self.entry} if self.entry is not None else {})}


class LayoutError(ValueError):
    """The folder is not in ImageNet layout (missing, empty, no class folders)."""


def find_classes(root: str | os.PathLike, splits: list[str]) -> list[str]:
    """Sorted union of the class folder names found under ROOT/<split> for each split."""
    root = Path(root)
    if not root.is_dir():
        raise LayoutError(f"{root}: no such directory")
    classes: set[str] = set()
    for split in splits:
        split_dir = root / split
        if not split_dir.is_dir():
            raise LayoutError(f"{split_dir}: no such directory (ImageNet layout ROOT/<split>/<class>/<image>; "
                              f"{what_is_in(root)}{CONVERTERS_READ_MORE})")
        classes.update(entry.name for entry in os.scandir(split_dir) if entry.is_dir())
    if not classes:
        found = "; ".join(f"{split}/: {what_is_in(root / split)}" for split in splits)
        raise LayoutError(f"{root}: no class folders under {', '.join(splits)} ({found}){CONVERTERS_READ_MORE}")
    return sorted(classes)


CONVERTERS_READ_MORE = ("; python tools/convert_wds.py (or convert_ffcv.py) SRC OUT reads other forms: official "
                        "tars, Kaggle's layout, parquet, WebDataset tars, lists")
LOOKED_AT = 20_000      # entries a description reads at most


def what_is_in(folder: Path) -> str:
    """What a folder holds, for an error: its image files, and its folders with the images in each
    (a few levels down, at most LOOKED_AT entries read)."""
    images, folders, seen = 0, {}, 0
    for entry in os.scandir(folder):
        if entry.is_dir():
            count = 0
            for _, _, files in os.walk(entry.path):
                seen += len(files)
                count += sum(Path(name).suffix.lower() in IMAGE_EXTENSIONS for name in files)
                if seen > LOOKED_AT:
                    break
            folders[entry.name] = count
        elif Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS:
            images += 1
        seen += 1
        if seen > LOOKED_AT:
            break
    shown = ", ".join(f"{name}/ ({count:,} image{'s' * (count != 1)})" for name, count in sorted(folders.items())[:8])
    more = f" and {len(folders) - 8:,} more" if len(folders) > 8 else ""
    return (f"found {images:,} image file{'s' * (images != 1)} and {len(folders):,} folder{'s' * (len(folders) != 1)}"
            f"{': ' + shown + more if folders else ''}{' (more not counted)' if seen > LOOKED_AT else ''}")


def walk_split(root: str | os.PathLike, split: str, classes: list[str]) -> Iterator[Sample | Skipped]:
    """Every file under ROOT/<split>/<class>/, in order, as a sample (an image extension) or a skip
    (the rest), one at a time: a folder of millions of files is never held whole.

    Only the extension is judged here; whether the bytes decode is the caller's business.
    """
    split_dir = Path(root) / split
    label_of = {name: index for index, name in enumerate(classes)}
    for entry in sorted(os.scandir(split_dir), key=lambda e: e.name):
        if not entry.is_dir():
            yield Skipped(entry.path, "not inside a class folder")
            continue
        for dirpath, dirnames, filenames in os.walk(entry.path, followlinks=True):
            dirnames.sort()
            for filename in sorted(filenames):
                path = os.path.join(dirpath, filename)
                if Path(filename).suffix.lower() in IMAGE_EXTENSIONS:
                    yield Sample(path, label_of[entry.name], os.path.relpath(path, root))
                else:
                    yield Skipped(path, f"not an image file name (extension {Path(filename).suffix or 'none'!r})")


def scan_split(root: str | os.PathLike, split: str, classes: list[str]) -> tuple[list[Sample], list[Skipped]]:
    """`walk_split`'s samples and skips, as two lists."""
    samples: list[Sample] = []
    skipped: list[Skipped] = []
    for found in walk_split(root, split, classes):
        (samples if isinstance(found, Sample) else skipped).append(found)
    return samples, skipped
