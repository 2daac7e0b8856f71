"""FFCV imported without numba compiling its typed dict in every process: import this module
before anything from `ffcv`.

`ffcv.fields.rgb_image` builds `IMAGE_MODES = numba.typed.Dict()` when it is imported, a table of
two entries ({'jpg': 0, 'raw': 1}) that FFCV only ever reads from Python. Filling a typed dict
from Python makes numba compile its dict code, which numba never caches on disk: most of FFCV's
import time, paid again by every process that imports it (each rank of a run on the ffcv
backend, each converter), and the first lookup compiles again in each of FFCV's writer processes. While FFCV is imported through here its
`from numba.typed import Dict` gets Python's `dict`, so `IMAGE_MODES` is a plain dict with the
same values, and the images, labels and compiled pipelines are the same. (Where
FFCV's writer puts each image in a .beton depends on which of its processes asks for a page
first, so a faster start can move them; the loaders read the same samples.) Where FFCV was
imported already, this changes nothing.
"""
from __future__ import annotations

import sys

if "ffcv" not in sys.modules:
    import numba.typed

    _typed_dict = numba.typed.Dict
    numba.typed.Dict = dict     # what `from numba.typed import Dict` inside FFCV binds
    try:
        import ffcv  # noqa: F401 - the package imports its fields, writer and loader
    finally:
        numba.typed.Dict = _typed_dict
