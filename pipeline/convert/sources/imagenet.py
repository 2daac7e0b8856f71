"""ImageNet as image-net.org hands it out, read in place: `ILSVRC2012_img_train.tar` (one tar per
class, `<wnid>.tar`, inside), `ILSVRC2012_img_val.tar` (50,000 flat `ILSVRC2012_val_%08d.JPEG`) and
`ILSVRC2012_devkit_t12.tar.gz`, on disk or under an s3://, gs:// or https:// prefix.

Nothing is extracted: a train image is read at its offset inside its class tar inside the train tar.
Val labels come from the devkit's `data/ILSVRC2012_validation_ground_truth.txt`, one ILSVRC2012_ID a
line in file-number order, each mapped to a WNID through the leaf synsets (`num_children == 0`) of
`data/meta.mat`, read as torchvision reads it. The IDs are not the sorted-WNID order (ID 1 is
n02119789): labels here are the sorted WNIDs' places, as the folder form and torchvision's `ImageNet`
give them, so a model trained from one form evaluates on another. Class names are the devkit's words.
"""
from __future__ import annotations

import io
import re
import tarfile
from bisect import bisect_right

import numpy as np

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Source
from pipeline.convert.sources.tars import TarScan, scan_tar, scanned_in_order
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.tar_members import TarDamaged, member_name, tar_members

TRAIN, VAL, DEVKIT = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"
TESTS = ("ILSVRC2012_img_test_v10102019.tar", "ILSVRC2012_img_test.tar")
META, GROUND_TRUTH = "data/meta.mat", "data/ILSVRC2012_validation_ground_truth.txt"
VAL_NAME = re.compile(r"^ILSVRC2012_val_(\d{8})\.JPEG$")
CLASS_TAR = re.compile(r"^(n\d{8})\.tar$")


