"""Direct range reads (`pipeline/storage/direct_ranges.py`) against real servers on
loopback: nginx over http and through the S3 API (URLs signed by obstore), and Python's own
http.server, which ignores Range, and a server of crafted answers; where they are not used at all."""
from __future__ import annotations

import functools
import http.server
import socketserver
import threading

import numpy as np
import pytest

from benchmarks.loopback_servers import Nginx
from pipeline.storage.direct_ranges import FAILURES_IN_A_ROW, DirectRanges, _host_header, direct_ranges
from pipeline.storage.object_store import open_store

RANGES = [(0, 1), (5, 70_000), (123_456, 200_000), (299_999, 300_000)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    data = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    (root / "bucket" / "a folder").mkdir(parents=True)
    (root / "bucket" / "a folder" / "shard 0.tar").write_bytes(data)
    server = Nginx(root, tmp_path_factory.mktemp("nginx"))
    yield server, data
    server.stop()


def read(reader: DirectRanges, name: str, start: int, end: int) -> bytes:
    into = bytearray(end - start)
    reader.read_into(name, start, end, memoryview(into))
    return bytes(into)


def read_all(reader: DirectRanges, name: str, ranges) -> list[bytes]:
    return [read(reader, name, start, end) for start, end in ranges]


def test_ranges_of_an_http_store_are_the_objects_bytes(served):
    server, data = served
    store = open_store(f"{server.url}/bucket/a%20folder")
    reader = direct_ranges(store.client, store.client_url, store.options)
    assert reader is not None and not reader.signs
    assert read_all(reader, "shard 0.tar", RANGES) == [data[start:end] for start, end in RANGES]


def test_s3_ranges_go_by_urls_that_obstore_signs_and_signs_again_as_they_age(served, monkeypatch):
    server, data = served
    for name, value in (("AWS_ENDPOINT_URL", server.url), ("AWS_ACCESS_KEY_ID", "reader"),
                        ("AWS_SECRET_ACCESS_KEY", "secret"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    store = open_store("s3://bucket/a folder")
    reader = DirectRanges(store.client, store.client_url, store.options, signed_for_s=0)
    assert reader.signs and reader.signings == 1
    assert read_all(reader, "shard 0.tar", RANGES) == [data[start:end] for start, end in RANGES]
    assert reader.signings == 1 + len(RANGES)       # each read found the URLs past half their life
    assert "X-Amz-Signature=" in server.access_log.read_text()


def test_a_connection_the_server_closed_while_idle_is_opened_again_and_not_counted_a_failure(tmp_path):
    """As a store closes kept-alive connections idle past its timeout (a long evaluation): here the
    server itself is replaced, on the same port, between two reads of the same thread."""
    data = np.random.default_rng(4).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "shard.tar").write_bytes(data)
    server = Nginx(tmp_path / "served", tmp_path / "nginx")
    try:
        store = open_store(server.url)
        reader = direct_ranges(store.client, store.client_url, store.options)
        assert read(reader, "shard.tar", 0, 100) == data[:100]
        server.stop()
        server = Nginx(tmp_path / "served", tmp_path / "nginx-again", port=server.port)
        assert read(reader, "shard.tar", 100, 5000) == data[100:5000]
        assert reader.failures == 0
    finally:
        server.stop()


class _NoRanges(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_server_that_ignores_range_is_an_error_and_the_next_read_opens_a_new_connection(served, tmp_path):
    """Until FAILURES_IN_A_ROW, after which the reader is no longer to be used."""
    _, data = served
    (tmp_path / "shard.tar").write_bytes(data)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_NoRanges, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        store = open_store(url)
        reader = direct_ranges(store.client, store.client_url, store.options)
        for _ in range(FAILURES_IN_A_ROW):
            assert reader.usable
            with pytest.raises(OSError, match="HTTP 200 .* for a range request"):
                read(reader, "shard.tar", 10, 20)
        assert not reader.usable
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_not_used_where_a_proxy_is_set_for_the_host_or_the_url_has_a_query(served, monkeypatch, variable):
    server, _ = served
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    store = open_store(f"{server.url}/bucket")
    assert direct_ranges(store.client, f"{server.url}/bucket?token=x", store.options) is None
    monkeypatch.setenv(variable, "http://proxy.internal:3128")
    assert direct_ranges(store.client, store.client_url, store.options) is None
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert direct_ranges(store.client, store.client_url, store.options) is not None


class _CraftedAnswers(socketserver.StreamRequestHandler):
    """Answers each GET with the next of the server's `answers` (a function of the range asked
    for), as a server other than nginx might: the connections it accepted are counted."""

    def handle(self):
        self.server.connections += 1
        while (request := self.rfile.readline()).startswith(b"GET "):
            headers = {}
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode("latin-1").partition(":")
                headers[key.strip().lower()] = value.strip()
            start, end = map(int, headers["range"].removeprefix("bytes=").split("-"))
            self.server.hosts.append(headers["host"])
            self.wfile.write(self.server.answers.pop(0)(start, end + 1))


def test_answers_that_close_the_connection_or_come_in_chunks_are_read_or_refused(tmp_path):
    """A 206 saying `Connection: close` is read, and the next read opens a connection of its own;
    a chunked or compressed one is an OSError (the caller reads the range through obstore)."""
    data = bytes(range(256)) * 4

    def partial(*extra: str):
        def answer(start, end):
            head = ["HTTP/1.1 206 Partial Content", f"Content-Range: bytes {start}-{end - 1}/{len(data)}",
                    f"Content-Length: {end - start}", *extra]
            return ("\r\n".join(head) + "\r\n\r\n").encode() + data[start:end]
        return answer

    def chunked(start, end):
        body = data[start:end]
        return (f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end - 1}/{len(data)}\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _CraftedAnswers)
    server.daemon_threads, server.connections, server.hosts = True, 0, []
    server.answers = [partial(), partial("Connection: close"), chunked, partial("Content-Encoding: gzip"), partial()]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        store = open_store(url)
        reader = direct_ranges(store.client, store.client_url, store.options)
        assert read(reader, "shard.tar", 0, 100) == data[:100]
        assert read(reader, "shard.tar", 100, 1000) == data[100:1000]       # then closed by the server
        for failures in (1, 2):         # each on a connection opened for it: not read again here
            with pytest.raises(OSError, match="HTTP 206 .* for a range request"):
                read(reader, "shard.tar", 5, 10)
            assert reader.failures == failures
        assert read(reader, "shard.tar", 1000, 1024) == data[1000:1024]
        assert server.connections == 4 and reader.failures == 0
        assert server.hosts == [f"127.0.0.1:{server.server_address[1]}"] * 5
    finally:
        server.shutdown()
        server.server_close()


def test_the_host_header_names_the_port_only_where_it_is_not_the_schemes_own():
    assert _host_header("https", "s3.amazonaws.com", 443) == "s3.amazonaws.com"
    assert _host_header("http", "127.0.0.1", 80) == "127.0.0.1"
    assert _host_header("http", "127.0.0.1", 9000) == "127.0.0.1:9000"
    assert _host_header("https", "::1", 8443) == "[::1]:8443"
    assert _host_header("https", "bücher.example", 443) == "xn--bcher-kva.example"
