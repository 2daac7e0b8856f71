"""What the DataLoader-worker backends (folder, webdataset) share: decode + crop + resize +
RandAugment + flip of one sample with PIL (Pillow-SIMD here), collation into a uint8 batch, and the
DataLoader that runs it.

`roi=True` decodes only the crop's region of a JPEG (`pipeline/jpeg_roi.py`), at 1/2, 1/4
or 1/8 scale (DCT scaling) when the crop is still at least twice the target size there, so
the decoder does less work and the resize sees no fewer pixels than it outputs. The
`folder` backend keeps it off (stock semantics: Pillow, full decode); `webdataset` turns it on.
"""
from __future__ import annotations

import atexit
import ctypes
import io
import math
import os
import signal
import sys
import weakref

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, get_worker_info

from pipeline import jpeg_roi
from pipeline.colout import colout_sample, sample_generator
from pipeline.crops import center_crop, sample_seed, sample_uniforms, train_crop
from pipeline.datasets import CorruptSample
from pipeline.randaugment import randaugment_image
from pipeline.spec import LoaderSpec

DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
# What schedulers send before they kill: SIGTERM (Slurm, Kubernetes, torchrun's shutdown) and
# SIGUSR1 (Slurm's early warning). The trainer stops on them (training/stop_requests.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RANDAUGMENT_STREAM = 2    # a random stream of its own per sample, apart from the crop's uniforms


def draft_reduction(crop_height: int, crop_width: int, side: int) -> int:
    """The largest DCT scale denominator (1, 2, 4, 8) that keeps the crop at least 2 x `side` pixels."""
    reduction = 1
    while reduction < 8 and min(crop_height, crop_width) >= 2 * reduction * side:
        reduction *= 2
    return reduction


def load_sample(source, spec: LoaderSpec, *, name: str, sample_id: int, epoch: int, side: int,
                roi: bool) -> np.ndarray:
    """(side', side', 3) uint8: one stored image (a path or JPEG bytes), augmented as the spec says.
    `roi=True` decodes JPEG bytes with `pipeline.jpeg_roi` (only the crop, DCT-scaled where it
    allows); anything else, and a JPEG it refuses, goes through Pillow."""
    uniforms = sample_uniforms(spec.seed, epoch, sample_id)
    try:
        image, flip = None, False
        if roi and isinstance(source, bytes):
            try:
                image, flip = _roi_crop(source, spec, uniforms, side)
            except jpeg_roi.JPEGError:
                pass    # CMYK, or damaged: Pillow decodes the first and names the damage of the second
        if image is None:
            image, flip = _pil_crop(source, spec, uniforms, side, draft=roi)
        if spec.randaugment and spec.train:
            seed = sample_seed(spec.seed, epoch, sample_id)
            image = randaugment_image(image.convert("RGB"), *spec.randaugment,
                                      np.random.default_rng((seed, RANDAUGMENT_STREAM)))
        pixels = np.asarray(image)[:, :, :3]    # the ROI path's images are RGBX
    except DECODE_ERRORS as error:
        raise CorruptSample(f"{name}: cannot decode ({error})") from None
    if flip:
        pixels = pixels[:, ::-1]    # a view: assembling the batch makes the one copy
    if spec.colout and spec.train:
        pixels = colout_sample(pixels, *spec.colout, sample_generator(uniforms))
    return pixels


def _crop_box(height: int, width: int, spec: LoaderSpec, uniforms) -> tuple[tuple[int, int, int, int], bool]:
    if spec.train:
        return train_crop(height, width, spec.scale, spec.ratio, uniforms)
    return center_crop(height, width, spec.val_crop_ratio), False


