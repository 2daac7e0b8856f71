"""Loaders: one interface (`LoaderSpec` -> `build_loader`), several backends, one semantics.

    loader = build_loader(LoaderSpec(backend="synthetic", batch_size=256, resolution=160))
    loader.set_epoch(epoch)              # reshuffle; the resolution the schedule gives
    for images, labels in loader: ...    # float NCHW, normalized, channels_last, on spec.device

Each backend lives in a module of its own and is imported only when asked for, so a
missing optional package (ffcv, nvidia-dali) only matters to the backend that needs it.
A loader's settings are those of its spec, fixed when it is built; `batches_per_epoch(spec)`
says how long its epochs will be before it is (every backend gives the batches
`pipeline.loader.sharding` says for the split's size).
"""
from __future__ import annotations

import importlib

_EXPORTS = {"BACKENDS": "pipeline.spec", "LoaderSpec": "pipeline.spec", "batches_per_epoch": "pipeline.build",
            "build_loader": "pipeline.build", "split_samples": "pipeline.build", "DatasetError": "pipeline.errors",
            "CorruptSample": "pipeline.errors", "RemoteDataError": "pipeline.errors"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An export, imported when first asked for: they import torch (seconds), which the converters
    and the package's other modules they use never need."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value
