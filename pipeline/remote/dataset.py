"""A converted dataset read from a URL (s3://, gs://, http(s)://): the folder a converter wrote,
served as it is by a bucket or a static web server.

The manifest is fetched at every start (it is small, and it says whether the dataset changed);
each shard's `.idx` (and checksums) is fetched once into the local cache and read from there
afterwards: all of them in a request or a few, as the split's index pack, where the converter wrote
one (`pipeline/formats/wds_shards.py`), rather than two requests a shard. The
cache folder of a dataset is named by a hash of its URL and manifest, so a dataset converted
again under the same URL never meets blocks of its old shards. Where things live:

    CACHE_DIR/<dataset>/manifest.json          a copy, for people looking at the cache
    CACHE_DIR/<dataset>/<split>/<shard>.idx    fetched once
    CACHE_DIR/<dataset>/<split>/<shard>.tar.<fetch size>.<block>.block
                                               samples, evicted past the limit
    CACHE_DIR/<dataset>/<split>.beton          an FFCV file, staged whole (pipeline/storage/staged_file.py)
                                               and checked against the manifest's size and sha256;
                                               outside the limit, as FFCV needs all of it
"""
from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.storage.atomic_files import FULL_DISK, write_bytes_atomic
from pipeline.remote.block_cache import BlockCache
from pipeline.remote.shared_blocks import FetchProcess
from pipeline.spec import parse_size
from pipeline.errors import DatasetError, RemoteDataError
from pipeline.formats.converted import CONVERTERS, ConvertedSplit, Shard, assign_members, checksum_table, split_record
from pipeline.formats.manifest import MANIFEST, ManifestError, parse_manifest
from pipeline.formats.wds_shards import PACKED, index_pack_parts
from pipeline.storage.object_store import ObjectStore, open_store
from pipeline.storage.errors import RemoteNotFound
from pipeline.storage.staged_file import stage_file

DEFAULT_CACHE_LIMIT = "16GiB"
PACK_REQUEST_BYTES = 8 << 20   # of a split's index pack a request, the requests at once
INDEX_FETCHES = 128       # .idx and .crc32 files fetched at once: a dataset has hundreds, each a round trip
FETCHES = 3               # answers asked for a file whose sha256 differs from the manifest's

log = logging.getLogger(__name__)


@dataclass
class RemoteSource:
    """Where a remote split's bytes come from and where they are kept."""
    store: ObjectStore
    cache: BlockCache
    dataset: str              # the dataset's folder in the cache
    fetch_process: Optional[FetchProcess] = None    # started early: see `_early_fetch_process`

    def take_fetch_process(self) -> Optional[FetchProcess]:
        """The fetch process started early, now the caller's to close; None if none was."""
        process, self.fetch_process = self.fetch_process, None
        return process


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fastpipe" / "datasets"


def remote_manifest(url: str, timeout_s: Optional[float] = None) -> tuple[dict, bytes, ObjectStore]:
    """The dataset manifest at URL, checked, with its bytes and the store (its requests retried
    after timeout_s without an answer)."""
    store = open_store(url, timeout_s)
    try:
        raw = store.read(MANIFEST)
    except RemoteNotFound:
        raise RemoteDataError(f"{store.where(MANIFEST)}: not found, so {store.shown} is not a finished conversion "
                              f"(or its upload was interrupted); run {' or '.join(CONVERTERS.values())} SRC URL") from None
    try:
        return parse_manifest(raw.decode("utf-8", errors="replace"), store.where(MANIFEST)), raw, store
    except ManifestError as error:
        raise DatasetError(str(error)) from None


