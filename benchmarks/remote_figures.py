"""What a loader reading a split from a URL fetched, and what its fetching cost, for
`benchmarks/loaders.py --remote`: per epoch, the bytes and requests of its store, the CPU time of its
fetch process (a split streamed through memory) and of the servers on this machine that answer it.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from benchmarks.remote_sources import cpu_seconds


class FetchCounters:
    """Counts an epoch at a time (`epoch_started`, `epoch_ended`); `figures` sums them up, the
    first epoch apart from the median of the others."""

    def __init__(self, loader, server_cpu_ids: list):
        self.loader, self.server_cpu_ids = loader, server_cpu_ids
        self.fetched, self.requests, self.fetch_process_cpu, self.server_cpu = [], [], [], []
        self._at_start = None

    def _now(self) -> tuple[int, int, float, float]:
        store = self.loader.stored.source.store
        return store.bytes_read, store.requests, fetch_process_seconds(self.loader), self._servers_seconds()

    def _servers_seconds(self) -> float:
        return sum(cpu_seconds(pid, descendants) for pid, descendants in self.server_cpu_ids)

    def epoch_started(self) -> None:
        self._at_start = self._now()

    def epoch_ended(self) -> None:
        for spent, now, then in zip((self.fetched, self.requests, self.fetch_process_cpu, self.server_cpu),
                                    self._now(), self._at_start):
            spent.append(now - then)

    def figures(self, last_epoch: int, cache_limit: int) -> dict:
        """The figures of the epochs counted, the bytes of samples read taken from epoch `last_epoch`'s plan."""
        from pipeline.remote.block_plan import sample_spans
        loader = self.loader
        starts, ends = sample_spans(loader.stored.members)
        plan = loader.stored.epoch_batches(loader.spec, last_epoch)     # webdataset's and DALI's source's
        return dict(fetched_bytes_per_epoch=statistics.median(self.fetched[1:]), first_epoch_fetched_bytes=self.fetched[0],
                    first_epoch_requests=self.requests[0], requests_per_epoch=statistics.median(self.requests[1:]),
                    sample_bytes_per_epoch=int((ends - starts)[np.concatenate(plan)].sum()),
                    cache_limit=cache_limit, streamed_in_memory=loader.stored.in_memory,
                    fetch_size=loader.stored.block_bytes,
                    fetch_process_cpu_s_per_epoch=statistics.median(self.fetch_process_cpu[1:]),
                    fetch_process_direct_share=fetch_process_direct_share(loader),
                    server_cpu_s_per_epoch=statistics.median(self.server_cpu[1:]))


def shared_blocks(loader):
    """The loader's fetch process (`SharedBlocks`) where its split streams through memory, else None."""
    fetch_process = getattr(getattr(loader.stored, "sources", None), "fetch_process", None)
    return fetch_process.shared if fetch_process is not None else None


def fetch_process_seconds(loader) -> float:
    """The CPU time so far of the loader's fetch process; 0 without one."""
    shared = shared_blocks(loader)
    return cpu_seconds(shared.process.pid, descendants=False) if shared is not None else 0.0


def fetch_process_direct_share(loader) -> float | None:
    """The share of its requests the fetch process read directly (`pipeline/storage/direct_ranges.py`),
    not through obstore; None without one."""
    shared = shared_blocks(loader)
    if shared is None or not shared.requests_made:
        return None
    return shared.direct_requests / shared.requests_made


def split_bytes(conversion: Path, split: str) -> int:
    """The bytes of a converted webdataset split's shards, from its manifest."""
    manifest = json.loads((conversion / "manifest.json").read_text())
    return sum(shard["bytes"] for shard in manifest["splits"][split]["shards"])


def remote_line(figures: dict) -> str:
    """A remote row's second line: its shares of local disk, what it fetched, what fetching cost."""
    direct = figures["fetch_process_direct_share"]
    return (f"{figures.get('share_of_local', float('nan')):.2f}x local; per epoch "
            f"{figures['fetched_bytes_per_epoch'] / 2**20:.1f} MiB in {figures['requests_per_epoch']:.0f} "
            f"requests for {figures['sample_bytes_per_epoch'] / 2**20:.1f} MiB of samples; "
            f"first batch {figures['first_batch_seconds']:.2f} s; first epoch "
            f"{figures.get('first_epoch_share_of_local', float('nan')):.2f}x local, "
            f"{figures['first_epoch_fetched_bytes'] / 2**20:.1f} MiB in {figures['first_epoch_requests']} requests; "
            f"CPU-s per epoch: fetch process {figures['fetch_process_cpu_s_per_epoch']:.2f}"
            + ("" if direct is None else f" ({direct:.0%} of its requests direct)")
            + f", server here {figures['server_cpu_s_per_epoch']:.2f}")
