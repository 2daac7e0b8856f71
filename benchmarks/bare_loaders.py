"""The loaders a user writes straight from FFCV's and DALI's own examples, and the decode-only
bounds: the references `benchmarks/loaders.py` measures our backends against.

- `ffcv_bare`: `ffcv.loader.Loader` with FFCV's RandomResizedCrop/CenterCrop decoder, flip and
  NormalizeImage (placed before ToTensor: after it, FFCV's CPU loader hangs).
- `dali_bare`: DALI's ResNet-50 example pipeline over the WebDataset shards (reader-side
  shuffle, `image_random_crop` or a center crop, resize, `crop_mirror_normalize`).
- `decode_bound`: every stored JPEG decoded at full size, no augmentation, one process per
  core, one library call per image: simplejpeg (libjpeg-turbo 3.1, bundled) and this
  project's `jpeg_roi` at full size (the system libjpeg-turbo that Pillow-SIMD and FFCV
  link). The faster of the two is the bound.
- `decode_floor`: what no decode of the loader's crops can go below: the decode engine entering
  each JPEG at its crop's MCUs (the restart markers) and Huffman-decoding them into
  coefficients, nothing more (no IDCT, colour conversion, resize or write), in as many threads
  as the loader has. Per split and resolution (the DCT scale moves the margin a little). Its
  `decode` stage's CPU time is the engine's entropy decoding of the same crops
  (`benchmarks/loaders.py`'s `split_decode_stage`).
- `gpu_decode_bound`: DALI's nvJPEG (`decoders.image`, device "mixed") on the same bytes, no
  augmentation (CUDA only).
Each takes the benchmark's config dict and returns an iterable of batches or a rate.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np

from pipeline.transforms.crops import CENTER_CROP_RATIO
from pipeline.datasets import read_converted


def ffcv_bare(config: dict):
    import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
    from pipeline.spec import IMAGENET_MEAN, IMAGENET_STD   # not at the top: torch comes with it, and decode_bound runs without
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    side, train = config["resolution"], config["split"] == "train"
    beton = read_converted(config["path"], config["split"], "ffcv").files[0]
    mean, std = np.array(IMAGENET_MEAN) * 255, np.array(IMAGENET_STD) * 255
    decode = [RandomResizedCropRGBImageDecoder((side, side)), RandomHorizontalFlip()] if train else \
        [CenterCropRGBImageDecoder((side, side), ratio=CENTER_CROP_RATIO)]
    return Loader(str(beton), batch_size=config["batch_size"], num_workers=config["workers"], os_cache=True,
                  order=OrderOption.RANDOM if train else OrderOption.SEQUENTIAL, drop_last=train,
                  pipelines={"image": [*decode, NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()],
                             "label": [IntDecoder(), ToTensor(), Squeeze()]})


def dali_bare(config: dict):
    import torch
    from pipeline.spec import IMAGENET_MEAN, IMAGENET_STD
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    side, train = config["resolution"], config["split"] == "train"
    shards = read_converted(config["path"], config["split"], "webdataset").shards
    cuda = torch.cuda.is_available()

    @pipeline_def
    def graph():
        jpegs, labels = fn.readers.webdataset(paths=[str(s.tar) for s in shards], index_paths=[str(s.index) for s in shards],
                                              ext=["jpg", "lbl"], dtypes=[types.UINT8, types.INT32],
                                              random_shuffle=train, pad_last_batch=True, name="reader")
        device = "mixed" if cuda else "cpu"
        if train:
            images = fn.decoders.image_random_crop(jpegs, device=device, output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3])
            images = fn.resize(images, resize_x=side, resize_y=side)
        else:
            images = fn.decoders.image(jpegs, device=device, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(side / CENTER_CROP_RATIO))
        images = fn.crop_mirror_normalize(images, crop=(side, side), dtype=types.FLOAT, output_layout="CHW",
                                          mean=[255 * m for m in IMAGENET_MEAN], std=[255 * s for s in IMAGENET_STD],
                                          mirror=fn.random.coin_flip() if train else 0)
        return images, labels

    pipe = graph(batch_size=config["batch_size"], num_threads=config["workers"], device_id=0 if cuda else None, seed=0)
    pipe.build()
    return DALIGenericIterator([pipe], ["images", "labels"], reader_name="reader", auto_reset=True,
                               last_batch_policy=LastBatchPolicy.DROP if train else LastBatchPolicy.PARTIAL)


def stored_jpegs(path: str, split: str) -> list[bytes]:
    """Every stored JPEG of a WebDataset conversion's split, in memory."""
    jpegs = []
    for shard in read_converted(path, split, "webdataset").shards:
        with open(shard.tar, "rb") as stream:
            jpegs += [os.pread(stream.fileno(), size, at) for at, size, _ in shard.members.tolist()]
    return jpegs


def _decode_all(args) -> float:
    decoder, jpegs, rounds = args
    if decoder == "simplejpeg":
        import simplejpeg
        decode = simplejpeg.decode_jpeg
    else:
        from pipeline.decode import jpeg_roi

        def decode(data):
            width, height = jpeg_roi.image_size(data)
            return jpeg_roi.decode_region(data, width, height, (0, 0, height, width), 1, 0)
    started = time.perf_counter()
    for _ in range(rounds):
        for data in jpegs:
            decode(data)
    return time.perf_counter() - started


