"""On the GPU node: check the chunks of a tools/gpu_bundle.py bundle and install what is complete.

    PYTHONPATH=. python3 tools/gpu_bundle.py install DIR [--site /tmp/site]   (in the repository root)
    source /tmp/site/env.sh                                              (then make gpu-check PY=python3 SETUP=)

Needs only the node's own Python. Checks whatever chunks DIR holds against MANIFEST.json and
installs each complete group into SITE/<group> (pip --no-index --no-deps --target; a wheel
whose distribution the node already has is skipped, so the image's own builds are never
shadowed), puts the photographs where make_sample_data and the tests look
(data/sample/.debian), and writes SITE/env.sh. Run it again after each transfer: a group with
a chunk still missing is reported and left out, a group installed before from the same chunks
is kept, any other replaced whole. A damaged chunk stops the install with a one-line error
naming it (what was installed stays).

Also the manifest's format, which tools/gpu_bundle.py's `pack` writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from pipeline.storage.atomic_files import replace_atomically, write_bytes_atomic

MANIFEST = "MANIFEST.json"
KITS = ("jpeg-kit", "nginx-kit")     # unpacked Debian packages a group carries beside its wheels
FORMAT = 3          # 3: xz-compressed groups of stored wheels, cut into chunks, with "transfers"


class BundleError(Exception):
    """A one-line reason the bundle cannot be made or installed."""


def say(message: str) -> None:
    print(f"[gpu-bundle] {message}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(wheel: Path) -> str:
    """A wheel file's distribution name, normalized (PEP 503)."""
    return normalized(wheel.name.split("-")[0])


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise BundleError(f"no {MANIFEST} in {folder}: copy it with the chunks") from None
    except json.JSONDecodeError as error:
        raise BundleError(f"{folder / MANIFEST} is not JSON ({error})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("groups"), dict):
        raise BundleError(f"{folder / MANIFEST}: not a gpu_bundle manifest of format {FORMAT}; pack it again")
    return manifest


def checked_chunks(folder: Path, name: str, group: dict) -> list[Path] | None:
    """The group's chunks, each checked; None when some are not here yet."""
    paths = [folder / c["name"] for c in group["chunks"]]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        say(f"{name}: {len(paths) - len(missing)} of {len(paths)} chunks here, not installed "
            f"(missing {', '.join(missing)})")
        return None
    for path, chunk in zip(paths, group["chunks"]):
        if path.stat().st_size != chunk["size"] or sha256(path) != chunk["sha256"]:
            raise BundleError(f"{path}: size or sha256 differs from {MANIFEST}; copy this chunk again")
    return paths


def node_has(wheel: Path, site: Path) -> bool:
    """Whether this Python already has the wheel's distribution, from somewhere other than site
    (an env.sh sourced before puts site's own copies on the path)."""
    try:
        found = Path(metadata.distribution(distribution(wheel)).locate_file("")).resolve()
    except metadata.PackageNotFoundError:
        return False
    return site.resolve() not in (found, *found.parents)


def install_group(name: str, chunks: list[Path], site: Path, root: Path, group_sha256: str) -> list[str]:
    """Join, unpack and install one group into site/name; returns what it installed."""
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=site))
    try:
        tar_path = staging / "group.tar.xz"
        with open(tar_path, "wb") as whole:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, whole)
        with tarfile.open(tar_path) as tar:
            tar.extractall(staging / "files", filter="data")
        files = staging / "files"
        wheels = sorted(files.glob("*.whl"))
        wanted = [w for w in wheels if not node_has(w, site)]
        target = staging / name
        target.mkdir()
        if wanted:
            command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                       "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(target), *map(str, wanted)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise BundleError(f"{name}: pip install failed: {result.stderr.strip().splitlines()[-1][:300]}")
        # A namespace package's __init__ would hide the node's own nvidia.* CUDA libraries.
        (target / "nvidia" / "__init__.py").unlink(missing_ok=True)
        for kit in KITS:
            if (files / kit).is_dir():
                os.replace(files / kit, target / kit)
        if (files / "photos").is_dir():
            cache = root / "data" / "sample" / ".debian"
            for photo in sorted((files / "photos").rglob("*")):
                destination = cache / photo.relative_to(files / "photos")
                if photo.is_file() and not destination.exists():
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(photo, destination)
        (target / ".bundle-sha256").write_text(group_sha256)
        replace_atomically(target, site / name)
        return [w.name for w in wanted]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def environment(site: Path, root: Path, groups) -> dict[str, str]:
    """The variables that make the installed groups usable, in env.sh and in the import check."""
    paths = [str(site / g) for g in groups if (site / g).is_dir()]
    variables = {"PYTHONPATH": ":".join([*paths, str(root)])}
    kit = next((kit for kit in (site / g / "jpeg-kit" / "usr" for g in groups) if kit.is_dir()), None)
    if kit:
        variables |= {"CPATH": f"{kit}/include:{kit}/include/x86_64-linux-gnu",
                      "LIBRARY_PATH": f"{kit}/lib/x86_64-linux-gnu", "LD_LIBRARY_PATH": f"{kit}/lib/x86_64-linux-gnu"}
    nginx = next((kit for kit in (site / g / "nginx-kit" / "bin" for g in groups) if kit.is_dir()), None)
    if nginx:
        variables["PATH"] = str(nginx)
    return variables


def check_imports(modules: list[str], variables: dict[str, str]) -> None:
    env = dict(os.environ)
    for key, value in variables.items():
        env[key] = f"{value}:{env[key]}" if env.get(key) else value
    for module in modules:
        result = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise BundleError(f"installed, but `import {module}` fails: {last[:300]}")
        say(f"import {module}: ok")


def install(folder: Path, site: Path, root: Path) -> list[str]:
    """Install every complete group found in folder; returns the groups installed."""
    manifest = read_manifest(folder)
    site.mkdir(parents=True, exist_ok=True)
    installed = []
    for name, group in manifest["groups"].items():
        stamp = site / name / ".bundle-sha256"
        if stamp.is_file() and stamp.read_text() == group["sha256"]:
            say(f"{name}: already installed in {site / name}")
            continue
        chunks = checked_chunks(folder, name, group)
        if chunks is not None:
            wheels = install_group(name, chunks, site, root, group["sha256"])
            say(f"{name}: installed into {site / name} ({len(wheels)} wheels; the node had the rest)")
            installed.append(name)
    variables = environment(site, root, manifest["groups"])
    lines = [f'export {key}="{value}${{{key}:+:${key}}}"' for key, value in variables.items()]
    write_bytes_atomic(site / "env.sh", ("\n".join(lines) + "\n").encode())
    check_imports([m for g in installed for m in manifest["groups"][g].get("imports", [])], variables)
    say(f"now: source {site / 'env.sh'}")
    return installed
