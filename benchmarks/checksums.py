"""Which function checks a sample fastest: zlib's CRC-32 (what the converters record), against
CRC32C (google-crc32c) and XXH3 (xxhash) where they are installed, over the JPEGs of a converted
WebDataset split as the readers check them (image bytes, then the 4 label bytes), on one core.

    python benchmarks/checksums.py data/bench/photos-wds [--split train] [--repeats 5] [--save]

Prints a table (MB/s, and ns a sample, best of the repeats) naming the machine; --save appends
the rows to this machine's results file (benchmarks/hardware.py). The readers check each sample where it is decoded (in C in the decode
engine, in Python elsewhere), so the chosen function must be fast in both and in every reader's
reach: zlib is in Python's standard library and in libz, which the engine links already.
"""
from __future__ import annotations

import argparse
import importlib
import time
import zlib
from pathlib import Path

from benchmarks.hardware import add_results_options, append_results, results_folder, signature
from pipeline.formats.converted import read_local_converted
from pipeline.shards.index import StoredShards


def candidates() -> dict:
    """name -> f(image, label) giving a checksum, for each library importable here."""
    found = {"crc32 (zlib)": lambda image, label: zlib.crc32(label, zlib.crc32(image))}
    try:
        crc32c = importlib.import_module("google_crc32c")
        found["crc32c (google-crc32c)"] = lambda image, label: crc32c.extend(crc32c.value(image), label)
    except ImportError:
        pass
    try:
        xxhash = importlib.import_module("xxhash")

        def xxh3(image, label):
            digest = xxhash.xxh3_64(image)
            digest.update(label)
            return digest.intdigest()
        found["xxh3-64 (xxhash)"] = xxh3
    except ImportError:
        pass
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", help="a webdataset conversion (tools/convert_wds.py's output)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--repeats", type=int, default=5)
    add_results_options(parser)
    args = parser.parse_args(argv)
    stored = StoredShards(read_local_converted(Path(args.dataset), args.split, "webdataset").shards)
    samples = [stored.read(number) for number in range(len(stored))]
    samples = [(image, int(label).to_bytes(4, "little", signed=True)) for image, label in samples]
    total = sum(len(image) + 4 for image, _ in samples)
    hardware = signature()
    rows = []
    for name, function in candidates().items():
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            for image, label in samples:
                function(image, label)
            best = min(best, time.perf_counter() - started)
        rows.append({"benchmark": "checksums", "function": name, "dataset": str(args.dataset), "split": args.split,
                     "samples": len(samples), "mean_bytes": total // len(samples), "mb_per_s": round(total / best / 1e6),
                     "ns_per_sample": round(best / len(samples) * 1e9)})
    print(f"{len(samples):,} samples of {args.dataset} ({total / len(samples) / 1e3:,.0f} kB mean), one core, "
          f"best of {args.repeats}; {hardware['cpu_model']} ({hardware['cpu_isa']}, {hardware['cpu_cores']} cores)")
    for row in rows:
        print(f"  {row['function']:<24} {row['mb_per_s']:>7,} MB/s {row['ns_per_sample']:>8,} ns a sample")
    append_results(rows, hardware, results_folder(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
