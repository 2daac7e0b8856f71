"""CPU a MiB of the ways a fetch process can read 1 MiB ranges into its slots, from nginx on loopback:
what `pipeline/remote/block_fetcher.py` chose between. On a node whose cores all decode, this CPU is
taken from the decode.

    python benchmarks/fetch_clients.py [--mib 512] [--rounds 2] [--save]

- `obstore async`: `get_range_async`, `--in-flight` at once on one event loop, each response then
  copied into its slot (the fetch process's fallback);
- `obstore sync`: `get_range` in `--threads` threads, each response copied into its slot;
- `direct`: `pipeline/storage/direct_ranges.py` in `--threads` threads, each range read into its slot.

Each figure is the process's CPU seconds (user and system) over the MiB read, the median of `--rounds`
rounds, the ways alternating; nginx's own CPU is not counted. The bytes are checked.
"""
from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from benchmarks.loopback_servers import Nginx
from pipeline.storage.direct_ranges import direct_ranges
from pipeline.storage.object_store import open_store

MiB = 1 << 20
FILE_MIB = 64
SLOTS = 32


def obstore_async(store, ranges, slots: memoryview, in_flight: int) -> None:
    import obstore

    async def run():
        allowed = asyncio.Semaphore(in_flight)

        async def one(i, start):
            async with allowed:
                data = await obstore.get_range_async(store.client, "shard.tar", start=start, end=start + MiB)
                slots[(i % SLOTS) * MiB:(i % SLOTS + 1) * MiB] = memoryview(data)
        await asyncio.gather(*(one(i, start) for i, start in enumerate(ranges)))
    asyncio.run(run())


def obstore_sync(store, ranges, slots: memoryview, threads: int) -> None:
    import obstore

    def one(i):
        data = obstore.get_range(store.client, "shard.tar", start=ranges[i], end=ranges[i] + MiB)
        slots[(i % SLOTS) * MiB:(i % SLOTS + 1) * MiB] = memoryview(data)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(ranges))))


def direct(store, ranges, slots: memoryview, threads: int) -> None:
    reader = direct_ranges(store.client, store.client_url, store.options)
    if reader is None:
        raise SystemExit("error: the direct reader is ruled out here (a proxy in the environment?)")

    def one(i):
        reader.read_into("shard.tar", ranges[i], ranges[i] + MiB, slots[(i % SLOTS) * MiB:(i % SLOTS + 1) * MiB])
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(ranges))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB read per way and round, in 1 MiB ranges")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=16, help="obstore async: requests at once")
    parser.add_argument("--threads", type=int, default=4, help="obstore sync and direct: threads")
    add_results_options(parser)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ways = {"obstore async": lambda *a: obstore_async(*a, args.in_flight),
            "obstore sync": lambda *a: obstore_sync(*a, args.threads),
            "direct": lambda *a: direct(*a, args.threads)}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "data").mkdir()
        data = rng.integers(0, 256, FILE_MIB * MiB, dtype=np.uint8).tobytes()
        (root / "data" / "shard.tar").write_bytes(data)
        ranges = (rng.integers(0, FILE_MIB - 1, args.mib) * MiB).tolist()
        server = Nginx(root / "data", root / "nginx")
        hardware = signature()
        slots = memoryview(mmap.mmap(-1, SLOTS * MiB))
        seconds = {way: [] for way in ways}
        try:
            store = open_store(server.url)
            print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores; {args.mib} ranges of 1 MiB from loopback "
                  f"nginx into {SLOTS} slots; median of {args.rounds} alternating rounds")
            for _ in range(args.rounds):
                for way, read in ways.items():
                    cpu, wall = time.process_time(), time.perf_counter()
                    read(store, ranges, slots)
                    seconds[way].append((time.process_time() - cpu, time.perf_counter() - wall))
                    last = len(ranges) - 1
                    assert slots[(last % SLOTS) * MiB:(last % SLOTS + 1) * MiB] == data[ranges[last]:ranges[last] + MiB]
        finally:
            server.stop()
        rows = []
        for way, spent in seconds.items():
            cpu = statistics.median(s for s, _ in spent)
            wall = statistics.median(w for _, w in spent)
            row = {"benchmark": "fetch_clients", "way": way, "range_bytes": MiB, "ranges": args.mib,
                   "in_flight": args.in_flight if way == "obstore async" else args.threads,
                   "cpu_ms_per_mib": round(1000 * cpu / args.mib, 3), "mib_per_s": round(args.mib / wall, 1)}
            rows.append(row)
            print(f"{way:14s} {row['cpu_ms_per_mib']:6.3f} ms CPU a MiB  {row['mib_per_s']:7.0f} MiB/s")
        append_results(rows, hardware, results_folder(args))


if __name__ == "__main__":
    main()
