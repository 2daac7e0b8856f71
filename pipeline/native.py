"""Compile a C file of this package into a shared library on first use, and load it (ctypes).

The library goes next to its source, built by the system `cc` the first time it is needed
or when the source or a header beside it is newer, under a temporary name then renamed: processes that import it
at the same moment never load a half-written file. The C files need the libjpeg-turbo
headers that tools/bootstrap.sh installs (libjpeg62-turbo-dev).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path


def load_library(source: Path, libraries: tuple[str, ...] = ("jpeg",), flags: tuple[str, ...] = (),
                 library: Path | None = None) -> ctypes.CDLL:
    """`source` (pipeline/NAME.c) compiled into `library` (default pipeline/_NAME.so) if needed, loaded."""
    library = library or source.with_name(f"_{source.stem}.so")
    newest_input = max(path.stat().st_mtime for path in [source, *source.parent.glob("*.h")])
    if not library.exists() or library.stat().st_mtime < newest_input:
        _build(source, library, [f"-l{name}" for name in libraries], list(flags))
    return ctypes.CDLL(str(library))


def _build(source: Path, library: Path, link: list[str], flags: list[str]) -> None:
    with tempfile.NamedTemporaryFile(dir=library.parent, prefix=f".{source.stem}-", suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run(["cc", "-O3", *flags, "-shared", "-fPIC", "-o", str(partial), str(source), *link],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"cannot compile {source.name} (needs cc and the libjpeg-turbo headers, "
                               f"libjpeg62-turbo-dev; run tools/bootstrap.sh): {result.stderr.strip()[:300]}")
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
