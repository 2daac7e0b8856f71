"""Byte ranges of a store's objects read by plain HTTP/1.1 GETs straight into the caller's memory,
over one kept-alive connection per thread: how the fetch process of a streamed split
(`pipeline/remote/block_fetcher.py`) reads its blocks into their slots, where the store allows.

Why: on a node whose cores all decode, the CPU a fetch costs is taken from the decode. For 1 MiB
ranges from nginx on loopback, obstore's async reads cost about 0.85 ms of CPU a MiB (0.75 in
threads) and each response is then copied into its slot; these cost about 0.43
(`benchmarks/fetch_clients.py`; figures in docs/loaders.md). Not in the training process: there
each read takes a turn of the GIL per chunk received where obstore's takes two a request, and a
split kept on disk ran its first epoch about 4% slower with them than with obstore's (alternating
runs of one tree), so the disk path's threads read through obstore.

Which stores: s3:// and gs:// through URLs that obstore signs (`obstore.sign`: the store's own
credentials and endpoint), each signed again once half of SIGNED_FOR_S has passed; http(s)://
through the object's URL with the store's headers (a URL's user and password, as Basic auth).
The store's certificate bundle is trusted besides the system's, as obstore trusts it.
`direct_ranges` gives None, and obstore reads every range, where the environment sends the
store's host through a proxy (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY, as obstore reads
them), where the URL has a query, or where the store cannot sign (anonymous access, a GCS account
without a key). A read that fails raises OSError and the caller reads the range through obstore,
with its retries and its one-line errors; after FAILURES_IN_A_ROW the reader is no longer `usable`
(a store that refuses presigned URLs, say).

Standard library and obstore only: the fetch process loads this file without the `pipeline`
package, which imports torch.
"""
from __future__ import annotations

import http.client
import ssl
import threading
import time
import urllib.request
from datetime import timedelta
from urllib.parse import quote, urlsplit

SIGNED_FOR_S = 3600
DEFAULT_TIMEOUT_S = 30
FAILURES_IN_A_ROW = 8       # after which the reader is not `usable`: the store answers obstore only


class DirectRanges:
    """Reads ranges of the store's objects (names relative to its URL) into memory. Thread-safe:
    each thread has its own connections."""

    def __init__(self, store, url: str, options: dict, signed_for_s: float = SIGNED_FOR_S):
        client_options = options.get("client_options", {})
        self.store, self.url = store, url.rstrip("/")
        self.headers = dict(client_options.get("default_headers", {}))
        # obstore's request timeout ("30s"), which abandons a stalled request here too
        self.timeout_s = float(str(client_options.get("timeout", f"{DEFAULT_TIMEOUT_S}s")).rstrip("s"))
        self.signed_for_s = signed_for_s
        self.signs = urlsplit(url).scheme.lower() in ("s3", "gs")
        self.root_certificate = client_options.get("root_certificate")
        self.context: ssl.SSLContext | None = None     # made at the first https connection: 40 ms of a first batch
        self._lock = threading.Lock()
        self._local = threading.local()
        self._targets: dict[str, tuple[float, tuple[str, str, int, str]]] = {}
        self.signings = 0
        self.failures = 0       # in a row
        self.server = self._target("")[:3]       # (scheme, host, port); a store that cannot sign raises here

    @property
    def usable(self) -> bool:
        return self.failures < FAILURES_IN_A_ROW

    def _target(self, name: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, the request target: path and query) of the object, its URL signed
        again once half of `signed_for_s` has passed."""
        now = time.monotonic()
        signed_at, target = self._targets.get(name, (None, None))
        if target is not None and (not self.signs or now - signed_at <= self.signed_for_s / 2):
            return target
        if self.signs:
            import obstore
            [url] = obstore.sign(self.store, "GET", [name], timedelta(seconds=self.signed_for_s))
            self.signings += 1
        else:
            url = f"{self.url}/{quote(name)}"
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        target = (scheme, parts.hostname, parts.port or (443 if scheme == "https" else 80),
                  f"{parts.path}?{parts.query}" if parts.query else parts.path)
        self._targets[name] = (now, target)
        return target

    def _tls(self) -> ssl.SSLContext:
        """The system's roots, and the store's bundle besides them."""
        with self._lock:
            if self.context is None:
                context = ssl.create_default_context()
                if self.root_certificate:
                    context.load_verify_locations(cadata=self.root_certificate)
                self.context = context
            return self.context

    def _connection(self, scheme: str, host: str, port: int) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the server, and whether it was opened now."""
        connections = self._local.__dict__.setdefault("connections", {})
        connection = connections.get((scheme, host, port))
        if connection is not None:
            return connection, False
        if scheme == "https":
            connection = http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=self._tls())
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        connections[(scheme, host, port)] = connection
        return connection, True

    def read_into(self, name: str, start: int, end: int, into: memoryview) -> None:
        """Bytes [start, end) of object `name` into `into` (end - start bytes long), or an OSError.
        A kept-alive connection the server has closed since (its idle timeout, during a long
        evaluation) is replaced and the read made again, and is not counted as a failure."""
        scheme, host, port, target = self._target(name)
        while True:
            connection, opened = self._connection(scheme, host, port)
            try:
                self._read(connection, target, start, end, into)
            except (OSError, http.client.HTTPException) as error:
                connection.close()      # its state is unknown: the next read opens another
                del self._local.connections[(scheme, host, port)]
                if opened:
                    self.failures += 1
                    raise OSError(str(error) or type(error).__name__) from None
                continue
            self.failures = 0
            return

    def _read(self, connection: http.client.HTTPConnection, target: str, start: int, end: int,
              into: memoryview) -> None:
        connection.request("GET", target, headers={**self.headers, "Range": f"bytes={start}-{end - 1}"})
        response = connection.getresponse()
        content_range = response.getheader("Content-Range", "")
        if response.status != 206 or not content_range.startswith(f"bytes {start}-{end - 1}/"):
            raise OSError(f"HTTP {response.status} ({content_range or 'no Content-Range'}) for a range request")
        got = 0
        while got < end - start:
            count = response.readinto(into[got:end - start])
            if not count:
                raise OSError(f"{got} bytes of {end - start} before the connection ended")
            got += count
        if response.read(1):
            raise OSError("a response longer than the range asked for")


def direct_ranges(store, url: str, options: dict) -> DirectRanges | None:
    """The direct reader of the store at `url`, or None where obstore is to read every range."""
    parts = urlsplit(url)
    if parts.query or parts.fragment or parts.scheme.lower() not in ("s3", "gs", "http", "https"):
        return None
    try:
        reader = DirectRanges(store, url, options)
    except Exception:       # noqa: BLE001 - obstore could not sign (no key to sign with)
        return None
    scheme, host, _ = reader.server
    proxies = urllib.request.getproxies_environment()
    if (proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass_environment(host, proxies):
        return None
    return reader
