#!/usr/bin/env bash
# Download every wheel and source distribution the set-up installs into one folder, so that a
# machine without internet (a cluster's compute node) of the same platform and Python version
# can set up with `WHEELHOUSE=DIR bash tools/bootstrap.sh` (or `make test WHEELHOUSE=DIR`).
# FFCV and Pillow-SIMD come as sources (they are compiled at install, against the node's own
# libjpeg-turbo and OpenCV); the Debian packages that needs cannot travel in a wheelhouse, and
# the offline bootstrap names any that are missing.
# Usage: bash tools/wheelhouse.sh DIR [TORCH]   (make wheelhouse [WHEELHOUSE=DIR] [TORCH=cpu|cu126|cu128|cu130])
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_specs.sh"
say() { printf '[wheelhouse] %s\n' "$*" >&2; }
die() { printf '[wheelhouse] error: %s\n' "$*" >&2; exit 2; }

(($# >= 1)) || die "usage: bash tools/wheelhouse.sh DIR [cpu|cu126|cu128|cu130]"
DIR="$1" TORCH="${2:-cpu}" PYTHON="${PYTHON:-python3}"
[[ "$TORCH" =~ ^(cpu|cu1[0-9]{2})$ ]] || die "TORCH=$TORCH: use cpu or a CUDA build of torch such as cu126, cu128, cu130"
[[ -e "$DIR" && ! -d "$DIR" ]] && die "$DIR exists and is not a folder"
# DALI's wheel must match torch's CUDA major version; on a CPU build DALI runs its CPU graph.
DALI="$DALI_SPEC"
[[ "$TORCH" == cu13* ]] && DALI="${DALI_SPEC/cuda1[0-9][0-9]/cuda130}"   # the same versions, built for CUDA 13
mkdir -p "$DIR"
download() { "$PYTHON" -m pip download --disable-pip-version-check -q -d "$DIR" "$@" \
                 2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2); }

say "for $("$PYTHON" -c 'import sys, platform; print(f"Python {sys.version.split()[0]} on {platform.machine()}")'): torch ($TORCH build)"
download --index-url "https://download.pytorch.org/whl/$TORCH" --extra-index-url https://pypi.org/simple "$TORCH_SPEC"
# Everything after torch is resolved against the torch just downloaded (FFCV's pytorch_pfn_extras
# requires torch, and PyPI's default build would bring another 3 GB of CUDA libraries).
echo "$TORCH_SPEC" >"$DIR/constraints.txt"
pinned() { download --find-links "$DIR" -c "$DIR/constraints.txt" "$@"; }
say "DALI, numpy, numba, webdataset, pytest, tqdm, matplotlib's and tensorboard's dependencies, build tools"
pinned "$DALI" "${REST_SPECS[@]}" "${NO_DEPS_DEPS[@]}" setuptools wheel pkgconfig
download --no-deps "${NO_DEPS_SPECS[@]}"
say "FFCV and Pillow-SIMD as sources, and FFCV's dependencies"
download --no-deps --no-binary :all: "$FFCV_SPEC" "$PILLOW_SIMD_SPEC"
pinned "${FFCV_DEPS[@]}"
# Building those sources offline needs their build requirements too (pip's isolated build
# environment reads the wheelhouse alone): read them from each source's pyproject.toml.
mapfile -t BUILD_REQUIRES < <("$PYTHON" - "$DIR" <<'PY'
import sys, tarfile
try:
    import tomllib
except ImportError:                     # Python 3.10: pip carries a copy
    from pip._vendor import tomli as tomllib
from pathlib import Path
for sdist in Path(sys.argv[1]).glob("*.tar.gz"):
    with tarfile.open(sdist) as tar:
        member = next((m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml")), None)
        if member:
            for requirement in tomllib.load(tar.extractfile(member)).get("build-system", {}).get("requires", []):
                print(requirement)
PY
)
((${#BUILD_REQUIRES[@]} == 0)) || pinned "${BUILD_REQUIRES[@]}"
# What tools/bootstrap.sh installs from here, where it differs from its defaults.
printf 'TORCH_SPEC=%q\nDALI_SPEC=%q\n' "$TORCH_SPEC" "$DALI" >"$DIR/setup.env"
say "done: $(find "$DIR" -maxdepth 1 -type f | wc -l) files, $(du -sh "$DIR" | cut -f1) in $DIR"
