"""Loader backends, one module each, imported only when asked for: a missing optional package
(ffcv, nvidia-dali) only matters to the backend that needs it. `backend: auto` chooses among
them (pipeline/backends/auto.py)."""
from __future__ import annotations

import importlib

from pipeline.datasets import require_directory
from pipeline.spec import LoaderSpec

# backend -> (module, class, the pip package it needs)
IMPLEMENTATIONS = {
    "ffcv": ("pipeline.backends.ffcv", "FFCVLoader", "ffcv"),
    # the set-up's build runs the CPU pipeline; a GPU node takes the build of its CUDA (13: -cuda130)
    "dali": ("pipeline.backends.dali", "DALILoader", "nvidia-dali-cuda120 or nvidia-dali-cuda130"),
    "webdataset": ("pipeline.backends.webdataset", "WebDatasetLoader", "pillow-simd"),  # reads tars itself
    "folder": ("pipeline.backends.folder", "FolderLoader", "pillow-simd"),
    "synthetic": ("pipeline.backends.synthetic", "SyntheticLoader", "torch"),
}


def open_backend(spec: LoaderSpec):
    """The loader of `spec.backend` (not "auto"); a missing optional package is a one-line ImportError."""
    module_name, class_name, package = IMPLEMENTATIONS[spec.backend]
    if spec.backend != "synthetic":
        # Before the backend's import, which takes seconds (torch with FFCV, DALI or numba).
        require_directory(spec.path, spec.backend)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"loader backend {spec.backend!r} needs the package {package!r} "
                          f"({error}); run `make setup` or pick another backend") from None
    return getattr(module, class_name)(spec)
