"""The batch decode engine (`decode_engine.c`): a whole batch of stored JPEGs read, cropped,
decoded at the smallest useful DCT scale, resized, flipped and ColOut'ed into one preallocated
uint8 batch by native threads, the GIL released throughout.

Python's part per sample is what must match the other backends bit for bit: the uniforms of
the sample's crop and flip (`pipeline.transforms.crops`, the same seeds) and ColOut's kept rows and
columns (`pipeline.transforms.colout.kept_indices`, the same generator). Everything else runs in C. A
sample libjpeg refuses (CMYK, damaged) comes back marked, for the caller to hand to Pillow.

DCT scales: libjpeg-turbo decodes at M/8 for M = 1..16. A crop is decoded at the smallest
allowed M that leaves its shorter side at least `oversample` x the target, and resized from
there with Pillow's bilinear filter. Only M = 1, 2, 4, 8 are allowed by default: their IDCTs
are SIMD in libjpeg-turbo, the others plain C, and on the photos sample (2-core AMD EPYC) the
others made the decode slower, not faster, for pixels further from a full decode (val 160:
worst image 10.3 of 255 from a full decode's with M = 1..8, 6.0 with 1, 2, 4, 8).
"""
from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.transforms.colout import kept_indices, kept_size, sample_generator
from pipeline.transforms.crops import UNIFORMS_PER_SAMPLE, sample_uniforms
from pipeline.native.library import load_library, source
from pipeline.spec import LoaderSpec

SOURCE = source("decode_engine.c")
MESSAGE_SIZE = 160
ALLOWED_SCALES = (1, 2, 4, 8)
OVERSAMPLE = 1.0
STAGES = ("read", "entry", "decode", "resize_across", "resize_down", "write")

_p = ctypes.c_void_p


class _BatchJob(ctypes.Structure):
    """decode_engine.c's batch_job, field for field."""
    _fields_ = [("count", ctypes.c_int), ("side", ctypes.c_int), ("out_rows", ctypes.c_int),
                ("out_cols", ctypes.c_int), ("train", ctypes.c_int), ("threads", ctypes.c_int),
                ("oversample_x100", ctypes.c_int), ("restarts", ctypes.c_int), ("scale_mask", ctypes.c_uint),
                ("scale_lo", ctypes.c_double), ("scale_hi", ctypes.c_double), ("log_ratio_lo", ctypes.c_double),
                ("log_ratio_hi", ctypes.c_double), ("val_crop_ratio", ctypes.c_double),
                ("fds", _p), ("bases", _p), ("image_at", _p), ("image_size", _p), ("label_at", _p), ("checksums", _p),
                ("uniforms", _p), ("uniforms_per_sample", ctypes.c_int), ("sample_ids", _p),
                ("seed", ctypes.c_longlong), ("epoch", ctypes.c_longlong), ("keep_rows", _p), ("keep_cols", _p),
                ("out", _p), ("out_float", _p), ("scale", ctypes.c_float * 3), ("offset", ctypes.c_float * 3),
                ("labels", _p), ("status", _p), ("scale_used", _p),
                ("messages", _p), ("message_size", ctypes.c_int), ("stage_seconds", _p), ("next", ctypes.c_int),
                ("entropy_only", ctypes.c_int)]


def load(flags: tuple[str, ...] = ("-march=native",), library: Path | None = None) -> ctypes.CDLL:
    """The engine compiled for this machine's CPU (its SIMD paths), or with other `flags` into
    another `library` file (the tests build the plain-C one)."""
    library = load_library(SOURCE, libraries=("jpeg", "z", "pthread", "m"), flags=flags, library=library,
                           check="engine_check")
    library.engine_decode_batch.argtypes = [ctypes.POINTER(_BatchJob)]
    library.engine_start_batch.argtypes = [ctypes.POINTER(_BatchJob)]
    library.engine_start_batch.restype = ctypes.c_void_p
    library.engine_finish_batch.argtypes = [ctypes.c_void_p]
    library.engine_finish_batch.restype = None
    int_p = ctypes.POINTER(ctypes.c_int)
    library.engine_crop_box.argtypes = [ctypes.POINTER(_BatchJob), ctypes.c_int, ctypes.c_int, ctypes.c_int, int_p, int_p]
    library.engine_stages.restype = ctypes.c_int
    library.engine_crc32.argtypes = [ctypes.c_uint, ctypes.c_char_p, ctypes.c_size_t]
    library.engine_crc32.restype = ctypes.c_uint
    library.engine_uniforms.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p,
                                        ctypes.c_int]
    if library.engine_stages() != len(STAGES):
        raise RuntimeError(f"{SOURCE.name} has {library.engine_stages()} stages where {__name__}.STAGES names "
                           f"{len(STAGES)}: make the two agree")
    return library


_library = load()


