"""The `dali` backend: an NVIDIA DALI pipeline over raw ImageNet-layout folders
(`readers.file`) or the WebDataset shards (an external source reading them in the webdataset
backend's plan, from local disk or, for a URL, through `pipeline/remote/shards.py`).

With CUDA, JPEGs are decoded by `decoders.image_random_crop(device='mixed')` (nvJPEG,
with `hw_decoder_load` sending part of the work to the hardware JPEG decoder where there is
one) and resized, flipped and normalized on the GPU; the batch never visits the host.
Without CUDA the same graph runs on the CPU (`device_id=None`). RandAugment, when the spec
asks for it, is DALI's own `auto_aug.rand_augment` after the resize, with the magnitude
scale `pipeline/transforms/randaugment.py` gives the PIL backends.

Epochs: a pipeline is built per epoch (about 10 ms), seeded from (seed, rank, epoch), with
the epoch's resolution as a constant, so a schedule decodes straight to the new size and
an epoch can be replayed exactly. Each pipeline is run exactly once per batch of its epoch,
and the next epoch's is started during the current one's last batches (`_EpochRun`).
Folder source: the reader gets this rank's file list for the epoch from `pipeline.loader.sharding`,
already in order. Shard source: the webdataset backend's plan (`pipeline/shards/index.py`), not
DALI's own `readers.webdataset`, whose sharding gives each global step other samples at each
world size. Both follow the global steps that make a resume at another world size exact in
its samples; DALI's crops do not come from the sample ids, so the pixels differ. Resuming at batch b runs the first b batches again and drops
them: DALI's random crops advance per-position generators, so skipping samples instead
would change every later augmentation. DALI cannot skip an undecodable sample: the error
names DALI's message and the dataset.
"""
from __future__ import annotations

import ctypes
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
from nvidia.dali import fn, math as dali_math, pipeline_def, types
from nvidia.dali.auto_aug import rand_augment

from pipeline.loader.base import Loader, not_a_class
from pipeline.transforms.crops import RANDOM_CROP_ATTEMPTS, sample_seed
from pipeline.datasets import read_converted, read_folder
from pipeline.errors import CorruptSample, DatasetError
from pipeline.formats.converted import is_converted
from pipeline.storage.urls import is_url
from pipeline.transforms.randaugment import SEVERITY_BINS
from pipeline.remote.shards import RemoteShards
from pipeline.shards.index import StoredShards, check_reads
from pipeline.loader.sharding import rank_batches, rank_sample_count, rank_samples
from pipeline.spec import LoaderSpec

# nvJPEG scratch sizes that avoid re-allocations on ImageNet (as in DALI's ResNet-50 example).
DEVICE_MEMORY_PADDING, HOST_MEMORY_PADDING = 211_025_920, 140_544_512
PREFETCH_DEPTH = 2


