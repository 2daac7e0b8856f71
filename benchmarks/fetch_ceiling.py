"""The most one loader's fetch process brings in from a URL: blocks of a file read as fast as
they arrive, with nothing decoded, from the loopback nginx with its answers delayed by each
`--latency-ms` (a far store's round trip), once with the requests in flight fixed at 16 and
once as the loader allows them (16, raised to 64 while the reader waits). A GPU rank needs
its images a second times their size: ImageNet's 110 KB images at 3,000 a second are over
300 MiB/s. Prints MiB/s and the most requests in flight, and with --save appends a row for each to
benchmarks/results/.

    python benchmarks/fetch_ceiling.py [--latency-ms 25,100] [--mib 800]

Needs nginx and its echo module (tools/setup_specs.sh's DEB_TEST_PACKAGES).
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
from pipeline.remote.block_plan import BLOCK_BYTES
from pipeline.remote.shards import LEAST_STREAMED_REQUESTS, MOST_STREAMED_REQUESTS
from pipeline.remote.block_fetcher import FetcherSettings
from pipeline.remote.shared_blocks import SharedBlocks, Visits

WINDOW = 256        # blocks fetched ahead of the reader at most


def stream(url: str, blocks: int, most_in_flight: int) -> tuple[float, int]:
    """(MiB/s, most requests in flight) reading `blocks` blocks of big.bin in order."""
    starts = np.arange(blocks, dtype=np.int64) * BLOCK_BYTES
    store = open_store(url)
    shared = SharedBlocks(FetcherSettings(store.client_url, store.options, ["big.bin"], np.zeros(blocks, np.int32), starts,
                          starts + BLOCK_BYTES, BLOCK_BYTES, WINDOW + most_in_flight, LEAST_STREAMED_REQUESTS, most_in_flight))
    try:
        order = np.arange(blocks, dtype=np.int64)
        shared.plan(Visits(order, order + 1, order + 1, starts, starts + BLOCK_BYTES), WINDOW, 0)   # block i: batch i + 1
        start = time.perf_counter()
        for block in range(blocks):
            if not shared.addresses(order[block:block + 1], starts[block:block + 1], starts[block:block + 1] + BLOCK_BYTES)[0]:
                raise RuntimeError(f"block {block} was not fetched")
            shared.at(block + 1)
        return blocks * BLOCK_BYTES / (time.perf_counter() - start) / 2**20, shared.peak_in_flight
    finally:
        shared.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", default="25,100", help="added round trips, comma-separated")
    parser.add_argument("--mib", type=int, default=800, help="MiB read at each setting")
    add_results_options(parser)
    args = parser.parse_args()
    hardware, rows = signature(), []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "served").mkdir()
        (root / "served" / "big.bin").write_bytes(np.random.default_rng(0).integers(
            0, 256, args.mib * BLOCK_BYTES, dtype=np.uint8).tobytes())
        print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores; {args.mib} blocks of "
              f"{BLOCK_BYTES >> 20} MiB from loopback nginx, read as they arrive")
        for latency_ms in map(float, args.latency_ms.split(",")):
            server = Nginx(root / "served", root / f"nginx-{latency_ms:g}", delay_ms=latency_ms)
            try:
                for most in (LEAST_STREAMED_REQUESTS, MOST_STREAMED_REQUESTS):
                    mib_per_s, peak = stream(server.url, args.mib, most)
                    rows.append({"benchmark": "fetch_ceiling", "latency_ms": latency_ms, "block_bytes": BLOCK_BYTES,
                                 "most_in_flight": most, "peak_in_flight": peak, "mib_per_s": round(mib_per_s, 1)})
                    print(f"+{latency_ms:g} ms, at most {most:2d} in flight: {mib_per_s:6.0f} MiB/s "
                          f"(most in flight {peak})", flush=True)
            finally:
                server.stop()
    append_results(rows, hardware, results_folder(args))


if __name__ == "__main__":
    main()
