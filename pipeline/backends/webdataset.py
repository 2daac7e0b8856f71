"""The `webdataset` backend: WebDataset tar shards, each JPEG decoded only where its crop lies,
at the coarsest DCT scale that keeps it sharp: this project's fastest CPU loader.

How an epoch is cut up, so that it is exact and resumable while still streaming:
- the split's shards are concatenated in an order drawn from (seed, epoch), and the
  stream is rotated by a random offset, so ranks see other samples every epoch; val keeps
  the stored order;
- each rank takes a contiguous range of that stream (train: `n // world_size` samples each;
  val: every sample exactly once, as `pipeline.sharding` says), shuffled within a window
  by the webdataset package's buffer (train), and cut into batches. This plan is made from
  the shards' `.idx` files alone, before any image is read, so it does not depend on how
  many threads or workers decode, and resuming at batch b simply starts there;
- each sample is read in one `pread` of its image and label at the offsets the index gives
  (no tar header parsed, nothing unpickled, only the `.jpg` and `.lbl` members).
Decoding: the native engine (`pipeline/decode_engine.py`) makes each batch with
`num_workers` threads in a background thread of this process. RandAugment, whose operations
are Pillow's and need Python, runs instead in DataLoader worker processes
(`pipeline/worker_decode.py`, region decode by `pipeline/jpeg_roi.py`), as does everything
with `native_decode=False`.
"""
from __future__ import annotations

import bisect
import os
import random
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset
from webdataset.filters import _shuffle as shuffle_samples

from pipeline import decode_engine
from pipeline.base import Loader
from pipeline.crops import sample_seed
from pipeline.datasets import DatasetError, SampleName, read_converted
from pipeline.normalize import normalized_batch
from pipeline.prefetch import BufferRing, prefetched
from pipeline.sharding import batch_count, rank_range
from pipeline.spec import LoaderSpec
from pipeline.worker_decode import BatchKeys, collate, load_or_report, torch_dataloader

SHUFFLE_BUFFER = 1000
PREFETCH_BATCHES = 2


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


def unreadable(tar, error: OSError) -> DatasetError:
    return DatasetError(f"{tar}: unreadable shard ({error.strerror or error}); run tools/convert_wds.py again")


class StoredShards:
    """The split's shards as one array of samples: per stored sample id its shard, and the
    offsets of its image and label; open files are kept per process (a forked worker opens
    its own)."""

    def __init__(self, shards):
        self.shards = shards
        self.counts = [shard.count for shard in shards]
        self.shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), self.counts)
        self.members = np.concatenate([shard.members for shard in shards]) if shards else np.empty((0, 3), np.int64)
        self._files: dict[int, int] = {}
        self._opened_by = os.getpid()

    def __len__(self) -> int:
        return len(self.shard_of)

    def epoch_batches(self, spec: LoaderSpec, epoch: int) -> list[np.ndarray]:
        """The stored sample ids of each of this rank's batches in this epoch."""
        lo, hi = rank_range(len(self), spec.rank, spec.world_size, shuffle=spec.train)
        firsts = np.concatenate([[0], np.cumsum(self.counts)])
        ids = [np.arange(firsts[s] + begin, firsts[s] + end)
               for s, begin, end in stream_pieces(self.counts, lo, hi, epoch, spec.seed, spec.train)]
        ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
        if spec.train:
            rng = random.Random(sample_seed(spec.seed + 7919 * spec.rank, epoch, 0))
            ids = np.fromiter(shuffle_samples(iter(ids.tolist()), bufsize=SHUFFLE_BUFFER, initial=SHUFFLE_BUFFER,
                                              rng=rng), np.int64, len(ids))
        size = spec.batch_size
        return [ids[b * size:(b + 1) * size] for b in range(batch_count(len(ids), size, spec.drop_last))]

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

    def located(self, ids: np.ndarray) -> decode_engine.StoredSamples:
        shards, which = np.unique(self.shard_of[ids], return_inverse=True)      # one fd lookup a shard
        fds = np.array([self.fd(int(shard)) for shard in shards], np.int32)[which]
        members = self.members[ids]
        return decode_engine.StoredSamples(ids, fds, members[:, 0], members[:, 1], members[:, 2])

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
        label = int.from_bytes(chunk[label_at - first:label_at - first + 4], "little", signed=True)
        return chunk[image_at - first:image_at - first + image_size], label

    def close(self) -> None:
        if self._opened_by == os.getpid():
            for fd in self._files.values():
                os.close(fd)
        self._files = {}

    __del__ = close


