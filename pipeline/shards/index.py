"""A WebDataset split's shards as one indexed array of samples, and each epoch's batches
planned from that index alone (no image read), so a plan depends on neither thread nor
worker counts and resuming at batch b simply starts there.

How an epoch is cut up, so that it is exact and resumable while still streaming:
- the split's shards are concatenated in an order drawn from (seed, epoch), and the
  stream is rotated by a random offset, so ranks see other samples every epoch; val keeps
  the stored order and rank r takes its contiguous range, as `pipeline.loader.sharding` says;
- train: for a global batch of G samples, the stream's first L*G samples (L = n // G) are
  cut into G lanes of L consecutive samples; each lane is shuffled within a window of
  max(1, SHUFFLE_BUFFER // G) samples (`pipeline/shards/buffer_shuffle.py`, seeded by (seed,
  epoch, lane)), and global step s takes the s-th sample of every lane. Rank r takes lanes
  [r*b, (r+1)*b) (b: its batch size), in a shuffled order within its batches. So a global
  step's samples depend on G alone, never on the world size, and each rank still reads one
  contiguous part of the stream, its own, as b runs of samples side by side;
- each sample is read in one `pread` of its image and label at the offsets the index gives
  (no tar header parsed, nothing unpickled, only the `.jpg` and `.lbl` members), and checked
  against the CRC-32 its converter recorded before anything is taken from it (in C by the decode
  engine, here by `read`); `checksums = None` (data.verify=off, or a dataset converted before
  checksums) reads unchecked.
"""
from __future__ import annotations

import bisect
import logging
import os
from contextlib import contextmanager

import numpy as np

from pipeline.decode import engine as decode_engine
from pipeline.shards.buffer_shuffle import shuffle_lanes
from pipeline.transforms.crops import sample_seed
from pipeline.errors import FAILS_CHECKSUM, CorruptSample, DatasetError
from pipeline.formats.converted import CONVERTERS, SampleName, Shard
from pipeline.formats.wds_shards import sample_checksum
from pipeline.loader.sharding import batch_count, rank_range
from pipeline.spec import LoaderSpec
from pipeline.storage.urls import redact

log = logging.getLogger(__name__)

SHUFFLE_BUFFER = 1000       # samples held back for shuffling, over all ranks together
_said_unchecked: set[str] = set()


def stream_pieces(counts: list[int], lo: int, hi: int, epoch: int, seed: int,
                  shuffle: bool) -> list[tuple[int, int, int]]:
    """(shard, begin, end) pieces holding the epoch stream's positions [lo, hi)."""
    total = sum(counts)
    rng = np.random.default_rng((seed, epoch, 1))
    order = rng.permutation(len(counts)) if shuffle else np.arange(len(counts))
    rotation = int(rng.integers(total)) if shuffle else 0
    starts = np.concatenate([[0], np.cumsum([counts[s] for s in order])])
    pieces = []
    position = lo
    while position < hi:
        stored = (position + rotation) % total
        slot = bisect.bisect_right(starts, stored) - 1
        begin = stored - starts[slot]
        length = min(hi - position, counts[order[slot]] - begin)
        pieces.append((int(order[slot]), int(begin), int(begin + length)))
        position += length
    return pieces


def check_reads(stored: "StoredShards", spec: LoaderSpec) -> None:
    """Reads checked against the recorded checksums unless spec.verify is off; a dataset converted
    before checksums reads unchecked, which is said once per dataset."""
    if not spec.verify:
        stored.checksums = None
    elif stored.checksums is None and stored.shards and str(spec.path) not in _said_unchecked:
        _said_unchecked.add(str(spec.path))
        log.warning("%s: converted before per-sample checksums, so its samples are read unchecked; convert it "
                    "again with %s to have them checked", redact(str(spec.path)), CONVERTERS["webdataset"])


def unreadable(tar, error: OSError) -> DatasetError:
    return DatasetError(f"{tar}: unreadable shard ({error.strerror or error}); run {CONVERTERS['webdataset']} again")


