"""The same images in every form the converters read (pipeline/convert/sources/), written from an
ImageNet-layout folder or from generated images: ImageNet's official files (a train tar of class
tars, a flat val tar, a devkit whose ILSVRC2012_IDs are not the sorted-WNID order), Kaggle's
layout, Hugging Face parquet, WebDataset tars and lists. The tests convert each and match labels
image by image; benchmarks/conversion.py times each.

    python benchmarks/source_forms.py data/sample/photos /tmp/forms [--forms imagenet,parquet]

Class folders become WNIDs in their sorted order (`wnids`), so every form's sorted-WNID labels are
the folder form's; the devkit numbers them in another order, as image-net.org's does.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

Image = tuple[str, str, Callable[[], bytes]]       # (class, file name, its bytes)
FORMS = ("imagenet", "kaggle", "parquet", "webdataset", "list")


def folder_images(src: Path, split: str) -> list[Image]:
    """The images of SRC/<split>/<class>/, sorted, read when asked."""
    return [(folder.name, path.name, path.read_bytes)
            for folder in sorted((src / split).iterdir()) if folder.is_dir()
            for path in sorted(folder.iterdir()) if path.is_file()]


def wnids(classes: Iterable[str]) -> dict[str, str]:
    """Class name -> a WNID, increasing with the sorted names (so sorted WNIDs are the sorted classes)."""
    return {name: f"n{1_000_000 + 37 * i:08d}" for i, name in enumerate(sorted(set(classes)))}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def _add_file(tar: tarfile.TarFile, name: str, file) -> None:
    info = tarfile.TarInfo(name)
    file.seek(0, os.SEEK_END)
    info.size, info.mode, info.mtime = file.tell(), 0o644, 0
    file.seek(0)
    tar.addfile(info, file)


def write_official(train: Iterable[Image], val: list[Image], classes: list[str], dest: Path,
                   seed: int = 0) -> dict[str, str]:
    """ILSVRC2012_img_train.tar (`<wnid>.tar` per class, members `<wnid>_<n>.JPEG`), _img_val.tar
    (flat `ILSVRC2012_val_%08d.JPEG`, in `val`'s order) and the devkit; returns the WNIDs. `train`
    may be a generator, in class order: each class tar is spooled, never the whole set."""
    dest.mkdir(parents=True, exist_ok=True)
    ids = wnids(classes)
    with tarfile.open(dest / "ILSVRC2012_img_train.tar", "w", format=tarfile.USTAR_FORMAT) as outer:
        current, inner, spool, count = None, None, None, 0

        def close_class():
            if inner is not None:
                inner.close()
                _add_file(outer, f"{ids[current]}.tar", spool)
                spool.close()
        for name, _, read in train:
            if name != current:
                close_class()
                current, count = name, 0
                spool = tempfile.SpooledTemporaryFile(64 << 20)
                inner = tarfile.open(fileobj=spool, mode="w", format=tarfile.USTAR_FORMAT)
            _add(inner, f"{ids[name]}_{count}.JPEG", read())
            count += 1
        close_class()
    with tarfile.open(dest / "ILSVRC2012_img_val.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for number, (_, _, read) in enumerate(val, 1):
            _add(tar, f"ILSVRC2012_val_{number:08d}.JPEG", read())
    write_devkit(dest / "ILSVRC2012_devkit_t12.tar.gz", [ids[name] for name, _, _ in val], classes, seed)
    return ids


def write_devkit(path: Path, val_wnids: list[str], classes: list[str], seed: int = 0) -> None:
    """A devkit as image-net.org's: data/meta.mat (leaf synsets numbered 1..K in a shuffled order,
    one parent synset after them) and the val ground truth, one ILSVRC2012_ID a line."""
    from scipy.io import savemat
    ids = wnids(classes)
    order = sorted(classes)
    random.Random(seed).shuffle(order)          # IDs not in sorted-WNID order: the trap a converter must avoid
    number = {ids[name]: i + 1 for i, name in enumerate(order)}
    synsets = np.zeros(len(order) + 1, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"),
                                              ("num_children", "O"), ("children", "O"), ("wordnet_height", "O"),
                                              ("num_train_images", "O")])
    for i, name in enumerate(order):
        synsets[i] = (i + 1, ids[name], name, f"the class {name}", 0, np.zeros((1, 0)), 0, 1300)
    synsets[-1] = (len(order) + 1, "n99999999", "entity", "everything", len(order),
                   np.arange(1, len(order) + 1, dtype=np.float64), 1, 0)
    meta = io.BytesIO()
    savemat(meta, {"synsets": synsets.reshape(-1, 1)})
    truth = "".join(f"{number[wnid]}\n" for wnid in val_wnids).encode()
    with tarfile.open(path, "w:gz") as kit:
        _add(kit, "ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue())
        _add(kit, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth)


def write_kaggle(train: list[Image], val: list[Image], classes: list[str], dest: Path, test: int = 3) -> None:
    """ILSVRC/Data/CLS-LOC/{train/<wnid>/, val/, test/}, LOC_val_solution.csv (rows not in file order),
    LOC_synset_mapping.txt."""
    ids = wnids(classes)
    data = dest / "ILSVRC/Data/CLS-LOC"
    for number, (name, _, read) in enumerate(train):
        path = data / "train" / ids[name] / f"{ids[name]}_{number}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read())
    rows = []
    (data / "val").mkdir(parents=True, exist_ok=True)
    for number, (name, _, read) in enumerate(val, 1):
        image_id = f"ILSVRC2012_val_{number:08d}"
        (data / "val" / f"{image_id}.JPEG").write_bytes(read())
        rows.append((image_id, f"{ids[name]} 10 20 110 120 {ids[name]} 5 5 50 50"))
    (data / "test").mkdir(parents=True, exist_ok=True)
    for number in range(1, test + 1):
        (data / "test" / f"ILSVRC2012_test_{number:08d}.JPEG").write_bytes(val[0][2]())
    random.Random(1).shuffle(rows)
    with open(dest / "LOC_val_solution.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["ImageId", "PredictionString"])
        writer.writerows(rows)
    (dest / "LOC_synset_mapping.txt").write_text("".join(f"{ids[name]} {name}\n" for name in sorted(classes)))


def write_parquet(splits: dict[str, list[Image]], classes: list[str], dest: Path, files: int = 2,
                  row_group_size: int = 8, test: int = 3) -> None:
    """data/<split>-NNNNN-of-NNNNN.parquet in the Hub's schema (image: {bytes, path}, label: int64),
    val as `validation`, a test split labelled -1, and a README.md card with the class_label names."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    place = {name: i for i, name in enumerate(sorted(classes))}
    (dest / "data").mkdir(parents=True, exist_ok=True)
    named = {"validation" if split == "val" else split: images for split, images in splits.items()}
    named["test"] = [(None, f"test_{i}.JPEG", splits["val"][0][2]) for i in range(test)]
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())])
    for split, images in named.items():
        for part in range(files):
            chunk = images[part::files]
            labels = [place[name] if name is not None else -1 for name, _, _ in chunk]
            table = pa.table({"image": [{"bytes": read(), "path": file} for _, file, read in chunk], "label": labels},
                             schema=schema)
            pq.write_table(table, dest / "data" / f"{split}-{part:05d}-of-{files:05d}.parquet",
                           row_group_size=row_group_size)
    names = "\n".join(f"          '{i}': {name}" for i, name in enumerate(sorted(classes)))
    (dest / "README.md").write_text(f"---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n"
                                    f"  - name: label\n    dtype:\n      class_label:\n        names:\n{names}\n---\n"
                                    f"# A dataset\n")


