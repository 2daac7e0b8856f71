"""Converting to object storage: with an s3:// or gs:// OUT the converters convert into a local
staging folder (`staging_folder`), then `Destination.upload` copies every file the staging
manifest lists and the manifest last, so a prefix that has a manifest is complete.

Each object carries its sha256 as user metadata (x-amz-meta-sha256 on S3); a re-run skips objects
whose size and sha256 already match, so an interrupted upload resumes where it stopped. A
manifest from an earlier upload is deleted before anything else changes at the destination, so a
half-updated prefix never looks finished. Large files go up in parts (obstore's multipart put).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.errors import RemoteDataError
from pipeline.formats.manifest import MANIFEST, ManifestError, read_manifest, write_manifest
from pipeline.formats.wds_shards import ShardFile, ShardRecord
from pipeline.storage.atomic_files import sha256_file
from pipeline.storage.object_store import open_store
from pipeline.storage.errors import describe_error
from pipeline.storage.urls import redact
from pipeline.progress import Progress

log = logging.getLogger(__name__)

UPLOAD_SCHEMES = ("s3", "gs")
CHECKSUM = "sha256"                  # the user-metadata key; S3 keeps such keys lower-case
PART_BYTES = 8 << 20                 # smallest multipart part; S3 wants >= 5 MiB
MAX_PARTS = 9000                     # S3 allows 10,000 parts: parts grow for larger files
MiB = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_destination_url(out: str) -> bool:
    """OUT names a remote destination (any scheme://), not a local folder."""
    return bool(_URL.match(out))


def staging_folder(url: str, format_name: str) -> Path:
    """The default staging folder: the same one for the same destination, so a re-run finds
    what an earlier run converted."""
    key = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fastpipe-staging-{os.getuid()}" / f"{format_name}-{key}"


def add_checksums(split: str, record: dict, folder: Path) -> bool:
    """Fill in the size and sha256 of a split record's files where the converter did not (a
    record kept from an older converter's manifest); True if anything was added."""
    added = False
    for number, shard in enumerate(record.get("shards", [])):
        kept = ShardRecord.from_dict(shard)
        files = {kind: file if file.sha256 else ShardFile(file.name, (folder / split / file.name).stat().st_size,
                                                          sha256_file(folder / split / file.name))
                 for kind, file in kept.files().items()}
        if files != kept.files():
            record["shards"][number] = {**shard, **ShardRecord(kept.count, **files).as_dict()}
            added = True
    if "shards" not in record and len(record.get("files", [])) == 1 and "sha256" not in record:
        path = folder / record["files"][0]
        record["bytes"], record["sha256"], added = path.stat().st_size, sha256_file(path), True
    return added


def listed_files(manifest: dict) -> dict[str, tuple[int | None, str | None]]:
    """Every file a manifest lists, relative to its folder: (bytes, sha256) as recorded, None
    where it records none."""
    files = {}
    for split, record in manifest.get("splits", {}).items():
        for name in record.get("files", []):
            files[name] = (None, None)
        for shard in record.get("shards", []):
            for file in ShardRecord.from_dict(shard).files().values():
                files[f"{split}/{file.name}"] = (file.bytes, file.sha256)
        if "index_pack" in record:
            files[f"{split}/{record['index_pack']['file']}"] = (record["index_pack"]["bytes"], record["index_pack"]["sha256"])
        if record.get("files") and "shards" not in record:        # FFCV: the .beton, then its checksums
            files[record["files"][0]] = (record.get("bytes"), record.get("sha256"))
            if "checksums" in record:
                files[record["checksums"]] = (record.get("checksums_bytes"), record.get("checksums_sha256"))
    return files


class Destination:
    """An s3:// or gs:// prefix to upload a converted dataset to; opening it lists it, so a
    missing bucket or refused credentials stop the run before anything is converted."""

    def __init__(self, url: str, workers: int = 4):
        scheme = urlsplit(url).scheme.lower()
        if scheme not in UPLOAD_SCHEMES:
            raise ConversionError(f"{redact(url)}: cannot upload there; uploads need s3:// or gs:// "
                                  "(or give a local folder)")
        try:
            self.store = open_store(url)
        except RemoteDataError as error:
            raise ConversionError(str(error)) from None
        self.client, self.workers, self.shown = self.store.client, workers, self.store.shown
        self.scheme, self.bucket = scheme, urlsplit(url).hostname
        self.stop = threading.Event()
        self.listing(first_only=True)

    def listing(self, first_only: bool = False) -> dict[str, int]:
        """{name: size} of the objects under the prefix (first_only: one page, a check)."""
        import obstore
        found = {}
        try:
            for chunk in obstore.list(self.client, chunk_size=1 if first_only else 1000):
                found.update((meta["path"], int(meta["size"])) for meta in chunk)
                if first_only:
                    break
        except Exception as error:  # noqa: BLE001 - obstore's classes; described below
            text = describe_error(error, self.scheme, self.bucket)
            if text.startswith("not found"):
                raise ConversionError(f"{self.shown}: the bucket does not exist (404)") from None
            if first_only:      # nothing is converted or uploaded yet: a bad destination
                raise ConversionError(f"{self.shown}: cannot list the destination: {text}") from None
            raise self._failure("", error, "cannot list the destination") from None
        return found

    def upload(self, staging: Path) -> None:
        """Upload what the staging manifest lists, unless already there, then the manifest."""
        try:
            manifest = read_manifest(staging)
        except ManifestError as error:
            raise ConversionFault(str(error)) from None
        if manifest is None:
            raise ConversionFault(f"{staging / MANIFEST}: missing, so there is nothing finished to upload")
        local = {}
        for name, (size, digest) in {**listed_files(manifest), MANIFEST: (None, None)}.items():
            path = staging / name
            actual = path.stat().st_size if path.exists() else None
            if actual is None or (size is not None and actual != size):
                raise ConversionFault(f"{path}: {'missing' if actual is None else f'{actual} bytes'} where the "
                                      f"manifest says {size} bytes; convert again with --force")
            local[name] = (actual, digest or sha256_file(path))
        remote = self.listing()
        with ThreadPoolExecutor(self.workers * 4) as pool:
            there = dict(zip(local, pool.map(lambda item: self._holds(item[0], *item[1], remote), local.items())))
        todo = [name for name in local if name != MANIFEST and not there[name]]
        if not todo and there[MANIFEST]:
            log.info("%s: up to date (%d objects)", self.shown, len(local))
            return
        if MANIFEST in remote:
            self._delete(MANIFEST)      # from here on the prefix does not look finished
        total = sum(local[name][0] for name in todo)
        if todo:
            self._put_all(staging, todo, local, total)
        self._put(staging, MANIFEST, *local[MANIFEST], None)
        log.info("%s: uploaded %d files (%s MiB) and %s; %d were there already", self.shown, len(todo),
                 f"{total / MiB:,.1f}", MANIFEST, len(local) - 1 - len(todo))
        stale = sorted(set(remote) - set(local))
        if stale:
            log.info("%s: %d objects there are not in this manifest (from an earlier conversion, e.g. %s); left "
                     "as they are", self.shown, len(stale), stale[0])

    def replace(self, staging: Path, names: list[str], manifest: dict | None) -> None:
        """Upload `names` from `staging` over what the destination holds (a repair: their metadata
        may vouch for bytes damaged since), then `manifest`, where given, as the new manifest; the
        earlier one is deleted first, so that the prefix never looks finished with records that
        do not match its files."""
        if manifest is not None:
            self._delete(MANIFEST)
        local = {name: ((staging / name).stat().st_size, sha256_file(staging / name)) for name in names}
        self._put_all(staging, names, local, sum(size for size, _ in local.values()))
        if manifest is not None:
            write_manifest(staging, manifest)
            self._put(staging, MANIFEST, (staging / MANIFEST).stat().st_size, sha256_file(staging / MANIFEST), None)

    def _put_all(self, staging: Path, todo: list[str], local: dict, total: int) -> None:
        progress = Progress(-(-total // MiB), f"uploading to {self.shown}", unit="MiB")
        counter = _MiBCounter(progress)
        pool = ThreadPoolExecutor(self.workers)
        try:
            for _ in pool.map(lambda name: self._put(staging, name, *local[name], counter), todo):
                pass
            counter.complete()
        except KeyboardInterrupt:
            self.stop.set()         # the parts of a large file stop; small files in flight finish
            raise KeyboardInterrupt(f"the upload to {self.shown} is incomplete and has no {MANIFEST}; "
                                    "run the same command again to resume") from None
        except BaseException:
            self.stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            progress.close()

    def _holds(self, name: str, size: int, digest: str, remote: dict[str, int]) -> bool:
        """The destination has `name` with this size and sha256 (its metadata, from our upload)."""
        import obstore
        if remote.get(name) != size:
            return False
        try:
            return obstore.get(self.client, name, options={"head": True}).attributes.get(CHECKSUM) == digest
        except FileNotFoundError:       # deleted since the listing
            return False
        except Exception as error:  # noqa: BLE001
            raise self._failure(name, error, "cannot read its metadata") from None

    def _put(self, staging: Path, name: str, size: int, digest: str, counter: _MiBCounter | None) -> None:
        import obstore
        if self.stop.is_set():
            return
        path = staging / name
        part = max(PART_BYTES, -(-size // MAX_PARTS))
        try:
            if size <= part:
                obstore.put(self.client, name, path, attributes={CHECKSUM: digest}, use_multipart=False)
                if counter:
                    counter.add(size)
            else:
                obstore.put(self.client, name, self._chunks(path, part, counter), attributes={CHECKSUM: digest},
                            use_multipart=True, chunk_size=part, max_concurrency=4)
        except Exception as error:  # noqa: BLE001
            if self.stop.is_set():
                raise KeyboardInterrupt from None
            raise self._failure(name, error, "upload failed") from None

    def _chunks(self, path: Path, part: int, counter: _MiBCounter | None):
        """The file in parts, counted as obstore takes them; stops the put when asked to."""
        with open(path, "rb") as f:
            while chunk := f.read(part):
                if self.stop.is_set():
                    raise KeyboardInterrupt     # obstore aborts the multipart upload
                yield chunk
                if counter:
                    counter.add(len(chunk))

    def _delete(self, name: str) -> None:
        import obstore
        try:
            obstore.delete(self.client, name)
        except Exception as error:  # noqa: BLE001
            raise self._failure(name, error, "cannot delete the earlier manifest") from None

    def _failure(self, name: str, error: BaseException, action: str) -> Exception:
        """A refused request is a ConversionError (exit 2); anything else a fault to retry (exit 1)."""
        where = self.store.where(name) if name else self.shown
        text = describe_error(error, self.scheme, self.bucket)
        if text.startswith(("access denied", "no credentials", "not found", "the bucket is in")):
            return ConversionError(f"{where}: {action}: {text}")
        return ConversionFault(f"{where}: {action}: {text}; run again to resume (what is uploaded stays)")


class _MiBCounter:
    """Bytes uploaded, from several threads, shown by a Progress counting MiB."""

    def __init__(self, progress: Progress):
        self.progress, self.bytes, self.shown, self.lock = progress, 0, 0, threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n
            whole = self.bytes // MiB
            if whole > self.shown:
                self.progress.update(whole - self.shown)
                self.shown = whole

    def complete(self) -> None:
        with self.lock:
            self.progress.update(self.progress.total - self.shown)     # the last part of a MiB
            self.shown = self.progress.total


def open_destination(run, format_name: str) -> tuple[Destination | None, Path]:
    """(the Destination, checked, and the staging folder to convert into) for an s3:// or gs://
    OUT; (None, OUT) for a local one. `run`: the run's options (pipeline/convert/options.py)."""
    out = str(run.out)
    if not is_destination_url(out):
        if run.staging:
            raise ConversionError(f"--staging {run.staging}: only for an s3:// or gs:// OUT; {out} is a local folder")
        return None, Path(out)
    destination = Destination(out, run.upload_workers)
    staging = Path(run.staging) if run.staging else staging_folder(out, format_name)
    log.info("%s: converting in %s, then uploading", destination.shown, staging)
    return destination, staging
