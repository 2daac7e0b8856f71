"""Check a converted dataset's bytes, on local disk or at a URL: every file against the size and
sha256 its manifest records, and every WebDataset sample against the checksum its converter
recorded (the CRC-32 of its image and label bytes, `shard-NNNNNN.crc32` beside each shard).

    python tools/verify_dataset.py PATH|URL [--splits train,val] [--repair SRC]

Prints progress, then a summary and every damaged file and sample (`TAR:KEY`, as the loaders name
them). Exit code 0: clean; 1: damaged; 2: not a dataset this can read (one line naming it).
`--repair SRC` then converts the damaged shards again from SRC, the source the dataset was converted
from (pipeline/convert/repair.py), writes a split's index pack again from its shards' files (in a
bucket: drops it from the manifest), checks them again, and exits 0 once they are sound. A dataset
converted before per-sample checksums is checked file by file, with one line saying its samples
are unchecked. An FFCV `.beton` is checked against its sha256 and each of its samples against its
recorded checksum (`SPLIT.crc32`, pipeline/formats/beton_checksums.py), named `BETON: sample N`.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.repair import SHARD_FILES, rebuild_beton, rebuild_shards
from pipeline.convert.upload import UPLOAD_SCHEMES, Destination
from pipeline.errors import FAILS_CHECKSUM, DatasetError
from pipeline.formats.beton_checksums import BetonLayoutError, damaged_samples as damaged_beton_samples
from pipeline.formats.converted import CONVERTERS
from pipeline.formats.wds_shards import (IMAGE_MEMBER, LABEL_MEMBER, ShardRecord, add_index_pack, drop_index_pack,
                                         index_rows, sample_checksum)
from pipeline.formats.manifest import MANIFEST, ManifestError, parse_manifest, write_manifest
from pipeline.progress import Progress
from pipeline.storage.atomic_files import FULL_DISK
from pipeline.storage.urls import is_url, redact

log = logging.getLogger("verify_dataset")
USAGE_ERROR, DAMAGED = 2, 1
INDEX_PACK_UNIT = "index pack"
IN_MEMORY, CHUNK = 512 << 20, 64 << 20      # a remote file larger than IN_MEMORY is copied to disk, CHUNK at a time


class Folder:
    """A converted dataset's files on local disk."""

    def __init__(self, root: str):
        self.root, self.name = Path(root), root
        if not self.root.is_dir():
            raise DatasetError(f"{root}: no such directory")

    def read(self, name: str):
        """The file's bytes (a read-only memory map: a .beton can be larger than memory), or None
        when it is missing."""
        try:
            with open(self.root / name, "rb") as file:
                return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if file.seek(0, 2) else b""
        except FileNotFoundError:
            return None


class Remote:
    """A converted dataset's files at an s3://, gs:// or http(s):// URL."""

    def __init__(self, url: str):
        from pipeline.storage.object_store import open_store
        self.store, self.name, self.url = open_store(url), redact(url), url

    def read(self, name: str):
        """The object's bytes, or None when it is missing; one larger than IN_MEMORY (a .beton) is
        fetched in ranges into a temporary file, unlinked at once, and read through a memory map."""
        from pipeline.storage.errors import RemoteNotFound
        try:
            size = self.store.size(name)
            if size <= IN_MEMORY:
                return self.store.read(name)
            with tempfile.TemporaryFile(prefix="verify-") as file:
                for start in range(0, size, CHUNK):
                    file.write(self.store.read_ranges(name, [(start, min(start + CHUNK, size))])[0])
                file.flush()
                return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except RemoteNotFound:
            return None
        except OSError as error:
            if error.errno not in FULL_DISK:
                raise
            raise DatasetError(f"{self.store.where(name)}: no room for a copy in {tempfile.gettempdir()} "
                               f"({error.strerror}); set TMPDIR to a larger disk") from None


def open_dataset(path: str):
    source = Remote(path) if is_url(path) else Folder(path)
    text = source.read(MANIFEST)
    if text is None:
        raise DatasetError(f"{source.name}: no {MANIFEST}; not a converted dataset (convert one with "
                           f"{CONVERTERS['webdataset']} or {CONVERTERS['ffcv']})")
    return source, parse_manifest(bytes(text).decode("utf-8", errors="replace"), f"{source.name}/{MANIFEST}")


def file_problem(data: bytes | None, size: int | None, sha256: str | None) -> str | None:
    """What is wrong with a file against its manifest record, or None."""
    if data is None:
        return "missing"
    if size is not None and len(data) != size:
        return f"{len(data):,} bytes, the manifest says {size:,}" + (" (truncated)" if len(data) < size else "")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return "its sha256 differs from the manifest's: its bytes changed"
    return None