@dataclass
class StoredSamples:
    """Where a batch's samples lie: per sample, its id in the split's stored order, the open
    file holding it (or the address of memory holding it, which the caller keeps alive while
    the batch is made), and the offsets of its image and label in that file or memory."""
    sample_ids: np.ndarray      # int64
    fds: np.ndarray             # int32; ignored where bases is not 0
    image_at: np.ndarray        # int64
    image_size: np.ndarray      # int64
    label_at: np.ndarray        # int64
    bases: np.ndarray | None = None     # uint64 addresses, 0 where the sample is read from its fd
    checksums: np.ndarray | None = None     # uint32, each sample's recorded CRC-32; None: unchecked


@dataclass
class DecodedBatch:
    labels: np.ndarray          # int32, per sample
    failed: list[tuple[int, str]]   # (position in the batch, libjpeg's message) of samples left to Pillow
    damaged: list[tuple[int, str]]  # (position, why) of samples whose bytes fail their recorded checksum
    scales: np.ndarray          # the M of the DCT scale M/8 each sample was decoded at
    stage_seconds: np.ndarray   # (len(STAGES),) CPU seconds summed over the batch's samples
    python_seconds: float       # this thread's CPU time outside the C call (the uniforms, ColOut's draws)


def out_shape(spec: LoaderSpec, side: int) -> tuple[int, int]:
    """(rows, cols) of each image the engine writes for this spec at this side."""
    if spec.colout and spec.train:
        return kept_size(side, side, *spec.colout)
    return side, side


def decode_batch(samples: StoredSamples, spec: LoaderSpec, epoch: int, side: int, out: np.ndarray,
                 threads: int, scales=ALLOWED_SCALES, oversample: float = OVERSAMPLE,
                 library: ctypes.CDLL | None = None, restarts: bool = True, entropy_only: bool = False) -> DecodedBatch:
    """Makes len(samples.sample_ids) images into out[:count], an (N, rows, cols, 3) C-ordered
    array: uint8 pixels, or float32 normalized with spec.mean and spec.std. With `restarts`,
    a JPEG with a restart marker after every MCU is entropy-decoded only around its crop
    (jpeg_restarts.h: the same pixels; False decodes every MCU above and beside it too).
    `entropy_only` stops each sample once the MCUs it would decode are Huffman-decoded into
    coefficients (no pixels are written): what a decode of that crop cannot go below.
    `library`: another build of the engine (an older one among them: benchmarks/engine_versions.py)."""
    batch = _BatchCall(samples, spec, epoch, side, out, threads, scales, oversample, restarts, entropy_only)
    (library or _library).engine_decode_batch(ctypes.byref(batch.job))
    return batch.decoded()


class StartedBatch:
    """A batch `decode_batch` would make, handed to the engine's threads (kept from batch to
    batch) and not waited for: the caller prepares the next batch, or finishes the last, meanwhile.
    `result()` waits and gives the DecodedBatch. Until then, `out` and the samples' memory are
    the engine's; a StartedBatch dropped unawaited is waited for."""

    def __init__(self, samples: StoredSamples, spec: LoaderSpec, epoch: int, side: int, out: np.ndarray,
                 threads: int, scales=ALLOWED_SCALES, oversample: float = OVERSAMPLE):
        self._batch = _BatchCall(samples, spec, epoch, side, out, threads, scales, oversample, True, False)
        self._task = _library.engine_start_batch(ctypes.byref(self._batch.job))
        if not self._task:
            raise MemoryError("the decode engine could not start a batch: out of memory")
        self._decoded: DecodedBatch | None = None

    def result(self) -> DecodedBatch:
        if self._decoded is None:
            _library.engine_finish_batch(self._task)
            self._decoded = self._batch.decoded()
        return self._decoded

    def __del__(self):
        if getattr(self, "_task", None) and self._decoded is None:
            self.result()


