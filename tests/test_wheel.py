"""The package as users install it: `pip install .` builds a wheel which, in a fresh virtual
environment and a folder outside the repository, converts the fashion sample with its console
script, and trains a few steps under `torchrun -m training.main --config fashion_baseline` (a
recipe shipped in the package), the decode engine compiled into the per-user cache.

The new environment takes its dependencies (torch, numpy, ...) from this one's site-packages
through a `.pth` line, added only after the wheel is installed: pip then never sees, let alone
uninstalls, the editable install of the repository, and a `.pth` line adds a folder to the path
without running the `.pth` files in it, so the editable finder stays out of the new environment.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from runs import tiny_run

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ["pyproject.toml", "README.md", "pipeline", "training", "algorithms", "benchmarks"]


def run(command: list, **options) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=300, **options)
    assert result.returncode == 0, f"{command[:4]} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the package's sources: a build writes build/ and *.egg-info beside them."""
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
        else:
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", "-w", tmp_path / "wheels", source])
    (wheel,) = (tmp_path / "wheels").glob("fastpipe-*.whl")
    return wheel


@pytest.mark.timeout(600)
def test_the_wheel_installs_converts_and_trains_outside_the_repository(tmp_path, sample_sets):
    wheel = build_wheel(tmp_path)
    env = tmp_path / "env"
    run([sys.executable, "-m", "venv", env])
    python = env / "bin" / "python"
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", wheel])
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "fastpipe-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"          # outside the repository: only the installed package can be found
    work.mkdir()
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environment |= {"PATH": f"{env / 'bin'}{os.pathsep}{environment['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    environment.pop("FASTPIPE_NATIVE_CACHE", None)
    options = dict(cwd=work, env=environment)

    where = json.loads(run([python, "-c", "import json, pipeline, training, algorithms; "
                                          "print(json.dumps([m.__file__ for m in (pipeline, training, algorithms)]))"],
                           **options).stdout)
    assert all(Path(path).is_relative_to(site) for path in where), where
    installed = site / "pipeline"
    assert {path.name for path in (installed / "native").glob("*.[ch]")} >= {"decode_engine.c", "jpeg_roi.c",
                                                                               "sample_uniforms.c", "buffer_shuffle.c"}
    assert (site / "algorithms" / "recipes" / "fashion_baseline.yaml").is_file()
    catalog = run([python, "-c", "from benchmarks.instance_catalog import load_catalog; "
                                 "print(load_catalog()['p4d.24xlarge'].gpu_count)"], **options).stdout
    assert catalog.strip() == "8" and (site / "benchmarks" / "catalog" / "published_rates.csv").is_file()

    assert "--backends" in run([env / "bin" / "fastpipe-benchmark-loaders", "--help"], **options).stdout
    run([env / "bin" / "fastpipe-convert-wds", sample_sets / "fashion", "wds", "--num-workers", 1], **options)
    assert json.loads((work / "wds" / "manifest.json").read_text())["format"] == "webdataset"

    overrides = tiny_run(work / "wds", "webdataset", work / "run", "max_duration=3ba")
    run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "training.main",
         "--config", "fashion_baseline", *overrides], **options)
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["steps"] == 3, summary

    assert not list(installed.rglob("*.so")), "the engine was compiled into the package's folder"
    compiled = {path.name.split("-")[0] for path in (tmp_path / "cache" / "fastpipe" / "native").glob("*.so")}
    assert {"decode_engine", "jpeg_roi"} <= compiled, compiled   # the webdataset backend's
