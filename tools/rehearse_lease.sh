#!/usr/bin/env bash
# Rehearse a GPU lease here, before one is lent: the runbook's calls (docs/benchmarks.md, "On a GPU
# lease"), one per entry of gpu-bundle/MANIFEST.json's "calls", each with only that call's pieces,
# each over a fresh copy of the working tree's tracked files that keeps the last call's ignored
# data/ (as the lent machines do), KEEP kept between calls, the network cut (`unshare -n`, loopback
# up), in NODE_PYTHON: a stand-in for the GPU image (Python 3.12 with torch 2.11+cu130, numpy,
# numba, Pillow and OpenCV, nothing else). Without CUDA gpu_check.py runs only the stages' CPU
# halves (GPU_CHECK_WITHOUT_CUDA=1): call 1 `data`, later calls `tests` (collected, skipped),
# the last `tests,report`. Found two faults that would each have cost a lease (2026-11-26).
# Usage: NODE_PYTHON=/path/venv/bin/python bash tools/rehearse_lease.sh [WORK]   (root: unshare -n)
#        WORK (default /tmp/rehearse-lease) gets repo/, keep/ and out<N>/ with each call's log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/rehearse-lease}" NODE_PYTHON="${NODE_PYTHON:-}"
say() { printf '[rehearse] %s\n' "$*" >&2; }
die() { printf '[rehearse] error: %s\n' "$*" >&2; exit 2; }

[[ -n "$NODE_PYTHON" && -x "$NODE_PYTHON" ]] || die "NODE_PYTHON=${NODE_PYTHON:-(unset)}: name the stand-in venv's python"
[[ -f "$ROOT/gpu-bundle/MANIFEST.json" ]] || die "no gpu-bundle/MANIFEST.json: run make gpu-bundle first"
unshare -n true 2>/dev/null || die "unshare -n failed: run as root (it cuts this rehearsal's network)"
mapfile -t calls < <(python3 -c 'import json, sys
for pieces in json.load(open(sys.argv[1]))["calls"]: print(" ".join(pieces))' "$ROOT/gpu-bundle/MANIFEST.json")

mkdir -p "$WORK/repo"
for i in "${!calls[@]}"; do
    n=$((i + 1))
    if ((n == 1)); then stages=data; elif ((n < ${#calls[@]})); then stages=tests; else stages=tests,report; fi
    rm -rf "$WORK/repo/gpu-bundle" && mkdir -p "$WORK/repo/gpu-bundle" "$WORK/out$n"
    (cd "$ROOT" && git ls-files -z | tar cf - --null -T -) | tar xf - -C "$WORK/repo"
    # shellcheck disable=SC2086  # the call's piece names, split on purpose
    (cd "$ROOT/gpu-bundle" && cp MANIFEST.json ${calls[$i]} "$WORK/repo/gpu-bundle/")
    say "call $n: ${calls[$i]}; stages $stages"
    started=$(date +%s)
    status=0
    (cd "$WORK/repo" && unshare -n sh -c 'ip link set lo up && exec "$@"' sh env GPU_CHECK_WITHOUT_CUDA=1 \
        PYTHON="$NODE_PYTHON" KEEP="$WORK/keep" OUT="$WORK/out$n" bash tools/gpu_session.sh "$stages") \
        >"$WORK/out$n/call.log" 2>&1 || status=$?
    say "call $n: exit $status in $(($(date +%s) - started)) s; log $WORK/out$n/call.log"
    grep -E '^\[gpu-(bundle|session)\]|^# gpu-check stage' "$WORK/out$n/call.log" | sed 's/^/    /' >&2 || true
done
