"""Batches of a WebDataset split decoded by the native engine (`pipeline/decode/engine.py`):
`num_workers` threads per batch, in a background thread of this process that makes
`PREFETCH_BATCHES` batches ahead into a ring of reused buffers (`pipeline/loader/prefetch.py`).
That thread hands the next batch to the engine before it finishes the last one (its labels,
its Pillow fallbacks), so the engine's threads do not wait on Python between batches.

A sample the engine refuses goes through Pillow here; one Pillow cannot decode either is left
out of its batch and reported. The CPU seconds of each engine stage are summed for the
loader benchmark (`seconds`, over `samples`).

The engine's threads keep the process's CPU priority: lowered below the training step's, they
fed the GPU worse, not better (benchmarks/results/gpu-check/ holds the figures).
"""
from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from functools import partial

import numpy as np
import torch

from pipeline.decode import engine as decode_engine
from pipeline.errors import CorruptSample
from pipeline.transforms.normalize import normalized_batch
from pipeline.loader.base import damaged_labels
from pipeline.loader.prefetch import BufferRing, prefetched
from pipeline.decode.pillow_sample import load_or_report
from pipeline.shards.index import StoredShards
from pipeline.spec import LoaderSpec

PREFETCH_BATCHES = 2


class EngineBatches:
    def __init__(self, stored: StoredShards, spec: LoaderSpec, device: torch.device, num_classes: int):
        self.stored, self.spec, self.device, self.num_classes = stored, spec, device, num_classes
        self.seconds = dict.fromkeys((*decode_engine.STAGES, "python"), 0.0)   # summed over samples
        self.samples = 0
        self._seconds_lock = threading.Lock()
        # Made at the first batch of a side and made again when the side changes: a resolution
        # schedule changes the batch's shape from epoch to epoch.
        self._ring: BufferRing | None = None

    def batches(self, plan: list[np.ndarray], epoch: int, side: int, start: int):
        """(batch index, images (N, 3, H, W), labels, undecodable messages) of the plan's batches
        from `start` on. Images are uint8 for a GPU (a quarter of the bytes to copy; it
        normalizes after the copy), else float32 normalized by the engine's threads, so the main
        thread has no pass left to make. A batch's buffer is reused once the next one is asked for."""
        on_gpu = self.device.type == "cuda"
        shape = (self.spec.batch_size, *decode_engine.out_shape(self.spec, side), 3)
        dtype = torch.uint8 if on_gpu else torch.float32
        if self._ring is None or not self._ring.fits(shape, dtype):
            self._ring = BufferRing(PREFETCH_BATCHES + 3, shape, dtype, pinned=on_gpu)
        ring = self._ring
        keys, previous = list(enumerate(plan))[start:], None
        for index, buffer, images, labels, errors in prefetched(
                partial(self._start, epoch, side), keys, ring, PREFETCH_BATCHES):
            if previous is not None:          # asked for this batch: done with the one before
                ring.give_back(previous, self.device)
            previous = buffer
            yield index, images.permute(0, 3, 1, 2), labels, errors
        if previous is not None:
            ring.give_back(previous, self.device)

    def _start(self, epoch: int, side: int, key: tuple[int, np.ndarray], buffer: torch.Tensor):
        """Batch `key` (its index in the plan, its sample ids) handed to the engine's threads, to be
        made into `buffer`; returns what waits for it and finishes it (`_finished`)."""
        index, ids = key
        started = time.thread_time()
        with ExitStack() as on_failure:
            samples = on_failure.enter_context(self.stored.located(ids))
            python_seconds = time.thread_time() - started
            batch = decode_engine.StartedBatch(samples, self.spec, epoch, side, buffer.numpy(),
                                               threads=self.spec.num_workers)
            held = on_failure.pop_all()       # the samples stay where they are until the batch is made

        def finish():
            with held:
                decoded = batch.result()
            return (index, buffer, *self._finished(epoch, side, ids, buffer, decoded, python_seconds))
        return finish

    def _finished(self, epoch: int, side: int, ids: np.ndarray, buffer: torch.Tensor,
                  decoded: decode_engine.DecodedBatch, python_seconds: float):
        """The batch's images, labels and errors: the samples the engine refused go through Pillow,
        and those Pillow cannot decode either are left out and reported."""
        out = buffer.numpy()
        fallback_started = time.thread_time()
        labels = torch.from_numpy(decoded.labels.astype(np.int64))
        unhealed = []
        for position, why in decoded.damaged:       # failed their checksum: healed from the store, or named
            label = self._healed(int(ids[position]), epoch, side, out[position:position + 1])
            if label is None:
                unhealed.append((position, why))
            labels[position] = label if label is not None else 0     # never read from damaged bytes
        bad, errors = damaged_labels(labels, self.num_classes, lambda position: self.stored.name(int(ids[position])))
        kept = ~bad.numpy()
        for position, why in unhealed:              # no other decoder tries them
            kept[position] = False
            errors.append(f"{self.stored.name(int(ids[position]))}: {why}")
        for position, _ in decoded.failed:
            if not kept[position]:
                continue
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
                self.seconds[stage] += float(seconds)
            self.seconds["python"] += (python_seconds + decoded.python_seconds +
                                       time.thread_time() - fallback_started)
            self.samples += len(ids)
        return images, labels, errors

    def _healed(self, sample_id: int, epoch: int, side: int, out: np.ndarray) -> int | None:
        """A sample from a URL whose bytes failed their checksum, fetched again (`healed`) and made by
        the engine into `out` as the batch would have made it; its label, or None where it cannot be."""
        if not hasattr(self.stored, "healed"):
            return None
        try:
            chunk = np.frombuffer(self.stored.healed(sample_id), np.uint8)
        except CorruptSample:
            return None
        image_at, image_size, label_at = (int(v) for v in self.stored.members[sample_id])
        first = min(image_at, label_at)
        one = decode_engine.StoredSamples(np.array([sample_id], np.int64), np.array([-1], np.int32),
                                          np.array([image_at - first]), np.array([image_size]),
                                          np.array([label_at - first]), bases=np.array([chunk.ctypes.data], np.uint64))
        decoded = decode_engine.decode_batch(one, self.spec, epoch, side, out, threads=1)
        return None if decoded.failed or decoded.damaged else int(decoded.labels[0])
