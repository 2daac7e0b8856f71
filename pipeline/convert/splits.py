"""The conversion of a source, split by split, that both converters run (`run_conversion`): find
the form SRC holds (pipeline/convert/sources/), convert each split that is not up to date with the
converter's own `convert_split`, and write the manifest (pipeline/formats/manifest.py) last. With an
s3:// or gs:// OUT, all of that happens in a local staging folder, which is then uploaded
(pipeline/convert/upload.py).

Outputs are written under temporary names and renamed into place by `convert_split`, and the
manifest is written after them, so an output that has a manifest is complete; a split whose
source and options are unchanged since the manifest was written is not converted again, and a
manifest that would say nothing new is left as it is. The manifest records each output file's size
and sha256, the source's form and a fingerprint of each split's source.
Samples that cannot be used are skipped, listed with their reason in the manifest and on
stderr; the run never stops half-way.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.in_progress import forget_work
from pipeline.convert.options import ImageOptions, RunOptions
from pipeline.convert.out_lock import out_lock
from pipeline.convert.sources import Source, open_source
from pipeline.convert.upload import add_checksums, open_destination
from pipeline.storage.atomic_files import check_writable
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.wds_shards import add_index_pack
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


@dataclass
class SplitResult:
    count: int                                  # samples a reader will read back
    skipped: list[Skipped] = field(default_factory=list)
    files: list[str] = field(default_factory=list)   # outputs, relative to OUT
    extra: dict = field(default_factory=dict)   # format-specific manifest entries
    place: Callable[[], None] | None = None     # puts outputs still kept aside in place, once all splits are done


def report_skips(skipped: list[Skipped]) -> None:
    for skip in skipped:
        log.warning("skipped %s: %s", skip.path, skip.reason)


def run_conversion(run: RunOptions, options: ImageOptions, format_name: str, libraries: tuple[str, ...],
                   convert_split: Callable[..., SplitResult | None]) -> int:
    """Find SRC's form, convert each split with `convert_split`, write the manifest; the exit code.

    `convert_split(options, run, source, split, out, identity)` writes its outputs under temporary
    names and renames them into place, before it returns or in its result's `place`, called once
    every split is converted; `identity` names what decides its output (the source, its
    fingerprint, the options). It returns None for a part of a run across machines, which writes
    no manifest. The manifest, written last, marks completion. One converter at a time writes in
    OUT (pipeline/convert/out_lock.py).
    Splits converted by an earlier run into the same OUT with the same classes and options stay
    in the manifest; a split whose source is unchanged is not converted again. An s3:// or gs://
    OUT is checked first, then converted in a staging folder and uploaded.
    """
    splits = list(run.splits)
    source = open_source(run.src, run.source, splits)
    log.info("%s", source.describe())
    for note in source.notes():
        log.info("%s", note)
    source.check_splits(splits)
    destination, out = open_destination(run, format_name)
    if not source.files.remote:
        src = Path(run.src).resolve()
        if src == out.resolve() or out.resolve() in src.parents:
            raise ConversionError(f"{out}: output folder must not contain the source folder")
    check_out_folder(out, create=False)
    with scratch_in(out) as source.scratch, out_lock(out, shared=run.part is not None):
        try:
            classes = source.classes(splits)
            source.use_classes(classes)
            where_from = source.files.root if source.files.remote else str(Path(run.src).resolve())
            record = {"format": format_name, "classes": classes, "params": options.params(), "source": where_from,
                      "source_form": source.form, "source_options": run.source.recorded()}
            previous = previous_manifest(out)
            kept, todo, fingerprints = splits_to_convert(out, previous, record, source, splits, run.force)
            # Every split is read before anything is written: a source's errors are met with OUT untouched
            if todo and not sum(len(source.entries(split)) for split in todo):
                skipped = [skip for split in todo for skip in source.entries(split).skipped]
                why = f"; {len(skipped):,} skipped, the first {skipped[0].path}: {skipped[0].reason}" if skipped else ""
                raise ConversionError(f"{source.files.root}: no image files in {', '.join(todo)}{why}")
        except OSError as error:        # the scan's columns go to OUT, which may be full; or SRC unreadable
            raise ConversionFault(f"{out}: {describe_os_error(error)} while reading {source.files.root}; nothing was "
                                  f"written, and outputs of earlier runs are intact") from None
        check_out_folder(out)
        started, converted, results = time.perf_counter(), 0, {}
        for split in todo:
            identity = {**record, "source_fingerprint": fingerprints[split]}
            results[split] = convert_one(options, run, source, split, out, convert_split, identity, classes)
            converted += len(source.entries(split))
        elapsed = time.perf_counter() - started
        if run.part:
            log.info("%s: part %d/%d written; once every part is, --finish %d writes the manifest", out, *run.part,
                     run.part[1])
            return 0
        for split, (result, split_record) in results.items():
            if result.place:
                result.place()
            kept[split] = split_record
        done = {split: kept[split] for split in sorted(kept)}
        for split, split_record in done.items():
            add_checksums(split, split_record, out)
            if "shards" in split_record:
                add_index_pack(split, split_record, out)
        content = manifest_content(record, done, source.class_names(splits), libraries)
        # A manifest that says nothing new is kept, date and all, so an upload finds it already there.
        if converted or not previous or not same_content(previous, content):
            try:
                write_manifest(out, {**content, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            except OSError as error:
                raise ConversionFault(f"{out}: {describe_os_error(error)} while writing {MANIFEST}: the new files "
                                      "are in place but the manifest is the earlier one; run again once there is "
                                      "room") from None
        for split in done:          # complete in OUT now: what a killed run left of it is of no use
            forget_work(out, split)
    rate = f", {converted / elapsed:.0f} img/s" if converted else ""
    log.info("%s: %s, %d classes, %s, %d skipped%s", out, format_name, len(classes),
             ", ".join(f"{split} {split_record['count']}" for split, split_record in done.items()),
             len(content["skipped"]), rate)
    if destination:
        destination.upload(out)
    return 1 if run.strict and any(done[s]["skipped"] for s in splits) else 0


def splits_to_convert(out: Path, previous: dict | None, record: dict, source: Source, splits: list[str],
                      force: bool) -> tuple[dict[str, dict], list[str], dict[str, str]]:
    """(the split records an earlier manifest in OUT holds that stay, the splits to convert, each
    split's source fingerprint). A split is kept only from a manifest of this version converted
    the same way: an older converter's records lack what this one writes (a webdataset split's
    per-sample checksums, say), and "convert again" must add it."""
    kept = {}
    if previous and previous.get("manifest_version") == MANIFEST_VERSION and recorded_as(previous) == record:
        kept = {split: copy.deepcopy(done) for split, done in previous["splits"].items()
                if all((out / f).exists() for f in done["files"])}
    fingerprints = {split: source.fingerprint(split) for split in splits}
    todo = [split for split in splits if force or kept.get(split, {}).get("source_fingerprint") != fingerprints[split]]
    for split in splits:
        if split not in todo:
            log.info("%s: %s is up to date (%d samples); --force converts again", out, split, kept[split]["count"])
    return kept, todo, fingerprints


def convert_one(options: ImageOptions, run: RunOptions, source: Source, split: str, out: Path,
                convert_split: Callable, identity: dict, classes: list[str]) -> tuple[SplitResult | None, dict]:
    """Convert one split; its result and its record for the manifest (None and {} for a part)."""
    entries = source.entries(split)
    report_skips(entries.skipped)
    missing_classes = [name for name, count in zip(classes, entries.label_counts(len(classes)).tolist()) if not count]
    if missing_classes:
        log.warning("warning: %s: no images for classes %s", split, missing_classes[:20])
    try:
        result = convert_split(options, run, source, split, out, identity)
    except OSError as error:
        raise ConversionFault(f"{out}: {describe_os_error(error)} while writing the {split} split; nothing of "
                              f"it looks complete and outputs of earlier runs are intact; run again once fixed") from None
    if result is None:
        return None, {}
    report_skips(result.skipped)
    return result, {"count": result.count, "files": result.files, "source_fingerprint": identity["source_fingerprint"],
                    "empty_classes": missing_classes,
                    "skipped": [s.as_dict() for s in entries.skipped + result.skipped], **result.extra}


def manifest_content(record: dict, splits: dict[str, dict], class_names: list[str] | None,
                     libraries: tuple[str, ...]) -> dict:
    return {**record, **({"class_names": class_names} if class_names else {}),
            "counts": {split: done["count"] for split, done in splits.items()},
            "skipped": [{**skip, "split": split} for split, done in splits.items() for skip in done["skipped"]],
            "versions": library_versions(*libraries), "splits": splits}


@contextlib.contextmanager
def scratch_in(out: Path):
    """A folder in OUT for what a run keeps on disk besides its outputs (a source's scanned columns,
    the write order), removed at the end, and OUT with it where the run made OUT and left nothing
    there (a source's error met before anything was written)."""
    made = not out.exists()
    scratch = out / f".scan-{os.getpid()}"
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def recorded_as(manifest: dict) -> dict:
    """What an earlier manifest says of how it was converted, in the shape `run_conversion` compares;
    one written before sources and typed options (an ImageNet-layout folder, every option in `params`
    and those that change the output in `output_params`) reads as it would have been written now."""
    return {"format": manifest.get("format"), "classes": manifest.get("classes"),
            "params": manifest.get("output_params", manifest.get("params")), "source": manifest.get("source"),
            "source_form": manifest.get("source_form", "imagefolder"),
            "source_options": manifest.get("source_options", {})}


def same_content(previous: dict, content: dict) -> bool:
    """The previous manifest says what `content` says (its version and date aside)."""
    if previous.get("manifest_version") != MANIFEST_VERSION:
        return False
    comparable = {k: v for k, v in previous.items() if k not in ("manifest_version", "created")}
    return comparable == json.loads(json.dumps(content))


def check_out_folder(out: Path, create: bool = True) -> None:
    """OUT is, or can be made (`create`: is made), a folder this process can write in; else a
    ConversionError."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; OUT must be a folder, new or from an earlier run")
    if not create and not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
            why = "Read-only file system" if parent.is_dir() and os.statvfs(parent).f_flag & os.ST_RDONLY \
                else "Permission denied" if parent.is_dir() else "Not a directory"
            raise ConversionError(f"{out}: cannot write there ({why} ({parent}))")
        return
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
