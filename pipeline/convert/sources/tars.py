"""The samples of one tar (or of a tar inside a tar) as Entries, for the forms that hold tars
(ImageNet's official files): each image member's data offset and size, labelled by `label_of`
(its name -> its label); refused members (links, paths out of the tar), names that are no image,
and a tar that breaks off are skipped with their reason, never extracted."""
from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.convert.sources.base import Entries
from pipeline.formats.imagefolder import IMAGE_EXTENSIONS, Skipped
from pipeline.formats.tar_members import ReadAt, TarDamaged, tar_members


@dataclass
class TarScan:
    entries: Entries          # its `file` column all `file`
    skipped: list[Skipped]
    damage: str | None        # where the tar broke off, if it did


def scan_tar(read_at: ReadAt, start: int, size: int, where: str, label_of: Callable[[str], int],
             file: int = 0) -> TarScan:
    """The image members of the tar `size` bytes at `start`, named `where` in messages."""
    labels, offsets, sizes, backs = array("i"), array("q"), array("q"), array("i")
    skipped, damage = [], None
    try:
        for member in tar_members(read_at, start, size, where):
            extension = os.path.splitext(member.name)[1].lower()
            if member.refused:
                skipped.append(Skipped(f"{where}:{member.name}", member.refused))
            elif extension not in IMAGE_EXTENSIONS:
                skipped.append(Skipped(f"{where}:{member.name}",
                                       f"not an image file name (extension {extension or 'none'!r})"))
            else:
                labels.append(label_of(member.name))
                offsets.append(member.data_at)
                sizes.append(member.size)
                backs.append(member.data_at - member.header_at)
    except TarDamaged as error:
        damage = str(error)
        skipped.append(Skipped(where, f"{error.reason}; the rest of it is skipped"))
    n = len(labels)
    entries = Entries(np.frombuffer(labels, np.int32).copy(), np.full(n, file, np.int32),
                      np.frombuffer(offsets, np.int64).copy(), np.frombuffer(sizes, np.int64).copy(), [],
                      header_back=np.frombuffer(backs, np.int32).copy())
    return TarScan(entries, skipped, damage)
