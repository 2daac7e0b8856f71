"""The conversion of an ImageNet-layout folder, split by split, that both converters run
(`run_conversion`): scan SRC, convert each split that is not up to date with the converter's
own `convert_split`, and write the manifest (pipeline/formats/manifest.py) last. With an s3:// or gs://
OUT, all of that happens in a local staging folder, which is then uploaded (pipeline/convert/upload.py).

Outputs are written under temporary names and renamed into place by `convert_split`, and the
manifest is written after them, so an output that has a manifest is complete; a split whose
source files and options are unchanged since the manifest was written is not converted again,
and a manifest that would say nothing new is left as it is. The manifest records each output
file's size and sha256.
Files that cannot be samples are skipped, listed with their reason in the manifest and on
stderr; the run never stops half-way.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

from pipeline.convert.cli import check_common_args
from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.upload import add_checksums, open_destination
from pipeline.storage.atomic_files import check_writable
from pipeline.formats.imagefolder import LayoutError, Sample, Skipped, empty_classes, find_classes, scan_split
from pipeline.formats.manifest import MANIFEST, MANIFEST_VERSION, ManifestError, read_manifest, write_manifest

log = logging.getLogger(__name__)


def library_versions(*names: str) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("numpy", "opencv-python", "pillow-simd", "pillow", *names):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def source_fingerprint(samples: Iterable[Sample]) -> str:
    """Changes when any file of the split is added, removed, resized or touched."""
    digest = hashlib.sha256()
    for sample in samples:
        stat = os.stat(sample.path)
        digest.update(f"{sample.relpath}\0{sample.label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


@dataclass
class SplitResult:
    count: int                                  # samples a reader will read back
    skipped: list[Skipped] = field(default_factory=list)
    files: list[str] = field(default_factory=list)   # outputs, relative to OUT
    extra: dict = field(default_factory=dict)   # format-specific manifest entries


def report_skips(skipped: list[Skipped]) -> None:
    for skip in skipped:
        log.warning("skipped %s: %s", skip.path, skip.reason)


# Options that do not change what is written: a manifest from a run that differed only in
# these is still up to date.
NON_OUTPUT_PARAMS = ("splits", "num_workers", "strict")
# Options not recorded at all: where the output goes, and how.
UNRECORDED_PARAMS = ("src", "out", "force", "staging", "upload_workers")


def run_conversion(args: argparse.Namespace, format_name: str, libraries: tuple[str, ...],
                   convert_split: Callable[[argparse.Namespace, str, list[Sample], Path], SplitResult]) -> int:
    """Scan SRC, convert each split with `convert_split`, write the manifest; the exit code.

    `convert_split(args, split, samples, out)` writes its outputs under temporary names and
    renames them into place before it returns; the manifest, written last, marks completion.
    Splits converted by an earlier run into the same OUT with the same classes and options
    stay in the manifest; a split whose source files are unchanged is not converted again.
    An s3:// or gs:// OUT is checked first, then converted in a staging folder and uploaded.
    """
    check_common_args(args)
    destination = open_destination(args, format_name)
    src, out = args.src, args.out
    if not src.is_dir():
        raise ConversionError(f"{src}: source folder does not exist")
    if src.resolve() == out.resolve() or out.resolve() in src.resolve().parents:
        raise ConversionError(f"{out}: output folder must not contain the source folder")
    try:
        classes = find_classes(src, args.splits)
    except LayoutError as error:
        raise ConversionError(str(error)) from None
    scans = {split: scan_split(src, split, classes) for split in args.splits}
    if not any(samples for samples, _ in scans.values()):
        raise ConversionError(f"{src}: no image files under {', '.join(args.splits)}")

    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
              if k not in UNRECORDED_PARAMS}
    output_params = {k: v for k, v in params.items() if k not in NON_OUTPUT_PARAMS}
    check_out_folder(out)
    previous = previous_manifest(out)
    kept: dict[str, dict] = {}
    # A split is kept only from a manifest of this version: an older converter's records lack what this one
    # writes (a webdataset split's per-sample checksums, say), and "convert again" must add it.
    if previous and previous.get("format") == format_name and previous.get("classes") == classes \
            and previous.get("output_params") == output_params and previous.get("source") == str(src.resolve()) \
            and previous.get("manifest_version") == MANIFEST_VERSION:
        kept = {split: copy.deepcopy(record) for split, record in previous["splits"].items()
                if all((out / f).exists() for f in record["files"])}

    started, converted = time.perf_counter(), 0
    for split, (samples, name_skips) in scans.items():
        fingerprint = source_fingerprint(samples)
        if not args.force and kept.get(split, {}).get("source_fingerprint") == fingerprint:
            log.info("%s: %s is up to date (%d samples); --force converts again", out, split, kept[split]["count"])
            continue
        report_skips(name_skips)
        missing_classes = empty_classes(samples, classes)
        if missing_classes:
            log.warning("warning: %s: no images for classes %s", src / split, missing_classes)
        try:
            result = convert_split(args, split, samples, out)
        except OSError as error:
            raise ConversionFault(f"{out}: {describe_os_error(error)} while writing the {split} split; its partial "
                                  f"output was removed and outputs of earlier runs are intact") from None
        report_skips(result.skipped)
        converted += len(samples)
        kept[split] = {"count": result.count, "files": result.files, "source_fingerprint": fingerprint,
                       "empty_classes": missing_classes,
                       "skipped": [s.as_dict() for s in name_skips + result.skipped], **result.extra}
    elapsed = time.perf_counter() - started

    splits = {split: kept[split] for split in sorted(kept)}
    for split, record in splits.items():
        add_checksums(split, record, out)
    skipped = [{**skip, "split": split} for split, record in splits.items() for skip in record["skipped"]]
    content = {
        "format": format_name,
        "classes": classes,
        "counts": {split: record["count"] for split, record in splits.items()},
        "skipped": skipped,
        "params": params,
        "output_params": output_params,
        "source": str(src.resolve()),
        "versions": library_versions(*libraries),
        "splits": splits,
    }
    # A manifest that says nothing new is kept, date and all, so an upload finds it already there.
    if converted or not previous or not same_content(previous, content):
        try:
            write_manifest(out, {**content, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        except OSError as error:
            raise ConversionFault(f"{out}: {describe_os_error(error)} while writing {MANIFEST}: the new files "
                                  "are in place but the manifest is the earlier one; run again once there is "
                                  "room") from None
    rate = f", {converted / elapsed:.0f} img/s" if converted else ""
    log.info("%s: %s, %d classes, %s, %d skipped%s", out, format_name, len(classes),
             ", ".join(f"{split} {record['count']}" for split, record in splits.items()), len(skipped), rate)
    if destination:
        destination.upload(out)
    return 1 if args.strict and any(splits[s]["skipped"] for s in args.splits) else 0


def same_content(previous: dict, content: dict) -> bool:
    """The previous manifest says what `content` says (its version and date aside)."""
    if previous.get("manifest_version") != MANIFEST_VERSION:
        return False
    comparable = {k: v for k, v in previous.items() if k not in ("manifest_version", "created")}
    return comparable == json.loads(json.dumps(content))


def check_out_folder(out: Path) -> None:
    """OUT is, or can be made, a folder this process can write in; else a ConversionError."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; OUT must be a folder, new or from an earlier run")
    try:
        check_writable(out)
    except OSError as error:
        raise ConversionError(f"{out}: cannot write there ({describe_os_error(error)})") from None


def describe_os_error(error: OSError) -> str:
    return f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")


def previous_manifest(out: Path) -> dict | None:
    """The manifest an earlier run left in OUT, or None when there is none or it cannot be used
    (unreadable, of a newer version): then everything is converted again."""
    try:
        return read_manifest(out)
    except ManifestError as error:
        log.warning("warning: %s; converting everything", error)
        return None