def read_remote_converted(url: str, split: str, expected_format: str, cache_dir: Optional[str] = None,
                          cache_limit=None, fetch_timeout: Optional[float] = None, local_rank: int = 0) -> ConvertedSplit:
    """The manifest's view of one converted split at URL, its indexes in the cache; `local_rank`:
    this process's rank on its node (the first says what befalls the node's cache)."""
    manifest, raw, store = remote_manifest(url, fetch_timeout)
    kind, classes, record = split_record(manifest, store.shown, split, expected_format)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    limit = parse_size(cache_limit if cache_limit is not None else DEFAULT_CACHE_LIMIT)
    dataset = hashlib.sha256(store.shown.encode() + b"\0" + raw).hexdigest()[:16]
    folder = root / dataset
    fetch_process = _early_fetch_process(kind, record, limit)
    shards, first = [], 0
    for entry in record.get("shards", []):
        shards.append(Shard(store.where(f"{split}/{entry['tar']}"), folder / split / entry["index"], entry["count"],
                            first, object_name=f"{split}/{entry['tar']}"))
        first += entry["count"]
    with _writing_cache(root, store):
        cache = BlockCache(root, limit, first_on_node=local_rank == 0)
        (folder / split).mkdir(parents=True, exist_ok=True)
        if not (folder / MANIFEST).exists():
            write_bytes_atomic(folder / MANIFEST, raw, durable=False)
        pack = IndexPack.of(split, record, folder / split)
        with ThreadPoolExecutor(1) as beside:
            ranges = beside.submit(_check_ranges, store, shards[0].object_name) if shards else None
            _fetch_missing(store, [(f"{split}/{entry[kind]}", folder / split / entry[kind], entry.get(f"{kind}_sha256"))
                                   for entry in record.get("shards", []) for kind in PACKED if kind in entry], pack=pack)
            if ranges is not None:
                ranges.result()
        for shard, entry in zip(shards, record.get("shards", [])):
            if "checksums" in entry:
                shard.checksums = checksum_table(shard, folder / split / entry["checksums"])
        assign_members(shards, pack.members(record["count"]) if pack else None, [None] * len(shards))
        files = [Path(name) for name in record["files"]]
        if kind == "ffcv":      # FFCV memory-maps its file: read from a local copy, checked against the manifest
            files = [_staged_beton(store, record, folder)]
            if "checksums" in record:       # beside it, for data.verify=full to check the copy's samples against
                _fetch_missing(store, [(record["checksums"], folder / record["checksums"], record.get("checksums_sha256"))],
                               CONVERTERS["ffcv"])
    split_data = ConvertedSplit(folder, kind, split, classes, record["count"], files, shards, record=record)
    split_data.remote = RemoteSource(store, cache, dataset, fetch_process)
    return split_data


def _early_fetch_process(kind: str, record: dict, cache_limit: int) -> Optional[FetchProcess]:
    """Where the manifest already shows that the split will stream (its shards outweigh the cache's
    limit), the fetch process started now, so that its interpreter loads while the indexes are
    fetched rather than while the first batch waits; else None, as where it cannot start (the
    split's sources try again, and say why)."""
    sizes = [entry.get("bytes") for entry in record.get("shards", [])]
    if kind != "webdataset" or not sizes or not all(isinstance(size, int) for size in sizes):
        return None
    if sum(sizes) <= cache_limit:
        return None
    try:
        return FetchProcess()
    except OSError:
        return None


@contextmanager
def _writing_cache(root: Path, store: ObjectStore):
    """An OSError of the local cache (its disk full, read-only, not this user's) as one line: the
    store's own failures are RemoteDataErrors already."""
    try:
        yield
    except OSError as error:
        if error.errno in FULL_DISK:
            raise DatasetError(f"{root}: no room on its disk for the cache of {store.shown} ({error.strerror}); "
                               f"free some, or set data.cache_dir to a larger disk") from None
        raise DatasetError(f"{root}: the cache cannot be written there ({error.strerror}); set data.cache_dir to "
                           f"a folder this user can write") from None


def _staged_beton(store: ObjectStore, record: dict, folder: Path) -> Path:
    name = record["files"][0]
    if not isinstance(record.get("sha256"), str) or not isinstance(record.get("bytes"), int):
        raise DatasetError(f"{store.where(name)}: its manifest records no sha256 to check a copy against "
                           f"(an older converter); run {CONVERTERS['ffcv']} SRC {store.shown} again")
    return stage_file(store, name, folder / name, record["bytes"], record["sha256"])


def stage_again(data: ConvertedSplit) -> Path:
    """The staged copy of a split's .beton, found damaged since it was staged (the cache's disk), removed
    and staged again from the store, checked against its sha256."""
    data.files[0].unlink(missing_ok=True)
    return _staged_beton(data.remote.store, data.record, data.root)


def _check_ranges(store: ObjectStore, name: str) -> None:
    """A server that ignores Range and sends whole files (Python's http.server) is found here,
    beside the indexes' fetches, rather than at the first batch, where training had begun."""
    store.read_ranges(name, [(0, 1)])


