"""Converting again only what a check found damaged (tools/verify_dataset.py --repair SRC): the
WebDataset shards whose tar, index or checksums failed, or the FFCV split whose .beton did, from
the image folder SRC the dataset was converted from, with the options its manifest records.

A WebDataset shard is rebuilt from the very samples it held: the split's seeded write order, less
the files the manifest lists as skipped, cut at the shard's first sample and count, with the same
keys. The converter is deterministic, so the rebuilt tar has the manifest's sha256 unless the
encoding libraries changed since; then the new bytes are kept only if SRC's split is the one
converted (its fingerprint: the same files, sizes and modification times), and the manifest's
record of the shard is updated. FFCV's writer places images in the order its processes ask for
pages, so a rebuilt .beton always gets a new record, and only from an unchanged SRC.
Rebuilt files are written under temporary names and renamed into place in `out`; the caller
writes the manifest last, and only if a record changed.
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from pipeline.convert.errors import ConversionError
from pipeline.convert.parallel import parallel_map
from pipeline.convert.splits import source_fingerprint
from pipeline.formats.imagefolder import Sample, scan_split
from pipeline.storage.atomic_files import replace_atomically

SHARD_FILES = ("tar", "index", "checksums")       # a webdataset shard's files, as its record names them
AGAIN = "convert the whole dataset again"


def recorded_options(manifest: dict, num_workers: int) -> argparse.Namespace:
    """The converter's options as the manifest records them, with this machine's worker count."""
    return argparse.Namespace(**{**manifest.get("params", {}), "num_workers": num_workers})


def source_samples(src: Path, manifest: dict, split: str) -> tuple[list[Sample], bool]:
    """SRC's samples of `split`, labelled by the manifest's classes, and whether they are the files
    converted (the split record's fingerprint)."""
    try:
        samples, _ = scan_split(src, split, manifest["classes"])
    except FileNotFoundError:
        raise ConversionError(f"{src}: no {split} folder; --repair needs the folder the dataset was converted "
                              f"from ({manifest.get('source', 'its manifest says where')})") from None
    except KeyError as error:
        raise ConversionError(f"{src / split}: class folder {error.args[0]!r} is not one of the dataset's classes: "
                              f"not the folder it was converted from; {AGAIN}") from None
    return samples, source_fingerprint(samples) == manifest["splits"][split].get("source_fingerprint")


def written_samples(samples: list[Sample], manifest: dict, split: str) -> list[Sample]:
    """The samples in the order the converter wrote them: the write order less the files it skipped
    (named in the manifest by the path given then, so matched by their path under SRC)."""
    from pipeline.convert.wds import write_order
    skipped = [skip["path"].replace(os.sep, "/") for skip in manifest["splits"][split].get("skipped", [])]
    tails = {path.rsplit("/", 1)[-1] for path in skipped}

    def was_skipped(sample: Sample) -> bool:
        relpath = sample.relpath.replace(os.sep, "/")
        return relpath.rsplit("/", 1)[-1] in tails and any(p == relpath or p.endswith("/" + relpath) for p in skipped)
    return [sample for sample in write_order(samples, split, manifest["params"]["seed"]) if not was_skipped(sample)]


def rebuild_shards(src: Path, manifest: dict, split: str, numbers: list[int], out: Path, num_workers: int) -> bool:
    """Write the shards `numbers` of the webdataset `split` again into OUT/<split>/, updating their
    records in `manifest`; whether a record changed. A ConversionError (nothing written for that
    shard) where SRC no longer gives the samples it held."""
    from pipeline.convert.wds import ShardWriter, encoder, sample_members
    record = manifest["splits"][split]
    samples, same_source = source_samples(src, manifest, split)
    written = written_samples(samples, manifest, split)
    if len(written) != record["count"]:
        raise ConversionError(f"{src / split}: {len(written):,} samples to write where the dataset holds "
                              f"{record['count']:,}: not the folder it was converted from, or changed since; {AGAIN}")
    options, changed = recorded_options(manifest, num_workers), False
    firsts = [sum(shard["count"] for shard in record["shards"][:number]) for number in range(len(record["shards"]))]
    for number in numbers:
        shard, first = record["shards"][number], firsts[number]
        held = written[first:first + shard["count"]]
        scratch = out / split / f".repair-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            writer = ShardWriter(scratch, max_bytes=1 << 62, first_shard=number)
            encoded = parallel_map(encoder(options), [sample.path for sample in held], num_workers,
                                   f"{split}: {shard['tar']}")
            for position, (sample, result) in enumerate(zip(held, encoded)):
                if result.jpeg is None:
                    raise ConversionError(f"{sample.path}: {result.reason}; it was converted before, so {src} "
                                          f"changed since; {AGAIN}")
                writer.add(f"{first + position:09d}", sample_members(result.jpeg, sample.label))
            writer.close()
            rebuilt = writer.shards[0]
            kinds = [kind for kind in SHARD_FILES if kind in shard]      # a dataset from before checksums stays so
            if rebuilt["sha256"] != shard.get("sha256"):
                if not same_source:
                    raise ConversionError(f"{src / split}: its files differ from those converted (added, removed or "
                                          f"modified since), and {shard['tar']} rebuilt from them differs too; {AGAIN}")
                changed = True
                shard.update({key: value for key, value in rebuilt.items()
                              if "checksums" in kinds or not key.startswith("checksums")})
            for kind in kinds:
                replace_atomically(scratch / rebuilt[kind], out / split / rebuilt[kind])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return changed


def rebuild_beton(src: Path, manifest: dict, split: str, out: Path, num_workers: int) -> bool:
    """Write the FFCV `split` again as OUT/<split>.beton and its checksums, updating its record in
    `manifest` (always: FFCV's layout varies from run to run); True."""
    from pipeline.convert.ffcv import convert_split
    record = manifest["splits"][split]
    samples, same_source = source_samples(src, manifest, split)
    if not same_source:
        raise ConversionError(f"{src / split}: its files differ from those converted (added, removed or modified "
                              f"since); {AGAIN}")
    result = convert_split(recorded_options(manifest, num_workers), split, samples, out)
    if result.count != record["count"]:
        raise ConversionError(f"{src / split}: {result.count:,} samples written where the dataset held "
                              f"{record['count']:,}; {AGAIN}")
    record.update(result.extra)
    return True