def _roi_crop(jpeg: bytes, spec: LoaderSpec, uniforms, side: int) -> tuple[Image.Image, bool]:
    width, height = jpeg_roi.image_size(jpeg)
    box, flip = _crop_box(height, width, spec, uniforms)
    reduction = draft_reduction(box[2], box[3], side)
    # Bilinear resampling reads up to (shrink factor) pixels beyond the box: decode those too,
    # and one more, since libjpeg upsamples the chroma of a region's edge columns as if they
    # were the image's; so the result is the one a full decode gives.
    margin = math.ceil(max(box[2], box[3]) / reduction / side) + 2
    pixels, region_box = jpeg_roi.decode_region(jpeg, width, height, box, reduction, margin)
    region = Image.frombuffer("RGBX", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGBX", 0, 1)
    return region.resize((side, side), Image.BILINEAR, box=region_box), flip


def _pil_crop(source, spec: LoaderSpec, uniforms, side: int, draft: bool) -> tuple[Image.Image, bool]:
    image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    width, height = image.size
    (top, left, crop_height, crop_width), flip = _crop_box(height, width, spec, uniforms)
    if draft and image.format == "JPEG":
        reduction = draft_reduction(crop_height, crop_width, side)
        if reduction > 1:
            # Pillow picks the scale from size // request, so ask for floor sizes: ceil ones
            # make it decode at full size whenever a side is odd.
            image.draft("RGB", (width // reduction, height // reduction))
    x_scale, y_scale = image.size[0] / width, image.size[1] / height
    box = (left * x_scale, top * y_scale, (left + crop_width) * x_scale, (top + crop_height) * y_scale)
    return image.convert("RGB").resize((side, side), Image.BILINEAR, box=box), flip


def load_or_report(source, spec: LoaderSpec, **options) -> np.ndarray | str:
    """load_sample, with an undecodable sample reported as its error message instead of raised:
    the main process decides (spec.on_corrupt) and its error stays one line, not a worker traceback."""
    try:
        return load_sample(source, spec, **options)
    except CorruptSample as error:
        return str(error)


def collate(images: list, labels: list) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Decoded samples (error messages where one failed) -> an (N, 3, H, W) uint8 view of an
    NHWC batch, int64 labels, and the error messages. uint8, for any device: a quarter of the
    bytes of float32 to pass between processes and to copy to a GPU, which normalizes after
    the copy; on a CPU the main process normalizes into reused memory
    (`pipeline/normalize.py`), cheaper than a worker normalizing into fresh shared memory."""
    kept = [(image, label) for image, label in zip(images, labels) if not isinstance(image, str)]
    errors = [image for image in images if isinstance(image, str)]
    labels = torch.tensor([label for _, label in kept], dtype=torch.int64)
    if not kept:
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8), labels, errors
    batch = torch.empty((len(kept), *kept[0][0].shape), dtype=torch.uint8)
    if get_worker_info() is not None:
        batch.share_memory_()    # made in shared memory, the DataLoader sends it without another copy
    np.stack([image for image, _ in kept], out=batch.numpy())
    return batch.permute(0, 3, 1, 2), labels, errors


# The iterators of our DataLoaders that have worker processes, for the fork and exit hooks below.
_LIVE_WORKER_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()


def _disown_inherited_workers() -> None:
    # A forked worker inherits the parent's other DataLoaders, and with persistent workers
    # their live iterators; without this, each one's __del__ tries to stop processes that
    # are not its children when the worker exits ("AssertionError: can only test a child
    # process", seen whenever a train and a val loader are alive together).
    for iterator in list(_LIVE_WORKER_ITERATORS):
        iterator._shutdown = True
    _LIVE_WORKER_ITERATORS.clear()


os.register_at_fork(after_in_child=_disown_inherited_workers)


class _WorkersStopWhenFreed(DataLoader):
    """A DataLoader whose persistent workers are stopped as soon as it is freed, however it is.

    torch stops them from its iterator's __del__. When the garbage collector frees a DataLoader
    (it sat in a reference cycle: a trainer's, or an exception's traceback), those __del__ run in
    no set order, the stop message never reaches the workers, and each one sits out torch's 5 s
    join timeout (seen: 10 s for 2 workers, against 0.1 s when freed by its last reference).
    A weakref finalizer runs before the collector touches anything, so the stop gets through."""

    def _get_iterator(self):
        iterator = super()._get_iterator()
        if self.num_workers > 0:
            finalizer = weakref.finalize(self, _stop_workers, iterator)
            finalizer.atexit = False          # at exit, _stop_workers_at_exit ends them all
            _LIVE_WORKER_ITERATORS.add(iterator)
        return iterator


def _stop_workers(iterator) -> None:
    iterator._shutdown_workers()              # torch's own shutdown; a no-op the second time


@atexit.register        # after torch's and multiprocessing's own: so it runs before both (last in, first out)
def _stop_workers_at_exit() -> None:
    """Stop the workers of every loader still alive at interpreter exit: one held by an uncaught
    exception's traceback, mid-epoch. Left to them, torch's handler only marks the exit (its
    iterators' shutdown is then a no-op), and multiprocessing's SIGTERMs its daemon children,
    which our workers ignore (prepare_worker), then joins them: the process hung for good after
    printing its traceback. Stopped by torch's message here, and any worker still busy after
    torch's join timeout killed."""
    for iterator in list(_LIVE_WORKER_ITERATORS):
        _stop_workers(iterator)
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():
                worker.kill()
                worker.join()


class BatchKeys:
    """A sampler of whole-batch keys: this epoch's keys from the resume point (`start`) on, read
    when iteration starts. It holds the keys itself, not the loader, so that a dropped loader is
    freed at once, workers and all, not left in a loader -> DataLoader -> sampler -> loader
    cycle for the collector."""

    def __init__(self):
        self.keys: list = []
        self.start = 0

    def __iter__(self):
        return iter(self.keys[self.start:])

    def __len__(self) -> int:
        return len(self.keys) - self.start


def prepare_worker(worker_id: int = 0) -> None:
    """In DataLoader workers: torchrun and Slurm signal a rank's whole process group, and a
    worker killed by it would fail the batches its rank still takes before its checkpoint, so
    the stop signals are ignored and the rank stops its workers itself. A worker whose rank
    dies (SIGKILL, the out-of-memory killer) is killed with it (Linux's parent-death signal):
    torch's own watch of the parent takes seconds, in which an orphan printed tracebacks from
    the fd-passing thread of multiprocessing into its dead rank's log."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:                   # the rank died before the line above took effect
            os._exit(1)


def torch_dataloader(dataset, spec: LoaderSpec, **kwargs) -> DataLoader:
    """A DataLoader whose items are whole uint8 batches made in the workers."""
    workers = spec.num_workers
    dataloader = _WorkersStopWhenFreed(dataset, batch_size=None, num_workers=workers,
                                       pin_memory=spec.device.startswith("cuda"), persistent_workers=workers > 0,
                                       prefetch_factor=4 if workers else None, worker_init_fn=prepare_worker,
                                       **kwargs)
    return dataloader