class ImageNetSource(Source):
    form = "imagenet"
    title = "ImageNet's official files (ILSVRC2012_img_train.tar, _val.tar, the devkit)"
    remote_ok = True

    @classmethod
    def found(cls, files, splits: list[str]) -> str | None:
        held = [name for name in (TRAIN, VAL, DEVKIT) if files.exists(name)]
        return ", ".join(held) if {TRAIN, VAL} & set(held) else None

    def splits(self) -> list[str]:
        return [split for split, name in (("train", TRAIN), ("val", VAL)) if self.files.exists(name)]

    def notes(self) -> list[str]:
        return [f"{self.files.shown(name)}: the test images have no labels (not a labelled split): skipped"
                for name in TESTS if self.files.exists(name)]

    def _devkit(self) -> tuple[dict[int, tuple[str, str]], list[int]]:
        """({ILSVRC2012_ID: (WNID, words)} of the leaf synsets, the val ground truth's IDs)."""
        if hasattr(self, "_kit"):
            return self._kit
        where = self.files.shown(DEVKIT)
        if not self.files.exists(DEVKIT):
            raise ConversionError(f"{where}: missing; the val labels and the class list come from it (image-net.org "
                                  f"hands it out beside the tars)")
        try:
            with tarfile.open(fileobj=io.BytesIO(self.files.read(DEVKIT)), mode="r:*") as kit:
                found = {name: kit.extractfile(member) for member in kit.getmembers()
                         for name in (META, GROUND_TRUTH) if member.isfile() and member.name.endswith(name)}
                contents = {name: file.read() for name, file in found.items()}
        except (tarfile.TarError, OSError, EOFError) as error:
            raise ConversionError(f"{where}: not a readable tar.gz ({error})") from None
        for name in (META, GROUND_TRUTH):
            if name not in contents:
                raise ConversionError(f"{where}: has no {name}")
        leaves = read_leaf_synsets(contents[META], f"{where}:{META}")
        truth = []
        for number, line in enumerate(contents[GROUND_TRUTH].decode("ascii", "replace").splitlines(), 1):
            if not line.strip():
                continue
            if not line.strip().isdigit() or int(line) not in leaves:
                raise ConversionError(f"{where}:{GROUND_TRUTH}: line {number}: {line.strip()!r} is no ILSVRC2012_ID "
                                      f"of a leaf synset in {META}")
            truth.append(int(line))
        self._kit = leaves, truth
        return self._kit

    def classes(self, splits: list[str]) -> list[str]:
        if not self.files.exists(DEVKIT) and splits == ["train"]:
            return sorted(CLASS_TAR.match(m.name)[1] for m in self._class_tars() if CLASS_TAR.match(m.name))
        return sorted(wnid for wnid, _ in self._devkit()[0].values())

    def class_names(self, splits: list[str]) -> list[str] | None:
        if not self.files.exists(DEVKIT):
            return None
        words = dict(self._devkit()[0].values())
        return [words[wnid] for wnid in self.classes(splits)]

    def _class_tars(self):
        if not hasattr(self, "_outer"):
            size = self.files.size(TRAIN)
            try:
                self._outer = list(tar_members(self._reader(TRAIN), 0, size, self.files.shown(TRAIN)))
            except TarDamaged as error:
                raise ConversionError(str(error)) from None
        return self._outer

    def _reader(self, name: str):
        return lambda offset, size: self.files.read_at(name, offset, size)

    def scan(self, split: str) -> Entries:
        return self._scan_train() if split == "train" else self._scan_val()

    def _scan_train(self) -> Entries:
        place = {wnid: label for label, wnid in enumerate(self.used_classes)}
        where, builder, tars = self.files.shown(TRAIN), self.builder("train"), []
        for member in self._class_tars():
            found = CLASS_TAR.match(member.name)
            if member.refused or not found:
                builder.skipped.append(Skipped(f"{where}:{member.name}",
                                               member.refused or "not a class tar (<wnid>.tar)"))
            elif found[1] not in place:
                raise ConversionError(f"{where}:{member.name}: {found[1]} is not a class of the devkit's leaf synsets")
            else:
                tars.append((member, place[found[1]]))

        def scan_class(item) -> TarScan:
            member, label = item
            return scan_tar(self._reader(TRAIN), member.data_at, member.size, f"{where}:{member.name}",
                            lambda name: label)
        self._containers = [(member.data_at, member.size, member.name) for member, _ in tars]
        for scan in scanned_in_order(scan_class, tars, self.files.remote):
            if scan.damage:
                self._damaged(scan.damage)
            scan.add_to(builder)
        return builder.build([TRAIN])

    def _damaged(self, damage: TarDamaged) -> None:
        if self.options.strict:
            raise ConversionError(f"{damage}; --strict stops here (without it, its samples are skipped)")

    def _scan_val(self) -> Entries:
        leaves, truth = self._devkit()
        place = {wnid: label for label, wnid in enumerate(self.used_classes)}
        where, size = self.files.shown(VAL), self.files.size(VAL)
        seen = set()

        def label_of(name: str) -> int:
            found = VAL_NAME.match(name.rsplit("/", 1)[-1])
            if not found:
                raise ConversionError(f"{where}:{name}: not a val image name (ILSVRC2012_val_%08d.JPEG)")
            number = int(found[1])
            if not 1 <= number <= len(truth):
                raise ConversionError(f"{where}:{name}: has no line in the devkit's ground truth "
                                      f"({len(truth):,} lines)")
            seen.add(number)
            return place[leaves[truth[number - 1]][0]]
        scan = scan_tar(self._reader(VAL), 0, size, where, label_of)
        if scan.damage:
            self._damaged(scan.damage)
        elif len(truth) > len(seen):
            raise ConversionError(f"{self.files.shown(DEVKIT)}:{GROUND_TRUTH}: {len(truth):,} lines for "
                                  f"{len(seen):,} images in {where}")
        self._val_size = size
        builder = self.builder("val")
        scan.add_to(builder)
        return builder.build([VAL])

    def _member(self, tar: str, container_at: int, container_size: int, header_at: int) -> str:
        return member_name(self._reader(tar), container_at, container_size, header_at)

    def name(self, split: str, index: int) -> str:
        entries = self.entries(split)
        header_at = int(entries.offset[index] - entries.header_back[index])
        if split != "train":
            return f"{self.files.shown(VAL)}:{self._member(VAL, 0, self._val_size, header_at)}"
        starts = [start for start, _, _ in self._containers]
        start, size, inner = self._containers[bisect_right(starts, header_at) - 1]
        return f"{self.files.shown(TRAIN)}:{inner}:{self._member(TRAIN, start, size, header_at)}"

    def fingerprint(self, split: str) -> str:
        import hashlib
        kit = self.files.signature(DEVKIT) if self.files.exists(DEVKIT) else "none"
        tar = TRAIN if split == "train" else VAL
        return hashlib.sha256(f"{tar}\0{self.files.signature(tar)}\0{DEVKIT}\0{kit}\n".encode()).hexdigest()


def read_leaf_synsets(data: bytes, where: str) -> dict[int, tuple[str, str]]:
    """{ILSVRC2012_ID: (WNID, words)} of the leaf synsets of a devkit's meta.mat (MATLAB v5)."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise ConversionError("reading the devkit's meta.mat needs scipy (pip install scipy)") from None
    try:
        synsets = loadmat(io.BytesIO(data), squeeze_me=True)["synsets"]
        rows = [(int(s["ILSVRC2012_ID"]), str(s["WNID"]), str(s["words"]), int(s["num_children"]))
                for s in np.atleast_1d(synsets)]
    except Exception as error:  # noqa: BLE001 - scipy's and numpy's many ways to fail on a bad file
        raise ConversionError(f"{where}: unreadable ({type(error).__name__}: {error})") from None
    leaves = {number: (wnid, words) for number, wnid, words, children in rows if children == 0}
    if not leaves:
        raise ConversionError(f"{where}: no leaf synsets (num_children == 0)")
    return leaves
