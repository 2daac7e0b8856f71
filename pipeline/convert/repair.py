"""Converting again only what a check found damaged (tools/verify_dataset.py --repair SRC): the
WebDataset shards whose tar, index or checksums failed, or the FFCV split whose .beton did, from
SRC, the source the dataset was converted from, read in the form and with the options its manifest
records.

A WebDataset shard is rebuilt by running its task of the conversion's plan again
(pipeline/convert/plan.py); for a dataset converted before shards were planned, from the very
samples it held: the split's seeded write order, less the samples the manifest lists as skipped,
cut at the shard's first sample and count, with the same keys. Both converters are deterministic,
so a rebuilt tar or .beton has the manifest's sha256 unless the encoding libraries changed since
(or, for a .beton, it was converted before its layout was made canonical); then the new bytes are
kept only if SRC's split is the one converted (its fingerprint), and the manifest's record is
updated.
Rebuilt files are written under temporary names and renamed into place in `out`; the caller
writes the manifest last, and only if a record changed.
"""
from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import numpy as np

from pipeline.convert.errors import ConversionError
from pipeline.convert.options import FfcvOptions, RunOptions, WdsOptions
from pipeline.convert.parallel import map_samples
from pipeline.convert.plan import ShardPlan, write_order
from pipeline.convert.shard_tasks import ShardDone, encoder, write_shards
from pipeline.convert.sources import Missing, Source, SourceOptions, open_source
from pipeline.convert.splits import scratch_in
from pipeline.formats.wds_shards import ShardRecord, ShardWriter, drop_index_pack, sample_members
from pipeline.storage.atomic_files import replace_atomically

SHARD_FILES = ("tar", "index", "checksums")       # a webdataset shard's files, as its record names them
AGAIN = "convert the whole dataset again"
REPAIR_BLOCK = 16


def recorded_source(src: str, manifest: dict, split: str, scratch: Path) -> tuple[Source, bool]:
    """SRC read as the manifest says it was (its form, options and classes; scanned into
    `scratch`), and whether `split` there is the one converted (its fingerprint)."""
    recorded = manifest.get("source_options", {})
    options = SourceOptions(form=manifest.get("source_form", "imagefolder"),
                            split_paths=tuple(recorded.get("split_paths", {}).items()),
                            label_key=recorded.get("label_key"))
    source = open_source(src, options)
    source.scratch = scratch
    if split not in source.splits():
        raise ConversionError(f"{src}: no {split} split; --repair needs the source the dataset was converted from "
                              f"({manifest.get('source', 'its manifest says where')})")
    source.use_classes(manifest["classes"])
    try:
        same = source.fingerprint(split) == manifest["splits"][split].get("source_fingerprint")
    except ConversionError as error:
        raise ConversionError(f"{error}: not the source the dataset was converted from; {AGAIN}") from None
    return source, same


def written_samples(source: Source, manifest: dict, split: str) -> np.ndarray:
    """The indices of the source's samples in the order the converter wrote them: the write order
    less those it skipped (by their place in the source, or for a manifest that records no place,
    by their path under SRC)."""
    entries = source.entries(split)
    skipped = manifest["splits"][split].get("skipped", [])
    left_out = {skip["entry"] for skip in skipped if "entry" in skip}
    paths = [skip["path"].replace(os.sep, "/") for skip in skipped if "entry" not in skip]
    if paths:
        tails = {path.rsplit("/", 1)[-1] for path in paths}
        for index, name in enumerate(entries.files):
            relpath = name.replace(os.sep, "/")
            if relpath.rsplit("/", 1)[-1] in tails and any(p == relpath or p.endswith("/" + relpath) for p in paths):
                left_out.add(index)
    order = write_order(len(entries), split, manifest["params"]["seed"], source.scratch)
    order = np.arange(len(entries)) if order is None else order
    return order[~np.isin(order, np.fromiter(left_out, np.int64, len(left_out)))]


def rebuild_shards(src: str, manifest: dict, split: str, numbers: list[int], out: Path, num_workers: int) -> bool:
    """Write the shards `numbers` of the webdataset `split` again into OUT/<split>/, updating their
    records in `manifest`; whether a record changed. A ConversionError (nothing written for that
    shard) where SRC no longer gives the samples it held."""
    with scratch_in(out) as scratch:
        changed = _rebuild_shards(src, manifest, split, numbers, out, num_workers, scratch)
    if changed:
        drop_index_pack(split, manifest["splits"][split])
    return changed


