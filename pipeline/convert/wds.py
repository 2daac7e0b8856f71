"""Convert an ImageNet-layout folder to WebDataset shards: OUT/<split>/shard-NNNNNN.tar + .idx.

    python pipeline/convert/wds.py SRC OUT [--max-resolution 512] [--shard-size-mb 256] ...

Each sample is three tar members sharing a key: `KEY.jpg` (the image), `KEY.cls` (the
label as ASCII decimal, which the `webdataset` package decodes to an int) and `KEY.lbl`
(the label as little-endian int32: DALI's `readers.webdataset` hands members over as raw
bytes, so it reads this one with `dtypes=INT32`, where ASCII labels of different lengths
would break its batches). The manifest's `members` names them for the loaders.

Resize semantics are the FFCV converter's (longest side at most --max-resolution, OpenCV's
INTER_AREA, FFCV's size rounding). An RGB JPEG that needs no resize and no EXIF rotation
is stored as it is, without a lossy re-encode; anything else is re-encoded at
--jpeg-quality. Either way it is then rewritten losslessly with a restart marker after every
MCU (the same pixels, a few % more bytes; --no-restart-markers stores it without): the
decode engine then decodes only the MCUs under a crop (pipeline/native/jpeg_restarts.h). Train
samples are written in a seeded random order, because WebDataset readers only shuffle shards
and a buffer; val stays in folder order. Index files in DALI's `wds2idx` format (v1.2: per
sample, each member's extension, data offset, size and name) are written beside the shards,
from the offsets the writer knows, so converting needs no DALI (a GPU node may get DALI last).
Tars are deterministic: the same input and options give the same bytes. Each shard's manifest
entry holds the tar's size and sha256 (`bytes`, `sha256`) and its index's (`index_bytes`,
`index_sha256`), hashed as they are written, and names its checksums file (`checksums`,
`shard-NNNNNN.crc32`, with `checksums_bytes`, `checksums_sha256`): per sample, little-endian
uint32, the CRC-32 of its `.jpg` bytes then its `.lbl` bytes (`sample_checksum` in the split's
record says so). Beside the index, not in it, since DALI's reader parses the index. CRC-32 as
zlib computes it: about 4 GB/s a core, in Python's standard library and in C through libz.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from pipeline.convert.cli import common_parser, main_guard
from pipeline.convert.errors import ConversionError
from pipeline.convert.images import describe_failure, encode_jpeg, load_rgb, open_image, probe, usable_as_is
from pipeline.convert.parallel import parallel_map
from pipeline.convert.splits import SplitResult, run_conversion
from pipeline.storage.atomic_files import fsync_path, replace_atomically
from pipeline.formats.imagefolder import Sample, Skipped
from pipeline.decode.jpeg_roi import JPEGError, transcode

log = logging.getLogger(__name__)

MEMBERS = {"image": "jpg", "label": "cls", "label_int32": "lbl"}
SHARD_PATTERN = "shard-{:06d}"
SAMPLE_CHECKSUM = "crc32 of jpg then lbl"    # the split record's `sample_checksum`: what each value covers


def sample_checksum(image: bytes, label_int32: bytes) -> int:
    """The checksum a sample is recorded with: CRC-32 of its image bytes, then of its label's."""
    return zlib.crc32(label_int32, zlib.crc32(image))


@dataclass
class Encoded:
    jpeg: bytes | None        # None when the file could not be used
    reason: str | None = None
    restart_markers: bool = False


