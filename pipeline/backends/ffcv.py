"""The `ffcv` backend: the real `ffcv.loader.Loader` on a `.beton` written by tools/convert_ffcv.py.

What we add to FFCV, and why:
- `SeededRandomResizedCrop`, a decoder that draws each sample's crop and flip from a seed
  of (seed, epoch, sample id), the same numbers as every other backend (pipeline.transforms.crops's,
  through its C copy: numba has no numpy Generator). FFCV's own RandomResizedCrop and flip
  draw from numba's per-thread global RNG, which nothing seeds: their augmentations differ
  on every run and a resumed epoch could not repeat them. The epoch reaches the compiled
  code through a one-element array that the numba code reads by address at run time (globals
  and closure values are frozen into numba code when it compiles, and recompiling costs seconds).
- `_stop`: an epoch left mid-way ends FFCV's epoch thread, which would otherwise run on.
- Our traversal order (`pipeline.loader.sharding`) in place of FFCV's: its `distributed=True`
  pads like DistributedSampler, so a val epoch would count some samples twice. The order
  is set on the loader object after construction because Loader(order=<TraversalOrder
  subclass>) is rejected by an `isinstance` check in FFCV 1.0.2.
- Normalization after the batch leaves FFCV: it writes a new tensor, so FFCV's reused
  output buffers never reach the caller, and FFCV's own NormalizeImage is never used: on a CPU
  device it leaves FFCV's loader looping forever, no batch ever coming out.
The scheduled resolution is set on the decoder at `set_epoch` (`output_size`), which FFCV
applies at the next epoch without recompiling. ColOut acts on the uint8 batch.
- `data.verify=full` on a local .beton: its samples checked once at open against the checksums
  its converter recorded (pipeline/formats/beton_checksums.py). A damaged sample is never handed
  to FFCV's decoder (its size and place may be what changed): a good sample stands in for it and
  its row is dropped from the batch, so the batches, and every rank's count of them, stay those
  of an undamaged run, less the damaged samples.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import queue
import sys
from pathlib import Path

import numpy as np
import torch
import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import IMAGE_MODES, CenterCropRGBImageDecoder, ResizedCropRGBImageDecoder
from ffcv.libffcv import imdecode, resize_crop
from ffcv.loader import Loader as FFCVBaseLoader, OrderOption
from ffcv.pipeline.compiler import Compiler
from ffcv.reader import Reader
from ffcv.transforms import ToDevice, ToTensor, ToTorchImage
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pipeline.formats.beton_checksums import BetonLayoutError, check_once
from pipeline.loader.base import Loader, damaged_labels
from pipeline.transforms.crops import UNIFORMS_PER_SAMPLE, compiled_sample_uniforms, random_resized_crop
from pipeline.datasets import read_converted
from pipeline.errors import FAILS_CHECKSUM, CorruptSample, DatasetError
from pipeline.formats.converted import CONVERTERS
from pipeline.loader.sharding import batch_count, rank_samples
from pipeline.remote.dataset import default_cache_dir, stage_again
from pipeline.spec import LoaderSpec

log = logging.getLogger(__name__)


@intrinsic
def _read_int64(typing_context, address):
    """Load an int64 from a raw address inside numba code: a value that can change after compiling."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()))
    return types.int64(address), codegen