class StoredShards:
    """The split's shards as one array of samples: per stored sample id its shard, and the
    offsets of its image and label; open files are kept per process (a forked worker opens
    its own)."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        self.counts = [shard.count for shard in shards]
        self.shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), self.counts)
        self.members = np.concatenate([shard.members for shard in shards]) if shards else np.empty((0, 3), np.int64)
        recorded = shards and all(shard.checksums is not None for shard in shards)
        self.checksums = np.concatenate([shard.checksums for shard in shards]) if recorded else None
        self._files: dict[int, int] = {}
        self._opened_by = os.getpid()

    def __len__(self) -> int:
        return len(self.shard_of)

    def epoch_batches(self, spec: LoaderSpec, epoch: int) -> list[np.ndarray]:
        """The stored sample ids of each of this rank's batches in this epoch."""
        if spec.train:
            ids = self._train_ids(spec, epoch)
        else:
            ids = self._stream(*rank_range(len(self), spec.rank, spec.world_size), epoch, spec.seed, shuffle=False)
        size = spec.batch_size
        return [ids[b * size:(b + 1) * size] for b in range(batch_count(len(ids), size, spec.drop_last))]

    def _stream(self, lo: int, hi: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The stored sample ids at positions [lo, hi) of the epoch's stream."""
        firsts = np.concatenate([[0], np.cumsum(self.counts)])
        ids = [np.arange(firsts[s] + begin, firsts[s] + end)
               for s, begin, end in stream_pieces(self.counts, lo, hi, epoch, seed, shuffle)]
        return np.concatenate(ids) if ids else np.empty(0, np.int64)

    def _train_ids(self, spec: LoaderSpec, epoch: int) -> np.ndarray:
        """This rank's samples of the epoch, step by step: its lanes' s-th samples, then s+1's..."""
        world, size, rank = spec.world_size, spec.batch_size, spec.rank
        lanes, length = world * size, len(self) // (world * size)
        # A rank's lanes are neighbours, so it reads one contiguous part of the stream; in its batches they
        # come in a shuffled order, so that consecutive samples are not neighbours in the stream
        part = self._stream(rank * size * length, (rank + 1) * size * length, epoch, spec.seed, shuffle=True)
        window = max(1, SHUFFLE_BUFFER // lanes)
        shuffled = shuffle_lanes(part[:size * length].reshape(size, length), window,
                                 [sample_seed(spec.seed, epoch, rank * size + lane) for lane in range(size)])
        order = np.random.default_rng((spec.seed, epoch, 2, rank)).permutation(size)
        ids = shuffled[order].T.reshape(-1)
        if not spec.drop_last:        # the samples past the lanes, dealt as evenly as ranks can stay in step
            rest = self._stream(lanes * length, len(self), epoch, spec.seed, shuffle=True)
            ids = np.concatenate([ids, rest[rank::world][:len(rest) // world]])
        return ids

    def read_ahead(self, plan: list[np.ndarray], start: int, following=None, first_batch_located: bool = False) -> None:
        """An epoch's plan is about to be read from batch `start` on (and `following()` gives the
        next one's; batch `start` is read by `located` where first_batch_located); a reader that
        fetches ahead (pipeline/remote/shards.py) starts here."""

    def stop_read_ahead(self) -> None:
        pass

    def consumed(self, batch_index: int) -> None:
        """Told of each batch handed out; a reader that fetches ahead listens."""

    def fd(self, shard_index: int) -> int:
        if self._opened_by != os.getpid():            # a forked worker: the parent's files are not ours to share
            self._files, self._opened_by = {}, os.getpid()
        if shard_index not in self._files:
            tar = self.shards[shard_index].tar
            try:
                self._files[shard_index] = os.open(tar, os.O_RDONLY)
            except OSError as error:
                raise unreadable(tar, error) from None
        return self._files[shard_index]

    @contextmanager
    def located(self, ids: np.ndarray):
        """Where the samples `ids` lie, for the decode engine, while the context lasts."""
        shards, which = np.unique(self.shard_of[ids], return_inverse=True)      # one fd lookup a shard
        fds = np.array([self.fd(int(shard)) for shard in shards], np.int32)[which]
        members = self.members[ids]
        yield decode_engine.StoredSamples(ids, fds, members[:, 0], members[:, 1], members[:, 2],
                                          checksums=self.checksums[ids] if self.checksums is not None else None)

    def name(self, sample_id: int) -> SampleName:
        shard = self.shards[int(self.shard_of[sample_id])]
        return SampleName(shard, int(sample_id) - shard.first_sample)

    def read(self, sample_id: int) -> tuple[bytes, int]:
        """One sample's JPEG bytes and label, in one read."""
        shard_index = int(self.shard_of[sample_id])
        image_at, image_size, label_at = (int(v) for v in self.members[sample_id])
        first = min(image_at, label_at)
        try:
            chunk = os.pread(self.fd(shard_index), max(image_at + image_size, label_at + 4) - first, first)
        except OSError as error:
            raise unreadable(self.shards[shard_index].tar, error) from None
        return self.checked(sample_id, chunk, image_at - first, image_size, label_at - first)

    def checked(self, sample_id: int, chunk, image_at: int, image_size: int, label_at: int) -> tuple[bytes, int]:
        """(image bytes, label) of a sample read into `chunk`, its image and label at those offsets in it;
        a CorruptSample naming it when its bytes fail the checksum recorded for it."""
        image, label_bytes = chunk[image_at:image_at + image_size], chunk[label_at:label_at + 4]
        if self.checksums is not None:
            crc = sample_checksum(image, label_bytes)
            if crc != int(self.checksums[sample_id]):
                raise CorruptSample(f"{self.name(sample_id)}: {FAILS_CHECKSUM} "
                                    f"(CRC-32 {crc:08x}, recorded {int(self.checksums[sample_id]):08x})")
        return image, int.from_bytes(label_bytes, "little", signed=True)

    def close(self) -> None:
        if self._opened_by == os.getpid():
            for fd in self._files.values():
                os.close(fd)
        self._files = {}

    __del__ = close