class DALILoader(Loader):
    def __init__(self, spec: LoaderSpec):
        self.stored = None
        if is_url(spec.path) or is_converted(spec.path):   # a URL's samples come through the node's block cache
            shards = read_converted(spec.path, spec.split, "webdataset", **spec.remote_options)
            # its source reads the batch after the one DALI is given (`_PlannedBatches`)
            self.stored = (RemoteShards(shards.shards, shards.remote, spec.fetch_size, reads_ahead=2) if shards.remote
                           else StoredShards(shards.shards))
            check_reads(self.stored, spec)
            classes, self.files, self.count = shards.classes, None, shards.count
        else:
            classes, self.files = read_folder(spec.path, spec.split)
            self.count = len(self.files)
        self.cuda = spec.device.startswith("cuda")
        self._ahead = None                # (run key, _EpochRun) started during the last epoch
        super().__init__(spec, len(classes))
        self.device_id = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None

    def __len__(self) -> int:
        return rank_batches(self.count, self.spec)

    def _batches(self, epoch: int, start: int):
        spec = self.spec
        samples = rank_sample_count(self.count, spec)
        try:
            run = self._take_run(epoch)
            for index, (images, labels) in enumerate(run):
                if run.all_scheduled and self._ahead is None:
                    self._ahead = (self._run_key(epoch + 1), self._start_run(epoch + 1))
                if index >= start:
                    keep = min(spec.batch_size, samples - index * spec.batch_size)   # the reader pads the last batch
                    images = self._colout(images[:keep].permute(0, 3, 1, 2), index)
                    yield index, images.to(spec.dtype).contiguous(memory_format=torch.channels_last), \
                        self._to_device_labels(labels[:keep])
            del run
            _return_free_memory()
        except RuntimeError as error:
            first_line = _summary(error)
            raise DatasetError(f"{spec.path}: DALI failed while reading the {spec.split} split "
                               f"({first_line})") from None

    def _run_key(self, epoch: int) -> int:
        """Epochs whose pipelines are the same: every val epoch reads the same crops."""
        return epoch if self.spec.train else 0

    def _take_run(self, epoch: int) -> _EpochRun:
        """This epoch's run: the one started ahead during the last epoch if it is this epoch's
        (a resume or a replay of another epoch drops it), else a new one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self._run_key(epoch):
            return ahead[1]
        return self._start_run(epoch)

    def _start_run(self, epoch: int) -> _EpochRun:
        spec = self.spec
        seed = sample_seed(spec.seed + 7919 * spec.rank, epoch, 0) % (2 ** 31)
        pipe = _graph(self, epoch, batch_size=spec.batch_size, num_threads=max(1, spec.num_workers),
                      device_id=self.device_id, seed=seed, prefetch_queue_depth=PREFETCH_DEPTH, exec_dynamic=True)
        return _EpochRun(pipe, len(self), self.device)

    def _read(self, epoch: int):
        """(jpegs, labels) from the reader for this rank and epoch."""
        spec = self.spec
        if self.files is not None:
            ids = rank_samples(self.count, epoch, spec.seed, spec.rank, spec.world_size, shuffle=spec.train)
            return fn.readers.file(files=[self.files[i].path for i in ids], labels=[self.files[i].label for i in ids],
                                   random_shuffle=False, pad_last_batch=True, name="reader")
        # A partial of the stored shards, not a lambda: one naming the loader would keep it alive from its own pipeline
        source = _PlannedBatches(self.stored, self.stored.epoch_batches(spec, epoch), self.num_classes,
                                 following=partial(self.stored.epoch_batches, spec, epoch + 1))
        return fn.external_source(source=source,
                                  num_outputs=2, batch=True, batch_info=True, dtype=[types.UINT8, types.INT32])


class _PlannedBatches:
    """An external source of one epoch's (JPEG bytes, label) batches, in the webdataset backend's
    plan, read from the shards (from a URL, `pipeline/remote/shards.py` fetches ahead from the
    first batch on, and near the end the first batches of `following()`, the next epoch's plan).
    Each batch's bytes are read in a thread while DALI works on the one before: DALI calls a
    source from the thread that schedules its runs, the training loop's."""

    def __init__(self, stored: StoredShards, plan: list, num_classes: int, following=None):
        self.stored, self.plan, self.num_classes, self.following = stored, plan, num_classes, following
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="dali-source")
        self._next: tuple[int, Future] | None = None

    def __call__(self, info):
        index = info.iteration
        if index >= len(self.plan):
            self._reader.shutdown(wait=False)
            raise StopIteration
        if index == 0:
            self.stored.read_ahead(self.plan, 0, self.following)
        else:       # the batches before this one have been handed to DALI
            self.stored.consumed(index - 1)
        ahead, self._next = self._next, None
        batch = ahead[1].result() if ahead and ahead[0] == index else self._read(index)
        if index + 1 < len(self.plan):
            self._next = index + 1, self._reader.submit(self._read, index + 1)
        return batch

    def _read(self, index: int):
        jpegs, labels = [], []
        for sample_id in self.plan[index].tolist():
            jpeg, label = self.stored.read(sample_id)
            if not 0 <= label < self.num_classes:      # DALI cannot leave a sample out of its batch
                raise CorruptSample(f"{not_a_class(self.stored.name(sample_id), label, self.num_classes)}; "
                                    f"DALI cannot skip it")
            jpegs.append(np.frombuffer(jpeg, np.uint8))
            labels.append(np.array([label], np.int32))
        return jpegs, labels