def decode_bound(path: str, split: str, rounds: int = 3) -> dict:
    """Full-size decode img/s of the stored pixels on all cores, per decoder and per byte form,
    and the best of them. The forms: the JPEGs as stored, and the same coefficients rewritten
    without restart markers (convert_wds.py stores a marker after every MCU, which costs a full
    decode a few %): the bound is the fastest way to decode those pixels, whichever it is."""
    from pipeline.decode.jpeg_roi import JPEGError, transcode

    def without_markers(data: bytes) -> bytes:
        try:
            return transcode(data, restart_markers=False)
        except JPEGError:
            return data
    decoders = ["jpeg_roi"]
    try:
        import simplejpeg  # noqa: F401
        decoders.insert(0, "simplejpeg")
    except ImportError:
        pass
    stored, cores = stored_jpegs(path, split), len(os.sched_getaffinity(0))   # pinned by --cores, else all
    rates = {}
    for form, jpegs in (("stored", stored), ("no markers", [without_markers(data) for data in stored])):
        for decoder in decoders:
            parts = [(decoder, jpegs[i::cores], 1) for i in range(cores)]
            with multiprocessing.get_context("fork").Pool(cores) as pool:
                pool.map(_decode_all, parts)                      # warm-up: page in code and data
                seconds = max(pool.map(_decode_all, [(d, part, rounds) for d, part, _ in parts]))
            rates[f"{decoder}, {form}"] = len(stored) * rounds / seconds
    best = max(rates, key=rates.get)
    return {"img_per_s": rates[best], "decoder": best, "by_decoder": rates, "images_per_epoch": len(stored)}


def engine_epoch(shards, spec, side: int, out: np.ndarray, threads: int, epoch: int = 0, library=None,
                 entropy_only: bool = False) -> tuple[float, np.ndarray]:
    """Wall seconds for the decode engine to make every sample of `shards` (a `StoredShards`) once,
    in batches of `out`'s size into `out` (one buffer reused, as the loader reuses its ring's), and
    the stage CPU seconds summed (`pipeline.decode.engine.STAGES` of the engine `library` is)."""
    from pipeline.decode import engine as decode_engine
    ids, batch_size = np.arange(len(shards)), len(out)
    stages = np.zeros(len(decode_engine.STAGES))
    started = time.perf_counter()
    for first in range(0, len(ids), batch_size):
        with shards.located(ids[first:first + batch_size]) as samples:
            decoded = decode_engine.decode_batch(samples, spec, epoch, side, out, threads, library=library,
                                                 entropy_only=entropy_only)
        if decoded.failed or decoded.damaged:
            raise RuntimeError(f"the engine refused samples: {(decoded.failed + decoded.damaged)[:2]}")
        stages += decoded.stage_seconds
    return time.perf_counter() - started, stages


def decode_floor(path: str, split: str, side: int, threads: int, batch_size: int, rounds: int = 3) -> dict:
    """img/s of the decode engine's `entropy_only` pass over every sample of a webdataset split,
    from the page cache: the median of `rounds` epochs after a warm-up one."""
    from pipeline import LoaderSpec
    from pipeline.decode import engine as decode_engine
    from pipeline.shards.index import StoredShards
    shards = StoredShards(read_converted(path, split, "webdataset").shards)
    spec = LoaderSpec("webdataset", path=path, split=split)
    out = np.empty((batch_size, *decode_engine.out_shape(spec, side), 3), np.uint8)    # written to by no sample
    count = len(shards)
    try:
        epochs = [engine_epoch(shards, spec, side, out, threads, epoch, entropy_only=True) for epoch in range(rounds + 1)]
    finally:
        shards.close()
    spent = sum(stages for _, stages in epochs[1:])
    return {"img_per_s": count / float(np.median([seconds for seconds, _ in epochs[1:]])), "images_per_epoch": count,
            "engine_us_per_image": {stage: 1e6 * spent[k] / (count * rounds) for k, stage in enumerate(decode_engine.STAGES)
                                    if stage in ("read", "entry", "decode")}}


def gpu_decode_bound(path: str, split: str, batch_size: int, rounds: int = 3) -> dict:
    """nvJPEG (DALI `mixed`) full-size decode img/s of the stored JPEGs, fed from memory."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    jpegs = [np.frombuffer(data, np.uint8) for data in stored_jpegs(path, split)]
    batches = [jpegs[i:i + batch_size] for i in range(0, len(jpegs) - batch_size + 1, batch_size)]

    @pipeline_def
    def graph():
        return fn.decoders.image(fn.external_source(name="jpegs", dtype=types.UINT8), device="mixed",
                                 output_type=types.RGB, hw_decoder_load=0.65)

    pipe = graph(batch_size=batch_size, num_threads=os.cpu_count(), device_id=0, prefetch_queue_depth=1)
    pipe.build()

    def run_once() -> float:
        started = time.perf_counter()
        for batch in batches:
            pipe.feed_input("jpegs", batch)
            pipe.run()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run_once()
    seconds = sorted(run_once() for _ in range(rounds))[rounds // 2]
    return {"img_per_s": len(batches) * batch_size / seconds, "decoder": "nvjpeg (dali mixed)",
            "images_per_epoch": len(batches) * batch_size}


BARE = {"ffcv-bare": ffcv_bare, "dali-bare": dali_bare}
