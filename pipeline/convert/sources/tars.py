"""The samples of one tar (or of a tar inside a tar) as columns of entries, for the forms that hold
tars (ImageNet's official files): each image member's data offset and size, labelled by `label_of`
(its name -> its label); refused members (links, paths out of the tar), names that are no image,
and a tar that breaks off are skipped with their reason, never extracted. `scanned_in_order` scans
many tars on threads (their headers are small reads), handing their results on in order."""
from __future__ import annotations

import os
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from pipeline.formats.imagefolder import IMAGE_EXTENSIONS, Skipped
from pipeline.formats.tar_members import ReadAt, TarDamaged, tar_members

# Tars scanned at once: a scan is one small read a member, a round trip each from a bucket
SCAN_THREADS = {"local": 8, "remote": 64}


@dataclass
class TarScan:
    labels: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    header_back: np.ndarray
    skipped: list[Skipped]
    damage: TarDamaged | None       # where the tar broke off, if it did

    def add_to(self, builder, file: int = 0) -> None:
        builder.add(self.labels, file, self.offsets, self.sizes, self.header_back)
        builder.skipped += self.skipped


def scan_tar(read_at: ReadAt, start: int, size: int, where: str, label_of: Callable[[str], int]) -> TarScan:
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
        damage = error
        skipped.append(Skipped(where, f"{error.reason}; the rest of it is skipped"))
    return TarScan(np.frombuffer(labels, np.int32), np.frombuffer(offsets, np.int64),
                   np.frombuffer(sizes, np.int64), np.frombuffer(backs, np.int32), skipped, damage)


def scanned_in_order(scan: Callable, items: Iterable, remote: bool) -> Iterator:
    """scan(item) for each item, on threads, in order, a few ahead of the one handed on."""
    threads = SCAN_THREADS["remote" if remote else "local"]
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(scan, item))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
