#!/usr/bin/env bash
# One short session on a GPU node that keeps /tmp between sessions but gets a fresh copy of the
# repository each time (the GPU machines lent to us: 10 minutes and 64 MiB carried a call, so
# the tracked results files a stage appends to are replaced by the next call's copy). It
#   1. takes in the bundle pieces that came with this session (tools/gpu_bundle.py pack),
#   2. installs every group whose pieces are all in by now, and sources its env.sh,
#   3. runs the `make gpu-check` stages asked for, with results and records under KEEP,
#   4. packs the results and the records' small files into OUT/gpu-results.tgz for the trip back.
# Usage: bash tools/gpu_session.sh [STAGES]      (gpu_check.py --stages; none: steps 1, 2 and 4)
# Env: BUNDLE (the pieces carried in; default gpu-bundle), KEEP (what stays between sessions;
#      default /tmp/fastpipe), OUT (default KEEP), PYTHON (default python3), DEADLINE (seconds
#      from now by which every stage has ended, cut short if need be, so that the results are
#      packed before the call's own limit kills this script: that limit less ~15 s).
# Back here: tar xzf gpu-results.tgz, then copy results/<machine>.jsonl and results/report/ into
# benchmarks/results (docs/benchmarks.md, "On a GPU lease").
set -euo pipefail
STARTED=$(date +%s)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${BUNDLE:-$ROOT/gpu-bundle}" KEEP="${KEEP:-/tmp/fastpipe}" PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$KEEP}"
say() { printf '[gpu-session] %s\n' "$*" >&2; }
cd "$ROOT"

mkdir -p "$KEEP/bundle" "$KEEP/results" "$OUT"
if compgen -G "$BUNDLE/*" >/dev/null; then
    cp -f "$BUNDLE"/* "$KEEP/bundle/"
    say "pieces here: $(cd "$KEEP/bundle" && ls -- *.tar.* 2>/dev/null | tr '\n' ' ')"
fi
if [[ -f "$KEEP/bundle/MANIFEST.json" ]]; then
    "$PYTHON" tools/gpu_bundle.py install "$KEEP/bundle" --site "$KEEP/site"
    # shellcheck disable=SC1091
    source "$KEEP/site/env.sh"
else
    say "no bundle in $BUNDLE or $KEEP/bundle: using this Python's own packages"
fi
# The committed results seed KEEP once; the rows stages append there outlive the next copy.
cp -rn benchmarks/results/. "$KEEP/results/"

status=0
if (($# > 0)); then
    deadline=()
    [[ -n "${DEADLINE:-}" ]] && deadline=(--deadline-at "$((STARTED + DEADLINE))")
    "$PYTHON" tools/gpu_check.py --stages "$1" --results-dir "$KEEP/results" --work "$KEEP/work" "${deadline[@]}" \
        || status=$?
fi
# Records, logs and JSONs: not the run directories' checkpoints.
mapfile -t records < <(cd "$KEEP" && find work -type f -size -2M \( -name '*.json' -o -name '*.jsonl' \
                           -o -name '*.log' -o -name '*.md' \) 2>/dev/null | sort)
tar czf "$OUT/gpu-results.tgz" -C "$KEEP" results "${records[@]}"
say "packed $OUT/gpu-results.tgz ($(du -h "$OUT/gpu-results.tgz" | cut -f1)); gpu_check exit $status"
exit "$status"