def index_members(text: str) -> list[tuple[str, int, int, int]]:
    """(key, image offset, image size, label offset) per sample of a shard's index."""
    samples = []
    for members in index_rows(text):
        image_at, image_size, name = members[IMAGE_MEMBER]
        samples.append((name.rsplit(".", 1)[0], image_at, image_size, members[LABEL_MEMBER][0]))
    return samples


def damaged_samples(tar: bytes, members, checksums: np.ndarray) -> list[tuple[str, str]]:
    """(key, why) of each sample whose bytes fail the checksum recorded for it."""
    found = []
    for (key, image_at, image_size, label_at), recorded in zip(members, checksums.tolist()):
        if max(image_at + image_size, label_at + 4) > len(tar):
            found.append((key, "past the end of the tar (truncated)"))
        elif sample_checksum(tar[image_at:image_at + image_size], tar[label_at:label_at + 4]) != recorded:
            found.append((key, FAILS_CHECKSUM))
    return found


def verify(source, manifest: dict, splits: list[str], only: set | None = None) -> dict:
    """Every file and sample of `splits` (of the units `only`, where given) checked: {"files", "samples",
    "bytes", "damaged_files", "damaged_samples", "damaged_units", "unchecked_splits"}. A unit is
    (split, shard number) of a webdataset shard, (split, INDEX_PACK_UNIT) of its split's index pack,
    (split, None) of an FFCV split."""
    records = {split: manifest["splits"][split] for split in splits}
    units = [(split, number) for split, record in records.items() for number in range(len(record.get("shards", [])))] + \
            [(split, None) for split, record in records.items() if "shards" not in record] + \
            [(split, INDEX_PACK_UNIT) for split, record in records.items() if "index_pack" in record]
    units = [unit for unit in units if only is None or unit in only]
    report = {"files": 0, "samples": 0, "bytes": 0, "damaged_files": [], "damaged_samples": [], "damaged_units": [],
              "unchecked_splits": []}
    with Progress(total=len(units), desc=f"verify {source.name}", unit="shard") as progress:
        for split, number in units:
            damaged_before = len(report["damaged_files"]) + len(report["damaged_samples"])
            if number is None:        # one file for the split (FFCV's .beton)
                check_beton(source, records[split], report)
            elif number == INDEX_PACK_UNIT:
                pack = records[split].get("index_pack")     # none once a repair dropped it
                if pack is not None:
                    check_file(source, f"{split}/{pack['file']}", pack["bytes"], pack["sha256"], report)
            else:
                check_shard(source, split, records[split]["shards"][number], report)
            if len(report["damaged_files"]) + len(report["damaged_samples"]) > damaged_before:
                report["damaged_units"].append((split, number))
            progress.update(1)
            progress.set_postfix(MB=f"{report['bytes'] / 1e6:,.0f}")
    report["unchecked_splits"] = [split for split, record in records.items()
                                  if not all("checksums" in s for s in record.get("shards", [record]))]
    return report


def check_file(source, name: str, size, sha256, report: dict) -> bytes | None:
    data = source.read(name)
    report["files"] += 1
    report["bytes"] += len(data or b"")
    problem = file_problem(data, size, sha256)
    if problem:
        report["damaged_files"].append((f"{source.name}/{name}", problem))
    return data


def check_beton(source, record: dict, report: dict) -> None:
    """A split's .beton against its size and sha256, and each of its samples against its checksum."""
    if not record.get("files"):
        return
    name = record["files"][0]
    beton = check_file(source, name, record.get("bytes"), record.get("sha256"), report)
    report["samples"] += record.get("count", 0)
    if "checksums" not in record or beton is None:
        return
    checksums = check_file(source, record["checksums"], record.get("checksums_bytes"), record.get("checksums_sha256"),
                           report)
    if checksums is None or len(checksums) != 4 * record.get("count", -1):
        return
    try:
        damaged = damaged_beton_samples(beton, np.frombuffer(checksums, "<u4"), record["layout_crc32"])
    except BetonLayoutError as error:
        report["damaged_files"].append((f"{source.name}/{name}", str(error)))
        return
    report["damaged_samples"] += [(f"{source.name}/{name}: sample {number}", FAILS_CHECKSUM) for number in damaged]


def check_shard(source, split: str, shard: dict, report: dict) -> None:
    record = ShardRecord.from_dict(shard)
    read = {kind: check_file(source, f"{split}/{file.name}", file.bytes, file.sha256, report)
            for kind, file in record.files().items()}
    report["samples"] += record.count
    tar_name, tar, index, checksums = f"{split}/{record.tar.name}", read["tar"], read["index"], read.get("checksums")
    if checksums is None or tar is None or index is None or len(checksums) != 4 * record.count:
        return
    try:
        members = index_members(bytes(index).decode("ascii"))
    except (UnicodeDecodeError, ValueError, KeyError):
        return                                  # a damaged index is reported as a damaged file
    for key, why in damaged_samples(tar, members, np.frombuffer(checksums, "<u4")):
        report["damaged_samples"].append((f"{source.name}/{tar_name}:{key}", why))


