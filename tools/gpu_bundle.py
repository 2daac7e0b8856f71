"""What `make gpu-check` needs on a GPU node without internet, packed here in chunks for transfer.

For a GPU node without internet whose image already has Python, torch (CUDA), numpy, numba,
Pillow and OpenCV (an NGC-style container, say), and which you may have for a few minutes at a
time: the image lacks DALI, webdataset, simplejpeg, FFCV, the libjpeg-turbo headers our C
engine compiles against, and the photographs tools/make_sample_data.py cuts its sets from.
`pack` gathers them here, where there is internet, into chunks of at most --chunk-mib MiB, for
however you carry files to the node; `install` (tools/gpu_bundle_install.py) sets them up
there with the node's own Python, a group at a time as its chunks arrive.

    python tools/gpu_bundle.py pack [OUT] [--python python3.12] [--cuda 13] [--chunk-mib 58]
    PYTHONPATH=. python3 tools/gpu_bundle.py install DIR [--site /tmp/site]   (on the node, repository root)
    source /tmp/site/env.sh                                              (then make gpu-check PY=python3 SETUP=)

`pack` (default OUT: gpu-bundle/) makes two groups, each an xz-compressed tar cut into chunks,
and MANIFEST.json with every chunk's size and sha256:
- base: the FFCV wheel (tools/ffcv_wheel.sh) and its small dependencies, webdataset,
  simplejpeg, pytest and its plugins, obstore, a libjpeg-turbo kit (headers and library,
  from Debian packages), nginx with the libraries it links (Debian's; bin/nginx runs it with
  them: the loopback HTTP server the e2e-remote stage reads from) and the 23 source
  photographs (about 21 MiB). Every stage but DALI's runs with it alone;
- each group also carries what its wheels require on the node and neither it, the other group
  nor the node has (`complete`: pip downloads for another platform must be --no-deps);
- dali: DALI for CUDA `--cuda`, nvImageCodec and nvJPEG, and DALI's pure-Python dependencies.
  nvCOMP, nvJPEG2000 and nvTIFF stay out: DALI prints that it cannot load them and goes on
  (JPEG needs none of them).
The wheels go in stored, not deflated, so that xz -9 sees their libraries whole: DALI 2.4.0's
group shrinks from 223 MiB of wheels to 144 MiB, and the node spends about 5 s unpacking it.
The manifest's "transfers" suggest which chunks to carry together (`pack` prints them): base
first, each transfer at most --chunk-mib MiB, a group's first chunk filling what the transfer
before had left, so that with --chunk-mib 58 the bundle takes three transfers where the plain
wheels, a group to a transfer, took five. Carry MANIFEST.json with each, and run `install` after
each: base, carried first, is usable as soon as its chunks are in.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from pipeline.storage.atomic_files import write_bytes_atomic
from gpu_bundle_install import (FORMAT, MANIFEST, BundleError, distribution, install,
                                normalized, say, sha256)

# What the node is taken to have: built against its own CUDA and Python, too big to carry.
NODE_HAS = {"torch", "numpy", "numba", "llvmlite", "pillow", "opencv-python", "opencv-python-headless"}
# What the GPU check never runs: reading parquet and ImageNet's devkit, and Ray, which converting does where the data is.
NOT_CARRIED = {"pyarrow", "scipy", "ray"}
# DALI's optional codec libraries (nvTIFF and nvJPEG2000 decoders, nvCOMP's GPU decompression).
DALI_OPTIONAL = re.compile(r"nvidia-(libnvcomp|nvjpeg2k|nvtiff)")
JPEG_KIT_PACKAGES = ("libjpeg62-turbo", "libjpeg62-turbo-dev")
# nginx and the libraries it links beyond libc: the loopback HTTP server of the e2e-remote stage.
NGINX_KIT_PACKAGES = ("nginx", "libpcre2-8-0", "libssl3", "zlib1g", "libcrypt1")
# Run through this, so that only nginx sees the kit's libraries (not Python's ssl, nor torch's zlib).
NGINX_WRAPPER = """#!/bin/sh
kit=$(dirname "$(dirname "$(readlink -f "$0")")")
LD_LIBRARY_PATH="$kit/lib" exec "$kit/sbin/nginx" "$@"
"""
# What each group must make importable on the node (kept in the manifest).
GROUP_IMPORTS = {"base": ["ffcv", "webdataset", "simplejpeg", "pytest", "xdist", "pytest_timeout"],
                 "dali": ["nvidia.dali"]}
DEFAULT_CHUNK_MIB = 58


def requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=~!;]", spec, maxsplit=1)[0].lower()


def run(command: list, what: str, cwd=None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith(("ERROR", "E:", "[ffcv-wheel] error"))] or lines or ["no message"]
        raise BundleError(f"{what} failed: {errors[-1][:300]}")


def setup_specs(name: str) -> list[str]:
    """A variable or array of tools/setup_specs.sh, the one place that says what the set-up installs."""
    script = f'source "$0" && printf "%s\\n" "${{{name}[@]}}"'
    result = subprocess.run(["bash", "-c", script, str(ROOT / "tools" / "setup_specs.sh")], capture_output=True,
                            text=True)
    specs = result.stdout.split()
    if result.returncode != 0 or not specs:
        raise BundleError(f"tools/setup_specs.sh has no {name}")
    return specs


def pip_download(specs: list[str], dest: Path, python_version: str) -> None:
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["manylinux2014_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               *[arg for p in platforms for arg in ("--platform", p)], "-d", str(dest), *specs]
    run(command, f"pip download {' '.join(specs)}")


def requirements(wheel: Path, python_version: str) -> list[str]:
    """The wheel's Requires-Dist that hold on the node (Linux x86-64, CPython `python_version`,
    no extras), as name and version range without the marker."""
    from packaging.requirements import Requirement   # the set-up installs it (matplotlib's)
    node = {"python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    wanted = [Requirement(ln.split(":", 1)[1]) for ln in lines if ln.startswith("Requires-Dist:")]
    return [f"{r.name}{r.specifier}" for r in wanted if r.marker is None or r.marker.evaluate(node)]


def complete(dest: Path, python_version: str, elsewhere: set[str] = frozenset()) -> None:
    """Downloads, level by level, what the wheels in `dest` require and neither `dest`, the node
    (NODE_HAS) nor `elsewhere` (another group) holds: the closure pip's resolver would install,
    which `--no-deps` downloads leave out (pytest's pluggy and iniconfig, webdataset's braceexpand)."""
    while True:
        present = {distribution(w) for w in dest.glob("*.whl")} | NODE_HAS | set(elsewhere)
        missing = sorted({spec for wheel in dest.glob("*.whl") for spec in requirements(wheel, python_version)
                          if (name := normalized(requirement_name(spec))) not in present
                          and not DALI_OPTIONAL.match(name)})
        if not missing:
            return
        pip_download(missing, dest, python_version)
        if not {distribution(w) for w in dest.glob("*.whl")} - present:
            raise BundleError(f"pip download {' '.join(missing)} brought no new wheel")


def gather_dali(dest: Path, cuda: str, python_version: str, elsewhere: set[str]) -> None:
    dali_spec = re.sub(r"cuda\d+", f"cuda{cuda}0", setup_specs("DALI_SPEC")[0])   # the set-up's, for the node's CUDA
    pip_download([dali_spec], dest, python_version)
    pip_download([f"nvidia-nvjpeg>={cuda},<{int(cuda) + 1}"], dest, python_version)
    complete(dest, python_version, elsewhere)


def unpack_debian_packages(packages: tuple[str, ...], into: Path) -> None:
    with tempfile.TemporaryDirectory() as debs:
        run(["apt-get", "download", *packages], "apt-get download", cwd=debs)
        for deb in Path(debs).glob("*.deb"):
            run(["dpkg", "-x", str(deb), str(into)], f"dpkg -x {deb.name}")


def gather_nginx(kit: Path) -> None:
    """nginx, its libraries in kit/lib and kit/bin/nginx, which runs it with them."""
    with tempfile.TemporaryDirectory() as unpacked:
        unpack_debian_packages(NGINX_KIT_PACKAGES, Path(unpacked))
        (kit / "sbin").mkdir(parents=True)
        (kit / "lib").mkdir()
        shutil.copy2(Path(unpacked) / "usr" / "sbin" / "nginx", kit / "sbin" / "nginx")
        for library in Path(unpacked).rglob("lib*.so*"):
            if library.is_symlink() or library.is_file():
                shutil.copy2(library, kit / "lib" / library.name, follow_symlinks=False)
    (kit / "bin").mkdir()
    (kit / "bin" / "nginx").write_text(NGINX_WRAPPER)
    (kit / "bin" / "nginx").chmod(0o755)


def gather_base(dest: Path, python: str, python_version: str) -> None:
    carried = [spec for spec in setup_specs("REST_SPECS") if requirement_name(spec) not in NODE_HAS | NOT_CARRIED]
    pip_download(carried, dest, python_version)
    run(["bash", str(ROOT / "tools" / "ffcv_wheel.sh"), str(dest), python], "tools/ffcv_wheel.sh")
    for wheel in dest.glob("*.whl"):                  # ffcv_wheel.sh adds OpenCV, which the node has
        if distribution(wheel) in NODE_HAS:
            wheel.unlink()
    complete(dest, python_version)
    unpack_debian_packages(JPEG_KIT_PACKAGES, dest / "jpeg-kit")
    gather_nginx(dest / "nginx-kit")
    from debian_packages import DebianPackageError, package_root
    from make_sample_data import PHOTO_SOURCES, largest_image
    cache = ROOT / "data" / "sample" / ".debian"
    for _, package, path in PHOTO_SOURCES:
        try:
            package_dir = package_root(package, [path], cache)
        except DebianPackageError as error:
            raise BundleError(f"the photographs: {error}") from None
        source = package_dir / path
        if source.is_dir():                           # a wallpaper folder: only the size make_photos reads
            source = largest_image(source)
        target = dest / "photos" / package / source.relative_to(package_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def store_wheel(wheel: Path) -> None:
    """Rewrite a wheel with its members stored, not deflated (the same files: pip installs it alike)."""
    partial = wheel.with_name(f".{wheel.name}.partial")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as stored:
        for info in source.infolist():
            data = source.read(info)
            info.compress_type = zipfile.ZIP_STORED
            stored.writestr(info, data)
    os.replace(partial, wheel)


def compress_xz(source: Path, target: Path, program: str | None = shutil.which("xz")) -> None:
    """xz -9 on every core when the xz program is here (2 min for DALI on 2 cores); else Python's
    lzma, one core (several times slower). Python's tarfile reads either on the node."""
    if program:
        with open(target, "wb") as out:
            result = subprocess.run([program, "-9", "-T0", "--stdout", str(source)], stdout=out, stderr=subprocess.PIPE,
                                    text=True)
        if result.returncode != 0:
            raise BundleError(f"xz {source.name} failed: {result.stderr.strip()[:300]}")
        return
    say(f"no xz program here: compressing {source.name} with Python's lzma on one core")
    with open(source, "rb") as whole, lzma.open(target, "wb", preset=9) as out:
        shutil.copyfileobj(whole, out, 1 << 20)


