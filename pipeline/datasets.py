"""What a loader reads, wherever it is: the façade that routes a path to the local readers
(pipeline/formats/) and a URL to the remote ones (pipeline/remote/), and checks the path first.

Each function fails with a one-line `DatasetError` naming the path (a URL with its credentials
redacted) and what to do, before any backend's import or worker starts.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.errors import DatasetError
from pipeline.formats.converted import (CONVERTERS, ConvertedSplit, is_converted, manifest_split,
                                        read_local_converted, split_record)
from pipeline.formats.imagefolder import LayoutError, Sample, find_classes, scan_split
from pipeline.storage.urls import is_url, redact

REMOTE_BACKENDS = ("webdataset", "ffcv", "dali")      # the backends that read a dataset from a URL


def require_directory(path: str | Path, backend: str) -> None:
    """A one-line error for a data path that is no directory, phrased for the backend reading it."""
    if is_url(path):
        if backend in REMOTE_BACKENDS:
            return
        # A URL is never printed whole (it may carry credentials). The folder backend would need
        # a request per image: data in object storage is a conversion's.
        advice = (f"; convert the dataset with {CONVERTERS['webdataset']} and use the webdataset backend"
                  if backend == "folder" else f"; use backend {' or '.join(map(repr, REMOTE_BACKENDS))}")
        raise DatasetError(f"{redact(str(path))}: the {backend} backend reads local paths only{advice}")
    root = Path(path)
    if root.is_dir():
        return
    if backend in CONVERTERS:
        raise DatasetError(f"{root}: no such directory; convert a dataset there with {CONVERTERS[backend]} SRC {root}")
    raise DatasetError(f"{root}: no such directory; give an ImageNet-layout folder (ROOT/<split>/<class>/<image>)"
                       f"{' or the output of ' + CONVERTERS['webdataset'] if backend == 'dali' else ''}")


def read_converted(path: str | Path, split: str, expected_format: str, **remote) -> ConvertedSplit:
    """The manifest's view of one converted split, with its files checked to be whole. A URL is
    read by pipeline/remote/dataset.py, with `remote`'s cache settings."""
    if is_url(path):
        from pipeline.remote.dataset import read_remote_converted
        return read_remote_converted(str(path), split, expected_format, **remote)
    require_directory(path, expected_format)
    return read_local_converted(Path(path), split, expected_format)


def split_size(path: str | Path, split: str, backend: str) -> int:
    """Samples in a split, known before any loader reads it: a converted split's count from its
    manifest (the loader checks the files when it reads them), else a scan of the folder. A
    backend that reads only converted data (ffcv, webdataset) gets the manifest's error, not a scan."""
    if is_url(path):
        from pipeline.remote.dataset import remote_manifest
        manifest, _, store = remote_manifest(str(path))
        return split_record(manifest, store.shown, split, backend if backend in CONVERTERS else None)[2]["count"]
    if backend in CONVERTERS:
        return manifest_split(Path(path), split, expected_format=backend)[2]["count"]
    if is_converted(path):
        return manifest_split(Path(path), split, expected_format=None)[2]["count"]
    return len(read_folder(path, split)[1])


def read_folder(path: str | Path, split: str) -> tuple[list[str], list[Sample]]:
    """Classes and samples of ROOT/<split>/<class>/<image>; labels as the converters assign them."""
    root = Path(path)
    if is_converted(root):
        raise DatasetError(f"{root} is a converted dataset, not an ImageNet-layout folder; "
                           f"point this backend at the folder the converter read")
    try:
        splits = [name for name in ("train", "val") if (root / name).is_dir()] or [split]
        classes = find_classes(root, sorted(set(splits) | {split}))
        samples, _ = scan_split(root, split, classes)
    except LayoutError as error:
        raise DatasetError(str(error)) from None
    if not samples:
        raise DatasetError(f"{root / split}: no image files in its class folders")
    return classes, samples
