"""The WebDataset shards the converters write, in the one module that both writes (`ShardWriter`) and
reads their format (as pipeline/formats/beton_checksums.py does for FFCV): a sample's members, the
`.idx` index beside each tar, the per-sample checksum, and a shard's record in the manifest
(`ShardRecord`).

- A sample is three tar members sharing a key: `KEY.jpg` (the image), `KEY.cls` (the label as ASCII
  decimal, what the `webdataset` package decodes to an int) and `KEY.lbl` (the label as little-endian
  int32: DALI's `readers.webdataset` reads it with `dtypes=INT32`, where ASCII labels of different
  lengths would break its batches). The loaders read only `.jpg` and `.lbl`.
- The index is DALI's `wds2idx` format, v1.2: a header line `v1.2 COUNT`, then per sample, per
  member, its extension, data offset, size and name.
- A sample's checksum is the CRC-32 (zlib's) of its `.jpg` bytes, then of its `.lbl` bytes; a shard's
  are little-endian uint32 in `shard-NNNNNN.crc32`, beside the index (DALI parses the index).
- Tars are deterministic (USTAR, mode 0444, mtime 0): the same samples give the same bytes. The
  index is written from the offsets the writer knows, so writing needs no DALI.
- A split's index pack, `shard-indexes.pack`, holds every shard's index then checksums, one after
  another in the manifest's order (each file's size is in its record), then the split's member table
  from `members_at` on: per sample, its image's offset and size and its label's offset in its tar,
  little-endian int64, what a loader would otherwise parse from a thousand indexes. A loader reading
  the split from a URL fetches it in a request or a few rather than two a shard. The split's record
  names it as `index_pack` (file, bytes, sha256, members_at, members_sha256); each part is also checked
  against its own file's sha256, so a pack that no longer matches its shards costs only speed.
"""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.storage.atomic_files import sha256_file, write_bytes_atomic

MEMBERS = {"image": "jpg", "label": "cls", "label_int32": "lbl"}
IMAGE_MEMBER, LABEL_MEMBER = MEMBERS["image"], MEMBERS["label_int32"]     # the members the loaders read
SHARD_NAME = "shard-{:06d}"
SAMPLE_CHECKSUM = "crc32 of jpg then lbl"    # the split record's `sample_checksum`: what each value covers
INDEX_VERSION = "v1.2"
INDEX_PACK = "shard-indexes.pack"
PACKED = ("index", "checksums")     # a shard's files in the pack, in this order


def sample_members(jpeg: bytes, label: int) -> dict[str, bytes]:
    """A sample's tar members, by extension."""
    return {MEMBERS["image"]: jpeg, MEMBERS["label"]: str(label).encode("ascii"),
            MEMBERS["label_int32"]: np.int32(label).astype("<i4").tobytes()}


def sample_checksum(image, label_int32) -> int:
    """The checksum a sample is recorded with: CRC-32 of its image bytes, then of its label's."""
    return zlib.crc32(label_int32, zlib.crc32(image))


def index_line(members: list[tuple[str, int, int, str]]) -> str:
    """A sample's line of the index, from (extension, data offset, size, name) per member."""
    return " ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in members)


def index_rows(text: str):
    """Per sample of an index, {extension: (data offset, size, name)} (see `index_row`)."""
    return map(index_row, text.splitlines()[1:])


def index_row(line: str) -> dict[str, tuple[int, int, str]]:
    """A sample's line of an index as {extension: (data offset, size, name)}; ValueError where it
    does not parse (the caller names the file and line)."""
    fields = line.split()
    if len(fields) % 4:
        raise ValueError(f"{len(fields)} fields, not 4 a member")
    return {ext: (int(start), int(size), name)
            for ext, start, size, name in zip(fields[0::4], fields[1::4], fields[2::4], fields[3::4])}


