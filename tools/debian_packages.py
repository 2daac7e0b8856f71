"""Files of Debian packages without installing them: read where installed, else fetched with
`apt-get download` and unpacked with `dpkg -x` into a cache folder (no root needed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


class DebianPackageError(Exception):
    """A package that cannot be had; the message says which command to run."""


def package_root(package: str, paths: list[str], cache_dir: Path) -> Path:
    """A root under which all of a package's `paths` exist: / if the package is installed,
    else an unpacked copy in cache_dir (fetched with apt-get download, no root needed)."""
    for root in (Path("/"), cache_dir / package):
        if all((root / p).exists() for p in paths):
            return root
    root = fetch_package(package, cache_dir)
    absent = [p for p in paths if not (root / p).exists()]
    if absent:
        raise DebianPackageError(f"Debian package {package} has no /{absent[0]}: another version?")
    return root


def fetch_package(package: str, cache_dir: Path) -> Path:
    is_root = os.geteuid() == 0
    sudo = "" if is_root else "sudo "
    fix = f"{sudo}apt-get update && {sudo}apt-get install -y {package}"
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise DebianPackageError(f"{package} is not installed and apt-get/dpkg are missing; "
                              f"install the Debian package {package}")
    work = cache_dir / f".{package}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for attempt in range(2):
        result = subprocess.run(["apt-get", "download", package], cwd=work,
                                capture_output=True, text=True)
        if result.returncode == 0:
            break
        if attempt == 0 and is_root:  # a fresh container often has no package lists yet
            print(f"apt-get download {package} failed; running apt-get update", file=sys.stderr)
            subprocess.run(["apt-get", "update"], capture_output=True)
            continue
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("E:")]
        why = errors[-1] if errors else f"exit code {result.returncode}"
        raise DebianPackageError(f"cannot download Debian package {package} ({why}); run: {fix}")
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        raise DebianPackageError(f"apt-get download {package} left no .deb in {work}; run: {fix}")
    unpacked = subprocess.run(["dpkg", "-x", str(debs[0]), str(work / "root")],
                              capture_output=True, text=True)
    if unpacked.returncode != 0:
        raise DebianPackageError(f"dpkg -x {debs[0].name} failed: {unpacked.stderr.strip()}")
    dest = cache_dir / package
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(work / "root", dest)  # the cache holds complete packages only
    shutil.rmtree(work)
    return dest
