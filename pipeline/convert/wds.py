"""Convert a dataset, in the form you hold it, to WebDataset shards: OUT/<split>/shard-NNNNNN.tar + .idx.
(The forms it reads: pipeline/convert/sources/.)

    python pipeline/convert/wds.py SRC OUT [--max-resolution 512] [--shard-size-mb 256] ...

What a shard holds (each sample's `.jpg`, `.cls` and `.lbl`, the `.idx` index, the per-sample
checksums) is pipeline/formats/wds_shards.py's, which writes and reads it. The manifest's
`members` names the members for the loaders.

Resize semantics are the FFCV converter's (longest side at most --max-resolution, OpenCV's
INTER_AREA, FFCV's size rounding). An RGB JPEG that needs no resize and no EXIF rotation
is stored as it is, without a lossy re-encode; anything else is re-encoded at
--jpeg-quality. Either way it is then rewritten losslessly with a restart marker after every
MCU (the same pixels, a few % more bytes; --no-restart-markers stores it without): the
decode engine then decodes only the MCUs under a crop (pipeline/native/jpeg_restarts.h). Train
samples are written in a seeded random order, because WebDataset readers only shuffle shards
and a buffer; val stays in the source's order. Samples are read and encoded in the source's
order and put in the write order through buckets on disk (pipeline/convert/reorder.py).
Tars are deterministic: the same input and options give the same bytes.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.convert.cli import common_parser, main_guard, run_options
from pipeline.convert.images import describe_failure, encode_jpeg, load_rgb, open_image, probe, usable_as_is
from pipeline.convert.options import RunOptions, WdsOptions
from pipeline.convert.parallel import map_samples
from pipeline.convert.reorder import Reorder
from pipeline.convert.sources import Missing, Source
from pipeline.convert.sources.entries import CHUNK
from pipeline.convert.splits import SplitResult, run_conversion
from pipeline.storage.atomic_files import replace_atomically
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.wds_shards import MEMBERS, SAMPLE_CHECKSUM, ShardWriter, sample_members
from pipeline.decode.jpeg_roi import JPEGError, transcode

log = logging.getLogger(__name__)


@dataclass
class Encoded:
    jpeg: bytes | None        # None when the sample could not be used
    reason: str | None = None
    restart_markers: bool = False


def encode_sample(data: bytes, max_resolution: int | None, jpeg_quality: int, restart_markers: bool) -> Encoded:
    try:
        with open_image(data) as image:
            as_is = usable_as_is(image, max_resolution)
        if not as_is:
            jpeg = encode_jpeg(load_rgb(data, max_resolution), jpeg_quality)
        else:
            # Stored unchanged, so a full decode would only check it: probe's 1/8-scale decode
            # reads the whole stream at a fraction of the cost.
            reason = probe(data)
            if reason:
                return Encoded(None, reason)
            jpeg = bytes(data)
    except Exception as error:  # noqa: BLE001 - any failure of any decoder is a skip
        return Encoded(None, describe_failure(error))
    if restart_markers:
        try:
            return Encoded(transcode(jpeg), restart_markers=True)
        except JPEGError:   # libjpeg warns about it (Pillow did not): stored as it is, decoded whole
            pass
    return Encoded(jpeg)


def encoder(options: WdsOptions):
    """`encode_sample` with the format's options (the command line's, or a manifest's `params`)."""
    return partial(encode_sample, max_resolution=options.max_resolution or None, jpeg_quality=options.jpeg_quality,
                   restart_markers=options.restart_markers)


def write_order(count: int, split: str, seed: int, folder: Path | None = None) -> np.ndarray | None:
    """The samples' indices in the order they are written: for train a seeded permutation (in a
    file under `folder` where given, so that memory does not grow with the count); None (the
    source's order) for the other splits."""
    if split != "train":
        return None
    if folder is None:
        return np.random.default_rng(seed).permutation(count)
    folder.mkdir(parents=True, exist_ok=True)
    order = np.memmap(folder / "order.bin", np.int64, mode="w+", shape=(max(count, 1),))[:count]
    for at in range(0, count, CHUNK):
        order[at:at + CHUNK] = np.arange(at, min(at + CHUNK, count))
    np.random.default_rng(seed).shuffle(order)      # permutation(count)'s very shuffle, on the file
    return order


