"""Building a loader from its spec (`build_loader`), and the length of its epochs before it is
built (`split_samples`, `batches_per_epoch`); `pipeline` exports these."""
from __future__ import annotations

import dataclasses
import importlib

from pipeline.datasets import require_directory, split_size
from pipeline.sharding import rank_batches
from pipeline.spec import LoaderSpec

# backend -> (module, class, the pip package it needs)
_IMPLEMENTATIONS = {
    "ffcv": ("pipeline.backends.ffcv", "FFCVLoader", "ffcv"),
    # the set-up's build runs the CPU pipeline; a GPU node takes the build of its CUDA (13: -cuda130)
    "dali": ("pipeline.backends.dali", "DALILoader", "nvidia-dali-cuda120 or nvidia-dali-cuda130"),
    "webdataset": ("pipeline.backends.webdataset", "WebDatasetLoader", "pillow-simd"),  # reads tars itself
    "folder": ("pipeline.backends.folder", "FolderLoader", "pillow-simd"),
    "synthetic": ("pipeline.backends.synthetic", "SyntheticLoader", "torch"),
}


def build_loader(spec: LoaderSpec):
    """The loader `spec` asks for; a missing optional package is a one-line ImportError.
    `backend="auto"` picks the fastest backend that reads spec.path here (pipeline/auto_backend.py)."""
    if spec.backend == "auto":
        from pipeline.auto_backend import choose_backend
        require_directory(spec.path, spec.backend)
        spec = dataclasses.replace(spec, backend=choose_backend(spec)[0])
    module_name, class_name, package = _IMPLEMENTATIONS[spec.backend]
    if spec.backend != "synthetic":
        # Before the backend's import, which takes seconds (torch with FFCV, DALI or numba).
        require_directory(spec.path, spec.backend)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"loader backend {spec.backend!r} needs the package {package!r} "
                          f"({error}); run `make setup` or pick another backend") from None
    return getattr(module, class_name)(spec)


def split_samples(spec: LoaderSpec) -> int:
    """The samples of `spec`'s split over all ranks, known before a loader is built: a converted
    split's manifest holds it, a folder's scan counts it."""
    if spec.backend == "synthetic":
        return spec.synthetic_size
    require_directory(spec.path, spec.backend)
    return split_size(spec.path, spec.split, spec.backend)


def batches_per_epoch(spec: LoaderSpec) -> int:
    """The batches an epoch of `spec`'s loader gives on its rank (the same for every epoch and backend)."""
    return rank_batches(split_samples(spec), spec)
