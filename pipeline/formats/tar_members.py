"""A tar's members where they lie, read from their headers alone: each member's name, the offset
of its data and its size, so that a member is later read with one ranged read and nothing is
ever extracted. Nested too: a member of a tar inside a tar (ImageNet's train tar holds one tar per
class) lies at the inner tar's data offset plus its own, in the outer file.

Headers are parsed by Python's `tarfile` (ustar, GNU and pax, long names included) over a window
of the file read through `read_at(offset, size)` (pipeline/storage/range_file.py), so the same code
reads a local file (a pread) or an object in a bucket (a range request). Each read fetches at least
`readahead` bytes: tarfile checks the byte before each header, which then comes in the same read,
and a small member's data (a WebDataset label) with it.
"""
from __future__ import annotations

import posixpath
import tarfile
from dataclasses import dataclass
from typing import Iterator

from pipeline.storage.range_file import RangeFile, ReadAt

READAHEAD = 4096


@dataclass(frozen=True)
class TarMember:
    name: str
    header_at: int      # where its first header starts (a pax or GNU long-name header included)
    data_at: int        # where its data starts
    size: int
    refused: str | None = None   # why it cannot be a sample though it is in the tar: a link, a path out
    data: bytes | None = None    # its data, where it came with the header read (small members only)


class TarDamaged(ValueError):
    """The tar is not one, or ends or breaks before its end: `where` (the tar), and `reason`."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def refusal(info: tarfile.TarInfo) -> str | None:
    """Why a member cannot be a sample, or None: only regular files inside the tar can."""
    if info.issym() or info.islnk():
        return f"refused: a link (to {info.linkname!r}), not a file"
    name = info.name.replace("\\", "/")
    if name.startswith("/") or ".." in posixpath.normpath(name).split("/"):
        return "refused: its path leads out of the tar"
    if not info.isreg():
        return "not a file (a folder or a device)"
    return None


def tar_members(read_at: ReadAt, start: int, length: int, where: str, keep_data_below: int = 0,
                readahead: int = READAHEAD) -> Iterator[TarMember]:
    """Every member of the tar that is `length` bytes at `start` in the file `read_at` reads, in
    order, with absolute offsets; folders are left out. A member of up to `keep_data_below` bytes
    comes with its data. A TarDamaged naming `where` and the last good member where the tar is not
    one or breaks; the members before come first."""
    window = RangeFile(read_at, start, length, max(readahead, keep_data_below + 2 * tarfile.BLOCKSIZE))
    last = "its start"
    try:
        tar = tarfile.open(fileobj=window, mode="r:")
    except tarfile.TarError as error:
        raise TarDamaged(where, f"not a tar ({error})") from None
    while True:
        try:
            info = tar.next()
        except tarfile.TarError as error:
            raise TarDamaged(where, f"damaged or truncated after {last} ({error})") from None
        if info is None:
            return
        tar.members.clear()         # tarfile keeps every member read; a scan needs none of them
        if info.isdir():
            continue
        if info.offset_data + info.size > length:
            raise TarDamaged(where, f"truncated: {info.name} needs {info.offset_data + info.size:,} bytes, the "
                                    f"tar has {length:,}")
        data = window.held(info.offset_data, info.size) if info.size <= keep_data_below else None
        yield TarMember(info.name, start + info.offset, start + info.offset_data, info.size, refusal(info), data)
        last = info.name


def member_name(read_at: ReadAt, container_start: int, container_length: int, header_at: int) -> str:
    """The name of the member whose headers start at `header_at`, in the tar `container_length`
    bytes at `container_start` (read again only for a message, so scans need not keep names)."""
    window = RangeFile(read_at, container_start, container_length, READAHEAD)
    window.seek(header_at - container_start)
    try:
        info = tarfile.TarFile(fileobj=window, mode="r").firstmember
    except tarfile.TarError:
        info = None
    return info.name if info is not None else f"the member at byte {header_at:,}"