def write_webdataset(splits: dict[str, list[Image]], classes: list[str], dest: Path, per_shard: int = 10,
                     label_key: str | None = None) -> None:
    """<split>/shard-NNNNN.tar of KEY.jpg with KEY.cls (or KEY.json holding the class name under `label_key`)."""
    place = {name: i for i, name in enumerate(sorted(classes))}
    for split, images in splits.items():
        (dest / split).mkdir(parents=True, exist_ok=True)
        for shard, start in enumerate(range(0, len(images), per_shard)):
            with tarfile.open(dest / split / f"shard-{shard:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for number, (name, file, read) in enumerate(images[start:start + per_shard], start):
                    key = f"{split}_{number:06d}"
                    _add(tar, f"{key}.jpg", read())
                    if label_key:
                        _add(tar, f"{key}.json", json.dumps({label_key: name, "file": file}).encode())
                    else:
                        _add(tar, f"{key}.cls", str(place[name]).encode())


def write_lists(src: Path, splits: dict[str, list[Image]], dest: Path) -> None:
    """train.csv and val.csv naming the folder's images by paths relative to DEST, labelled by class name."""
    dest.mkdir(parents=True, exist_ok=True)
    for split, images in splits.items():
        with open(dest / f"{split}.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["path", "label"])
            for name, file_name, _ in images:
                writer.writerow([os.path.relpath(src / split / name / file_name, dest), name])


def write_forms(src: Path, dest: Path, forms: Iterable[str] = FORMS, parquet_rows: int = 8) -> dict[str, Path]:
    """The folder SRC's train and val splits in each form, under DEST/<form> (parquet in row groups
    of `parquet_rows`); returns the folders."""
    splits = {split: folder_images(src, split) for split in ("train", "val")}
    classes = sorted({name for images in splits.values() for name, _, _ in images})
    written = {}
    for form in forms:
        folder = dest / form
        if form == "imagenet":
            write_official(splits["train"], splits["val"], classes, folder)
        elif form == "kaggle":
            write_kaggle(splits["train"], splits["val"], classes, folder)
        elif form == "parquet":
            write_parquet(splits, classes, folder, row_group_size=parquet_rows)
        elif form == "webdataset":
            write_webdataset(splits, classes, folder)
        elif form == "list":
            write_lists(src, splits, folder)
        written[form] = folder
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="an ImageNet-layout folder")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--forms", default=",".join(FORMS))
    args = parser.parse_args(argv)
    for form, folder in write_forms(args.src, args.dest, args.forms.split(",")).items():
        print(f"{form}: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
