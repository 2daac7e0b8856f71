"""The decode engine of this tree against the engine of a git revision, in one run, alternating:
what a change to `pipeline/native/decode_engine.c` bought, per resolution, stage by stage.

    python benchmarks/engine_versions.py [--against HEAD] [--source data/sample/photos]
                                         [--resolutions 96,128,160] [--val-resolutions 224] [--threads 2] [--rounds 5]

Both engines make every sample of the split's webdataset conversion (made once under `--cache`,
as benchmarks/loaders.py makes it) in batches of `--batch-size`, from the page cache, into float32
normalized batches (what a CPU model is fed) or `--uint8` (what a GPU is sent). Rounds alternate
the two engines, so that a machine's drift falls on both; the figure is each one's median round.
Also shown: the `entropy_only` floor (the same crops' MCUs Huffman-decoded, nothing more), and this
tree's CPU microseconds per image in each stage (`pipeline.decode.engine.STAGES`), the decode
split into the floor's entropy decoding and the rest.
With --save (or --results-dir DIR), one JSON line per resolution goes to this machine's file in
benchmarks/results/.
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bare_loaders import engine_epoch
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from benchmarks.loaders import convert, split_decode_stage
from pipeline import LoaderSpec
from pipeline.datasets import read_converted
from pipeline.decode import engine as decode_engine
from pipeline.native.library import load_library
from pipeline.shards.index import StoredShards

ROOT = Path(__file__).resolve().parents[1]
NATIVE = "pipeline/native"


def engine_at(revision: str, folder: Path) -> ctypes.CDLL:
    """The engine as `revision` wrote it, compiled for this CPU into `folder`."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", revision, f"{NATIVE}/"],
                            capture_output=True, text=True, check=True).stdout.split()
    for path in listed:
        if path.endswith((".c", ".h")):
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{path}"], capture_output=True, check=True)
            (folder / Path(path).name).write_bytes(shown.stdout)
    library = load_library(folder / "decode_engine.c", libraries=("jpeg", "z", "pthread", "m"),
                           flags=("-march=native",), library=folder / "decode_engine.so", check="engine_check")
    library.engine_decode_batch.argtypes = [ctypes.POINTER(decode_engine._BatchJob)]
    return library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", help="the git revision whose engine this tree's is set against")
    parser.add_argument("--source", type=Path, default=ROOT / "data/sample/photos")
    parser.add_argument("--cache", type=Path, default=ROOT / "data/bench", help="where conversions are kept")
    parser.add_argument("--resolutions", default="96,128,160", help="train sides, comma-separated")
    parser.add_argument("--val-resolutions", default="224", help="val sides, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--uint8", action="store_true", help="uint8 batches (for a GPU) instead of float32 normalized")
    add_results_options(parser)
    args = parser.parse_args()
    dtype = np.uint8 if args.uint8 else np.float32
    conversion = convert("wds", args.source, args.cache)
    folder = Path(tempfile.mkdtemp(prefix="engine-versions-"))
    rows, hardware = [], signature()
    try:
        other = engine_at(args.against, folder)
        print(f"# {cpu_words(hardware)}; {args.threads} threads; {args.source.name} wds; {np.dtype(dtype).name} batches; "
              f"median of {args.rounds} alternating rounds")
        print(f"{'split':5} {'side':>4} {args.against[:10]:>10} {'this tree':>10} {'speed-up':>8} {'floor':>8}  "
              "this tree's CPU µs per image: " + " / ".join(decode_engine.STAGES) +
              " (decode: entropy + IDCT, upsampling and colour)")
        runs = [("train", int(side)) for side in args.resolutions.split(",") if side] + \
               [("val", int(side)) for side in args.val_resolutions.split(",") if side]
        for split, side in runs:
            shards = StoredShards(read_converted(str(conversion), split, "webdataset").shards)
            spec = LoaderSpec("webdataset", path=str(conversion), split=split)
            out = np.empty((args.batch_size, *decode_engine.out_shape(spec, side), 3), dtype)
            measure = lambda **kw: engine_epoch(shards, spec, side, out, args.threads, **kw)
            measure(library=other), measure(), measure(entropy_only=True)      # warm-up: page in code and data
            theirs, ours, floor = [], [], []
            stages, floor_stages = np.zeros(len(decode_engine.STAGES)), np.zeros(len(decode_engine.STAGES))
            for _ in range(args.rounds):
                theirs.append(measure(library=other)[0])
                seconds, spent = measure()
                ours.append(seconds)
                stages += spent
                seconds, spent = measure(entropy_only=True)
                floor.append(seconds)
                floor_stages += spent
            count = len(shards)
            rates = {name: count / statistics.median(values) for name, values in
                     (("against", theirs), ("this_tree", ours), ("floor", floor))}
            us = {stage: 1e6 * value / (count * args.rounds) for stage, value in zip(decode_engine.STAGES, stages)}
            decode_split = split_decode_stage(us, {stage: 1e6 * value / (count * args.rounds)
                                                   for stage, value in zip(decode_engine.STAGES, floor_stages)})
            shards.close()
            print(f"{split:5} {side:4d} {rates['against']:10.0f} {rates['this_tree']:10.0f} "
                  f"{rates['this_tree'] / rates['against']:7.2f}x {rates['floor']:8.0f}  "
                  + " / ".join(f"{value:.0f}" + (" ({:.0f} + {:.0f})".format(*decode_split.values()) if stage == "decode" else "")
                               for stage, value in us.items()))
            rows.append({"benchmark": "engine_versions", "source": args.source.name, "split": split, "resolution": side,
                         "threads": args.threads, "dtype": np.dtype(dtype).name, "against": args.against,
                         "img_per_s": {key: round(value, 1) for key, value in rates.items()},
                         "engine_us_per_image": {key: round(value, 1) for key, value in us.items()},
                         "decode_stage_us": {key: round(value, 1) for key, value in decode_split.items()}})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    append_results(rows, hardware, results_folder(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
