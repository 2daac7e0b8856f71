"""Compile a C file of this folder into a shared library on first use, and load it (ctypes).

The library goes to a per-user cache folder (`cache_dir`), since an installed package's own
folder is often read-only. Its file name carries a hash of everything that shapes it (the
sources, the flags, the compiler's search paths), so a changed source or another libjpeg kit
gets a library of its own and no stale one is ever loaded. It is built by the system `cc` under
a temporary name then renamed: processes that import it at the same moment never load a
half-written file. The C files need the libjpeg-turbo
headers that tools/bootstrap.sh installs (libjpeg62-turbo-dev), or a kit of headers and
library named by CPATH and LIBRARY_PATH (the GPU bundle's env.sh): then that kit's library is
the one linked and loaded, and a library whose libjpeg at run time is not the version its
headers describe is refused at load, in one line, rather than left to crash at its first call.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

MESSAGE_SIZE = 200
SOURCES = Path(__file__).resolve().parent


def source(name: str) -> Path:
    """The C file `name` of this folder."""
    return SOURCES / name


def cache_dir() -> Path:
    """Where compiled libraries go: $FASTPIPE_NATIVE_CACHE, else fastpipe/native in the user's
    cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    named = os.environ.get("FASTPIPE_NATIVE_CACHE")
    if named:
        return Path(named)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastpipe" / "native"


def library_path(source: Path, link: list[str], flags: list[str]) -> Path:
    """The cached library for `source` built with `link` and `flags`: named by their hash."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for setting in [*link, *flags, *library_dirs(), os.environ.get("CPATH", "")]:
        digest.update(setting.encode() + b"\0")
    return cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def load_library(source: Path, libraries: tuple[str, ...] = ("jpeg",), flags: tuple[str, ...] = (),
                 library: Path | None = None, check: str | None = None) -> ctypes.CDLL:
    """`source` (a C file of this folder) compiled into `library` (default: in `cache_dir`, see
    `library_path`) unless it is there, and loaded; `check` names its `int check(char *message,
    int size)`, called once loaded: not 0 means the library cannot work here, and it is deleted
    (so that the next import rebuilds it) and refused with the check's message."""
    link = [f"-l{name}" for name in libraries]
    library = library or library_path(source, link, list(flags))
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        _build(source, library, link, list(flags))
    loaded = ctypes.CDLL(str(library))
    if check:
        message, matches = ctypes.create_string_buffer(MESSAGE_SIZE), getattr(loaded, check)
        matches.argtypes = [ctypes.c_char_p, ctypes.c_int]
        if matches(message, MESSAGE_SIZE) != 0:
            library.unlink(missing_ok=True)
            found = ", ".join(loaded_files("libjpeg")) or "none found"
            raise RuntimeError(f"{library.name}: {message.value.decode(errors='replace')} (libjpeg loaded: {found}); "
                               "compile and run with one libjpeg-turbo: bash tools/bootstrap.sh, or on a GPU node "
                               "source the bundle's env.sh before the first import")
    return loaded


def loaded_files(fragment: str) -> list[str]:
    """The files mapped into this process whose name holds `fragment` (Linux; else none)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    fields = (line.split(maxsplit=5) for line in maps)
    return sorted({f[5] for f in fields if len(f) == 6 and fragment in Path(f[5]).name})


def library_dirs() -> list[str]:
    """LIBRARY_PATH's folders as `-L` flags ahead of the system's, with a run path to each.
    GCC searches LIBRARY_PATH itself only after /usr/lib/x86_64-linux-gnu (it tries each
    entry's `../lib` first, which misses Debian's multiarch layout): a kit's libjpeg named there
    would lose to a system libjpeg of another version, and the first call would crash."""
    folders = [folder for folder in os.environ.get("LIBRARY_PATH", "").split(os.pathsep) if folder]
    return [flag for folder in folders for flag in (f"-L{folder}", f"-Wl,-rpath,{folder}")]


def _build(source: Path, library: Path, link: list[str], flags: list[str]) -> None:
    with tempfile.NamedTemporaryFile(dir=library.parent, prefix=f".{source.stem}-", suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run(["cc", "-O3", *flags, "-shared", "-fPIC", "-o", str(partial), str(source),
                                 *library_dirs(), "-Wl,--no-undefined", *link],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"cannot compile {source.name} (needs cc and the libjpeg-turbo headers, "
                               f"libjpeg62-turbo-dev; run bash tools/bootstrap.sh): {result.stderr.strip()[:300]}")
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
