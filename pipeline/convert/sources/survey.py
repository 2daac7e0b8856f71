"""What a SRC that holds no known form does hold, in a few words for its one-line error: how many
images and where, the tars, parquet files and lists, and which form comes closest."""
from __future__ import annotations

import os
from collections import Counter

from pipeline.formats.imagefolder import IMAGE_EXTENSIONS

MOST_ENTRIES = 20_000          # a survey looks at this many names at most
SHOWN = 3


def survey(files) -> str:
    names = _names(files)
    kinds = Counter()
    image_folders = Counter()
    for name in names:
        extension = os.path.splitext(name)[1].lower()
        if extension in IMAGE_EXTENSIONS:
            kinds["image files"] += 1
            image_folders[os.path.dirname(name) or "."] += 1
        elif extension in (".tar", ".parquet", ".csv", ".jsonl"):
            kinds[f"{extension[1:]} files"] += 1
    if not names:
        return "it is empty"
    parts = [f"{count:,} {kind}" for kind, count in kinds.most_common()] or [f"{len(names):,} files, none of them "
                                                                          f"images, tars, parquet or lists"]
    where = ", ".join(f"{folder}/ ({count:,})" for folder, count in image_folders.most_common(SHOWN))
    text = "found " + ", ".join(parts) + (f"; images in {where}" if where else "")
    if len(names) >= MOST_ENTRIES:
        text += f" (the first {MOST_ENTRIES:,} names looked at)"
    return text + closest(image_folders, kinds)


def closest(image_folders: Counter, kinds: Counter) -> str:
    """The form the holdings come closest to, and what it still needs."""
    if image_folders:
        depths = {folder.count("/") + 1 if folder != "." else 0 for folder in image_folders}
        if max(depths) <= 1:
            return ("; closest: imagefolder, which needs SPLIT/CLASS/IMAGE (train/cat/1.jpg), or a list (train.csv "
                    "with path,label)")
        return "; closest: imagefolder, which needs SPLIT/CLASS/IMAGE directly under SRC (is SRC one level up?)"
    if kinds["tar files"]:
        return ("; closest: webdataset, whose tars lie in SPLIT/*.tar or SPLIT-*.tar (or name them with --split-path "
                "SPLIT=PATTERN), or imagenet (ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar)")
    if kinds["parquet files"]:
        return ("; closest: parquet, named data/SPLIT-NNNNN-of-NNNNN.parquet (or name them with --split-path "
                "SPLIT=PATTERN)")
    if kinds["csv files"] or kinds["jsonl files"]:
        return "; closest: list, whose files are named train.csv and val.csv (or .jsonl)"
    return ""


def _names(files) -> list[str]:
    if files.remote:
        return files.listing("", limit=MOST_ENTRIES)[:MOST_ENTRIES] if files.listable else []
    names = []
    for folder, subfolders, found in os.walk(files.path):
        subfolders.sort()
        relative = os.path.relpath(folder, files.path)
        names += [name if relative == "." else f"{relative}/{name}" for name in sorted(found)]
        if len(names) >= MOST_ENTRIES:
            break
    return names[:MOST_ENTRIES]
