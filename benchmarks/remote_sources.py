"""Where `benchmarks/loaders.py --remote` reads the conversions from: a URL the user gives (the
folder that holds them, named as under `--cache`), or a server started here on loopback over
`--cache` itself:
- `http`: nginx serving `--cache`;
- `s3`: moto's S3 server, a real S3 API (the conversions are uploaded to it). It is Python on
  the same cores as the loaders and copies the object for each range: its figures measure it;
- `s3-nginx`: the loaders' S3 requests, signed and path-style as to any S3-compatible endpoint,
  answered by nginx serving `--cache` as the bucket `bench`. It reads only and checks no
  signature; what it measures is the S3 client path's cost at a store's own cost to the node
  (none), as a node reading a real bucket sees it;
- `gs-nginx`: the same for the loaders' Google Cloud Storage requests (gs://bench/...), sent to
  nginx by a service-account file that names it as the endpoint (`gcs_base_url`, as GCS
  emulators are reached) and turns OAuth off.

`--latency-ms` adds that round trip to every request, as a cloud store far from the node would:
by putting the server (or a user's plain-http one) behind `benchmarks/latency_proxy.py`, or,
with `--latency-in server`, inside the loopback nginx, whose answers then start that late (no
proxy's copies on this machine's cores, which a real store's latency does not cost either).

A server here runs on the cores the loaders use, which a real store does not: `cpu_ids` names its
processes so that the benchmark counts their CPU time apart (`cpu_seconds`)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.latency_proxy import LatencyProxy
from benchmarks.loopback_servers import MotoS3, Nginx

BUCKET = "bench"
NGINX_S3_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
NGINX_SERVED = ("http", "s3-nginx", "gs-nginx")


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """CPU time (user and system) so far of a process, with its live descendants or without; 0
    where it is gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, pids = 0.0, [pid]
    while pids:
        pid = pids.pop()
        total += _stat_seconds(f"/proc/{pid}/stat", ticks)
        try:
            with open(f"/proc/{pid}/task/{pid}/children", encoding="utf-8") as f:
                pids += [int(child) for child in f.read().split()] if descendants else []
        except OSError:
            continue
    return total


def _stat_seconds(path: str, ticks: int) -> float:
    try:
        with open(path, encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()     # after the command, which may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / ticks     # utime, stime


class RemoteSource:
    """A context manager: `url_for(conversion folder)` and the `environment` its readers need."""

    def __init__(self, where: str, cache: Path, latency_ms: float = 0, latency_in: str = "proxy"):
        if latency_in == "server" and where not in NGINX_SERVED:
            raise SystemExit("error: --latency-in server needs --remote http, s3-nginx or gs-nginx (the loopback nginx)")
        self.where, self.cache, self.latency_ms, self.latency_in = where, cache, latency_ms, latency_in
        self.environment: dict[str, str] = {}
        self._servers = []
        self._base = ""
        self._folder = tempfile.TemporaryDirectory(prefix="remote-source-")

    def __enter__(self) -> "RemoteSource":
        if self.where in NGINX_SERVED:
            root = self.cache
            if self.where != "http":      # path-style S3 and GCS ask for /BUCKET/KEY
                root = Path(self._folder.name) / "buckets"
                root.mkdir()
                (root / BUCKET).symlink_to(self.cache.resolve(), target_is_directory=True)
            delay_ms = self.latency_ms if self.latency_in == "server" else 0
            nginx = self._start(Nginx(root, Path(self._folder.name) / "nginx", delay_ms=delay_ms))
            url = nginx.url if delay_ms else self._proxied(nginx.url)
            if self.where == "s3-nginx":
                self.environment = {**NGINX_S3_ENVIRONMENT, "AWS_ENDPOINT_URL": url}
                self._base = f"s3://{BUCKET}"
            elif self.where == "gs-nginx":
                account = Path(self._folder.name) / "service-account.json"
                account.write_text(json.dumps({"gcs_base_url": url, "disable_oauth": True, "client_email": "",
                                               "private_key": "", "private_key_id": ""}))
                self.environment = {"GOOGLE_SERVICE_ACCOUNT": str(account), "GOOGLE_ALLOW_HTTP": "true"}
                self._base = f"gs://{BUCKET}"
            else:
                self._base = url
        elif self.where == "s3":
            self._moto = self._start(MotoS3())
            self.environment = {**self._moto.environment(), "AWS_ENDPOINT_URL": self._proxied(self._moto.url)}
            self._base = "s3://bench"
        else:
            self._base = self._proxied(self.where.rstrip("/")) if self.latency_ms else self.where.rstrip("/")
        return self

    def url_for(self, conversion: Path) -> str:
        if self.where == "s3":
            return self._moto.upload(conversion, BUCKET, conversion.name)
        return f"{self._base}/{conversion.name}"

    def describe(self) -> str:
        kind = {"http": "nginx on loopback", "s3": "moto's S3 server on loopback",
                "s3-nginx": "S3 requests answered by nginx on loopback",
                "gs-nginx": "GCS requests answered by nginx on loopback"}.get(self.where, "given URL")
        where = "answers delayed in nginx" if self.latency_in == "server" else "through a delay proxy"
        return f"{kind}{f', +{self.latency_ms:g} ms round trip ({where})' if self.latency_ms else ''}"

    def cpu_ids(self) -> list[tuple[int, bool]]:
        """(pid, with its descendants) of the processes serving here, whose CPU time `cpu_seconds`
        counts: nginx and its workers; this process alone for the servers it runs in threads (the
        latency proxy, moto), as it only waits for the loader measured in another."""
        ids = [(server.process.pid, True) for server in self._servers if isinstance(server, Nginx)]
        if any(not isinstance(server, Nginx) for server in self._servers):
            ids.append((os.getpid(), False))
        return ids

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
