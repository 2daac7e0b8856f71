"""A converter's output on local disk: the manifest's view of one split (its files, and for
WebDataset its shards with each sample's place in the tar), checked before any worker starts.

Each function fails with a one-line `DatasetError` naming the path and what to run, so a
half-copied dataset never surfaces as a hang or a traceback from inside FFCV, DALI or a
DataLoader worker. The manifest itself is read by pipeline/formats/manifest.py, which checks its
version; a split in object storage is read by pipeline/remote/dataset.py, which reuses these
records.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pipeline.errors import DatasetError
from pipeline.formats.manifest import MANIFEST, ManifestError, manifest_path, read_manifest
from pipeline.formats.wds_shards import IndexLineError, index_members, members_end

log = logging.getLogger(__name__)

# The command that makes each format, for the messages that tell a user what to run
CONVERTERS = {"ffcv": "python tools/convert_ffcv.py", "webdataset": "python tools/convert_wds.py"}


@dataclass
class Shard:
    tar: Path
    index: Path
    count: int
    first_sample: int          # id of its first sample in the split's stored order
    # per sample: (image offset, image size, label offset) in the tar, from the `.idx` file
    members: Optional[np.ndarray] = None
    # a shard in object storage: its name in the store (`tar` is then its redacted URL, for messages)
    object_name: Optional[str] = None
    # per sample: the CRC-32 of its image then label bytes, from `shard-NNNNNN.crc32`; None: unrecorded
    checksums: Optional[np.ndarray] = None


@dataclass(frozen=True)
class SampleName:
    """`TAR:KEY` of one sample of a shard, looked up in its index only when printed: only
    error messages need it, and a million keys held as strings would cost memory."""
    shard: Shard
    number: int

    def __str__(self) -> str:
        line = self.shard.index.read_text().splitlines()[1 + self.number]
        return f"{self.shard.tar}:{line.split()[3].rsplit('.', 1)[0]}"


@dataclass
class ConvertedSplit:
    root: Path
    format: str
    split: str
    classes: list[str]
    count: int
    files: list[Path]
    shards: list[Shard] = field(default_factory=list)   # webdataset only
    remote: Any = None        # read from a URL: its pipeline.remote.dataset.RemoteSource
    record: dict = field(default_factory=dict)          # the split's record in the manifest


def is_converted(path: str | Path) -> bool:
    return manifest_path(path).is_file()


def converted_format(path: str | Path) -> Optional[str]:
    """The format a converter wrote at `path` (its manifest's), or None where there is no manifest."""
    try:
        manifest = read_manifest(path)
    except ManifestError as error:
        raise DatasetError(str(error)) from None
    return manifest["format"] if manifest else None


def read_local_converted(root: Path, split: str, expected_format: str) -> ConvertedSplit:
    """The manifest's view of one converted split in the folder `root`, with its files checked to be whole."""
    converter = CONVERTERS[expected_format]
    kind, classes, record = manifest_split(root, split, expected_format)
    shards, first, directory = [], 0, root / split
    for shard in record.get("shards", []):
        shards.append(Shard(directory / shard["tar"], directory / shard["index"], shard["count"], first))
        if "checksums" in shard:
            shards[-1].checksums = checksum_table(shards[-1], directory / shard["checksums"])
        first += shard["count"]
    pack = record.get("index_pack")
    assign_members(shards, packed_members(directory / pack["file"], record) if isinstance(pack, dict) else None,
                   [_size_or_none(shard.tar) for shard in shards])
    files = [root / name for name in record["files"]]
    for file in files:
        if not file.is_file():
            raise DatasetError(f"{file}: missing (listed in {manifest_path(root)}); run {converter} again")
    if kind == "ffcv":
        _check_size(files[0], record["bytes"], converter)
    return ConvertedSplit(root, kind, split, classes, record["count"], files, shards, record=record)


def manifest_split(root: Path, split: str, expected_format: Optional[str]) -> tuple[str, list[str], dict]:
    """The format, classes and `split`'s record of the converter manifest in `root`, checked: it is
    there and whole, of `expected_format` (None: of either), and holds the split."""
    path = manifest_path(root)
    converter = CONVERTERS[expected_format] if expected_format else " or ".join(CONVERTERS.values())
    try:
        manifest = read_manifest(root)
    except ManifestError as error:
        raise DatasetError(f"{error} ({converter})") from None
    if manifest is None:
        raise DatasetError(f"{path}: missing, so {root} is not a finished conversion; "
                           f"run {converter} SRC {root}")
    return split_record(manifest, root, split, expected_format)


def split_record(manifest: dict, root, split: str, expected_format: Optional[str]) -> tuple[str, list[str], dict]:
    """The format, classes and `split`'s record of a converter manifest read from `root` (a
    folder, or a redacted URL), checked: of `expected_format` (None: of either), holding the split."""
    path = f"{root}/{MANIFEST}"
    converter = CONVERTERS[expected_format] if expected_format else " or ".join(CONVERTERS.values())
    try:
        kind, classes, splits = manifest["format"], manifest["classes"], manifest["splits"]
        converter = CONVERTERS[expected_format or kind]
    except (KeyError, TypeError) as error:
        raise DatasetError(f"{path}: not a converter manifest ({error!r}); run {converter} again") from None
    if expected_format and kind != expected_format:
        raise DatasetError(f"{root} holds a {kind} conversion, not {expected_format}; "
                           f"use backend {kind!r} or run {converter}")
    if split not in splits:
        raise DatasetError(f"{root}: split {split!r} was not converted (have: {', '.join(splits) or 'none'}); "
                           f"run {converter} SRC {root} --splits {split}")
    return kind, classes, splits[split]


def _size_or_none(file: Path) -> Optional[int]:
    """None for a missing file, which the caller reports as missing."""
    try:
        return file.stat().st_size
    except FileNotFoundError:
        return None


def _check_size(file: Path, expected: int, converter: str) -> None:
    size = file.stat().st_size if file.exists() else None
    if size != expected:
        raise DatasetError(f"{file}: {size if size is not None else 'missing'} bytes where the manifest says "
                           f"{expected}: truncated or changed; run {converter} again")


def checksum_table(shard: Shard, path: Path) -> np.ndarray:
    """The shard's per-sample checksums (uint32), checked to be one a sample."""
    try:
        table = np.fromfile(path, "<u4")
    except (OSError, ValueError) as error:
        raise DatasetError(f"{path}: unreadable checksums ({error}); run {CONVERTERS['webdataset']} again") from None
    if len(table) != shard.count:
        raise DatasetError(f"{path}: {len(table)} checksums where the manifest says {shard.count} samples; "
                           f"run {CONVERTERS['webdataset']} again")
    return table


def member_table(shard: Shard, tar_size: Optional[int] = None) -> np.ndarray:
    """(count, 3) int64: each sample's image offset and size and label offset in the tar, from
    the DALI-style `.idx` file; checks that the tar, of `tar_size` bytes where known, is long
    enough for every member it lists."""
    try:
        table = index_members(shard.index.read_text())
    except (OSError, ValueError) as error:
        # A scrambled index can be one huge line, which int()'s message would quote whole:
        # the message keeps one line and a short excerpt of the reason.
        reason = " ".join((str(error) if isinstance(error, IndexLineError) else f"{type(error).__name__}: {error}").split())
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        raise DatasetError(f"{shard.index}: unreadable index ({reason}); "
                           f"run {CONVERTERS['webdataset']} again") from None
    if len(table) != shard.count:
        raise DatasetError(f"{shard.index}: {len(table)} samples where the manifest says {shard.count}; "
                           f"run {CONVERTERS['webdataset']} again")
    check_tar_size(shard, table, tar_size)
    return table


def check_tar_size(shard: Shard, table: np.ndarray, tar_size: Optional[int]) -> None:
    """A DatasetError where the tar, of `tar_size` bytes where known, is shorter than its samples reach."""
    end = members_end(table)
    if tar_size is not None and tar_size < end:
        raise DatasetError(f"{shard.tar}: {tar_size} bytes, its index needs {end}: truncated; "
                           f"run {CONVERTERS['webdataset']} again")


def packed_members(pack: Path, record: dict) -> Optional[np.ndarray]:
    """The split's member table from its index pack (`pipeline/formats/wds_shards.py`), or None where
    it has none, or where its file is not the size recorded or its table fails its sha256 (damaged
    since: one line saying so), and the shards' indexes are parsed instead."""
    entry = record.get("index_pack")
    if not isinstance(entry, dict) or not isinstance(entry.get("members_at"), int):
        return None
    if _size_or_none(pack) != entry["bytes"] or entry["bytes"] - entry["members_at"] != 24 * record["count"]:
        return None
    table = np.fromfile(pack, "<i8", offset=entry["members_at"])
    if hashlib.sha256(table).hexdigest() != entry.get("members_sha256"):
        log.warning("%s: its member table fails its sha256 (damaged since it was written): the shards' indexes are "
                    "read instead; python tools/verify_dataset.py --repair SRC writes it again", pack)
        return None
    return table.reshape(-1, 3)


def assign_members(shards: list[Shard], table: Optional[np.ndarray], tar_sizes) -> None:
    """Each shard's rows of the split's member table, or where there is none its own index parsed;
    `tar_sizes[i]`: shard i's tar size where known, to check the tar is long enough."""
    for shard, tar_size in zip(shards, tar_sizes):
        if table is None:
            shard.members = member_table(shard, tar_size)
        else:
            shard.members = table[shard.first_sample:shard.first_sample + shard.count]
            check_tar_size(shard, shard.members, tar_size)
