"""Building a loader from its spec (`build_loader`), and the length of its epochs before it is
built (`split_samples`, `batches_per_epoch`); `pipeline` exports these."""
from __future__ import annotations

import dataclasses

from pipeline.backends import open_backend
from pipeline.backends.auto import choose_backend
from pipeline.datasets import require_directory, split_size
from pipeline.loader.sharding import rank_batches
from pipeline.spec import LoaderSpec


def build_loader(spec: LoaderSpec):
    """The loader `spec` asks for; a missing optional package is a one-line ImportError.
    `backend="auto"` picks the fastest backend that reads spec.path here (pipeline/backends/auto.py)."""
    if spec.backend == "auto":
        require_directory(spec.path, spec.backend)
        spec = dataclasses.replace(spec, backend=choose_backend(spec)[0])
    return open_backend(spec)


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
