"""Reading a dataset folder in object storage (s3://, gs://) or behind http(s)://, through obstore
(Rust's object_store): whole objects, many byte ranges of one object, object sizes.

Conventions: S3 credentials, region and endpoint come from the usual AWS_* variables
(`AWS_ENDPOINT_URL` for S3-compatible stores) and the AWS profile (`pipeline/store_credentials.py`),
GCS from GOOGLE_* ones; HTTPS certificates are
verified. Requests are retried with backoff by obstore (5xx, connection resets, timeouts); a
response shorter than asked for is read again once. Every failure is one `RemoteDataError` line
naming the URL through `redact`, so credentials carried in a URL are never printed.
"""
from __future__ import annotations

import base64
import bisect
import os
import re
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from urllib.parse import unquote, urlsplit, urlunsplit

from pipeline.store_credentials import instance_answers, s3_ca_bundle, s3_settings
from pipeline.datasets import RemoteDataError

SCHEMES = ("s3", "gs", "http", "https")
# Plain http to a store, as its client library's own variables allow it (an emulator, a store
# inside the cluster); the client options set here would otherwise override them
ALLOW_HTTP_VARIABLES = {"s3": "AWS_ALLOW_HTTP", "gs": "GOOGLE_ALLOW_HTTP"}
# Ranges closer than this are fetched as one request: a request costs far more than a few KiB.
MERGE_GAP = 64 * 1024
REQUEST_TIMEOUT_S = 30
_STATUS = re.compile(r"status(?: code)?:? (\d{3})\b", re.I)
_SHORT = re.compile(r"Requested \d+\.\.\d+, got \d+\.\.\d+")
_SECRET_QUERY = re.compile(r"(sig|signature|token|credential|key|secret|password|auth)", re.I)
# What a store says in an error answer's body: S3's and GCS's XML (<Code>, <Message>), GCS's JSON
_XML_CODE = re.compile(r"<Code>([^<]{1,80})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"([^"\\]{1,300})"')
_XML_REGION = re.compile(r"<Region>([a-z0-9-]{2,40})</Region>")
_REGION = re.compile(r"^[a-z0-9-]{2,40}$")
REGION_LOOKUP_TIMEOUT_S = 5
# Every obstore error's debug dump names its retry_timeout setting: only a timeout that happened counts
_TIMED_OUT = re.compile(r"timed out|(?<!retry_)timeout", re.I)
_PERFORMING = re.compile(r"^.*?Error performing \w+ \S+ in [^-]*- ")
_URL = re.compile(r"https?://\S+")
NO_CREDENTIALS = {
    "s3": ("no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile of "
           "~/.aws/credentials (or run where an instance role provides them)"),
    "gs": ("no credentials found: set GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT) to a service "
           "account's key file, or run `gcloud auth application-default login` (or run where the instance's "
           "service account provides them)"),
}


class RemoteNotFound(RemoteDataError):
    """The object asked for is not there (404, or no such key)."""


def is_url(path) -> bool:
    """True for a URL this module reads; a plain (local) path is not a URL."""
    return isinstance(path, str) and urlsplit(path).scheme.lower() in SCHEMES and "://" in path


def redact(url: str) -> str:
    """The URL with user:password@ and secret-looking query values replaced by `***`; a local
    path as it is."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(
        f"{key}=***" if _SECRET_QUERY.search(key) else f"{key}={value}" if sep else key
        for key, sep, value in (item.partition("=") for item in parts.query.split("&") if item))
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def merge_ranges(ranges: list[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """(start, end) ranges sorted and merged where they overlap or lie within `gap` bytes."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def describe_error(error: BaseException, scheme: str = "s3", bucket: str | None = None,
                   carries_user: bool = False) -> str:
    """What happened, in words a user acts on, from an obstore exception (whose text carries
    a multi-line debug dump that is never shown) met reading a `scheme` URL (of `bucket`, where
    it has one: a bucket in another region is named with the region to set; that carries a user
    and password, or not)."""
    from obstore import exceptions as errors
    text = str(error)
    low = text.lower()
    if "/latest/api/token" in text or "/latest/meta-data" in text:
        return NO_CREDENTIALS["s3"]     # no keys in the environment or the profile: obstore asked the instance
    if "/computemetadata/" in low:
        return NO_CREDENTIALS["gs"]     # no key file named and no gcloud login: obstore asked the instance
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else None
    if isinstance(error, (errors.NotFoundError, FileNotFoundError)) or code == 404:
        return "not found (404)"
    if isinstance(error, (errors.PermissionDeniedError, errors.UnauthenticatedError)) or code in (401, 403):
        if scheme in ("http", "https") and code == 401:
            return ("the server refused the user and password in the URL (401)" if carries_user else
                    "the server asks for a user and password (401): give them in the URL, "
                    f"{scheme}://USER:PASSWORD@host/...")
        if scheme in ("http", "https"):
            return f"access denied ({code or 403}) by the server: its access rules, or a signed URL's expiry"
        return f"access denied ({code or 403}): check the credentials (the AWS_* or GOOGLE_* variables) and the bucket's policy"
    if code is not None:
        said = _store_says(text)
        if scheme == "s3" and (code == 301 or "AuthorizationHeaderMalformed" in said):
            return _wrong_region(code, said, _XML_REGION.search(text), bucket)
        retried = code >= 500 or code == 429      # obstore retries these; another 4xx is answered at once
        return f"the server answered {code}" + (f" ({said})" if said else "") + (" after retries" if retried else "")
    if "connection refused" in low:
        return "connection refused: is the endpoint right and the server up?"
    if "dns error" in low or "failed to lookup" in low or "name or service not known" in low:
        return "unknown host: check the endpoint"
    if "invalidcertificate" in low or "certificate verify failed" in low:
        trust = "AWS_CA_BUNDLE=ca.pem (or SSL_CERT_FILE)" if scheme == "s3" else "SSL_CERT_FILE=ca.pem"
        return f"the server's certificate is not trusted here (verified by default): give its CA as {trust}, or fix the certificate"
    if "credential" in low and scheme in NO_CREDENTIALS:
        return NO_CREDENTIALS[scheme]
    if "range request not supported" in low:
        return ("the server does not answer range requests (it sends whole files): serve the folder with one "
                "that does, such as nginx or a bucket (Python's http.server does not)")
    if "received redirect without location" in low and scheme == "s3":
        return _wrong_region(301, "", None, bucket)
    if _TIMED_OUT.search(text):
        return "timed out after retries"
    summary = " ".join(text.split("\n\n")[0].split())
    summary = _URL.sub(lambda url: redact(url.group(0)), _PERFORMING.sub("", summary))   # the caller names the URL
    return f"{type(error).__name__}: {summary[:200]}"


def _store_says(text: str) -> str:
    """The store's own error code and message from the answer's body in an obstore error's text,
    on one line; empty where the body is not a store's (an HTML page, nothing)."""
    code, message = _XML_CODE.search(text), _XML_MESSAGE.search(text) or _JSON_MESSAGE.search(text)
    said = ": ".join(match.group(1).strip() for match in (code, message) if match)
    return " ".join(said.split())


def _wrong_region(code: int, said: str, named, bucket: str | None) -> str:
    """S3's answer to a request signed for another region than the bucket's: 400
    AuthorizationHeaderMalformed naming the region, or 301 with the region in a header that
    obstore does not show, which a request of our own for the bucket reads."""
    try:
        s3 = s3_settings()
    except RemoteDataError:
        s3 = {}
    configured = (s3.get("aws_region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                  or "us-east-1, the default")
    region = named.group(1) if named else _bucket_region(bucket, s3.get("aws_endpoint")) if bucket else None
    if region:
        return f"the bucket is in region {region}, not {configured} (S3 answered {code}): set AWS_REGION={region}"
    return (f"the bucket is in another region than {configured} (S3 answered {code}{': ' + said if said else ''}): "
            f"set AWS_REGION to its region")


def _bucket_region(bucket: str, endpoint: str | None) -> str | None:
    """The bucket's region as S3 tells it to anyone who asks (the x-amz-bucket-region header of
    its answer to a HEAD of the bucket, whatever its status), or None."""
    # Path-style, so that a bucket name with dots meets no certificate made for one label
    url = f"{(endpoint or 'https://s3.amazonaws.com').rstrip('/')}/{bucket}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                    timeout=REGION_LOOKUP_TIMEOUT_S) as answer:
            region = answer.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as answer:      # 301, 403: the header comes all the same
        region = answer.headers.get("x-amz-bucket-region")
    except (OSError, ValueError):
        return None
    return region if region and _REGION.match(region) else None


class ObjectStore:
    """A store rooted at a URL's folder; object names are paths relative to it."""

    def __init__(self, url: str, retries: int = 4, timeout_s: float = REQUEST_TIMEOUT_S):
        from_url = _obstore().store.from_url
        self.url = url.rstrip("/")
        self.shown = redact(self.url)
        self.requests = self.bytes_read = 0       # made and received by this process, for the benchmarks
        self._counter_lock = threading.Lock()
        # Kept for the fetch process of a streamed split (pipeline/shared_blocks.py), which opens its own
        self.client_url = client_url(self.url)
        try:
            self.options = store_options(self.url, retries, timeout_s)
        except RemoteDataError as error:      # the AWS profile asked for is not usable
            raise RemoteDataError(f"{self.shown}: {error}") from None
        try:
            self.client = from_url(self.client_url, **self.options)
        except Exception as error:  # obstore raises its own classes and ValueError for a bad URL
            raise RemoteDataError(f"{self.shown}: cannot open ({describe_error(error)})") from None
        scheme = urlsplit(self.url).scheme.lower()
        if not instance_answers(scheme, self.options.get("config", {})):
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
            raise _error(self.where(name), error) from None

    def read(self, name: str) -> bytes:
        obstore = _obstore()
        try:
            data = bytes(obstore.get(self.client, name).bytes())
        except Exception as error:
            raise _error(self.where(name), error) from None
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
                raise _error(self.where(name), error) from None
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


def _error(where: str, error: BaseException) -> RemoteDataError:
    parts = urlsplit(where)
    what = describe_error(error, parts.scheme.lower(), parts.hostname, carries_user="@" in parts.netloc)
    return (RemoteNotFound if what.startswith("not found") else RemoteDataError)(f"{where}: {what}")


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
    s3 = s3_settings() if scheme == "s3" else {}
    if (scheme == "http" or s3.get("aws_endpoint", "").startswith("http://")
            or os.environ.get(ALLOW_HTTP_VARIABLES.get(scheme, ""), "").lower() in ("1", "true")):
        options["allow_http"] = True
    kwargs = {"client_options": options, "retry_config": retry}
    if scheme == "s3":
        kwargs["config"] = s3
        bundle = s3_ca_bundle()
        if bundle:
            options["root_certificate"] = bundle     # trusted besides the system's roots
    return kwargs


def client_url(url: str) -> str:
    """The URL without the user and password it may carry, which `store_options` sends as a header."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])) if "@" in parts.netloc else url


def open_store(url: str, timeout_s: float | None = None) -> ObjectStore:
    """The store for an s3://, gs://, http:// or https:// folder URL."""
    if not is_url(url):
        raise RemoteDataError(f"{redact(str(url))}: not an object-storage URL (s3://, gs://, http://, https://)")
    return ObjectStore(url, timeout_s=timeout_s or REQUEST_TIMEOUT_S)
