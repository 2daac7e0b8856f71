"""What `make gpu-check` needs on a GPU node without internet, packed here in pieces of a size you choose.

A GPU image that already holds Python, torch (CUDA), numpy, numba, Pillow and OpenCV (an
NGC-style container; the GPU machines lent to us: Python 3.12, torch 2.11+cu130, where one call
carries at most 64 MiB) lacks DALI, webdataset, simplejpeg, FFCV, the libjpeg-turbo headers our
C engine compiles against, and the photographs tools/make_sample_data.py cuts its sets from.

    python tools/gpu_bundle.py pack [OUT] [--python python3.12] [--cuda 13] [--piece-mib 58]
    python3 tools/gpu_bundle.py install DIR [--site /tmp/site]      (on the node, repository root)
    source /tmp/site/env.sh                                           (then make gpu-check PY=python3 SETUP=)

`pack` (default OUT: gpu-bundle/) makes two groups, each an xz-compressed tar cut into pieces,
and MANIFEST.json with every piece's size and sha256 and the calls that carry them:
- base: the FFCV wheel (tools/ffcv_wheel.sh) and its small dependencies, webdataset,
  simplejpeg, pytest and its plugins, a libjpeg-turbo kit (headers and library,
  from Debian packages) and the 23 source photographs (about 21 MiB). Every stage but DALI's
  runs with it alone;
- each group also carries what its wheels require on the node and neither it, the other group
  nor the node has (`complete`: pip downloads for another platform must be --no-deps);
- dali: DALI for CUDA `--cuda`, nvImageCodec and nvJPEG, and DALI's pure-Python dependencies.
  nvCOMP, nvJPEG2000 and nvTIFF stay out: DALI prints that it cannot load them and goes on
  (JPEG needs none of them).
The wheels go in stored, not deflated, so that xz -9 sees their libraries whole: DALI 2.4.0's
group shrinks from 223 MiB of wheels to 144 MiB, and the node spends about 5 s unpacking it.
The pieces are laid out call by call, base first, each call at most a piece's size, the first
piece of a group filling what the call before had left (manifest "calls"): at 58 MiB the
bundle takes three calls, where the plain wheels, a group to a call, took five.
`install` checks whatever pieces DIR holds against the manifest and installs each complete
group into SITE/<group> (pip --no-index --no-deps --target; a wheel whose distribution the node
already has is skipped, so the image's own builds are never shadowed), puts the photographs
where make_sample_data and the tests look (data/sample/.debian), and writes SITE/env.sh. A
group with a piece missing is reported and left out; a damaged piece stops the install with a
one-line error naming it (what was installed stays); a group installed before from the same
pieces is kept, any other replaced whole. docs/benchmarks.md ("On a GPU lease") gives the
calls.
"""
from __future__ import annotations

import argparse
import hashlib
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
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline.atomic_files import replace_atomically, write_bytes_atomic  # noqa: E402

MANIFEST = "MANIFEST.json"
FORMAT = 2          # 2: xz-compressed groups of stored wheels, laid out in calls
# What the node is taken to have: built against its own CUDA and Python, too big to carry.
NODE_HAS = {"torch", "numpy", "numba", "llvmlite", "pillow", "opencv-python", "opencv-python-headless"}
# DALI's optional codec libraries (nvTIFF and nvJPEG2000 decoders, nvCOMP's GPU decompression).
DALI_OPTIONAL = re.compile(r"nvidia-(libnvcomp|nvjpeg2k|nvtiff)")
JPEG_KIT_PACKAGES = ("libjpeg62-turbo", "libjpeg62-turbo-dev")
# What each group must make importable on the node (kept in the manifest).
GROUP_IMPORTS = {"base": ["ffcv", "webdataset", "simplejpeg", "pytest", "xdist", "pytest_timeout"],
                 "dali": ["nvidia.dali"]}


class BundleError(Exception):
    """A one-line reason the bundle cannot be made or installed."""


def say(message: str) -> None:
    print(f"[gpu-bundle] {message}", file=sys.stderr, flush=True)


def distribution(wheel: Path) -> str:
    """A wheel file's distribution name, normalized (PEP 503)."""
    return normalized(wheel.name.split("-")[0])


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=~!;]", spec, maxsplit=1)[0].lower()


# --- pack (here, with internet) ---------------------------------------------------------------
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


def gather_base(dest: Path, python: str, python_version: str) -> None:
    carried = [spec for spec in setup_specs("REST_SPECS") if requirement_name(spec) not in NODE_HAS]
    pip_download(carried, dest, python_version)
    run(["bash", str(ROOT / "tools" / "ffcv_wheel.sh"), str(dest), python], "tools/ffcv_wheel.sh")
    for wheel in dest.glob("*.whl"):                  # ffcv_wheel.sh adds OpenCV, which the node has
        if distribution(wheel) in NODE_HAS:
            wheel.unlink()
    complete(dest, python_version)
    kit = dest / "jpeg-kit"
    with tempfile.TemporaryDirectory() as debs:
        run(["apt-get", "download", *JPEG_KIT_PACKAGES], "apt-get download", cwd=debs)
        for deb in Path(debs).glob("*.deb"):
            run(["dpkg", "-x", str(deb), str(kit)], f"dpkg -x {deb.name}")
    sys.path.insert(0, str(ROOT / "tools"))
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


