"""WebDataset tars written by another tool, read in place: per split, the tars of a folder
(`SRC/<split>/*.tar`), of a name pattern (`SRC/<split>-*.tar`) or of `--split-path
SPLIT=PATTERN` (a glob, or `{000..146}` numbering), on disk or under an s3://, gs:// or
https:// prefix.

Members group into samples as the `webdataset` package groups them: consecutive members
sharing a key (the path up to the first dot of the file name). A sample's image is its `.jpg`,
`.jpeg`, `.png` or `.webp`; its label its `.cls` (an integer as text) or a key of its `.json`
(`--label-key`). Integer labels are kept as they are; class names are labelled by their place in
the sorted names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source, canonical_split, class_list
from pipeline.convert.sources.entries import CHUNK, relabelled
from pipeline.convert.sources.tars import scanned_in_order
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.tar_members import TarDamaged, tar_members

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
DEFAULT_PATTERNS = ("{split}/*.tar", "{split}-*.tar", "{split}_*.tar")
SPLIT_STEMS = ("train", "val", "validation")
SMALL = 64 << 10              # a label member read with its header
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


@dataclass
class _RawScan:
    entries: Entries
    names: list[str]          # where labels were class names: the names, in the order their ids were given


class WebDatasetSource(Source):
    form = "webdataset"
    title = "WebDataset tars (KEY.jpg with KEY.cls or KEY.json)"
    remote_ok = True

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        if not files.listable:
            return None
        found = cls._patterns(files, ())
        return ", ".join(f"{split}: {len(names)} tars" for split, (_, names) in sorted(found.items())) or None

    @staticmethod
    def _patterns(files, split_paths) -> dict[str, tuple[str, list[str]]]:
        """{split: (pattern, tar names)}, from --split-path where given, else the usual places."""
        if split_paths:
            return {canonical_split(split): (pattern, files.list(pattern)) for split, pattern in split_paths
                    if pattern.endswith(".tar") or "*" in pattern}
        found = {}
        for stem in SPLIT_STEMS:
            for pattern in DEFAULT_PATTERNS:
                names = files.list(pattern.format(split=stem))
                if names and canonical_split(stem) not in found:
                    found[canonical_split(stem)] = (pattern.format(split=stem), names)
        return found

    def _tars(self) -> dict[str, tuple[str, list[str]]]:
        if not hasattr(self, "_found"):
            self._found = self._patterns(self.files, self.options.split_paths)
        return self._found

    def splits(self) -> list[str]:
        return sorted(split for split, (_, names) in self._tars().items() if names)

    def describe(self) -> str:
        held = ", ".join(f"{split} {len(names)} tars ({pattern})"
                         for split, (pattern, names) in sorted(self._tars().items()))
        return f"{self.files.root}: {self.title}: {held}"

    def classes(self, splits: list[str]) -> list[str]:
        numbers, names = set(), set()
        for split in splits:
            raw = self._raw(split)
            if raw.names:
                names.update(raw.names)
            else:
                numbers.update(raw.entries.distinct_labels())
        return class_list(numbers, names, f"{self.files.root}: the labels of {', '.join(splits)}")

    def _raw(self, split: str) -> _RawScan:
        """The split's samples as scanned, labels as found: integers, or places in `names`; once."""
        if not hasattr(self, "_scans"):
            self._scans = {}
        if split not in self._scans:
            self._scans[split] = self._scan_tars(split, self._tars()[split][1])
        return self._scans[split]

    def scan(self, split: str) -> Entries:
        raw = self._raw(split)
        entries = raw.entries
        if raw.names:
            place = {name: label for label, name in enumerate(self.used_classes)}
            entries.labels = relabelled(entries.labels, np.array([place[name] for name in raw.names], np.int32),
                                        self.scratch)
            raw.names = []           # relabelled once: the column now holds the classes' places
        top = max((int(entries.labels[at:at + CHUNK].max()) for at in range(0, len(entries), CHUNK)), default=-1)
        if top >= len(self.used_classes):
            raise ConversionError(f"{self.files.root}: label {top} in {split} is out of range (the classes number "
                                  f"{len(self.used_classes)})")
        return entries

    def _scan_tars(self, split: str, names: list[str]) -> _RawScan:
        """The tars' samples (read on threads, a tar each, handed on in order), labels as found."""
        builder, label_names, numbers_seen = self.builder(split), {}, False
        for number, (where, found, skipped, damage) in enumerate(scanned_in_order(self._scan_tar, names,
                                                                                   self.files.remote)):
            builder.skipped += skipped
            labels = []
            for key, label in zip(found["keys"], found["labels"]):
                if (numbers_seen and isinstance(label, str)) or (label_names and not isinstance(label, str)):
                    raise ConversionError(f"{where}:{key}: labels mix integers and class names")
                numbers_seen = numbers_seen or not isinstance(label, str)
                labels.append(label_names.setdefault(label, len(label_names)) if isinstance(label, str) else label)
            builder.add(labels, number, found["offsets"], found["sizes"], found["backs"])
            if damage:
                if self.options.strict:
                    raise ConversionError(f"{damage}; --strict stops here (without it, its samples are skipped)")
                builder.skipped.append(Skipped(where, f"{damage.reason}; the rest of it is skipped"))
        return _RawScan(builder.build(list(names)), list(label_names))

    def _scan_tar(self, name: str) -> tuple[str, dict[str, list], list[Skipped], TarDamaged | None]:
        """(where, each usable sample's key, label as found, image offset, size and header distance, the
        samples skipped, where the tar broke off) of one tar."""
        where = self.files.shown(name)
        found: dict[str, list] = {"keys": [], "labels": [], "offsets": [], "sizes": [], "backs": []}
        samples, skipped, damage = [], [], None
        try:
            for member in tar_members(lambda at, size: self.files.read_at(name, at, size), 0, self.files.size(name),
                                      where, keep_data_below=SMALL):
                key = _KEY.match(member.name)
                if member.refused or not key:
                    skipped.append(Skipped(f"{where}:{member.name}", member.refused or "not a KEY.EXTENSION name"))
                elif not samples or samples[-1][0] != key[1]:
                    samples.append((key[1], {key[2].lower(): member}))
                else:
                    samples[-1][1][key[2].lower()] = member
        except TarDamaged as error:
            damage = error
        for key, members in samples:
            image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
            label, reason = self._label(name, members)
            if image is None:
                reason = f"no image member (.{', .'.join(IMAGE_EXTENSIONS)})"
            if reason:
                skipped.append(Skipped(f"{where}:{key}", reason))
                continue
            for column, value in zip(found.values(), (key, label, image.data_at, image.size,
                                                      image.data_at - image.header_at)):
                column.append(value)
        return where, found, skipped, damage

    def _label(self, name: str, members: dict):
        """(the label as found, None) or (None, why there is none)."""
        key = self.options.label_key
        member = members.get("json") if key else members.get("cls")
        if member is None:
            return None, "no label (.cls, or .json with --label-key)" if not key else f"no .json for --label-key {key}"
        data = member.data if member.data is not None else self.files.read_at(name, member.data_at, member.size)
        text = data.decode("utf-8", "replace").strip()
        if not key:
            return (int(text), None) if text.lstrip("-").isdigit() else (None, f".cls is not an integer: {text[:40]!r}")
        try:
            value = json.loads(text)[key]
        except (ValueError, KeyError, TypeError):
            return None, f".json has no key {key!r}"
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return None, f".json's {key!r} is neither an integer nor a class name: {str(value)[:40]!r}"
        return value, None

    def fingerprint(self, split: str) -> str:
        import hashlib
        digest = hashlib.sha256(self.options.label_key.encode() if self.options.label_key else b"")
        for name in self._tars()[split][1]:
            digest.update(f"{name}\0{self.files.signature(name)}\n".encode())
        return digest.hexdigest()

    def name(self, split: str, index: int) -> str:
        from pipeline.formats.tar_members import member_name
        entries = self.entries(split)
        tar = entries.files[int(entries.file[index])]
        header = int(entries.offset[index] - entries.header_back[index])
        found = member_name(lambda at, size: self.files.read_at(tar, at, size), 0, self.files.size(tar), header)
        return f"{self.files.shown(tar)}:{found}"
