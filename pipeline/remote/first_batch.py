"""An epoch's first batch read from its own samples' byte ranges, fetched for it alone before the
read-ahead begins, where the blocks holding them are not held already (`pipeline/remote/shards.py`).

A first batch reads a block of every lane: at batch 128 and 1 MiB blocks, 128 MiB before the
first step, of which its samples are about 3 MB. Fetched alone, they arrive in a round trip, and
the blocks follow for the batches after, which read the rest of them: the first batch's samples
are fetched twice, one batch's bytes in an epoch. The read-ahead starts once they are in, so that
on few cores its fetching does not slow their decode; after a long round trip, the blocks start
that one round trip later.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.decode import engine as decode_engine
from pipeline.formats.converted import Shard
from pipeline.remote.block_plan import sample_spans

MOST_AT_ONCE = 256     # requests at once: a batch's samples, each its own


class FirstBatch:
    """The samples of one batch, fetched by range, each its own piece of memory; `samples` says
    where they lie for the decode engine while this is alive."""

    def __init__(self, ids: np.ndarray, store, shards: list[Shard], shard_of: np.ndarray, members: np.ndarray,
                 checksums: np.ndarray | None):
        """Fetches the samples `ids`, a request each, all at once: a store answers a request for
        several ranges of an object a few at a time (obstore's get_ranges), a round trip each few;
        raises what the store raises."""
        self.ids = ids
        members = members[ids]
        starts, ends = sample_spans(members)
        requests = [(shards[shard].object_name, [(start, end)])
                    for shard, start, end in zip(shard_of[ids].tolist(), starts.tolist(), ends.tolist())]
        with ThreadPoolExecutor(min(MOST_AT_ONCE, len(requests)), thread_name_prefix="first-batch") as pool:
            views = list(pool.map(lambda request: store.read_ranges(*request)[0], requests))
        # The responses' bytes, which the engine reads where they lie, held as long as this is
        self._pieces = [np.frombuffer(view, np.uint8) for view in views]
        addresses = np.array([piece.ctypes.data for piece in self._pieces], np.uint64)
        self.samples = decode_engine.StoredSamples(ids, np.full(len(ids), -1, np.int32), members[:, 0] - starts,
                                                   members[:, 1], members[:, 2] - starts, bases=addresses,
                                                   checksums=checksums[ids] if checksums is not None else None)

    def is_for(self, ids: np.ndarray) -> bool:
        return len(ids) == len(self.ids) and bool(np.array_equal(ids, self.ids))