def write_group(name: str, folder: Path, out: Path, piece_bytes: int, imports: list[str],
                first_piece_bytes: int) -> dict:
    """Tar `folder` (its wheels stored), xz it and cut it into out/<name>.tar.xz.NN, the first piece
    at most first_piece_bytes; returns the group's manifest entry."""
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
    pieces, size = [], xz_path.stat().st_size
    with open(xz_path, "rb") as whole:
        limit = first_piece_bytes
        while chunk := whole.read(limit):
            piece = out / f"{name}.tar.xz.{len(pieces):02d}"
            write_bytes_atomic(piece, chunk, durable=False)
            pieces.append({"name": piece.name, "size": len(chunk), "sha256": sha256(piece)})
            limit = piece_bytes
    entry = {"size": size, "sha256": sha256(xz_path), "pieces": pieces, "imports": imports,
             "wheels": sorted(p.name for p in folder.glob("*.whl"))}
    xz_path.unlink()
    return entry


def write_bundle(out: Path, groups: dict[str, tuple[Path, list[str]]], piece_bytes: int, **about) -> dict:
    """Each group (name -> (folder, modules it must make importable)) as pieces, laid out in calls
    of at most piece_bytes each, then the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)          # never an old manifest beside new pieces
    manifest = {"format": FORMAT, **about, "groups": {}, "calls": []}
    calls, room = manifest["calls"], 0                # room: what the last call can still carry
    for name, (folder, imports) in groups.items():
        group = write_group(name, folder, out, piece_bytes, imports, room or piece_bytes)
        manifest["groups"][name] = group
        for index, piece in enumerate(group["pieces"]):
            if index == 0 and room:
                calls[-1].append(piece["name"])
                room -= piece["size"]
            else:
                calls.append([piece["name"]])
                room = piece_bytes - piece["size"]
        say(f"{name}: {len(group['pieces'])} piece(s), {group['size'] / 2**20:.0f} MiB")
    write_bytes_atomic(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def pack(out: Path, python: str, cuda: str, piece_mib: int) -> dict:
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
                            piece_mib << 20, python=python_version, cuda=cuda)


# --- install (on the node) --------------------------------------------------------------------
def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise BundleError(f"no {MANIFEST} in {folder}: carry it with the pieces") from None
    except json.JSONDecodeError as error:
        raise BundleError(f"{folder / MANIFEST} is not JSON ({error})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("groups"), dict):
        raise BundleError(f"{folder / MANIFEST}: not a gpu_bundle manifest of format {FORMAT}; pack it again")
    return manifest


def checked_pieces(folder: Path, name: str, group: dict) -> list[Path] | None:
    """The group's pieces, each checked; None when some are not here yet."""
    paths = [folder / p["name"] for p in group["pieces"]]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        say(f"{name}: {len(paths) - len(missing)} of {len(paths)} pieces here, not installed "
            f"(missing {', '.join(missing)})")
        return None
    for path, piece in zip(paths, group["pieces"]):
        if path.stat().st_size != piece["size"] or sha256(path) != piece["sha256"]:
            raise BundleError(f"{path}: size or sha256 differs from {MANIFEST}; copy this piece again")
    return paths


def node_has(wheel: Path, site: Path) -> bool:
    """Whether this Python already has the wheel's distribution, from somewhere other than site
    (an env.sh sourced before puts site's own copies on the path)."""
    try:
        found = Path(metadata.distribution(distribution(wheel)).locate_file("")).resolve()
    except metadata.PackageNotFoundError:
        return False
    return site.resolve() not in (found, *found.parents)


def install_group(name: str, pieces: list[Path], site: Path, root: Path, group_sha256: str) -> list[str]:
    """Join, unpack and install one group into site/name; returns what it installed."""
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=site))
    try:
        tar_path = staging / "group.tar.xz"
        with open(tar_path, "wb") as whole:
            for piece in pieces:
                with open(piece, "rb") as f:
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
        if (files / "jpeg-kit").is_dir():
            os.replace(files / "jpeg-kit", target / "jpeg-kit")
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
        pieces = checked_pieces(folder, name, group)
        if pieces is not None:
            wheels = install_group(name, pieces, site, root, group["sha256"])
            say(f"{name}: installed into {site / name} ({len(wheels)} wheels; the node had the rest)")
            installed.append(name)
    variables = environment(site, root, manifest["groups"])
    lines = [f'export {key}="{value}${{{key}:+:${key}}}"' for key, value in variables.items()]
    write_bytes_atomic(site / "env.sh", ("\n".join(lines) + "\n").encode())
    check_imports([m for g in installed for m in manifest["groups"][g].get("imports", [])], variables)
    say(f"now: source {site / 'env.sh'}")
    return installed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="gather and split the bundle here (needs internet)")
    packing.add_argument("out", nargs="?", type=Path, default=ROOT / "gpu-bundle")
    packing.add_argument("--python", default="python3.12", help="an interpreter of the node's Python version")
    packing.add_argument("--cuda", default="13", help="the node's CUDA major version (torch's build)")
    packing.add_argument("--piece-mib", type=int, default=58, help="most a call carries, MiB (default 58)")
    installing = commands.add_parser("install", help="check the pieces here and install the complete groups")
    installing.add_argument("folder", type=Path)
    installing.add_argument("--site", type=Path, default=Path("/tmp/site"))
    installing.add_argument("--root", type=Path, default=ROOT, help="the repository the tests and tools run in")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            if args.piece_mib < 1:
                parser.error("--piece-mib must be at least 1")
            manifest = pack(args.out, args.python, args.cuda, args.piece_mib)
            for number, names in enumerate(manifest["calls"], 1):
                say(f"call {number} carries {MANIFEST}, " + ", ".join(names))
        else:
            install(args.folder, args.site, args.root)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
