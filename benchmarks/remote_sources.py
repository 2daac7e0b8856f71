"""Where `benchmarks/loaders.py --remote` reads the conversions from: a URL the user gives (the
folder that holds them, named as under `--cache`), or a server started here on loopback over
`--cache` itself: `http` (nginx) or `s3` (moto's S3 server). `--latency-ms` adds that round
trip to every request, as a cloud store far from the node would: by putting the server (or a
user's plain-http one) behind `benchmarks/latency_proxy.py`, or, with `--latency-in server`,
inside the loopback nginx, whose answers then start that late (no proxy's copies on this
machine's cores, which a real store's latency does not cost either)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.latency_proxy import LatencyProxy
from benchmarks.loopback_servers import MotoS3, Nginx

LOOPBACK = ("http", "s3")


class RemoteSource:
    """A context manager: `url_for(conversion folder)` and the `environment` its readers need."""

    def __init__(self, where: str, cache: Path, latency_ms: float = 0, latency_in: str = "proxy"):
        if latency_in == "server" and where != "http":
            raise SystemExit("error: --latency-in server needs --remote http (the loopback nginx)")
        self.where, self.cache, self.latency_ms, self.latency_in = where, cache, latency_ms, latency_in
        self.environment: dict[str, str] = {}
        self._servers = []
        self._base = ""
        self._folder = tempfile.TemporaryDirectory(prefix="remote-source-")

    def __enter__(self) -> "RemoteSource":
        if self.where == "http" and self.latency_in == "server":
            self._base = self._start(Nginx(self.cache, Path(self._folder.name) / "nginx", delay_ms=self.latency_ms)).url
        elif self.where == "http":
            nginx = self._start(Nginx(self.cache, Path(self._folder.name) / "nginx"))
            self._base = self._proxied(nginx.url)
        elif self.where == "s3":
            self._moto = self._start(MotoS3())
            self.environment = {**self._moto.environment(), "AWS_ENDPOINT_URL": self._proxied(self._moto.url)}
            self._base = "s3://bench"
        else:
            self._base = self._proxied(self.where.rstrip("/")) if self.latency_ms else self.where.rstrip("/")
        return self

    def url_for(self, conversion: Path) -> str:
        if self.where == "s3":
            return self._moto.upload(conversion, "bench", conversion.name)
        return f"{self._base}/{conversion.name}"

    def describe(self) -> str:
        kind = {"http": "nginx on loopback", "s3": "moto's S3 server on loopback"}.get(self.where, "given URL")
        where = "answers delayed in nginx" if self.latency_in == "server" else "through a delay proxy"
        return f"{kind}{f', +{self.latency_ms:g} ms round trip ({where})' if self.latency_ms else ''}"

    def _start(self, server):
        self._servers.append(server)
        return server

    def _proxied(self, url: str) -> str:
        if not self.latency_ms:
            return url
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.port:
            raise SystemExit(f"error: --latency-ms needs a plain http://HOST:PORT server, not {parts.scheme}://")
        proxy = self._start(LatencyProxy(parts.hostname, parts.port, self.latency_ms))
        proxy.start()
        return f"{proxy.url}{parts.path}"

    def __exit__(self, *exc) -> None:
        for server in reversed(self._servers):
            server.stop()
        self._folder.cleanup()
