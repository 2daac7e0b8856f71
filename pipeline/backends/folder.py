"""The `folder` backend: the loader a user writes first, and the 1.0x of every comparison.

An ImageFolder-style dataset on the raw files, decoded with PIL (stock semantics: full
decode, no DCT scaling), through a torch DataLoader with workers and pinned memory. The
sampler follows `pipeline.loader.sharding` (a DistributedSampler without the padding) and hands
each worker a whole batch at a time, keyed by (epoch, side, sample ids): persistent workers
learn the epoch and the scheduled resolution from the key itself.
"""
from __future__ import annotations

from torch.utils.data import Dataset

from pipeline.loader.base import Loader
from pipeline.datasets import read_folder
from pipeline.loader.workers import BatchKeys, torch_dataloader
from pipeline.decode.pillow_sample import collate, load_or_report
from pipeline.loader.sharding import batch_count, rank_samples
from pipeline.spec import LoaderSpec


class FolderBatches(Dataset):
    """Map-style: a batch key (epoch, side, sample ids) -> a collated uint8 batch."""

    def __init__(self, samples, spec: LoaderSpec):
        self.paths = [sample.path for sample in samples]
        self.labels = [sample.label for sample in samples]
        self.spec = spec

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key):
        epoch, side, ids = key
        images = [self._load(int(i), epoch, side) for i in ids]
        return collate(images, [self.labels[i] for i in ids])

    def _load(self, sample_id: int, epoch: int, side: int):
        return load_or_report(self.paths[sample_id], self.spec, name=self.paths[sample_id], sample_id=sample_id,
                              epoch=epoch, side=side, roi=False)


class FolderLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        classes, samples = read_folder(spec.path, spec.split)
        self.dataset = FolderBatches(samples, spec)
        self._remaining = BatchKeys()
        super().__init__(spec, len(classes))
        self.dataloader = torch_dataloader(self.dataset, spec, sampler=self._remaining)

    def _prepare_epoch(self, epoch: int) -> None:
        spec = self.spec
        ids = rank_samples(len(self.dataset), epoch, spec.seed, spec.rank, spec.world_size, shuffle=spec.train)
        batches = batch_count(len(ids), spec.batch_size, spec.drop_last)
        self._remaining.keys = [(epoch, self.side, ids[b * spec.batch_size:(b + 1) * spec.batch_size])
                                for b in range(batches)]

    def __len__(self) -> int:
        return len(self._remaining.keys)

    def _batches(self, epoch: int, start: int):
        self._remaining.start = start
        for index, (images, labels, errors) in enumerate(self.dataloader, start):
            self._undecodable(errors)
            if len(labels):
                yield index, self._to_model_input(images), self._to_device_labels(labels)

