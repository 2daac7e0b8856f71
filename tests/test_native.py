"""pipeline/native/library.py, which compiles our C files against libjpeg: a libjpeg kit named by
LIBRARY_PATH (the GPU bundle's) is the one linked and loaded even where the system has its own,
and a library whose libjpeg is not the version its headers describe is refused in one line at
load, not left to crash at its first call."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.decode import jpeg_roi
from pipeline.native.library import load_library, loaded_files

ROOT = Path(__file__).resolve().parents[1]
MULTIARCH = "usr/lib/x86_64-linux-gnu"     # Debian's layout, which GCC's own LIBRARY_PATH search misses


def system_libjpeg() -> Path:
    """The libjpeg this process loaded for the jpeg_roi library (imported above). By its file
    name: a stock Pillow wheel brings its own copy too (libjpeg-<hash>.so.62...), whose SONAME no
    library linked against it could find."""
    found = [Path(path) for path in loaded_files("libjpeg") if Path(path).name.startswith("libjpeg.so.62")]
    assert found, f"no libjpeg.so.62 loaded: {loaded_files('libjpeg')}"
    return found[0]


def kit(tmp_path: Path, library: Path | None) -> Path:
    """A kit folder in Debian's layout holding `library` as libjpeg.so, or a library without
    libjpeg's symbols."""
    folder = tmp_path / "kit" / MULTIARCH
    folder.mkdir(parents=True)
    if library:
        shutil.copy2(library, folder / "libjpeg.so.62")
        (folder / "libjpeg.so").symlink_to("libjpeg.so.62")
    else:
        (tmp_path / "empty.c").write_text("int not_libjpeg(void) { return 0; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libjpeg.so.62", "-o", str(folder / "libjpeg.so"),
                        str(tmp_path / "empty.c")], check=True)
    return folder


def test_a_kit_named_by_library_path_is_linked_before_the_systems_libjpeg(tmp_path, monkeypatch):
    # GCC would find the system's libjpeg.so first and link it, whatever the kit holds: this kit's
    # library has none of libjpeg's symbols, so only a link against it fails.
    monkeypatch.setenv("LIBRARY_PATH", str(kit(tmp_path, None)))
    with pytest.raises(RuntimeError, match=r"(?s)cannot compile jpeg_roi\.c .*undefined reference to `jpeg_"):
        load_library(jpeg_roi.SOURCE, library=tmp_path / "_jpeg_roi.so")
    assert not (tmp_path / "_jpeg_roi.so").exists()


def test_the_kits_libjpeg_is_the_one_loaded_without_ld_library_path(tmp_path):
    folder = kit(tmp_path, system_libjpeg())
    library = tmp_path / "_jpeg_roi.so"
    # native.py alone: `import pipeline` loads Pillow, whose libjpeg.so.62 (here the system's)
    # would then serve our library too, whatever its run path says.
    code = ("import importlib.util, json, pathlib; "
            "spec = importlib.util.spec_from_file_location('native', 'pipeline/native/library.py'); "
            "native = importlib.util.module_from_spec(spec); spec.loader.exec_module(native); "
            f"native.load_library(pathlib.Path('pipeline/native/jpeg_roi.c'), library=pathlib.Path({str(library)!r}), "
            "check='jpeg_roi_check'); print(json.dumps(native.loaded_files('libjpeg')))")
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"} | {"LIBRARY_PATH": str(folder)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [str(folder / "libjpeg.so.62")]


def test_a_library_compiled_for_another_libjpeg_is_refused_at_load_and_deleted(tmp_path):
    library = tmp_path / "_jpeg_roi.so"
    with pytest.raises(RuntimeError, match=r"_jpeg_roi\.so: Wrong JPEG library version: library is \d+, "
                                           r"caller expects 1 \(libjpeg loaded: .*libjpeg"):
        load_library(jpeg_roi.SOURCE, flags=("-DCHECKED_JPEG_LIB_VERSION=1",), library=library,
                     check="jpeg_roi_check")
    assert not library.exists()     # the next import builds it again