def write_group(name: str, folder: Path, out: Path, chunk_bytes: int, imports: list[str],
                first_chunk_bytes: int) -> dict:
    """Tar `folder` (its wheels stored), xz it and cut it into out/<name>.tar.xz.NN, the first chunk
    at most first_chunk_bytes; returns the group's manifest entry."""
    for old in out.glob(f"{name}.tar.*"):
        old.unlink()
    for wheel in folder.glob("*.whl"):
        store_wheel(wheel)
    tar_path, xz_path = out / f".{name}.tar.partial", out / f".{name}.tar.xz.partial"
    with tarfile.open(tar_path, "w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    compress_xz(tar_path, xz_path)
    tar_path.unlink()
    chunks, size = [], xz_path.stat().st_size
    with open(xz_path, "rb") as whole:
        limit = first_chunk_bytes
        while data := whole.read(limit):
            chunk = out / f"{name}.tar.xz.{len(chunks):02d}"
            write_bytes_atomic(chunk, data, durable=False)
            chunks.append({"name": chunk.name, "size": len(data), "sha256": sha256(chunk)})
            limit = chunk_bytes
    entry = {"size": size, "sha256": sha256(xz_path), "chunks": chunks, "imports": imports,
             "wheels": sorted(p.name for p in folder.glob("*.whl"))}
    xz_path.unlink()
    return entry


def write_bundle(out: Path, groups: dict[str, tuple[Path, list[str]]], chunk_bytes: int, **about) -> dict:
    """Each group (name -> (folder, modules it must make importable)) as chunks, laid out in
    transfers of at most chunk_bytes each, then the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)          # never an old manifest beside new chunks
    manifest = {"format": FORMAT, **about, "groups": {}, "transfers": []}
    transfers, room = manifest["transfers"], 0        # room: what the last transfer can still carry
    for name, (folder, imports) in groups.items():
        group = write_group(name, folder, out, chunk_bytes, imports, room or chunk_bytes)
        manifest["groups"][name] = group
        for index, chunk in enumerate(group["chunks"]):
            if index == 0 and room:
                transfers[-1].append(chunk["name"])
                room -= chunk["size"]
            else:
                transfers.append([chunk["name"]])
                room = chunk_bytes - chunk["size"]
        say(f"{name}: {len(group['chunks'])} chunk(s), {group['size'] / 2**20:.0f} MiB")
    write_bytes_atomic(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def pack(out: Path, python: str, cuda: str, chunk_mib: int) -> dict:
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True)
    if version.returncode != 0:
        raise BundleError(f"no interpreter {python} (the node's Python version, with its headers, builds FFCV)")
    python_version = version.stdout.strip()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as work:
        base, dali = Path(work) / "base", Path(work) / "dali"
        for folder in (base, dali):
            folder.mkdir()
        say("base: gathering")
        gather_base(base, python, python_version)
        say("dali: gathering")
        gather_dali(dali, cuda, python_version, {distribution(w) for w in base.glob("*.whl")})
        return write_bundle(out, {"base": (base, GROUP_IMPORTS["base"]), "dali": (dali, GROUP_IMPORTS["dali"])},
                            chunk_mib << 20, python=python_version, cuda=cuda)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="gather the bundle here and cut it into chunks (needs internet)")
    packing.add_argument("out", nargs="?", type=Path, default=ROOT / "gpu-bundle")
    packing.add_argument("--python", default="python3.12", help="an interpreter of the node's Python version")
    packing.add_argument("--cuda", default="13", help="the node's CUDA major version (torch's build)")
    packing.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_MIB,
                         help=f"most one transfer carries, MiB (default {DEFAULT_CHUNK_MIB})")
    installing = commands.add_parser("install", help="check the chunks here and install the complete groups")
    installing.add_argument("folder", type=Path)
    installing.add_argument("--site", type=Path, default=Path("/tmp/site"))
    installing.add_argument("--root", type=Path, default=ROOT, help="the repository the tests and tools run in")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            if args.chunk_mib < 1:
                parser.error("--chunk-mib must be at least 1")
            manifest = pack(args.out, args.python, args.cuda, args.chunk_mib)
            for number, names in enumerate(manifest["transfers"], 1):
                say(f"transfer {number}: {MANIFEST}, " + ", ".join(names))
        else:
            install(args.folder, args.site, args.root)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