def places(order: np.ndarray, folder: Path) -> np.ndarray:
    """Each sample's place in the write order (the inverse of `order`), in a file under `folder`."""
    place = np.memmap(folder / "place.bin", np.int64, mode="w+", shape=(max(len(order), 1),))[:len(order)]
    for at in range(0, len(order), CHUNK):
        place[order[at:at + CHUNK]] = np.arange(at, min(at + CHUNK, len(order)))
    return place


def encoded_in_write_order(source: Source, split: str, options: WdsOptions, num_workers: int, scratch: Path,
                           skipped: list[Skipped]) -> Iterator[tuple[int, Encoded]]:
    """(index, encoded sample) of each usable sample of the split in the write order; what cannot
    be used goes to `skipped`, in source order. Read and encoded in the source's order."""
    entries = source.entries(split)
    results = map_samples(source, split, encoder(options), num_workers, f"{split}: encoding")

    def usable() -> Iterator[tuple[int, Encoded]]:
        for index, result in results:
            if isinstance(result, Missing):
                result = Encoded(None, result.reason)
            if result.jpeg is None:
                skipped.append(Skipped(source.name(split, index), result.reason, index))
            else:
                yield index, result
    order = write_order(len(entries), split, options.seed, scratch)
    if order is None:
        yield from usable()
        return
    place = places(order, scratch)
    reorder = Reorder(scratch / "buckets", len(order), entries.mean_size())
    for index, result in usable():
        reorder.put(int(place[index]), result.jpeg, result.restart_markers)
    del place
    for position, flags, jpeg in reorder.taken():
        yield int(order[position]), Encoded(jpeg, restart_markers=bool(flags))


def convert_split(options: WdsOptions, run: RunOptions, source: Source, split: str, out: Path) -> SplitResult:
    final = out / split
    tmp = out / f".{split}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        labels = source.entries(split).labels
        writer, skipped, with_markers = ShardWriter(tmp, int(options.shard_size_mb * 2**20)), [], 0
        for index, encoded in encoded_in_write_order(source, split, options, run.num_workers, tmp / ".reorder",
                                                     skipped):
            with_markers += encoded.restart_markers
            writer.add(f"{writer.count:09d}", sample_members(encoded.jpeg, int(labels[index])))
        writer.close()
        shutil.rmtree(tmp / ".reorder", ignore_errors=True)
        count = writer.count
        if not count:
            log.warning("warning: %s: no decodable images; %s not written", split, final)
            return SplitResult(0, skipped)
        replace_atomically(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = [f"{split}/{shard[kind]}" for shard in writer.shards for kind in ("tar", "index", "checksums")]
    return SplitResult(count, skipped, files, {"shards": writer.shards, "members": MEMBERS, "restart_markers": with_markers,
                                               "sample_checksum": SAMPLE_CHECKSUM,
                                               "bytes": sum((out / f).stat().st_size for f in files)})


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--shard-size-mb", type=float, default=256, help="largest shard size in MiB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train split's write order")
    parser.add_argument("--restart-markers", action=argparse.BooleanOptionalAction, default=True,
                        help="store each JPEG with a restart marker after every MCU (lossless), so the decode "
                             "engine decodes only the MCUs a crop needs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = run_options(args)
    options = WdsOptions(max_resolution=args.max_resolution, jpeg_quality=args.jpeg_quality,
                         shard_size_mb=args.shard_size_mb, seed=args.seed, restart_markers=args.restart_markers)
    return run_conversion(run, options, "webdataset", ("webdataset",), convert_split)


def command(argv: list[str] | None = None) -> None:
    """The command line (tools/convert_wds.py, fastpipe-convert-wds): a conversion's error is one
    line on stderr and its exit code."""
    main_guard(lambda: main(argv))


if __name__ == "__main__":
    command()
