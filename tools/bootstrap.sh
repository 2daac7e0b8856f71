#!/usr/bin/env bash
# Bootstrap the project's environment: Debian build packages, .venv, torch (CPU), FFCV,
# DALI, WebDataset, numba, pytest, tqdm, matplotlib and tensorboard (without their pillow), and Pillow-SIMD last.
#
# Idempotent and fast the second time: a stamp in .venv records a hash of this script and
# of pyproject.toml; when it matches, only the Pillow-SIMD check runs.
# Usage: bash tools/bootstrap.sh   (make demo / make test call it)
#        WHEELHOUSE=DIR bash tools/bootstrap.sh   (offline: only from DIR, made by `make wheelhouse`)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.bootstrap-stamp"
PYTHON="${PYTHON:-python3}"

source "$ROOT/tools/setup_specs.sh"
WHEELHOUSE="${WHEELHOUSE:-}"
# A wheelhouse says which torch and DALI builds it holds (tools/wheelhouse.sh)
[[ -n "$WHEELHOUSE" && -f "$WHEELHOUSE/setup.env" ]] && source "$WHEELHOUSE/setup.env"

say() { printf '[bootstrap] %s\n' "$*" >&2; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

stamp_value() { cat "${BASH_SOURCE[0]}" "$ROOT/tools/setup_specs.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1; }

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

# --- Debian packages: for building, and the tests' servers ------------------------------
missing=()
for pkg in "${DEB_BUILD_PACKAGES[@]}" "${DEB_TEST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
    if [[ -n "$WHEELHOUSE" ]]; then
        die "missing Debian packages, which a wheelhouse cannot hold: ${missing[*]}; install them from your distribution's mirror or media ($cmd), then re-run"
    elif [[ $(id -u) -eq 0 ]]; then
        say "installing Debian packages: ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive bash -c "$cmd" >/dev/null
    else
        die "missing Debian packages; run as root: sudo bash -c '$cmd'"
    fi
fi

# --- virtual environment -----------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
    # pip unpacks torch and DALI under TMPDIR and installs them here: about 2.5 GB in the
    # venv, more while it works. Fail now with the place named, not half-way with Errno 28.
    for place in "$ROOT" "${TMPDIR:-/tmp}"; do
        free_mb=$(df --output=avail -BM "$place" | tail -1 | tr -dc 0-9)
        ((free_mb >= 3500)) ||
            die "only ${free_mb} MB free on $place; the set-up needs about 3.5 GB (the venv, and pip's unpacking under TMPDIR): free some space, or set TMPDIR to a roomier folder"
    done
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# Offline: every pip call below reads the wheelhouse alone (pip takes its options from the environment).
if [[ -n "$WHEELHOUSE" ]]; then
    [[ -d "$WHEELHOUSE" ]] || die "WHEELHOUSE=$WHEELHOUSE: no such folder (make it with: make wheelhouse WHEELHOUSE=DIR)"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$(cd "$WHEELHOUSE" && pwd)"
    say "offline: installing from $PIP_FIND_LINKS only"
fi
# This machine's pip config names local index folders that may not exist; pip warns about
# each one per package. Those lines are noise: keep every other message.
pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" \
        2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2) ||
        { [[ -z "$WHEELHOUSE" ]] || die "pip install $* failed offline: is it in $WHEELHOUSE? (make wheelhouse)"; exit 1; }
}

say "installing $TORCH_SPEC and numpy"
pip_install "$TORCH_SPEC" "${REST_SPECS[0]}"
say "installing $FFCV_SPEC (builds from source, about 40 s the first time)"
# FFCV's setup.py needs numpy at build time and does not declare it: build in this venv.
pip_install setuptools wheel pkgconfig "${REST_SPECS[0]}"
pip_install --no-build-isolation "$FFCV_SPEC"
say "installing DALI, WebDataset, numba, pytest, tqdm"
pip_install "$DALI_SPEC" "${REST_SPECS[@]}"
say "installing matplotlib and tensorboard (--no-deps: they would pull stock pillow) and their other dependencies"
pip_install "${REST_SPECS[0]}" "${NO_DEPS_DEPS[@]}"
pip_install --no-deps "${NO_DEPS_SPECS[@]}"
say "installing the project itself (editable, no dependencies)"
pip_install --no-deps --no-build-isolation -e "$ROOT"

# --- Pillow-SIMD, last ---------------------------------------------------------------
if ! check_pillow_simd 2>/dev/null; then
    cflags=""
    grep -qw avx2 /proc/cpuinfo && cflags="-mavx2"
    say "building Pillow-SIMD (CC='cc $cflags', about 70 s)"
    "$PY" -m pip uninstall -y -q pillow pillow-simd >/dev/null 2>&1 || true
    # Only Pillow-SIMD from source: with :all:, pip would also build its build requirements
    # (pybind11, setuptools) from source, and offline the wheelhouse holds their wheels.
    CC="cc $cflags" pip_install --no-cache-dir --no-binary=pillow-simd "$PILLOW_SIMD_SPEC"
fi
check_pillow_simd
stamp_value >"$STAMP"
"$PY" -c 'import torch, ffcv, nvidia.dali, webdataset, PIL, matplotlib, tensorboard' || die "the environment does not import; rm -rf .venv and re-run"
# Compiles the backends' C (pipeline/native/decode_engine.c, jpeg_roi.c, sample_uniforms.c) now rather than in the first loader.
(cd "$ROOT" && "$PY" -c 'import pipeline.decode.jpeg_roi, pipeline.decode.engine, pipeline.transforms.crops as c; c.compiled_sample_uniforms()') ||
    die "cannot build pipeline/native/decode_engine.c, jpeg_roi.c or sample_uniforms.c (needs cc and libjpeg-dev)"
say "ready: $("$PY" -c 'import sys; from importlib.metadata import version as v; print(", ".join(f"{n} {v(n)}" for n in ("torch", "ffcv", sys.argv[1], "webdataset", "matplotlib", "tensorboard", "pillow-simd")))' "${DALI_SPEC%%[<>=]*}")"