def summary(report: dict, seconds: float) -> list[str]:
    rate = f"{report['bytes'] / 1e6:,.0f} MB in {seconds:.1f} s, {report['bytes'] / 1e6 / max(seconds, 1e-9):,.0f} MB/s"
    damaged = report["damaged_files"] or report["damaged_samples"]
    lines = [f"{'DAMAGED' if damaged else 'clean'}: {report['files']} files, {report['samples']:,} samples ({rate}); "
             f"{len(report['damaged_files'])} damaged files, {len(report['damaged_samples'])} damaged samples"]
    lines += [f"  {name}: {why}" for name, why in report["damaged_files"]]
    lines += [f"  {name}: {why}" for name, why in report["damaged_samples"]]
    if report["unchecked_splits"]:
        lines.append(f"samples unchecked in {', '.join(report['unchecked_splits'])}: converted before per-sample "
                     f"checksums; convert it again to have them checked")
    return lines


def repair(source, manifest: dict, units: list[tuple], src: str, num_workers: int) -> list[str]:
    """Convert the damaged `units` again from SRC (pipeline/convert/repair.py) into the dataset, in
    place or through a local staging folder into its bucket, the manifest last and only if a record
    changed; the files rewritten."""
    if isinstance(source, Remote) and urlsplit(source.url).scheme.lower() not in UPLOAD_SCHEMES:
        raise ConversionError(f"{source.name}: cannot be written; repair a copy on local disk or in s3:// or gs://")
    with tempfile.TemporaryDirectory(prefix="fastpipe-repair-") as staging:
        out = Path(staging) if isinstance(source, Remote) else source.root
        changed, rewritten = False, []
        for split in dict.fromkeys(split for split, _ in units):
            record = manifest["splits"][split]
            if "shards" in record:
                numbers = [number for unit_split, number in units if unit_split == split and number != INDEX_PACK_UNIT]
                if numbers:
                    changed |= rebuild_shards(src, manifest, split, numbers, out, num_workers)
                rewritten += [f"{split}/{record['shards'][number][kind]}" for number in numbers
                              for kind in SHARD_FILES if kind in record["shards"][number]]
                if (split, INDEX_PACK_UNIT) in units:
                    drop_index_pack(split, record)
                    changed = True
                # In place, every shard's files are at hand to write the pack again; a bucket's split
                # goes without one, its loaders parsing the shards' indexes, until converted again
                if not isinstance(source, Remote) and add_index_pack(split, record, out):
                    rewritten.append(f"{split}/{record['index_pack']['file']}")
                    changed = True
            else:
                changed |= rebuild_beton(src, manifest, split, out, num_workers)
                rewritten += [record["files"][0], record["checksums"]]
        if isinstance(source, Remote):
            Destination(source.url).replace(out, rewritten, manifest if changed else None)
        elif changed:
            write_manifest(out, manifest)
    return rewritten


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a converted dataset: a folder, or an s3://, gs:// or http(s):// URL")
    parser.add_argument("--splits", help="comma-separated (default: every split of the manifest)")
    parser.add_argument("--repair", metavar="SRC",
                        help="convert the damaged shards (an FFCV split: its .beton) again from SRC, the source the "
                             "dataset was converted from (a folder or URL, read in the form its manifest records), in "
                             "place or into its bucket, the manifest last")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="--repair's worker processes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        source, manifest = open_dataset(args.path)
        splits = args.splits.split(",") if args.splits else list(manifest.get("splits", {}))
        unknown = [split for split in splits if split not in manifest.get("splits", {})]
        if unknown:
            raise DatasetError(f"{source.name}: no split {unknown[0]!r} in its manifest "
                               f"(it has {', '.join(manifest.get('splits', {}))})")
        report = verify(source, manifest, splits)
        print("\n".join(summary(report, time.perf_counter() - started)), flush=True)
        if not (args.repair and report["damaged_units"]):
            return DAMAGED if report["damaged_units"] else 0
        rewritten = repair(source, manifest, report["damaged_units"], args.repair, args.num_workers)
        print(f"repaired from {args.repair}: {', '.join(rewritten)}", flush=True)
        started = time.perf_counter()
        source, manifest = open_dataset(args.path)
        after = verify(source, manifest, splits, only=set(report["damaged_units"]))
        print("\n".join(summary(after, time.perf_counter() - started)), flush=True)
        return DAMAGED if after["damaged_units"] else 0
    except (DatasetError, ManifestError, ConversionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except ConversionFault as error:
        print(f"error: {error}", file=sys.stderr)
        return DAMAGED


if __name__ == "__main__":
    sys.exit(main())