def index_columns(text: str) -> dict[str, np.ndarray] | None:
    """Per extension, the (data offset, size) of every sample of an index whose lines all list
    the same members in the same order (the converters' own, and most tools'), parsed at once; None
    for any other index, or one that does not parse, which `index_row` reads line by line."""
    lines = text.splitlines()[1:]
    first = lines[0].split() if lines else []
    width, tokens = len(first), " ".join(lines).split()
    if not width or width % 4 or len(tokens) != width * len(lines):
        return None
    extensions = first[0::4]
    if any(tokens[k::width].count(extension) != len(lines) for k, extension in zip(range(0, width, 4), extensions)):
        return None
    try:
        return {extension: np.stack([np.array(tokens[k + 1::width], np.int64),
                                     np.array(tokens[k + 2::width], np.int64)], 1)
                for k, extension in zip(range(0, width, 4), extensions)}
    except (ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class ShardFile:
    name: str
    bytes: int | None        # None in a record written before sizes were kept
    sha256: str | None


# The manifest's keys for each file of a shard: (name, size, sha256)
RECORD_KEYS = {"tar": ("tar", "bytes", "sha256"), "index": ("index", "index_bytes", "index_sha256"),
               "checksums": ("checksums", "checksums_bytes", "checksums_sha256")}


@dataclass(frozen=True)
class ShardRecord:
    """A shard's entry in its split's manifest record: its sample count and files."""
    count: int
    tar: ShardFile
    index: ShardFile
    checksums: ShardFile | None = None       # None: converted before per-sample checksums

    @classmethod
    def from_dict(cls, record: dict) -> ShardRecord:
        files = {kind: ShardFile(record[name], record.get(size), record.get(digest))
                 for kind, (name, size, digest) in RECORD_KEYS.items() if name in record}
        return cls(record["count"], files["tar"], files["index"], files.get("checksums"))

    def as_dict(self) -> dict:
        record = {"count": self.count}
        for kind, file in self.files().items():
            name, size, digest = RECORD_KEYS[kind]
            record.update({name: file.name, size: file.bytes, digest: file.sha256})
        return record

    def files(self) -> dict[str, ShardFile]:
        """{"tar", "index" and, where recorded, "checksums": its file}."""
        return {kind: file for kind, file in (("tar", self.tar), ("index", self.index), ("checksums", self.checksums))
                if file is not None}


def _tar_size(member_bytes: int) -> int:
    """The size of a tar file whose members (headers and padded data) take `member_bytes`: with
    the two end blocks, rounded up to tarfile's 10 KiB record."""
    return -(-(member_bytes + 2 * tarfile.BLOCKSIZE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class HashingFile:
    """A file opened for writing that hashes what goes into it: tarfile writes a shard front to
    back, so the hash is the file's without reading it again."""

    def __init__(self, path: Path):
        self.file, self.digest = open(path, "wb"), hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> int:
        """Flush, fsync and close; the file's size."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return os.path.getsize(self.file.name)


class ShardWriter:
    """Writes samples into size-capped, deterministic tar shards, each with its index and checksums,
    hashed as they are written; the first is numbered `first_shard` (a repair writes one shard of a
    split again). `shards`: the records of those written, as the manifest keeps them."""

    def __init__(self, folder: Path, max_bytes: int, first_shard: int = 0):
        self.folder, self.max_bytes, self.first_shard = folder, max_bytes, first_shard
        self.shards: list[dict] = []
        self.count = 0
        self.tar: tarfile.TarFile | None = None
        self.tar_file: HashingFile | None = None
        self.name = ""
        self.held = self.held_bytes = 0     # the current shard's samples, and its members' bytes
        self.index_lines = None            # the current shard's index lines, kept in a file until it closes
        self.checksums = array("I")         # the current shard's, one a sample

    def add(self, key: str, members: dict[str, bytes]) -> None:
        size = sum(512 + -(-len(data) // 512) * 512 for data in members.values())
        if self.tar is None or (self.held and _tar_size(self.held_bytes + size) > self.max_bytes):
            self._open_next()
        entries = []
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(data), 0o444, 0
            self.tar.addfile(info, io.BytesIO(data))
            self.tar.members.clear()        # tarfile keeps every member it wrote; a shard of small images, 100s of MB
            # The data ends the member's padded blocks, the header(s) come before them.
            entries.append((ext, self.tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE, len(data),
                            info.name))
        self.index_lines.write((index_line(entries) + "\n").encode())
        self.checksums.append(sample_checksum(members[IMAGE_MEMBER], members[LABEL_MEMBER]))
        self.held, self.held_bytes, self.count = self.held + 1, self.held_bytes + size, self.count + 1

    def _open_next(self) -> None:
        self._close_current()
        self.name = SHARD_NAME.format(self.first_shard + len(self.shards))
        self.tar_file = HashingFile(self.folder / f"{self.name}.tar")
        self.tar = tarfile.open(fileobj=self.tar_file, mode="w", format=tarfile.USTAR_FORMAT)
        self.index_lines = open(self.folder / f".{self.name}.idx-lines", "w+b")

    def _written(self, name: str, data: bytes) -> ShardFile:
        write_bytes_atomic(self.folder / name, data)
        return ShardFile(name, len(data), hashlib.sha256(data).hexdigest())

    def _index_written(self) -> ShardFile:
        """The index: its header, then the lines kept aside, copied a MiB at a time."""
        name, lines = f"{self.name}.idx", self.index_lines
        index = HashingFile(self.folder / name)
        index.write(f"{INDEX_VERSION} {self.held}\n".encode())
        lines.seek(0)
        while chunk := lines.read(1 << 20):
            index.write(chunk)
        lines.close()
        os.unlink(lines.name)
        return ShardFile(name, index.close(), index.digest.hexdigest())

    def _close_current(self) -> None:
        if self.tar is None:
            return
        self.tar.close()
        tar = ShardFile(f"{self.name}.tar", self.tar_file.close(), self.tar_file.digest.hexdigest())
        index = self._index_written()
        checksums = self._written(f"{self.name}.crc32", np.asarray(self.checksums, "<u4").tobytes())
        self.shards.append(ShardRecord(self.held, tar, index, checksums).as_dict())
        self.tar, self.tar_file, self.index_lines, self.checksums = None, None, None, array("I")
        self.held = self.held_bytes = 0

    def close(self) -> None:
        self._close_current()


class IndexLineError(ValueError):
    """A line of an index that does not parse: its number (the file's, the header being line 1) and why."""

    def __init__(self, line_number: int, error: Exception):
        super().__init__(f"line {line_number}: {type(error).__name__}: {error}")


def index_members(text: str) -> np.ndarray:
    """(count, 3) int64: each sample's image offset and size and label offset in its tar, from its
    shard's index; an IndexLineError where a line does not parse (the caller names the file)."""
    columns = index_columns(text)
    if columns is not None and IMAGE_MEMBER in columns and LABEL_MEMBER in columns:
        return np.stack([*columns[IMAGE_MEMBER].T, columns[LABEL_MEMBER][:, 0]], 1)
    rows = []
    for line_number, line in enumerate(text.splitlines()[1:], start=2):
        try:
            members = index_row(line)
            rows.append((*members[IMAGE_MEMBER][:2], members[LABEL_MEMBER][0]))
        except (ValueError, KeyError) as error:
            raise IndexLineError(line_number, error) from None
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def members_end(members: np.ndarray) -> int:
    """One past the last byte a table's samples read (images, and labels of 4 bytes) in their tar."""
    return int(max((members[:, 0] + members[:, 1]).max(initial=0), (members[:, 2] + 4).max(initial=0)))


def index_pack_parts(shards: list[dict]) -> dict[str, tuple[int, int]] | None:
    """{file name: (start, end)} of each shard's index and checksums in its split's index pack;
    None where a record lacks a file's size (an older converter's)."""
    parts, at = {}, 0
    for shard in shards:
        files = ShardRecord.from_dict(shard).files()
        for kind in PACKED:
            if kind in files:
                if files[kind].bytes is None:
                    return None
                parts[files[kind].name] = (at, at + files[kind].bytes)
                at += files[kind].bytes
    return parts


def add_index_pack(split: str, record: dict, out: Path) -> bool:
    """Writes the index pack of a webdataset split in OUT/<split> from its shards' files, where its
    record names none or its file is not the one recorded (missing, or damaged since), and records
    it; True if it did."""
    pack, folder = record.get("index_pack"), out / split
    if pack and (folder / pack["file"]).is_file() and sha256_file(folder / pack["file"]) == pack["sha256"]:
        return False
    if not record["shards"] or index_pack_parts(record["shards"]) is None:      # nothing to pack, or sizes unknown
        return False
    data, tables = bytearray(), []
    for shard in record["shards"]:
        files = ShardRecord.from_dict(shard).files()
        for kind in PACKED:
            if kind in files:
                data += (folder / files[kind].name).read_bytes()
        tables.append(index_members((folder / files["index"].name).read_text()))
    members = np.concatenate(tables).astype("<i8").tobytes()
    members_at = len(data)
    data += members
    write_bytes_atomic(folder / INDEX_PACK, data)
    record["index_pack"] = {"file": INDEX_PACK, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "members_at": members_at, "members_sha256": hashlib.sha256(members).hexdigest()}
    if f"{split}/{INDEX_PACK}" not in record.setdefault("files", []):
        record["files"].append(f"{split}/{INDEX_PACK}")
    return True


def drop_index_pack(split: str, record: dict) -> None:
    """Forgets a split's index pack, once a shard's index or checksums were written again: loaders
    then fetch the shards' files one by one, until a conversion run writes the pack again."""
    if record.pop("index_pack", None) is not None:
        record["files"] = [name for name in record.get("files", []) if name != f"{split}/{INDEX_PACK}"]
