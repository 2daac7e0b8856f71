"""Byte ranges of a store's objects read by plain HTTP/1.1 GETs straight into the fetch process's
slots, over one kept-alive connection per thread: the fetch process's reads, where the store allows.

Why: on a node whose cores all decode, the CPU a fetch costs is taken from the decode. For 1 MiB
ranges from nginx on loopback, obstore's async reads cost about 0.9 ms of CPU a MiB and are then
copied into the slot; `http.client` reading into the slot costs about 0.3 (2-core AMD EPYC;
`benchmarks/fetch_clients.py`).

Which stores: s3:// and gs:// through URLs that obstore signs (`obstore.sign`, the store's own
credentials and endpoint), signed again when half of SIGNED_FOR_S has passed; http(s):// through
the object's URL with the store's headers (a URL's user and password, as Basic auth). The store's
certificate bundle is trusted besides the system's, as obstore trusts it. `direct_ranges` gives
None, and obstore reads everything, where the environment sends the store's host through a proxy
(HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY, as obstore reads them), where the URL has a query, or where the store cannot sign (anonymous access,
a GCS account without a key). A read that fails raises; the caller reads that block through obstore,
with its retries.

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


class DirectRanges:
    """Reads ranges of the objects `names` (relative to the store's URL) into memory."""

    def __init__(self, store, url: str, options: dict, names: list[str], signed_for_s: float = SIGNED_FOR_S):
        client_options = options.get("client_options", {})
        self.store, self.url, self.names = store, url.rstrip("/"), names
        self.headers = dict(client_options.get("default_headers", {}))
        # obstore's request timeout ("30s"), which abandons a stalled request here too
        self.timeout_s = float(str(client_options.get("timeout", f"{DEFAULT_TIMEOUT_S}s")).rstrip("s"))
        self.signed_for_s = signed_for_s
        self.signs = urlsplit(url).scheme.lower() in ("s3", "gs")
        self.context = ssl.create_default_context()
        if client_options.get("root_certificate"):
            self.context.load_verify_locations(cadata=client_options["root_certificate"])
        self._lock = threading.Lock()
        self._local = threading.local()
        self.signings = 0
        self._targets, self._signed_at = self._sign(), time.monotonic()

    def _sign(self) -> list[tuple[str, str, int, str]]:
        """Per object: (scheme, host, port, the request target: its path and query)."""
        if self.signs:
            import obstore
            urls = obstore.sign(self.store, "GET", self.names, timedelta(seconds=self.signed_for_s))
            self.signings += 1
        else:
            urls = [f"{self.url}/{quote(name)}" for name in self.names]
        targets = []
        for url in urls:
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            port = parts.port or (443 if scheme == "https" else 80)
            targets.append((scheme, parts.hostname, port, f"{parts.path}?{parts.query}" if parts.query else parts.path))
        return targets

    def _target(self, index: int) -> tuple[str, str, int, str]:
        if self.signs and time.monotonic() - self._signed_at > self.signed_for_s / 2:
            with self._lock:
                if time.monotonic() - self._signed_at > self.signed_for_s / 2:
                    self._targets, self._signed_at = self._sign(), time.monotonic()
        return self._targets[index]

    def _connection(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection:
        connections = self._local.__dict__.setdefault("connections", {})
        connection = connections.get((scheme, host, port))
        if connection is None:
            if scheme == "https":
                connection = http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=self.context)
            else:
                connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            connections[(scheme, host, port)] = connection
        return connection

    def read_into(self, index: int, start: int, end: int, into: memoryview) -> None:
        """Bytes [start, end) of object `index` into `into` (end - start bytes long), or an OSError."""
        scheme, host, port, target = self._target(index)
        connection = self._connection(scheme, host, port)
        try:
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
        except (OSError, http.client.HTTPException) as error:
            connection.close()      # its state is unknown: the next read opens another
            del self._local.connections[(scheme, host, port)]
            raise OSError(str(error) or type(error).__name__) from None


def direct_ranges(store, url: str, options: dict, names: list[str]) -> DirectRanges | None:
    """The direct reader of the store at `url`, or None where obstore is to read every block."""
    parts = urlsplit(url)
    if parts.query or parts.fragment or parts.scheme.lower() not in ("s3", "gs", "http", "https"):
        return None
    try:
        reader = DirectRanges(store, url, options, names)
    except Exception:       # noqa: BLE001 - obstore could not sign (no key to sign with), or a bad bundle
        return None
    proxies = urllib.request.getproxies_environment()
    for scheme, host, port, _ in set(reader._targets):
        if (proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass_environment(host, proxies):
            return None
    return reader
