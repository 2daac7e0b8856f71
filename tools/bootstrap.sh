#!/usr/bin/env bash
# Bootstrap the project's environment: Debian build packages, .venv, torch (CPU), FFCV,
# DALI, WebDataset, numba, pytest, tqdm, matplotlib (without its pillow), and Pillow-SIMD last.
#
# Idempotent and fast the second time: a stamp in .venv records a hash of this script and
# of pyproject.toml; when it matches, only the Pillow-SIMD check runs.
# Usage: bash tools/bootstrap.sh   (make demo / make test call it)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.bootstrap-stamp"
PYTHON="${PYTHON:-python3}"

# FFCV compiles against libturbojpeg and OpenCV (found through pkg-config);
# Pillow-SIMD compiles against libjpeg and zlib.
DEB_BUILD_PACKAGES=(libturbojpeg0-dev libopencv-dev pkg-config libjpeg-dev zlib1g-dev)
TORCH_SPEC="torch==2.13.0"            # the CPU build here; an unpinned torch pulls CUDA wheels
FFCV_SPEC="ffcv==1.0.2"
DALI_SPEC="nvidia-dali-cuda120>=2.0,<3"
REST_SPECS=("numpy>=1.24,<2.6" "numba>=0.60,<0.70" "webdataset>=1.0,<2" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "tqdm>=4.60" "pyyaml>=6"
            "simplejpeg>=1.7,<2")   # simplejpeg: the decode-only bound in benchmarks/loaders.py
PILLOW_SIMD_SPEC="pillow-simd>=9"
# matplotlib (benchmarks/report.py) declares `pillow`, so a plain install would put stock Pillow
# over Pillow-SIMD. It goes in with --no-deps, after its other dependencies installed normally
# (none of them needs pillow); its PIL needs are met by Pillow-SIMD's `PIL`. This list is
# matplotlib 3.x's Requires-Dist less pillow and numpy (numpy comes with its own pin above).
MATPLOTLIB_SPEC="matplotlib>=3.8,<4"
MATPLOTLIB_DEPS=("contourpy>=1.0.1" "cycler>=0.10" "fonttools>=4.28.2" "kiwisolver>=1.3.1" "packaging>=20.0"
                 "pyparsing>=3" "python-dateutil>=2.7")

say() { printf '[bootstrap] %s\n' "$*" >&2; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

stamp_value() { cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1; }

check_pillow_simd() {
    # Any later pip install that resolves a package needing `pillow` silently puts stock
    # Pillow back over Pillow-SIMD (both provide the `PIL` module): refuse to go on then.
    "$PY" - <<'EOF'
import sys
from importlib import metadata
import PIL
try:
    simd = metadata.version("pillow-simd")
except metadata.PackageNotFoundError:
    simd = None
try:
    stock = metadata.version("pillow")
except metadata.PackageNotFoundError:
    stock = None
if simd is None or stock is not None or PIL.__version__ != simd:
    sys.exit(f"[bootstrap] error: PIL is not Pillow-SIMD (PIL {PIL.__version__}, "
             f"pillow-simd {simd}, stock pillow {stock}). Re-run: rm -f .venv/.bootstrap-stamp "
             f"&& bash tools/bootstrap.sh")
EOF
}

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" ]]; then
    check_pillow_simd
    exit 0
fi

# --- Debian build packages -------------------------------------------------------------
missing=()
for pkg in "${DEB_BUILD_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
    if [[ $(id -u) -eq 0 ]]; then
        say "installing Debian packages: ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive bash -c "$cmd" >/dev/null
    else
        die "missing Debian packages; run as root: sudo bash -c '$cmd'"
    fi
fi

# --- virtual environment -----------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# This machine's pip config names local index folders that may not exist; pip warns about
# each one per package. Those lines are noise: keep every other message.
pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" \
        2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2)
}

say "installing $TORCH_SPEC and numpy"
pip_install "$TORCH_SPEC" "${REST_SPECS[0]}"
say "installing $FFCV_SPEC (builds from source, about 40 s the first time)"
# FFCV's setup.py needs numpy at build time and does not declare it: build in this venv.
pip_install setuptools wheel pkgconfig "${REST_SPECS[0]}"
pip_install --no-build-isolation "$FFCV_SPEC"
say "installing DALI, WebDataset, numba, pytest, tqdm"
pip_install "$DALI_SPEC" "${REST_SPECS[@]}"
say "installing matplotlib (--no-deps: it would pull stock pillow) and its other dependencies"
pip_install "${REST_SPECS[0]}" "${MATPLOTLIB_DEPS[@]}"
pip_install --no-deps "$MATPLOTLIB_SPEC"
say "installing the project itself (editable, no dependencies)"
pip_install --no-deps --no-build-isolation -e "$ROOT"

# --- Pillow-SIMD, last ---------------------------------------------------------------
if ! check_pillow_simd 2>/dev/null; then
    cflags=""
    grep -qw avx2 /proc/cpuinfo && cflags="-mavx2"
    say "building Pillow-SIMD (CC='cc $cflags', about 70 s)"
    "$PY" -m pip uninstall -y -q pillow pillow-simd >/dev/null 2>&1 || true
    CC="cc $cflags" pip_install --no-cache-dir --no-binary=:all: "$PILLOW_SIMD_SPEC"
fi
check_pillow_simd
stamp_value >"$STAMP"
"$PY" -c 'import torch, ffcv, nvidia.dali, webdataset, PIL, matplotlib' || die "the environment does not import; rm -rf .venv and re-run"
# Compiles the webdataset backend's C (pipeline/decode_engine.c, jpeg_roi.c) now rather than in the first loader.
(cd "$ROOT" && "$PY" -c 'import pipeline.jpeg_roi, pipeline.decode_engine') ||
    die "cannot build pipeline/decode_engine.c or jpeg_roi.c (needs cc and libjpeg-dev)"
say "ready: $("$PY" -c 'from importlib.metadata import version as v; print(", ".join(f"{n} {v(n)}" for n in ("torch", "ffcv", "nvidia-dali-cuda120", "webdataset", "matplotlib", "pillow-simd")))')"
