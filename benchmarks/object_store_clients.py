"""Many small range reads of one object over loopback HTTP (nginx): obstore, which
pipeline/storage/object_store.py reads through, against fsspec's HTTP filesystem (aiohttp).

Each client reads the same scattered 16 KiB ranges of a 64 MiB file, all handed over at once
(obstore's get_ranges, fsspec's cat_ranges: both keep several requests in flight), and again
one range per call (a request's latency). Prints range reads/s and MiB/s for each, the HTTP
requests nginx logged, and with --save appends one row per client and mode to benchmarks/results/.

    python benchmarks/object_store_clients.py [--ranges 2000]

Needs nginx (tools/setup_specs.sh's DEB_TEST_PACKAGES) and, for the comparison, fsspec and aiohttp.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from benchmarks.loopback_servers import Nginx
from pipeline.storage.object_store import open_store

FILE_SIZE = 64 << 20
RANGE_SIZE = 16 << 10


def obstore_reader(url: str, name: str):
    store = open_store(url)
    return lambda ranges: store.read_ranges(name, ranges)


def fsspec_reader(url: str, name: str):
    import fsspec
    fs = fsspec.filesystem("http")
    target = f"{url}/{name}"
    return lambda ranges: fs.cat_ranges([target] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges])


def measure(read, ranges, local: bytes, batched: bool) -> float:
    """Seconds to read every range; checks the bytes."""
    start = time.perf_counter()
    pieces = read(ranges) if batched else [read([r])[0] for r in ranges]
    seconds = time.perf_counter() - start
    assert all(piece == local[s:e] for piece, (s, e) in zip(pieces, ranges)), "wrong bytes"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranges", type=int, default=2000, help="range reads per client and mode")
    add_results_options(parser)
    args = parser.parse_args()
    clients = {"obstore": obstore_reader, "fsspec-http": fsspec_reader}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "data").mkdir()
        local = rng.integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
        (root / "data" / "shard.tar").write_bytes(local)
        # scattered, non-neighbouring ranges at 16 KiB-aligned slots, as samples of a shard are
        slots = rng.choice(FILE_SIZE // RANGE_SIZE // 2, size=args.ranges, replace=args.ranges > FILE_SIZE // RANGE_SIZE // 2)
        ranges = [(int(s) * 2 * RANGE_SIZE, int(s) * 2 * RANGE_SIZE + RANGE_SIZE) for s in slots]
        server = Nginx(root / "data", root / "nginx")
        hardware = signature()
        rows = []
        try:
            print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores; {args.ranges} reads of {RANGE_SIZE >> 10} KiB "
                  f"from a {FILE_SIZE >> 20} MiB file on loopback nginx")
            for client, make in clients.items():
                try:
                    read = make(server.url, "shard.tar")
                except ImportError as error:
                    print(f"{client}: skipped ({error})")
                    continue
                for batched in (True, False):
                    count = args.ranges if batched else max(1, args.ranges // 4)
                    before = server.requests()
                    seconds = measure(read, ranges[:count], local, batched)
                    requests = server.requests() - before
                    mode = "all at once" if batched else "one per call"
                    row = {"benchmark": "object_store_clients", "client": client, "mode": mode, "ranges": count,
                           "range_bytes": RANGE_SIZE, "http_requests": requests,
                           "reads_per_s": round(count / seconds, 1),
                           "mib_per_s": round(count * RANGE_SIZE / seconds / 2**20, 1)}
                    rows.append(row)
                    print(f"{client:12s} {mode:13s} {row['reads_per_s']:9.0f} reads/s {row['mib_per_s']:8.1f} MiB/s "
                          f"({requests} HTTP requests for {count} ranges)")
        finally:
            server.stop()
        append_results(rows, hardware, results_folder(args))


if __name__ == "__main__":
    main()
