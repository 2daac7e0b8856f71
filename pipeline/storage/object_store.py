"""Reading a dataset folder in object storage (s3://, gs://) or behind http(s)://, through obstore
(Rust's object_store): whole objects, many byte ranges of one object, object sizes.

Conventions: S3 credentials, region and endpoint come from the usual AWS_* variables
(`AWS_ENDPOINT_URL` for S3-compatible stores) and the AWS profile, GCS from GOOGLE_* ones
(`pipeline/storage/credentials.py`); HTTPS certificates are verified. Requests are retried with
backoff by obstore (5xx, connection resets, timeouts); a response shorter than asked for is read
again once. Every failure is one `RemoteDataError` line (`pipeline/storage/errors.py`) naming the
URL through `redact` (`pipeline/storage/urls.py`), so credentials carried in a URL are never printed.
"""
from __future__ import annotations

import base64
import bisect
import os
import re
import threading
from datetime import timedelta
from urllib.parse import unquote, urlsplit, urlunsplit

from pipeline.errors import RemoteDataError
from pipeline.storage.credentials import instance_answers, s3_ca_bundle, s3_options
from pipeline.storage.errors import NO_CREDENTIALS, describe_error, store_error
from pipeline.storage.urls import client_url, is_url, redact

# Plain http to a store, as its client library's own variables allow it (an emulator, a store
# inside the cluster); the client options set here would otherwise override them
ALLOW_HTTP_VARIABLES = {"s3": "AWS_ALLOW_HTTP", "gs": "GOOGLE_ALLOW_HTTP"}
# Ranges closer than this are fetched as one request: a request costs far more than a few KiB.
MERGE_GAP = 64 * 1024
REQUEST_TIMEOUT_S = 30
_SHORT = re.compile(r"Requested \d+\.\.\d+, got \d+\.\.\d+")


def merge_ranges(ranges: list[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """(start, end) ranges sorted and merged where they overlap or lie within `gap` bytes."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


class ObjectStore:
    """A store rooted at a URL's folder; object names are paths relative to it."""

    def __init__(self, url: str, retries: int = 4, timeout_s: float = REQUEST_TIMEOUT_S):
        from_url = _obstore().store.from_url
        self.url = url.rstrip("/")
        self.shown = redact(self.url)
        self.requests = self.bytes_read = 0       # made and received by this process, for the benchmarks
        self._counter_lock = threading.Lock()
        # Kept for the fetch process of a streamed split (pipeline/remote/shared_blocks.py), which opens its own
        self.client_url = client_url(self.url)
        try:
            self.options = store_options(self.url, retries, timeout_s)
            if "credential_provider" in self.options:
                self.options["credential_provider"]()      # its failure as one line now, not at the first read
        except RemoteDataError as error:      # the AWS profile asked for, or its keys, not to be had
            raise RemoteDataError(f"{self.shown}: {error}") from None
        try:
            self.client = from_url(self.client_url, **self.options)
        except Exception as error:  # obstore raises its own classes and ValueError for a bad URL
            raise RemoteDataError(f"{self.shown}: cannot open ({describe_error(error)})") from None
        scheme = urlsplit(self.url).scheme.lower()
        if not instance_answers(scheme, self.options):
            raise RemoteDataError(f"{self.shown}: {NO_CREDENTIALS[scheme]}")

    def count(self, requests: int, size: int) -> None:
        """Adds requests made and bytes received (by this process or its fetch process)."""
        with self._counter_lock:
            self.requests += requests
            self.bytes_read += size

    def where(self, name: str) -> str:
        """The object's URL for a message: the name goes in the path, before any query."""
        parts = urlsplit(self.url)
        return redact(urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}")))

    def size(self, name: str) -> int:
        obstore = _obstore()
        try:
            return int(obstore.head(self.client, name)["size"])
        except Exception as error:
            raise store_error(self.where(name), error) from None

    def read(self, name: str) -> bytes:
        obstore = _obstore()
        try:
            data = bytes(obstore.get(self.client, name).bytes())
        except Exception as error:
            raise store_error(self.where(name), error) from None
        self.count(1, len(data))
        return data

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each (start, end) range, in the order given, as views of the responses
        (no copy: at a loader's rate each copy of the data costs CPU that decoding needs);
        neighbouring ranges are fetched as one request and the requests run concurrently
        (obstore's get_ranges)."""
        obstore = _obstore()
        if not ranges:
            return []
        merged = merge_ranges(ranges)
        starts, ends = [s for s, _ in merged], [e for _, e in merged]
        pieces = None
        for attempt in range(2):   # once more when a response came back short
            try:
                pieces = [memoryview(p) for p in obstore.get_ranges(self.client, name, starts=starts, ends=ends)]
            except Exception as error:
                # obstore checks a range response against the range asked for but does not retry it
                if attempt == 0 and _SHORT.search(str(error)):
                    continue
                raise store_error(self.where(name), error) from None
            if all(len(p) == e - s for p, s, e in zip(pieces, starts, ends)):
                break
        else:
            raise RemoteDataError(f"{self.where(name)}: responses shorter than the ranges asked for, twice")
        self.count(len(pieces), sum(map(len, pieces)))
        out = []
        for start, end in ranges:
            i = _containing(starts, start)
            out.append(pieces[i][start - starts[i]:end - starts[i]])
        return out


def _obstore():
    """obstore, imported on first use: it is an optional dependency (the `remote` extra), and
    local datasets never need it."""
    try:
        import obstore
        import obstore.store  # noqa: F401
    except ImportError:
        raise RemoteDataError("reading from object storage needs the package 'obstore' (pip install obstore)") from None
    return obstore


def _containing(starts: list[int], position: int) -> int:
    """The index of the merged range that holds `position`."""
    return bisect.bisect_right(starts, position) - 1


def store_options(url: str, retries: int, timeout_s: float) -> dict:
    """obstore's `from_url` keyword arguments for the URL: retries with backoff, a stalled request
    abandoned after timeout_s and retried, plain http only where the user named it (an http:// URL
    or endpoint, or AWS_ALLOW_HTTP / GOOGLE_ALLOW_HTTP set to true), the user and password an
    http(s):// URL carries as a header (`client_url` is the URL to give with them)."""
    scheme = urlsplit(url).scheme.lower()
    retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=60),
             "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=5), "base": 2}}
    options = {"timeout": f"{timeout_s:g}s", "connect_timeout": "5s"}
    parts = urlsplit(url)
    if scheme in ("http", "https") and parts.username is not None:
        # obstore sends no credentials a URL carries: they go as HTTP Basic auth, as curl sends them
        user_password = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        options["default_headers"] = {"Authorization": "Basic " + base64.b64encode(user_password).decode()}
    s3 = s3_options() if scheme == "s3" else {"config": {}}
    if (scheme == "http" or s3["config"].get("aws_endpoint", "").startswith("http://")
            or os.environ.get(ALLOW_HTTP_VARIABLES.get(scheme, ""), "").lower() in ("1", "true")):
        options["allow_http"] = True
    kwargs = {"client_options": options, "retry_config": retry}
    if scheme == "s3":
        kwargs.update(s3)
        bundle = s3_ca_bundle()
        if bundle:
            options["root_certificate"] = bundle     # trusted besides the system's roots
    return kwargs


def open_store(url: str, timeout_s: float | None = None) -> ObjectStore:
    """The store for an s3://, gs://, http:// or https:// folder URL."""
    if not is_url(url):
        raise RemoteDataError(f"{redact(str(url))}: not an object-storage URL (s3://, gs://, http://, https://)")
    return ObjectStore(url, timeout_s=timeout_s or REQUEST_TIMEOUT_S)
