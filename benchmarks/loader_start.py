"""What a webdataset loader computes before its first batch, at ImageNet's size, against a git
revision's code in one run: reading the shards' indexes (parsing them, or reading the split's member
table from its index pack, where a tree has packs), and planning an epoch's batches.

    python benchmarks/loader_start.py [--against HEAD] [--samples 1281167] [--shards 1024]
                                      [--batch-size 256] [--world-sizes 1,8] [--rounds 5]

No image is read: the split is its indexes alone, written here as the converter writes them
(`tools/convert_wds.py`: a line per sample, its .jpg, .cls and .lbl members), with ImageNet's mean
JPEG size. Each round times, in a fresh process of each tree in turn (so that a machine's drift falls
on both), `member_table` over one shard's index (scaled to all of them) and `epoch_batches` for rank
0 at each world size, the global batch being `--batch-size` x the world size. The figure is each
one's median round. With --save (or --results-dir DIR), one JSON line per figure goes to this
machine's file in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature

ROOT = Path(__file__).resolve().parents[1]
MEAN_JPEG_BYTES = 110_000

MEASURE = """
import json, sys, time
from pathlib import Path
import numpy as np
from pipeline.formats.converted import Shard, member_table
from pipeline.shards.index import StoredShards
from pipeline.spec import LoaderSpec
samples, shards, batch, index = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
worlds = [int(world) for world in sys.argv[5].split(",")]
counts = [samples // shards + (s < samples % shards) for s in range(shards)]
shard = Shard(tar=index, index=index, count=counts[0], first_sample=0)
started = time.perf_counter()
member_table(shard)
figures = {"index_s": (time.perf_counter() - started) * shards}
try:
    from pipeline.formats.converted import packed_members
except ImportError:     # a tree from before index packs
    packed_members = None
if packed_members is not None:
    import hashlib
    pack = index.with_name("shard-indexes.pack")
    record = {"count": samples, "index_pack": {"bytes": 24 * samples, "members_at": 0,
                                               "members_sha256": hashlib.sha256(pack.read_bytes()).hexdigest()}}
    starts = np.cumsum([0] + counts[:-1])
    started = time.perf_counter()
    table = packed_members(pack, record)        # read, and checked against its sha256
    tables = [table[first:first + count] for first, count in zip(starts.tolist(), counts)]
    figures["members_from_pack_s"] = time.perf_counter() - started
stored = StoredShards.__new__(StoredShards)     # the plan needs the counts alone
stored.counts, stored.shard_of = counts, np.repeat(np.arange(shards, dtype=np.int32), counts)
for world in worlds:
    spec = LoaderSpec("webdataset", path="unused", split="train", batch_size=batch, world_size=world, rank=0)
    started = time.perf_counter()
    stored.epoch_batches(spec, 1)
    figures[f"plan_s_world_{world}"] = time.perf_counter() - started
print(json.dumps(figures))
"""


def write_index(path: Path, count: int) -> None:
    """One shard's index as tools/convert_wds.py writes it, for `count` samples of ImageNet's mean size."""
    lines, offset = [f"v1.2 {count}"], 0
    for i in range(count):
        size = MEAN_JPEG_BYTES + i % 997
        lines.append(f"jpg {offset + 512} {size} {i:09d}.jpg cls {offset + 1536 + size} 3 {i:09d}.cls "
                     f"lbl {offset + 2560 + size} 4 {i:09d}.lbl")
        offset += 3072 + size
    path.write_text("\n".join(lines) + "\n")


def tree_at(revision: str, folder: Path) -> Path:
    """The `pipeline` package as `revision` wrote it, in `folder`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "pipeline"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def measure(tree: Path, args, index: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, str(args.samples), str(args.shards), str(args.batch_size),
                             str(index), args.world_sizes], cwd=tree, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{tree}: the measurement failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", help="the git revision whose code this tree's is set against")
    parser.add_argument("--samples", type=int, default=1_281_167, help="samples in the split (ImageNet's train)")
    parser.add_argument("--shards", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--world-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    add_results_options(parser)
    args = parser.parse_args()
    hardware = signature()
    with tempfile.TemporaryDirectory(prefix="loader-start-") as folder:
        index = Path(folder) / "shard-000000.idx"
        write_index(index, -(-args.samples // args.shards))
        (Path(folder) / "shard-indexes.pack").write_bytes(np.zeros((args.samples, 3), "<i8").tobytes())
        trees = {args.against: tree_at(args.against, Path(tempfile.mkdtemp(dir=folder))), "this tree": ROOT}
        rounds = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                rounds[name].append(measure(tree, args, index))
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for name, runs in rounds.items()}
    print(f"# {cpu_words(hardware)}; {args.samples:,} samples in {args.shards:,} shards, batch {args.batch_size} a rank; "
          f"median of {args.rounds} alternating rounds (s)")
    print(f"{'what':<28} {args.against[:10]:>10} {'this tree':>10} {'speed-up':>8}")
    rows = []
    for key in medians["this tree"]:
        before, after = medians[args.against].get(key), medians["this tree"][key]
        what = {"index_s": "indexes parsed, all shards", "members_from_pack_s": "member table, index pack"}.get(
            key, f"epoch plan, {key.rsplit('_', 1)[1]} rank(s), rank 0")
        if before is None:      # a figure the other tree has no code for
            print(f"{what:<28} {'-':>10} {after:>10.3f} {'-':>8}")
        else:
            print(f"{what:<28} {before:>10.3f} {after:>10.3f} {before / after:>7.1f}x")
        rows.append({"benchmark": "loader_start", "what": key, "samples": args.samples, "shards": args.shards,
                     "batch_size": args.batch_size, "against": args.against, "seconds_against": before,
                     "seconds": after, "rounds": args.rounds})
    append_results(rows, hardware, results_folder(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