def encode_sample(path: str, max_resolution: int | None, jpeg_quality: int, restart_markers: bool) -> Encoded:
    try:
        with open_image(path) as image:
            as_is = usable_as_is(image, max_resolution)
        if not as_is:
            jpeg = encode_jpeg(load_rgb(path, max_resolution), jpeg_quality)
        else:
            # Stored unchanged, so a full decode would only check it: probe's 1/8-scale decode
            # reads the whole stream at a fraction of the cost.
            reason = probe(path)
            if reason:
                return Encoded(None, reason)
            with open(path, "rb") as f:
                jpeg = f.read()
    except Exception as error:  # noqa: BLE001 - any failure of any decoder is a skip
        return Encoded(None, describe_failure(error))
    if restart_markers:
        try:
            return Encoded(transcode(jpeg), restart_markers=True)
        except JPEGError:   # libjpeg warns about it (Pillow did not): stored as it is, decoded whole
            pass
    return Encoded(jpeg)


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
    """Writes samples into size-capped, deterministic tar shards, each with its DALI index; the
    first is numbered `first_shard` (a repair writes one shard of a split again)."""

    def __init__(self, folder: Path, max_bytes: int, first_shard: int = 0):
        self.folder, self.max_bytes, self.first_shard = folder, max_bytes, first_shard
        self.shards: list[dict] = []
        self.count = 0
        self.tar: tarfile.TarFile | None = None
        self.tar_file: HashingFile | None = None
        self.index_lines: list[str] = []   # the current shard's, one a sample
        self.checksums: list[int] = []      # the current shard's, one a sample

    def add(self, key: str, members: dict[str, bytes]) -> None:
        size = sum(512 + -(-len(data) // 512) * 512 for data in members.values())
        if self.tar is None or (self.shards[-1]["count"] and _tar_size(self.shards[-1]["bytes"] + size) > self.max_bytes):
            self._open_next()
        entries = []
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(data), 0o444, 0
            self.tar.addfile(info, io.BytesIO(data))
            # The data ends the member's padded blocks, the header(s) come before them.
            data_offset = self.tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            entries.append(f"{ext} {data_offset} {len(data)} {info.name}")
        self.index_lines.append(" ".join(entries))
        self.checksums.append(sample_checksum(members[MEMBERS["image"]], members[MEMBERS["label_int32"]]))
        self.shards[-1]["count"] += 1
        self.shards[-1]["bytes"] += size      # the members' so far; the file's size once closed
        self.count += 1

    def _open_next(self) -> None:
        self._close_current()
        name = SHARD_PATTERN.format(self.first_shard + len(self.shards))
        self.shards.append({"tar": f"{name}.tar", "index": f"{name}.idx", "checksums": f"{name}.crc32", "count": 0,
                            "bytes": 0})
        self.tar_file = HashingFile(self.folder / f"{name}.tar")
        self.tar = tarfile.open(fileobj=self.tar_file, mode="w", format=tarfile.USTAR_FORMAT)

    def _close_current(self) -> None:
        if self.tar is None:
            return
        self.tar.close()
        shard = self.shards[-1]
        shard["bytes"], shard["sha256"] = self.tar_file.close(), self.tar_file.digest.hexdigest()
        index = self.folder / shard["index"]
        text = (f"v1.2 {len(self.index_lines)}\n" + "".join(line + "\n" for line in self.index_lines)).encode()
        index.write_bytes(text)
        fsync_path(index)
        shard["index_bytes"], shard["index_sha256"] = len(text), hashlib.sha256(text).hexdigest()
        checksums = np.array(self.checksums, "<u4").tobytes()
        (self.folder / shard["checksums"]).write_bytes(checksums)
        fsync_path(self.folder / shard["checksums"])
        shard["checksums_bytes"], shard["checksums_sha256"] = len(checksums), hashlib.sha256(checksums).hexdigest()
        self.tar, self.tar_file, self.index_lines, self.checksums = None, None, [], []

    def close(self) -> None:
        self._close_current()


def sample_members(jpeg: bytes, label: int) -> dict[str, bytes]:
    """A sample's tar members, by extension."""
    return {MEMBERS["image"]: jpeg, MEMBERS["label"]: str(label).encode("ascii"),
            MEMBERS["label_int32"]: np.int32(label).astype("<i4").tobytes()}


def encoder(args):
    """`encode_sample` with the options of `args` (the command line's, or a manifest's `params`)."""
    return partial(encode_sample, max_resolution=args.max_resolution or None, jpeg_quality=args.jpeg_quality,
                   restart_markers=args.restart_markers)


def write_order(samples: list[Sample], split: str, seed: int) -> list[Sample]:
    if split != "train":
        return samples
    return [samples[i] for i in np.random.default_rng(seed).permutation(len(samples))]


def convert_split(args, split: str, samples: list[Sample], out: Path) -> SplitResult:
    final = out / split
    tmp = out / f".{split}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ordered = write_order(samples, split, args.seed)
        writer, skipped, with_markers = ShardWriter(tmp, int(args.shard_size_mb * 2**20)), [], 0
        for sample, encoded in zip(ordered, parallel_map(encoder(args), [s.path for s in ordered], args.num_workers,
                                                         f"{split}: encoding")):
            if encoded.jpeg is None:
                skipped.append(Skipped(sample.path, encoded.reason))
                continue
            with_markers += encoded.restart_markers
            writer.add(f"{writer.count:09d}", sample_members(encoded.jpeg, sample.label))
        writer.close()
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
    if args.shard_size_mb <= 0:
        raise ConversionError(f"--shard-size-mb must be > 0, got {args.shard_size_mb}")
    return run_conversion(args, "webdataset", ("webdataset",), convert_split)


def command(argv: list[str] | None = None) -> None:
    """The command line (tools/convert_wds.py, fastpipe-convert-wds): a conversion's error is one
    line on stderr and its exit code."""
    main_guard(lambda: main(argv))


if __name__ == "__main__":
    command()
