"""Byte ranges of a store's objects read by plain HTTP/1.1 GETs straight into the caller's memory,
over one kept-alive connection per thread: how the fetch process of a streamed split
(`pipeline/remote/block_fetcher.py`) reads its blocks into their slots, where the store allows.
The request is written and the answer's headers parsed on the socket itself: through http.client
(its headers parsed by the email package, the body through a buffered reader) a range cost a
third to a half more CPU.

Why: on a node whose cores all decode, the CPU a fetch costs is taken from the decode. For 1 MiB
ranges from nginx on loopback, obstore's async reads cost about twice these, and each response
is then copied into its slot (`benchmarks/fetch_clients.py`; figures in docs/loaders.md). Not in
the training process: there each read takes a turn of the GIL per chunk received where obstore's
takes two a request, and a split kept on disk ran its first epoch about 4% slower with them than
with obstore's (alternating runs of one tree), so the disk path's threads read through obstore.

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

import functools
import socket
import ssl
import threading
import time
import urllib.request
from datetime import timedelta
from urllib.parse import quote, urlsplit

SIGNED_FOR_S = 3600
DEFAULT_TIMEOUT_S = 30
FAILURES_IN_A_ROW = 8       # after which the reader is not `usable`: the store answers obstore only
HEAD_LIMIT = 64 << 10       # the most bytes of status line and headers an answer may have
HEAD_STEP = 4096            # read at a time until the headers end: the body's first bytes are copied once more


class DirectRanges:
    """Reads ranges of the store's objects (names relative to its URL) into memory. Thread-safe:
    each thread has its own connections."""

    def __init__(self, store, url: str, options: dict, signed_for_s: float = SIGNED_FOR_S):
        client_options = options.get("client_options", {})
        self.store, self.url = store, url.rstrip("/")
        self._header_lines = "".join(f"{key}: {value}\r\n"
                                     for key, value in client_options.get("default_headers", {}).items())
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

    def _connections(self) -> dict[tuple[str, str, int], socket.socket]:
        """This thread's connections, made with its buffer for answers' headers at its first read."""
        if not hasattr(self._local, "connections"):
            self._local.connections, self._local.head = {}, bytearray(HEAD_LIMIT)
        return self._local.connections

    def _connection(self, scheme: str, host: str, port: int) -> tuple[socket.socket, bool]:
        """This thread's connection to the server, and whether it was opened now."""
        connections = self._connections()
        connection = connections.get((scheme, host, port))
        if connection is not None:
            return connection, False
        connection = socket.create_connection((host, port), timeout=self.timeout_s)
        if scheme == "https":
            try:
                connection = self._tls().wrap_socket(connection, server_hostname=host)
            except OSError:
                connection.close()
                raise
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
                keep_alive = self._read(connection, _host_header(scheme, host, port), target, start, end, into)
            except OSError as error:
                # its state is unknown: the next read opens another
                self._connections().pop((scheme, host, port)).close()
                if opened:
                    self.failures += 1
                    raise OSError(str(error) or type(error).__name__) from None
                continue
            if not keep_alive:
                self._connections().pop((scheme, host, port)).close()
            self.failures = 0
            return

    def _read(self, connection: socket.socket, host: str, target: str, start: int, end: int,
              into: memoryview) -> bool:
        """One GET of the range into `into`; whether the server keeps the connection open."""
        connection.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: identity\r\n"
                           f"{self._header_lines}Range: bytes={start}-{end - 1}\r\n\r\n".encode("latin-1"))
        head = self._local.head
        received, head_end = 0, -1
        while head_end < 0:
            if received == HEAD_LIMIT:
                raise OSError(f"an answer whose headers exceed {HEAD_LIMIT} bytes")
            count = connection.recv_into(memoryview(head)[received:received + HEAD_STEP])
            if not count:
                raise OSError("the connection ended before an answer")
            head_end = head.find(b"\r\n\r\n", max(0, received - 3), received + count)
            received += count
        status_line, *lines = head[:head_end].decode("latin-1").split("\r\n")
        version, _, status = status_line.partition(" ")
        fields = {key.strip().lower(): value.strip() for key, _, value in (line.partition(":") for line in lines)}
        content_range, length, code = fields.get("content-range", ""), end - start, status.partition(" ")[0]
        if (code != "206" or not content_range.startswith(f"bytes {start}-{end - 1}/")
                or fields.get("content-length") != str(length) or "transfer-encoding" in fields
                or fields.get("content-encoding", "identity") != "identity"):
            raise OSError(f"HTTP {code} ({content_range or 'no Content-Range'}) for a range request")
        body = received - head_end - 4
        if body > length:
            raise OSError("a response longer than the range asked for")
        into[:body] = memoryview(head)[head_end + 4:received]
        while body < length:
            count = connection.recv_into(into[body:length])
            if not count:
                raise OSError(f"{body} bytes of {length} before the connection ended")
            body += count
        return version == "HTTP/1.1" and "close" not in fields.get("connection", "").lower().replace(" ", "").split(",")


@functools.lru_cache(maxsize=64)
def _host_header(scheme: str, host: str, port: int) -> str:
    """The Host header as the URL names the server (a signed URL signs it): the port only where
    it is not the scheme's own. Cached: every request of a store names the same few servers."""
    name = host.encode("idna").decode("ascii") if not host.isascii() else f"[{host}]" if ":" in host else host
    return name if port == (443 if scheme == "https" else 80) else f"{name}:{port}"


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