def _rebuild_shards(src: str, manifest: dict, split: str, numbers: list[int], out: Path, num_workers: int,
                    scratch: Path) -> bool:
    record = manifest["splits"][split]
    source, same_source = recorded_source(src, manifest, split, scratch)
    if "shard_samples" in record:
        return _run_shard_tasks(source, same_source, src, manifest, split, numbers, out, num_workers, scratch)
    written = written_samples(source, manifest, split)
    if len(written) != record["count"]:
        raise ConversionError(f"{src}: {len(written):,} {split} samples to write where the dataset holds "
                              f"{record['count']:,}: not the source it was converted from, or changed since; {AGAIN}")
    options, changed = WdsOptions.from_params(manifest["params"]), False
    labels = source.entries(split).labels
    firsts = [sum(shard["count"] for shard in record["shards"][:number]) for number in range(len(record["shards"]))]
    for number in numbers:
        shard, first = record["shards"][number], firsts[number]
        held = written[first:first + shard["count"]]
        staging = out / split / f".repair-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            writer = ShardWriter(staging, max_bytes=1 << 62, first_shard=number)
            blocks = [held[at:at + REPAIR_BLOCK] for at in range(0, len(held), REPAIR_BLOCK)]
            encoded = map_samples(source, split, encoder(options), num_workers, f"{split}: {shard['tar']}",
                                  blocks=blocks, total=len(held))
            for position, (index, result) in enumerate(encoded):
                reason = result.reason if isinstance(result, Missing) or result.jpeg is None else None
                if reason:
                    raise ConversionError(f"{source.name(split, index)}: {reason}; it was converted before, so {src} "
                                          f"changed since; {AGAIN}")
                writer.add(f"{first + position:09d}", sample_members(result.jpeg, int(labels[index])))
            writer.close()
            rebuilt = writer.shards[0]
            kinds = [kind for kind in SHARD_FILES if kind in shard]      # a dataset from before checksums stays so
            if rebuilt["sha256"] != shard.get("sha256"):
                if not same_source:
                    raise ConversionError(f"{src}: its {split} files differ from those converted (added, removed or "
                                          f"modified since), and {shard['tar']} rebuilt from them differs too; {AGAIN}")
                changed = True
                shard.update({key: value for key, value in rebuilt.items()
                              if "checksums" in kinds or not key.startswith("checksums")})
            for kind in kinds:
                replace_atomically(staging / rebuilt[kind], out / split / rebuilt[kind])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return changed


def _run_shard_tasks(source: Source, same_source: bool, src: str, manifest: dict, split: str, numbers: list[int],
                     out: Path, num_workers: int, scratch: Path) -> bool:
    """Rebuild shards of a planned conversion: their tasks, run again."""
    record, options = manifest["splits"][split], WdsOptions.from_params(manifest["params"])
    plan = ShardPlan(split, len(source.entries(split)), record["shard_samples"], options.seed)
    places = plan.order_and_places(scratch / "order")[1]
    holding, changed = out / split / f".repair-{os.getpid()}", False
    for number in numbers:
        shard = record["shards"][number]
        rebuilt: list[ShardDone] = []

        def hold(_: int, done: ShardDone, staging: Path) -> None:
            for file in (ShardRecord.from_dict(done.record).files().values() if done.record else ()):
                os.replace(staging / file.name, holding / file.name)
            rebuilt.append(done)
        shutil.rmtree(holding, ignore_errors=True)
        holding.mkdir(parents=True)
        try:
            staging = out / split / f".repair-staging-{os.getpid()}"
            write_shards(source, plan, [shard_number(shard)], places, options, num_workers, staging,
                         partial(hold, staging=staging))
            done = rebuilt[0]
            if done.record is None or done.record["count"] != shard["count"]:
                raise ConversionError(f"{src}: {shard['tar']} rebuilt holds {done.record['count'] if done.record else 0}"
                                      f" samples where it held {shard['count']}: not the source it was converted "
                                      f"from, or changed since; {AGAIN}")
            if done.record["sha256"] != shard["sha256"]:
                if not same_source:
                    raise ConversionError(f"{src}: its {split} files differ from those converted (added, removed or "
                                          f"modified since), and {shard['tar']} rebuilt from them differs too; {AGAIN}")
                shard.update(done.record)
                changed = True
            for kind in SHARD_FILES:
                replace_atomically(holding / done.record[kind], out / split / done.record[kind])
        finally:
            shutil.rmtree(holding, ignore_errors=True)
    return changed


def shard_number(shard: dict) -> int:
    """The number a shard's record names it by (shard-NNNNNN.tar)."""
    return int(shard["tar"].split("-")[1].split(".")[0])


def rebuild_beton(src: str, manifest: dict, split: str, out: Path, num_workers: int) -> bool:
    """Write the FFCV `split` again as OUT/<split>.beton and its checksums, updating its record in
    `manifest`; whether the record changed."""
    from pipeline.convert.ffcv import convert_split
    record = manifest["splits"][split]
    with scratch_in(out) as scratch:
        source, same_source = recorded_source(src, manifest, split, scratch)
        if not same_source:
            raise ConversionError(f"{src}: its {split} files differ from those converted (added, removed or "
                                  f"modified since); {AGAIN}")
        run = RunOptions(src=src, out=str(out), splits=(split,), num_workers=num_workers)
        result = convert_split(FfcvOptions.from_params(manifest["params"]), run, source, split, out)
    if result.count != record["count"]:
        raise ConversionError(f"{src}: {result.count:,} {split} samples written where the dataset held "
                              f"{record['count']:,}; {AGAIN}")
    changed = any(record.get(key) != value for key, value in result.extra.items())
    record.update(result.extra)
    return changed
