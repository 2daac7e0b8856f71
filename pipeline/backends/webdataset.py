"""The `webdataset` backend: WebDataset tar shards read in DataLoader workers, each JPEG
decoded only where its crop lies (`pipeline/jpeg_roi.py`: libjpeg-turbo, DCT-scaled where the
crop allows) and resized with Pillow-SIMD: this project's fastest CPU loader.

How an epoch is cut up, so that it is exact and resumable while still streaming:
- the split's shards are concatenated in an order drawn from (seed, epoch), and the
  stream is rotated by a random offset, so ranks see other samples every epoch; val keeps
  the stored order;
- each rank takes a contiguous range of that stream (train: `n // world_size` samples each;
  val: every sample exactly once, as `pipeline.sharding` says), cut into batches;
- worker k of K makes the rank's batches k, k+K, ...: it reads each sample's image and
  label in one `pread` at the offsets the shard's `.idx` gives, shuffles its samples with
  the webdataset package's buffer (train), and decodes them; the DataLoader's round-robin
  returns the batches in order;
- resuming at batch b: each worker passes over the samples of its batches before b
  without decoding them.
Only the `.jpg` and `.lbl` members are read, and nothing is ever unpickled.
"""
from __future__ import annotations

import bisect
import multiprocessing
import os
import random

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.filters import _shuffle as shuffle_samples

from pipeline.base import Loader
from pipeline.crops import sample_seed
from pipeline.datasets import ConvertedSplit, DatasetError, SampleName, Shard, read_converted
from pipeline.sharding import rank_batches, rank_range
from pipeline.spec import LoaderSpec
from pipeline.worker_decode import collate, load_or_report, torch_dataloader

SHUFFLE_BUFFER = 1000


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


class ShardBatches(IterableDataset):
    """Yields this worker's batches of this rank's part of an epoch, as collated uint8 batches."""

    def __init__(self, data: ConvertedSplit, spec: LoaderSpec):
        self.shards, self.spec = data.shards, spec
        self.counts = [shard.count for shard in data.shards]
        # (epoch, side, first batch): shared memory, so persistent workers see each new epoch.
        self.control = multiprocessing.Array("q", 3, lock=False)

    def __len__(self) -> int:
        return rank_batches(sum(self.counts), self.spec)

    def __iter__(self):
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch, side, start = self.control
        spec, batch_size = self.spec, self.spec.batch_size
        lo, hi = rank_range(sum(self.counts), spec.rank, spec.world_size, shuffle=spec.train)
        mine = range(worker_id, len(self), workers)
        samples = (sample for batch in mine
                   for sample in self._read(lo + batch * batch_size, min(lo + (batch + 1) * batch_size, hi), epoch))
        if spec.train:
            rng = random.Random(sample_seed(spec.seed + 7919 * spec.rank, epoch, worker_id))
            samples = shuffle_samples(samples, bufsize=SHUFFLE_BUFFER, initial=SHUFFLE_BUFFER, rng=rng)
        for batch in mine:
            chunk = [next(samples) for _ in range(min(batch_size, hi - lo - batch * batch_size))]
            if batch < start:
                continue
            images = [self._decode(sample, epoch, side) for sample in chunk]
            yield batch, collate(images, [label for _, _, label, _ in chunk])

    def _read(self, lo: int, hi: int, epoch: int):
        """(sample id, jpeg bytes, label, name) for the epoch stream's positions [lo, hi)."""
        for shard_index, begin, end in stream_pieces(self.counts, lo, hi, epoch, self.spec.seed, self.spec.train):
            shard = self.shards[shard_index]
            try:
                yield from self._read_piece(shard, begin, end)
            except OSError as error:
                raise DatasetError(f"{shard.tar}: unreadable shard ({error}); run tools/convert_wds.py again") from None

    @staticmethod
    def _read_piece(shard: Shard, begin: int, end: int):
        # One read per sample, from the image's first byte to the label's last: the index says
        # where both are, so no tar header is parsed (the webdataset package's tar iterator
        # cost about 160 us a sample, a tenth of a decode).
        with open(shard.tar, "rb") as stream:
            for number, (image_at, image_size, label_at) in enumerate(shard.members[begin:end].tolist(), begin):
                first = min(image_at, label_at)
                chunk = os.pread(stream.fileno(), max(image_at + image_size, label_at + 4) - first, first)
                label = int.from_bytes(chunk[label_at - first:label_at - first + 4], "little", signed=True)
                yield (shard.first_sample + number, chunk[image_at - first:image_at - first + image_size], label,
                       SampleName(shard, number))

    def _decode(self, sample, epoch: int, side: int):
        sample_id, jpeg, _, name = sample
        return load_or_report(jpeg, self.spec, name=name, sample_id=sample_id, epoch=epoch, side=side, roi=True)


class WebDatasetLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        data = read_converted(spec.path, spec.split, "webdataset")
        self.dataset = ShardBatches(data, spec)
        super().__init__(spec, len(data.classes))
        self.dataloader = torch_dataloader(self.dataset, spec)

    def __len__(self) -> int:
        return len(self.dataset)

    def _batches(self, epoch: int, start: int):
        self.dataset.control[:] = [epoch, self.side, start]
        for index, (images, labels, errors) in self.dataloader:
            self._undecodable(errors)
            if len(labels):
                yield index, self._to_model_input(images), self._to_device_labels(labels)
