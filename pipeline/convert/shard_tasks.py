"""Writing shards of a plan (pipeline/convert/plan.py): the one task every executor runs, whether it
writes all of a split's shards in one process pool, one part of N, one shard on a Ray worker, or a
damaged shard again. The samples of the shards asked for are read and encoded in the source's
order, on `num_workers` processes, put in their write order through buckets on disk
(pipeline/convert/reorder.py), and written one shard at a time into a staging folder. Each finished
shard is handed to `finished(number, ShardDone)`, which renames its files into place and records it
(pipeline/convert/progress_files.py), so a run killed at any moment loses only the shards it was
writing.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from pipeline.convert.images import describe_failure, encode_jpeg, load_rgb, open_image, probe, usable_as_is
from pipeline.convert.in_progress import ShardDone
from pipeline.convert.options import WdsOptions
from pipeline.convert.parallel import map_samples
from pipeline.convert.plan import ShardPlan
from pipeline.convert.reorder import Reorder
from pipeline.convert.sources import Missing, Source
from pipeline.decode.jpeg_roi import JPEGError, transcode
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.wds_shards import ShardWriter, sample_members
from pipeline.progress import Progress


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


def write_shards(source: Source, plan: ShardPlan, numbers: Iterable[int], places: np.ndarray | None,
                 options: WdsOptions, num_workers: int, staging: Path,
                 finished: Callable[[int, ShardDone], None], progress: Progress | None = None) -> None:
    """Write the shards `numbers` of `plan` from `source`, whose samples sit at write positions
    `places` (None: a sample's index is its place), each into `staging` then to `finished` (a
    shard whose every sample was skipped too, with no record); samples counted on `progress`
    where given (else a bar of their own)."""
    numbers = sorted(set(numbers))
    if not numbers:
        return
    wanted = np.zeros(plan.shards, bool)
    wanted[numbers] = True
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        skips: dict[int, list[Skipped]] = {}      # by shard
        labels = source.entries(plan.split).labels
        unfinished = iter(numbers)
        writer, markers = None, 0

        def finish(shard: int) -> None:
            """Hand on every wanted shard up to `shard` (those before it had no usable sample)."""
            nonlocal writer, markers
            for number in unfinished:
                written = writer is not None and writer.first_shard == number
                if written:
                    writer.close()
                done = ShardDone(writer.shards[0] if written else None,
                                 sorted(skips.pop(number, []), key=lambda skip: skip.entry), markers if written else 0)
                finished(number, done)
                if number == shard:
                    break
            writer, markers = None, 0

        for place, index, encoded in _in_write_order(source, plan, wanted, places, options, num_workers,
                                                     staging / ".reorder", skips, progress):
            shard = place // plan.per_shard
            if writer is None or writer.first_shard != shard:
                if writer is not None:
                    finish(writer.first_shard)
                writer = ShardWriter(staging, 1 << 62, first_shard=shard)
            markers += encoded.restart_markers
            writer.add(plan.key(place), sample_members(encoded.jpeg, int(labels[index])))
        finish(numbers[-1])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _in_write_order(source: Source, plan: ShardPlan, wanted: np.ndarray, places: np.ndarray | None,
                    options: WdsOptions, num_workers: int, scratch: Path, skips: dict[int, list[Skipped]],
                    progress: Progress | None) -> Iterator[tuple[int, int, Encoded]]:
    """(place, index, encoded) of each usable sample of the `wanted` shards, in place order; what
    cannot be used goes to `skips`, by shard, before any sample of a later shard comes. Read and
    encoded in the source's order."""
    def place_of(indices: np.ndarray) -> np.ndarray:
        return indices if places is None else np.asarray(places[indices])

    blocks = (block[wanted[place_of(block) // plan.per_shard]] for block in source.blocks(plan.split))
    blocks = (block for block in blocks if len(block))
    results = map_samples(source, plan.split, encoder(options), num_workers, f"{plan.split}: encoding",
                          blocks=blocks, total=plan.samples_in(np.flatnonzero(wanted)), progress=progress)

    def usable() -> Iterator[tuple[int, int, Encoded]]:
        for index, result in results:
            place = index if places is None else int(places[index])
            if isinstance(result, Missing):
                result = Encoded(None, result.reason)
            if result.jpeg is None:
                skip = Skipped("", result.reason, source.entry_number(plan.split, index))   # named when merged
                skips.setdefault(place // plan.per_shard, []).append(skip)
            else:
                yield place, index, result
    if not plan.shuffled:
        yield from usable()
        return
    reorder = Reorder(scratch, plan.count, source.entries(plan.split).mean_size())
    for place, index, result in usable():
        reorder.put(place, index, result.jpeg, result.restart_markers)
    for place, index, flags, jpeg in reorder.taken():
        yield place, index, Encoded(jpeg, restart_markers=bool(flags))