class _BatchCall:
    """One call's job and the arrays it points into, which must live until the engine is done."""

    def __init__(self, samples: StoredSamples, spec: LoaderSpec, epoch: int, side: int, out: np.ndarray,
                 threads: int, scales, oversample: float, restarts: bool, entropy_only: bool):
        started = time.thread_time()
        count = len(samples.sample_ids)
        rows, cols = out_shape(spec, side)
        if out.dtype not in (np.uint8, np.float32) or out.shape[1:] != (rows, cols, 3) or out.shape[0] < count \
                or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-ordered uint8 or float32 array of shape (>={count}, {rows}, {cols}, 3), "
                             f"got {out.dtype} {out.shape}")
        normalized = out.dtype == np.float32
        std = np.asarray(spec.std, np.float64) * 255
        arrays = dict(fds=np.ascontiguousarray(samples.fds, np.int32),
                      image_at=np.ascontiguousarray(samples.image_at, np.int64),
                      image_size=np.ascontiguousarray(samples.image_size, np.int64),
                      label_at=np.ascontiguousarray(samples.label_at, np.int64),
                      bases=np.ascontiguousarray(samples.bases if samples.bases is not None else np.zeros(count), np.uint64),
                      sample_ids=np.ascontiguousarray(samples.sample_ids, np.int64),
                      labels=np.empty(count, np.int32), status=np.empty(count, np.int32),
                      scale_used=np.zeros(count, np.int32), stage_seconds=np.zeros((count, len(STAGES))))
        if samples.checksums is not None:
            arrays["checksums"] = np.ascontiguousarray(samples.checksums, np.uint32)
        messages = ctypes.create_string_buffer(MESSAGE_SIZE * max(count, 1))
        keep_rows = keep_cols = uniforms = None
        if spec.train and spec.colout:      # ColOut's generator is seeded from the uniforms: Python draws them
            uniforms = _uniforms(spec, epoch, samples.sample_ids)
            kept = [kept_indices(side, side, *spec.colout, sample_generator(u)) for u in uniforms]
            keep_rows = np.array([r for r, _ in kept], np.int32).reshape(count, rows)
            keep_cols = np.array([c for _, c in kept], np.int32).reshape(count, cols)
        sample_ids = arrays.pop("sample_ids")
        job = _job(spec, side, uniforms, epoch, sample_ids, count=count, out_rows=rows, out_cols=cols, threads=max(1, threads),
                   oversample_x100=round(100 * oversample), restarts=int(restarts), entropy_only=int(entropy_only),
                   scale_mask=sum(1 << m for m in scales),
                   scale=(ctypes.c_float * 3)(*(1 / std)), offset=(ctypes.c_float * 3)(*(-np.asarray(spec.mean) / spec.std)),
                   out_float=out.ctypes.data if normalized else None,
                   keep_rows=keep_rows.ctypes.data if keep_rows is not None else None,
                   keep_cols=keep_cols.ctypes.data if keep_cols is not None else None,
                   out=None if normalized else out.ctypes.data, messages=ctypes.addressof(messages), message_size=MESSAGE_SIZE,
                   **{name: array.ctypes.data for name, array in arrays.items()})
        python_seconds = time.thread_time() - started
        self.job, self.arrays, self.messages, self.python_seconds = job, arrays, messages, python_seconds
        self.keep = (keep_rows, keep_cols, uniforms, sample_ids, samples, out)

    def decoded(self) -> DecodedBatch:
        """What the engine made of the batch, once it is done."""
        messages, status = self.messages, self.arrays["status"]

        def said(i) -> str:
            return messages.raw[i * MESSAGE_SIZE:(i + 1) * MESSAGE_SIZE].split(b"\0", 1)[0].decode(errors="replace")
        return DecodedBatch(self.arrays["labels"], [(int(i), said(i)) for i in np.flatnonzero(status == -1)],
                            [(int(i), said(i)) for i in np.flatnonzero(status == -2)], self.arrays["scale_used"],
                            self.arrays["stage_seconds"].sum(0), self.python_seconds)


def crop_boxes(spec: LoaderSpec, epoch: int, sample_ids, sizes, side: int = 64) -> list[tuple[tuple[int, ...], bool]]:
    """The (top, left, height, width) box and flip the engine draws (uniforms included) for each
    sample of a (height, width) image: what the tests hold against `pipeline.transforms.crops`."""
    ids = np.ascontiguousarray(sample_ids, np.int64)
    job = _job(spec, side, None, epoch, ids, count=len(ids))
    boxes = []
    for index, (height, width) in enumerate(sizes):
        box, flip = (ctypes.c_int * 4)(), ctypes.c_int()
        _library.engine_crop_box(ctypes.byref(job), index, height, width, box, ctypes.byref(flip))
        boxes.append((tuple(box), bool(flip.value)))
    return boxes


def engine_uniforms(seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """The uniforms the engine draws for one sample: `pipeline.transforms.crops.sample_uniforms`'s, in C."""
    out = np.empty(UNIFORMS_PER_SAMPLE)
    _library.engine_uniforms(seed, epoch, sample_id, out.ctypes.data, len(out))
    return out


def _uniforms(spec: LoaderSpec, epoch: int, sample_ids: np.ndarray) -> np.ndarray | None:
    if not spec.train:
        return None
    if not len(sample_ids):
        return np.empty((0, UNIFORMS_PER_SAMPLE))
    return np.stack([sample_uniforms(spec.seed, epoch, int(i)) for i in sample_ids])


def _job(spec: LoaderSpec, side: int, uniforms: np.ndarray | None, epoch: int, sample_ids: np.ndarray,
         **fields) -> _BatchJob:
    """The crop parameters every sample shares, and `fields`; `uniforms` (None: the engine
    draws them from the sample ids) and `sample_ids` (int64) must outlive the job."""
    return _BatchJob(side=side, train=int(spec.train), scale_lo=spec.scale[0], scale_hi=spec.scale[1],
                     log_ratio_lo=math.log(spec.ratio[0]), log_ratio_hi=math.log(spec.ratio[1]),
                     val_crop_ratio=spec.val_crop_ratio, uniforms_per_sample=UNIFORMS_PER_SAMPLE,
                     uniforms=uniforms.ctypes.data if uniforms is not None else None,
                     sample_ids=sample_ids.ctypes.data, seed=spec.seed, epoch=epoch, **fields)