class WorkerBatches(Dataset):
    """Map-style, for DataLoader workers: a batch key (epoch, side, sample ids) -> a collated
    uint8 batch, decoded with Pillow (RandAugment's operations are Pillow's)."""

    def __init__(self, stored: StoredShards, spec: LoaderSpec):
        self.stored, self.spec = stored, spec

    def __len__(self) -> int:
        return len(self.stored)

    def __getitem__(self, key):
        epoch, side, ids = key
        images, labels = [], []
        for sample_id in ids.tolist():
            jpeg, label = self.stored.read(sample_id)
            images.append(load_or_report(jpeg, self.spec, name=self.stored.name(sample_id), sample_id=sample_id,
                                         epoch=epoch, side=side, roi=True))
            labels.append(label)
        return collate(images, labels)


class WebDatasetLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        data = read_converted(spec.path, spec.split, "webdataset")
        self.stored = StoredShards(data.shards)
        self._plan: list[np.ndarray] = []
        self.engine_seconds = dict.fromkeys((*decode_engine.STAGES, "python"), 0.0)   # summed over samples
        self.engine_samples = 0
        self._seconds_lock = threading.Lock()
        self._sampler = BatchKeys()
        self._ring: BufferRing | None = None
        super().__init__(spec, len(data.classes))
        self.dataloader = None              # made at the first iteration that needs it

    @property
    def uses_engine(self) -> bool:
        """Read at iteration: RandAugment, set by its algorithm after the loader is made (at
        INIT, through `reconfigure`), moves decoding to DataLoader workers."""
        spec = self.spec
        return spec.native_decode and not (spec.train and spec.randaugment)

    def _prepare_epoch(self, epoch: int) -> None:
        self._plan = self.stored.epoch_batches(self.spec, epoch)

    def __len__(self) -> int:
        return len(self._plan)

    def _batches(self, epoch: int, start: int):
        if not self.uses_engine:
            if self.dataloader is None:
                self.dataloader = torch_dataloader(WorkerBatches(self.stored, self.spec), self.spec,
                                                   sampler=self._sampler)
            self._sampler.keys, self._sampler.start = [(epoch, self.side, ids) for ids in self._plan], start
            for index, (images, labels, errors) in enumerate(self.dataloader, start):
                self._undecodable(errors)
                if len(labels):
                    yield index, self._to_model_input(images), self._to_device_labels(labels)
            return
        side, on_gpu = self.side, self.device.type == "cuda"
        # uint8 for a GPU (a quarter of the bytes to copy; it normalizes after the copy), else
        # float32 normalized by the engine's threads, so the main thread has no pass left to make
        shape = (self.spec.batch_size, *decode_engine.out_shape(self.spec, side), 3)
        dtype = torch.uint8 if on_gpu else torch.float32
        if self._ring is None or not self._ring.fits(shape, dtype):
            self._ring = BufferRing(PREFETCH_BATCHES + 3, shape, dtype, pinned=on_gpu)
        ring = self._ring
        keys, previous = list(enumerate(self._plan))[start:], None
        for index, buffer, images, labels, errors in prefetched(
                lambda key, buffer: (key[0], buffer, *self._engine_batch(epoch, side, key[1], buffer)), keys, ring,
                PREFETCH_BATCHES):
            if previous is not None:          # asked for this batch: done with the one before
                ring.give_back(previous, self.device)
            previous = buffer
            self._undecodable(errors)
            if len(labels):
                yield index, self._to_model_input(images.permute(0, 3, 1, 2)), self._to_device_labels(labels)
        if previous is not None:
            ring.give_back(previous, self.device)

    def _engine_batch(self, epoch: int, side: int, ids: np.ndarray, buffer: torch.Tensor):
        """One batch by the engine into `buffer`; the samples it refuses go through Pillow, and
        those Pillow cannot decode either are left out and reported."""
        started = time.thread_time()
        out = buffer.numpy()
        samples = self.stored.located(ids)
        python_seconds = time.thread_time() - started
        decoded = decode_engine.decode_batch(samples, self.spec, epoch, side, out, threads=self.spec.num_workers)
        fallback_started = time.thread_time()
        labels, kept, errors = torch.from_numpy(decoded.labels.astype(np.int64)), np.ones(len(ids), bool), []
        for position, _ in decoded.failed:
            sample_id = int(ids[position])
            jpeg, _ = self.stored.read(sample_id)
            image = load_or_report(jpeg, self.spec, name=self.stored.name(sample_id), sample_id=sample_id,
                                   epoch=epoch, side=side, roi=True)
            if isinstance(image, str):
                kept[position] = False
                errors.append(image)
            elif out.dtype == np.uint8:
                out[position] = image
            else:
                normalized_batch(image[None], self.spec.mean, self.spec.std, out=buffer[position:position + 1])
        images = buffer[:len(ids)]
        if not kept.all():
            images, labels = images[torch.from_numpy(kept)], labels[torch.from_numpy(kept)]
        with self._seconds_lock:
            for stage, seconds in zip(decode_engine.STAGES, decoded.stage_seconds):
                self.engine_seconds[stage] += float(seconds)
            self.engine_seconds["python"] += (python_seconds + decoded.python_seconds +
                                              time.thread_time() - fallback_started)
            self.engine_samples += len(ids)
        return images, labels, errors

