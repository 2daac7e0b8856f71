"""The dataset manifest, `manifest.json` beside a converted dataset's files: the one place that
writes it (for the converters) and reads it (for the loaders), with its format version.

A converter writes it last and atomically (pipeline/storage/atomic_files.py), so an output folder that
has one is complete. It holds at least `manifest_version` and `format` (ffcv, webdataset); the
converters add the classes, per-split records (files, counts, shards) and how it was made.
A reader refuses, in one line naming the file, a manifest that does not parse or that a newer
version of the converters wrote: its fields may not mean what this code takes them to.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.storage.atomic_files import write_bytes_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 3          # raise it when a field changes meaning or a reader needs a new one
# 2: a webdataset shard's per-sample checksums (`checksums`); a version-1 dataset reads, unchecked
# 3: an FFCV split's per-sample checksums (`checksums`, `layout_crc32`); a version-2 .beton reads, unchecked
DETAIL_CHARS = 160            # of a parser's complaint, so the error stays one short line
AGAIN = "convert the dataset again"    # how every error ends: a reader may add the command


class ManifestError(ValueError):
    """A manifest that is there but cannot be used; the message is one line naming the file."""


def manifest_path(root: str | Path) -> Path:
    return Path(root) / MANIFEST


def write_manifest(root: str | Path, content: dict) -> Path:
    """Write `content`, with this code's `manifest_version`, as ROOT/manifest.json, atomically
    and durably (its presence marks the output complete); returns the file."""
    path = manifest_path(root)
    text = json.dumps({"manifest_version": MANIFEST_VERSION, **content}, indent=2, ensure_ascii=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))
    return path


def read_manifest(root: str | Path) -> dict | None:
    """ROOT's manifest, or None when there is none; a ManifestError when it does not parse, is
    not a manifest, or is of a version newer than MANIFEST_VERSION."""
    path = manifest_path(root)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: unreadable ({_short(error)}); {AGAIN}") from None
    return parse_manifest(text, str(path))


def parse_manifest(text: str, where: str) -> dict:
    """The manifest in `text`, read from `where` (a path, or a URL already redacted), checked as
    read_manifest checks it."""
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise ManifestError(f"{where}: not valid JSON ({_short(error)}); {AGAIN}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), str):
        raise ManifestError(f"{where}: not a dataset manifest (no 'format'); {AGAIN}")
    version = manifest.get("manifest_version")
    if version is None:
        raise ManifestError(f"{where}: written without a manifest_version (by an older converter); {AGAIN}")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ManifestError(f"{where}: not a dataset manifest (manifest_version {_short(version)}); {AGAIN}")
    if version > MANIFEST_VERSION:
        raise ManifestError(f"{where}: manifest version {version} is newer than this code reads "
                            f"(up to {MANIFEST_VERSION}): update this code, or {AGAIN} with this one")
    return manifest


def _short(value) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."
