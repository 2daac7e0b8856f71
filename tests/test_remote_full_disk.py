"""A node's cache disk with too little room, on a real small file system (a tmpfs the test
mounts): a split that does not fit streams through memory from the start; a disk that fills
mid-epoch neither stops the run nor leaves partial files, and the batches stay those of local
disk; a cache with no room at all hands blocks over in memory; a cache that cannot be written
at all (full, read-only) is one line before anything is read."""
from __future__ import annotations

import logging
import os

import pytest

from pipeline import build_loader
from pipeline.remote.block_cache import BLOCK_SUFFIX, BlockCache
from pipeline.errors import DatasetError
from conftest import fill
from test_remote_loader import assert_same, batches, photos_server, spec  # noqa: F401 (a fixture)

MIB = 1 << 20


def partial_files(root) -> list:
    return [path for path in root.rglob("*") if ".tmp-" in path.name]


@pytest.fixture
def said(caplog):
    """What was logged since the last call, a message a line, info and above from pipeline/."""
    caplog.set_level(logging.INFO, logger="pipeline")

    def since_last():
        lines = [line for record in caplog.records for line in record.getMessage().splitlines()]
        caplog.clear()
        return lines
    return since_last


def test_a_split_the_disk_has_no_room_for_streams_through_memory(converted_sets, photos_server, tmpfs, said):
    disk = tmpfs("disk", "2m")        # the split is 2.5 MiB
    remote = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=disk, cache_limit="1GiB"))
    lines = said()
    assert remote.stored.in_memory and remote.stored.split_bytes < (1 << 30)
    assert len(lines) == 1 and str(disk) in lines[0] and "streams through memory" in lines[0], lines
    assert_same(batches(build_loader(spec(converted_sets["photos"]["webdataset"]))), batches(remote))
    assert not list(disk.rglob(f"*{BLOCK_SUFFIX}"))


def test_a_disk_that_fills_mid_epoch_loses_nothing_and_the_split_then_streams(converted_sets, photos_server, tmpfs,
                                                                              said):
    disk = tmpfs("disk", "8m")
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    remote = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=disk, cache_limit="1GiB",
                               fetch_size="64KiB"))
    assert not remote.stored.in_memory          # it fits, until other files take the disk
    fill(disk, MIB)
    assert_same(batches(local, epoch=0), batches(remote, epoch=0))
    cache = remote.stored.source.cache
    lines = said()
    assert len(lines) == 1 and str(disk) in lines[0] and "disk is full" in lines[0], lines
    assert 0 < cache.limit < remote.stored.split_bytes
    assert not partial_files(disk)
    assert list(disk.rglob(f"*{BLOCK_SUFFIX}"))     # it kept what it had room for

    assert_same(batches(local, epoch=1), batches(remote, epoch=1))
    assert remote.stored.in_memory
    lines = said()
    assert len(lines) == 1 and "streams through memory from now on" in lines[0], lines
    assert not partial_files(disk)


def test_a_block_the_disk_has_no_room_for_is_read_from_memory(tmpfs):
    disk = tmpfs("disk", "4m")
    cache = BlockCache(disk / "cache", limit=1 << 30)
    data = os.urandom(MIB + 123)
    fill(disk)
    fd = cache.open("dataset/train/shard-000000.tar.1048576.7", lambda: data)
    try:
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
    assert cache.get("dataset/train/shard-000000.tar.1048576.8", lambda: data) is None
    assert cache.fetches == 2 and cache.limit == 0
    assert not partial_files(disk) and not list(disk.rglob(f"*{BLOCK_SUFFIX}"))


@pytest.mark.parametrize("backend", ["webdataset", "ffcv"])
@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_cache_that_cannot_be_written_is_one_line(converted_sets, photos_server, tmpfs, disk, backend):
    place = tmpfs("disk", "1m", read_only=disk == "read-only")
    if disk == "full":
        fill(place)
    with pytest.raises(DatasetError) as caught:
        build_loader(spec(f"{photos_server.url}/{converted_sets['photos'][backend].name}", backend=backend,
                          cache_dir=place / "cache"))
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{place / 'cache'}: ") and "data.cache_dir" in text, text
    assert ("no room" if disk == "full" else "Read-only file system") in text, text