class _EpochRun:
    """One epoch's pipeline, run exactly once per batch of its epoch.

    DALI's own iterator keeps one pipeline, which runs on into the next epoch. A pipeline
    per epoch (for exact replay) left to that iterator computed batches past its end, threw
    them away, waited for them when deleted, and started every epoch from an empty queue.
    Here no run is scheduled past the epoch's end, and once all of them are, the loader
    starts the next epoch's run, whose first batches then decode while this epoch's last
    ones are consumed (and a val run is ready for the next evaluation).
    """

    def __init__(self, pipe, batches: int, device: torch.device):
        self.pipe, self.batches, self.device, self.scheduled = pipe, batches, device, 0
        pipe.build()
        self._schedule()

    @property
    def all_scheduled(self) -> bool:
        return self.scheduled >= self.batches

    def _schedule(self) -> None:
        if not self.all_scheduled:
            self.scheduled += PREFETCH_DEPTH if self.scheduled == 0 else 1   # the first call fills the queue
            self.pipe.schedule_run()

    def __iter__(self):
        for _ in range(self.batches):
            images, labels = self.pipe.share_outputs()
            # Zero-copy: the dynamic executor (asked for in _start_run) keeps shared outputs
            # alive until the tensors made from them are freed, as DALI's own iterator relies on.
            with self.device:
                images, labels = torch.from_dlpack(images.as_tensor()), torch.from_dlpack(labels.as_tensor())
            self.pipe.release_outputs()
            self._schedule()
            yield images, labels


@pipeline_def(enable_conditionals=True)   # rand_augment selects operations with `if`
def _graph(loader: DALILoader, epoch: int):
    spec = loader.spec
    side = spec.resolution_at(epoch)
    jpegs, labels = loader._read(epoch)
    decode_options = dict(device="mixed", hw_decoder_load=spec.hw_decoder_load, device_memory_padding=DEVICE_MEMORY_PADDING,
                          host_memory_padding=HOST_MEMORY_PADDING) if loader.cuda else dict(device="cpu")
    if spec.train:
        images = fn.decoders.image_random_crop(jpegs, output_type=types.RGB, random_area=list(spec.scale),
                                               random_aspect_ratio=list(spec.ratio),
                                               num_attempts=RANDOM_CROP_ATTEMPTS, **decode_options)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        shape = fn.peek_image_shape(jpegs, dtype=types.FLOAT)   # (H, W, C)
        height, width = shape[0], shape[1]
        crop = dali_math.floor(dali_math.min(height, width) * spec.val_crop_ratio)
        anchor = fn.stack(dali_math.floor((height - crop) * 0.5), dali_math.floor((width - crop) * 0.5))
        images = fn.decoders.image_slice(jpegs, anchor, fn.stack(crop, crop), axis_names="HW", output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False, **decode_options)
        mirror = 0
    images = fn.resize(images, resize_x=side, resize_y=side, interp_type=types.INTERP_LINEAR, antialias=True)
    if spec.train and spec.randaugment:
        depth, severity = spec.randaugment
        images = rand_augment.rand_augment(images, n=depth, m=severity, num_magnitude_bins=SEVERITY_BINS,
                                           shape=(side, side), fill_value=128)
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16 if spec.dtype == torch.float16 else types.FLOAT,
                                      output_layout="HWC", mean=[255 * m for m in spec.mean],
                                      std=[255 * s for s in spec.std], mirror=mirror)
    return images, (labels.gpu() if loader.cuda else labels)


def _return_free_memory() -> None:
    """glibc's malloc_trim: hand the heap's free pages back to the system. Two pipelines'
    thread pools allocating side by side (one epoch ending, the next starting) fragment the
    heap, and without this RSS grew about 25 MB an epoch (0.9 to 1.7 GB over 40 epochs of
    the photo sample); with it RSS stayed at about 600 MB. A no-op on other C libraries."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _summary(error: Exception) -> str:
    """DALI's error in one line: the operator and what it met (which names the file when there is one)."""
    text = str(error)
    operator = re.search(r"operator `([^`]+)`", text)
    reason = [line.strip() for line in text.split("encountered:", 1)[-1].splitlines()
              if line.strip() and not line.strip().startswith(("Current pipeline", "Critical error", "[/", "Stacktrace"))]
    what = reason[0] if reason else repr(error)
    return f"{operator.group(1)}: {what}" if operator else what