def _fetch_missing(store: ObjectStore, wanted: list[tuple[str, Path, str | None]],
                   converter: str = CONVERTERS["webdataset"], pack: IndexPack | None = None) -> None:
    """Of the (name, local file, sha256) wanted, the files the cache lacks (shards' indexes and
    checksums): from the split's index pack where it has one, the others fetched INDEX_FETCHES at
    once and written by this thread as they come: 128 threads each writing its own file took about
    four times the CPU of one thread writing them all (their turns of the GIL, the folder's lock)."""
    wanted = [(name, local, sha256) for name, local, sha256 in wanted if not local.exists()]
    if pack is not None and (wanted or not pack.members_file.exists()):
        wanted = pack.unpacked(store, wanted)
    if not wanted:
        return
    with ThreadPoolExecutor(min(INDEX_FETCHES, len(wanted))) as pool:
        fetches = {pool.submit(_fetched, store, name, sha256, converter): local for name, local, sha256 in wanted}
        try:
            for fetch in as_completed(fetches):
                write_bytes_atomic(fetches[fetch], fetch.result(), durable=False)   # the first failure, as its one line
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


@dataclass
class IndexPack:
    """A split's index pack in the store (`pipeline/formats/wds_shards.py`): its shards' indexes and
    checksums, then the split's member table, which the cache keeps as a file of its own."""
    name: str                               # in the store
    parts: dict[str, tuple[int, int]]       # (start, end) in it of each shard's file, by its name in the store
    size: int
    sha256: str
    members_at: int
    members_file: Path                      # in the cache

    @classmethod
    def of(cls, split: str, record: dict, folder: Path) -> IndexPack | None:
        """The split's pack; None where it has none (converted before packs, or repaired since)."""
        pack = record.get("index_pack")
        if not isinstance(pack, dict) or not isinstance(pack.get("members_at"), int):
            return None
        parts = index_pack_parts(record.get("shards", []))
        if not parts or max(end for _, end in parts.values()) != pack["members_at"]:
            return None
        return cls(f"{split}/{pack['file']}", {f"{split}/{name}": span for name, span in parts.items()},
                   pack["bytes"], pack["sha256"], pack["members_at"], folder / f"{pack['file']}.members")

    def members(self, count: int) -> np.ndarray | None:
        """The split's member table as the cache keeps it; None where it does not (the indexes are parsed)."""
        try:
            table = np.fromfile(self.members_file, "<i8")
        except FileNotFoundError:
            return None
        return table.reshape(-1, 3) if len(table) == 3 * count else None

    def unpacked(self, store: ObjectStore, wanted: list[tuple[str, Path, str | None]]) -> list:
        """Writes the pack's member table and the wanted files into the cache from the pack, fetched
        PACK_REQUEST_BYTES a request, the requests at once; returns the wanted files it could not
        give as the manifest records them (damaged, or older than a repair), to be fetched one by
        one, or all of them where the store has no pack."""
        pieces = [(at, min(at + PACK_REQUEST_BYTES, self.size)) for at in range(0, self.size, PACK_REQUEST_BYTES)]
        try:
            if len(pieces) == 1:
                data = store.read(self.name)
            else:
                data = bytearray(self.size)
                with ThreadPoolExecutor(len(pieces)) as pool:
                    for (start, end), [piece] in zip(pieces, pool.map(lambda at: store.read_ranges(self.name, [at]),
                                                                      pieces)):
                        data[start:end] = piece
        except RemoteNotFound as error:     # its upload lost: what else the store refuses stops the run, in a line
            log.warning("%s; fetching the shards' indexes one by one instead", error)
            return wanted
        whole = hashlib.sha256(data).hexdigest() == self.sha256
        if whole:
            write_bytes_atomic(self.members_file, memoryview(data)[self.members_at:], durable=False)
        left = []
        for name, local, sha256 in wanted:
            start, end = self.parts.get(name, (0, 0))
            part = memoryview(data)[start:end]
            if name in self.parts and (whole or sha256 is None or hashlib.sha256(part).hexdigest() == sha256):
                write_bytes_atomic(local, part, durable=False)
            else:
                left.append((name, local, sha256))
        if not whole:
            log.warning("%s: its sha256 differs from the manifest's (damaged, or older than a repair): the shards' "
                        "indexes are parsed, and %d of its parts that differ from their files are fetched one by one",
                        store.where(self.name), sum(name in self.parts for name, _, _ in left))
        return left


def _fetched(store: ObjectStore, name: str, sha256: str | None = None,
             converter: str = CONVERTERS["webdataset"]) -> bytes:
    """A shard's index (or checksums), checked against the manifest's sha256 where it records one:
    an answer damaged in transit is fetched again, FETCHES times at most."""
    for _ in range(FETCHES):
        data = store.read(name)
        if sha256 is None or hashlib.sha256(data).hexdigest() == sha256:
            return data
    raise RemoteDataError(f"{store.where(name)}: its sha256 differs from the manifest's, in {FETCHES} answers: the "
                          f"stored file is damaged; run {converter} again")