def _mirror(image):
    """Flip an HxWxC image left to right in place. Element by element: an array slice assignment
    makes numba compile the code that formats its shape-mismatch error, seconds of every process's
    first batch."""
    width, channels = image.shape[1], image.shape[2]
    for y in range(image.shape[0]):
        row = image[y]
        for x in range(width // 2):
            for channel in range(channels):
                row[x, channel], row[width - 1 - x, channel] = row[width - 1 - x, channel], row[x, channel]


class SeededRandomResizedCrop(ResizedCropRGBImageDecoder):
    """RandomResizedCrop + horizontal flip, decided per sample from (seed, epoch, sample id)."""

    def __init__(self, output_size, scale, ratio, seed: int):
        super().__init__(output_size)
        self.scale, self.ratio, self.seed = scale, ratio, seed
        self.epoch = np.zeros(1, dtype=np.int64)   # read by the compiled code; keep it alive here

    def get_crop_generator(self):   # abstract in FFCV; generate_code below does the cropping
        return random_resized_crop

    def generate_code(self):
        jpg, memory_read, parallel_range = IMAGE_MODES["jpg"], self.memory_read, Compiler.get_iterator()
        decode_jpeg, crop_and_resize = Compiler.compile(imdecode), Compiler.compile(resize_crop)
        crop_box, draw_uniforms = Compiler.compile(random_resized_crop), compiled_sample_uniforms()
        mirror = Compiler.compile(_mirror)
        epoch_address, seed = self.epoch.ctypes.data, self.seed
        scale_lo, scale_hi = self.scale
        log_ratio_lo, log_ratio_hi = math.log(self.ratio[0]), math.log(self.ratio[1])

        def decode(batch_indices, storage, metadata, storage_state):
            destination, scratch = storage
            epoch = _read_int64(epoch_address)
            for slot in parallel_range(len(batch_indices)):
                sample_id = batch_indices[slot]
                uniforms = np.empty(UNIFORMS_PER_SAMPLE)
                draw_uniforms(seed, epoch, sample_id, uniforms.ctypes.data, UNIFORMS_PER_SAMPLE)
                field = metadata[sample_id]
                data = memory_read(field["data_ptr"], storage_state)
                height, width = np.uint32(field["height"]), np.uint32(field["width"])
                if field["mode"] == jpg:
                    pixels = scratch[slot]
                    decode_jpeg(data, pixels, height, width, height, width, 0, 0, 1, 1, False, False)
                    pixels = pixels.reshape(-1)[:3 * height * width].reshape(height, width, 3)
                else:
                    pixels = data.reshape(height, width, 3)
                top, left, crop_height, crop_width = crop_box(height, width, scale_lo, scale_hi,
                                                              log_ratio_lo, log_ratio_hi, uniforms)
                crop_and_resize(pixels, top, top + crop_height, left, left + crop_width, destination[slot])
                if uniforms[UNIFORMS_PER_SAMPLE - 1] < 0.5:
                    mirror(destination[slot])
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode


class _FixedOrder:
    """Stands in for FFCV's TraversalOrder: the sample ids the loader set for the next epoch."""

    def __init__(self):
        self.order = np.zeros(0, dtype=np.uint64)

    def sample_order(self, epoch: int) -> np.ndarray:
        return self.order


class FFCVLoader(Loader):
    def __init__(self, spec: LoaderSpec):
        # from a URL: a local copy staged into the node's cache
        data = read_converted(spec.path, spec.split, "ffcv", **spec.remote_options)
        beton = data.files[0]
        try:
            fields = Reader(str(beton)).handlers
        except Exception as error:  # FFCV raises assorted errors on a file that is not a .beton
            raise DatasetError(f"{beton}: not a readable FFCV .beton ({error!r}); "
                               f"run {CONVERTERS['ffcv']} again") from None
        if set(fields) != {"image", "label"}:
            raise DatasetError(f"{beton}: fields {sorted(fields)}, expected image and label "
                               f"({CONVERTERS['ffcv']} writes them)")
        self.count = data.count
        side = spec.resolution_at(0)
        if spec.train:
            self.decoder = SeededRandomResizedCrop((side, side), spec.scale, spec.ratio, spec.seed)
        else:
            self.decoder = CenterCropRGBImageDecoder((side, side), ratio=spec.val_crop_ratio)
        self.order = _FixedOrder()
        self._ids = np.zeros(0, dtype=np.int64)
        self.beton = beton
        self.damaged = np.asarray(_damaged_samples(data, spec), dtype=np.int64)
        self.stand_in = int(np.setdiff1d(np.arange(len(self.damaged) + 1), self.damaged)[0])   # the first sound sample
        super().__init__(spec, len(data.classes))
        self.ffcv = _ffcv_loader(beton, spec, self.decoder, self.order)

    def _prepare_epoch(self, epoch: int) -> None:
        spec = self.spec
        ids = rank_samples(self.count, epoch, spec.seed, spec.rank, spec.world_size, shuffle=spec.train)
        self._ids = ids[:len(ids) // spec.batch_size * spec.batch_size] if spec.drop_last else ids
        self.decoder.output_size = (self.side, self.side)
        if spec.train:
            self.decoder.epoch[0] = epoch

    def __len__(self) -> int:
        return batch_count(len(self._ids), self.spec.batch_size, drop_last=False)

    def _batches(self, epoch: int, start: int):
        ids = self._ids[start * self.spec.batch_size:]
        stood_in = np.isin(ids, self.damaged)
        self.order.order = np.where(stood_in, self.stand_in, ids).astype(np.uint64)
        self.ffcv.first_traversal_order = self.order.order   # what FFCV's len() counts
        self.ffcv.next_epoch = epoch
        epoch_thread = iter(self.ffcv)
        try:
            for index, (images, labels) in enumerate(epoch_thread, start):
                labels = labels.to(torch.int64).view(-1)      # on the CPU: checked before the copy to the device
                first = index * self.spec.batch_size
                bad, errors = damaged_labels(labels, self.num_classes,
                                             lambda position: f"{self.beton}: sample {self._ids[first + position]}")
                replaced = torch.from_numpy(stood_in[first - start * self.spec.batch_size:][:len(labels)])
                if bool(replaced.any()):
                    bad = bad | replaced
                    errors += [f"{self.beton}: sample {self._ids[first + position]}: {FAILS_CHECKSUM}"
                               for position in replaced.nonzero().view(-1).tolist()]
                if errors:
                    self._undecodable(errors)
                    images, labels = images[(~bad).to(images.device)], labels[~bad]
                images = self._colout(images, index)
                yield index, self._to_model_input(images), self._to_device_labels(labels)
        finally:
            _stop(epoch_thread)


def _damaged_samples(data, spec: LoaderSpec) -> list[int]:
    """With data.verify=full, the samples of the .beton that fail their recorded checksums
    (on_corrupt='raise': a CorruptSample naming them); else none. A staged copy of a remote
    .beton, checked whole by its sha256 when it was staged, is checked again here: one damaged
    since (the cache's disk) is staged again."""
    beton, record = data.files[0], data.record
    if spec.verify != "full":
        return []
    if "checksums" not in record:
        if data.remote is None:
            log.warning("%s: converted before per-sample checksums, so data.verify=full checks its sha256 instead; "
                        "run %s again to have its samples checked", beton, CONVERTERS["ffcv"])
            with open(beton, "rb") as file:
                if hashlib.file_digest(file, "sha256").hexdigest() != record.get("sha256"):
                    raise DatasetError(f"{beton}: its sha256 differs from its manifest's: its bytes changed; "
                                       f"run {CONVERTERS['ffcv']} again")
        return []
    results = Path(spec.cache_dir or default_cache_dir()) / "verified"

    def checked() -> list[int]:
        try:
            return check_once(beton, record, results)
        except BetonLayoutError as error:
            if data.remote is not None:
                return list(range(record["count"]))
            raise DatasetError(f"{beton}: {error}; run {CONVERTERS['ffcv']} again") from None
    damaged = checked()
    if damaged and data.remote is not None:
        log.warning("%s: the staged copy of %s is damaged (%d samples) since it was staged; staging it again",
                    beton, data.remote.store.where(record["files"][0]), len(damaged))
        stage_again(data)        # the store's copy, checked by its sha256 as it is staged
        damaged = checked()
    if len(damaged) == record["count"]:
        raise DatasetError(f"{beton}: every sample fails its checksum; run {CONVERTERS['ffcv']} again")
    if damaged:
        named = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        if spec.on_corrupt == "raise":
            raise CorruptSample(f"{beton}: sample {damaged[0]}: {FAILS_CHECKSUM}, and {len(damaged) - 1} more "
                                f"(on_corrupt='skip' skips and counts such samples)")
        log.warning("%s: %d samples fail their checksums (%s); skipped wherever read: run %s again to have them "
                    "back", beton, len(damaged), named, CONVERTERS["ffcv"])
    return damaged


def _ffcv_loader(beton, spec: LoaderSpec, decoder, order: _FixedOrder) -> FFCVBaseLoader:
    """FFCV's loader on `beton`, reading in `order`. Its constructor sets torch's thread count to
    its workers (`Compiler.set_num_threads`), which it does again at each epoch's start: the
    count is put back here, so that a loader built but not yet iterated changes nothing (the
    trainer's CPU precision probe runs between the two)."""
    to_device = [ToDevice(torch.device(spec.device), non_blocking=True)] if spec.device.startswith("cuda") else []
    threads = torch.get_num_threads()
    # FFCV's workers are numba threads, which numba caps at its NUMBA_NUM_THREADS (the cores):
    # past it FFCV's constructor raises numba's bare "number of threads must be between 1 and N"
    workers = max(1, spec.num_workers)
    if workers > numba.config.NUMBA_NUM_THREADS:
        log.warning("ffcv loader: num_workers=%d is more than numba's %d threads (the cores); using %d",
                    workers, numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS)
        workers = numba.config.NUMBA_NUM_THREADS
    try:
        loader = FFCVBaseLoader(
            str(beton), batch_size=spec.batch_size, num_workers=workers, os_cache=True,
            order=OrderOption.SEQUENTIAL, drop_last=False,
            pipelines={"image": [decoder, ToTensor(), ToTorchImage(channels_last=True), *to_device],
                       "label": [IntDecoder(), ToTensor()]})
    finally:
        torch.set_num_threads(threads)
    loader.traversal_order = order
    return loader


def _stop(epoch_thread) -> None:
    """Ends an FFCV epoch thread left mid-epoch, now. Left alone it goes on making batches (it
    checks its `terminate_event` only when its queue is full) and, as a daemon, may still be in
    torch's C++ when the interpreter finalizes: taking the GIL then unwinds the thread through a
    noexcept frame, and the process aborts (exit 134, "terminate called without an active
    exception", after all its work was done; 3 of 12 exits of a process that had also used the
    folder backend, Python 3.11). Its next batch is made the epoch's end, and the queue drained so that
    its last put does not block. Not while Python finalizes (a generator left in a reference
    cycle is closed then): a daemon thread may then have stopped without saying so."""
    epoch_thread.iter_ixes = iter(())
    epoch_thread.terminate_event.set()
    while epoch_thread.is_alive() and not sys.is_finalizing():
        with contextlib.suppress(queue.Empty):
            epoch_thread.output_queue.get(timeout=0.1)
