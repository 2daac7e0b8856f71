"""The `webdataset` backend: WebDataset tar shards, each JPEG decoded only where its crop lies,
at the coarsest DCT scale that keeps it sharp: this project's fastest CPU loader.

An epoch's batches are planned from the shards' index alone (`pipeline/shards/index.py`: which
samples, in which order, on which rank). Decoding: the native engine makes each batch with
`num_workers` threads in a background thread of this process (`pipeline/shards/engine_batches.py`).
RandAugment, whose operations are Pillow's and need Python, runs instead in DataLoader worker
processes (`pipeline/shards/worker_batches.py`), as does everything with `native_decode=False`.
A dataset at a URL is read through the node's block cache (`pipeline/remote/shards.py`).
"""
from __future__ import annotations

import numpy as np

from pipeline.loader.base import Loader
from pipeline.datasets import read_converted
from pipeline.loader.workers import PREFETCH_FACTOR, BatchKeys, torch_dataloader
from pipeline.shards.engine_batches import PREFETCH_BATCHES, EngineBatches
from pipeline.remote.shards import RemoteShards
from pipeline.shards.index import StoredShards, check_reads
from pipeline.shards.worker_batches import KeysWithSamples, WorkerBatches
from pipeline.spec import LoaderSpec


class WebDatasetLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        data = read_converted(spec.path, spec.split, "webdataset", **spec.remote_options)
        # RandAugment's operations are Pillow's, in Python: its samples are decoded in DataLoader workers
        self.uses_engine = spec.native_decode and not (spec.train and spec.randaugment)
        # From a URL the same samples and plans, their bytes fetched into the node's cache. Read at
        # most this many batches past the one last handed out: those made ahead, and the one begun
        # as the next is taken, before it is handed out
        reads_ahead = PREFETCH_BATCHES + 2 if self.uses_engine else max(1, spec.num_workers) * PREFETCH_FACTOR + 2
        self.stored = (RemoteShards(data.shards, data.remote, spec.fetch_size, reads_ahead) if data.remote
                       else StoredShards(data.shards))
        check_reads(self.stored, spec)
        self._plan: list[np.ndarray] = []
        super().__init__(spec, len(data.classes))
        self.engine = EngineBatches(self.stored, spec, self.device, self.num_classes) if self.uses_engine else None
        self._sampler = BatchKeys()
        self.dataloader = None if self.uses_engine else torch_dataloader(WorkerBatches(self.stored, spec, self.num_classes), spec,
                                                                           sampler=self._sampler)

    @property
    def engine_seconds(self) -> dict[str, float]:
        """CPU seconds per decode-engine stage, summed over `engine_samples` samples (none without the engine)."""
        return self.engine.seconds if self.engine else {}

    @property
    def engine_samples(self) -> int:
        return self.engine.samples if self.engine else 0

    def _prepare_epoch(self, epoch: int) -> None:
        self._plan = self.stored.epoch_batches(self.spec, epoch)

    def __len__(self) -> int:
        return len(self._plan)

    def _batches(self, epoch: int, start: int):
        self.stored.read_ahead(self._plan, start, following=lambda: self.stored.epoch_batches(self.spec, epoch + 1),
                               first_batch_located=self.engine is not None)
        try:
            yield from self._decoded_batches(epoch, start)
        finally:
            self.stored.stop_read_ahead()

    def _decoded_batches(self, epoch: int, start: int):
        if self.engine is not None:
            batches = self.engine.batches(self._plan, epoch, self.side, start)
        else:
            keys = [(epoch, self.side, ids) for ids in self._plan]
            if isinstance(self.stored, RemoteShards):
                keys = KeysWithSamples(self.stored, keys)
            self._sampler.keys, self._sampler.start = keys, start
            batches = ((index, *batch) for index, batch in enumerate(self.dataloader, start))
        for index, images, labels, errors in batches:
            self.stored.consumed(index)
            self._undecodable(errors)
            if len(labels):
                yield index, self._to_model_input(images), self._to_device_labels(labels)
