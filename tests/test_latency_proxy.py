"""benchmarks/latency_proxy.py in front of the loopback nginx: the bytes come through unchanged
(whole files, ranges, many connections at once), a round trip costs at least the latency asked
for, either side's close reaches the other, and a stopped proxy gives its port back. Also the
other way the loader benchmark adds latency: nginx's own answers delayed, and nginx serving a
folder while a command runs (`loopback_servers.py --serve`, the GPU check's e2e-remote stage)."""
from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.latency_proxy import LatencyProxy
from conftest import ROOT
from benchmarks.loopback_servers import free_port

SHARD = "train/shard-000000.tar"


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
        return response.status, response.read()


def proxy_for(nginx_server, latency_ms: float, **kwargs) -> LatencyProxy:
    return LatencyProxy("127.0.0.1", nginx_server.port, latency_ms, **kwargs)


def wait_for(condition, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)   # polling for a state change, not a timing assumption


@pytest.mark.timeout(60)
def test_whole_file_and_range_unchanged(nginx_server, served_files):
    local = (served_files / SHARD).read_bytes()
    with proxy_for(nginx_server, 10) as proxy:
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        assert get(f"{proxy.url}/{SHARD}") == (200, local)
        assert get(f"{proxy.url}/{SHARD}", {"Range": "bytes=1000-300000"}) == (206, local[1000:300001])
        assert get(f"{proxy.url}/manifest.json")[1] == (served_files / "manifest.json").read_bytes()
        assert proxy.connections == 3
        assert proxy.bytes_to_client > len(local) + 299001   # and the headers
        assert proxy.bytes_to_upstream > 0
        wait_for(lambda: proxy.open_connections == 0, "connections left open after their responses")


@pytest.mark.timeout(60)
def test_zero_latency_passes_through(nginx_server, served_files):
    local = (served_files / SHARD).read_bytes()
    with proxy_for(nginx_server, 0) as proxy:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        for start in (0, 5, 1 << 20):
            connection.request("GET", f"/{SHARD}", headers={"Range": f"bytes={start}-{start + 9999}"})
            response = connection.getresponse()
            assert (response.status, response.read()) == (206, local[start:start + 10000])
        connection.close()
        assert proxy.connections == 1   # keep-alive: three requests on one connection


@pytest.mark.timeout(60)
def test_round_trip_costs_at_least_the_latency(nginx_server):
    with proxy_for(nginx_server, 200) as proxy:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        start = time.perf_counter()
        connection.request("GET", "/manifest.json")
        assert connection.getresponse().read()
        first = time.perf_counter() - start
        start = time.perf_counter()
        connection.request("GET", "/manifest.json")
        assert connection.getresponse().read()
        second = time.perf_counter() - start
        connection.close()
    assert first >= 0.4, f"a request on a new connection took {first:.3f} s: handshake and round trip are 0.4 s"
    assert second >= 0.2, f"a request on an open connection took {second:.3f} s, under the 0.2 s round trip"


@pytest.mark.timeout(120)
def test_fifty_concurrent_requests(nginx_server, served_files):
    local = (served_files / SHARD).read_bytes()
    ranges = [(i * 61_000, i * 61_000 + 40_000 + i * 997) for i in range(50)]

    def fetch(span):
        start, end = span
        return get(f"{proxy.url}/{SHARD}", {"Range": f"bytes={start}-{end - 1}"})

    with proxy_for(nginx_server, 20) as proxy:
        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(fetch, ranges))
        assert proxy.connections == 50
    assert answers == [(206, local[start:end]) for start, end in ranges]


@pytest.mark.timeout(60)
def test_upstream_close_reaches_the_client(nginx_server, served_files):
    with proxy_for(nginx_server, 20) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(b"GET /manifest.json HTTP/1.0\r\nHost: x\r\n\r\n")   # nginx closes after an HTTP/1.0 answer
            received = b""
            while chunk := client.recv(65536):    # ends only at the end of the stream that nginx's close sent
                received += chunk
            assert received.endswith((served_files / "manifest.json").read_bytes())
        wait_for(lambda: proxy.open_connections == 0, "the proxy kept the connection after both sides closed")


@pytest.mark.timeout(60)
def test_client_close_reaches_upstream(nginx_server):
    with proxy_for(nginx_server, 20) as proxy:
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        client.sendall(b"GET /manifest.json HTTP/1.1\r\nHost: x\r\n")   # half a request: nginx waits for the rest
        wait_for(lambda: proxy.open_connections == 1, "the proxy did not take the connection")
        client.close()
        wait_for(lambda: proxy.open_connections == 0, "the client's close did not end the upstream connection")


@pytest.mark.timeout(60)
def test_upstream_not_listening_closes_the_client():
    with LatencyProxy("127.0.0.1", free_port(), 10) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert client.recv(100) == b""
        except ConnectionResetError:
            pass


@pytest.mark.timeout(60)
def test_stopped_proxy_releases_its_port(nginx_server, served_files):
    proxy = proxy_for(nginx_server, 10).start()
    port = proxy.port
    assert get(f"{proxy.url}/manifest.json")[0] == 200
    proxy.stop()
    proxy.stop()   # twice is harmless
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    with proxy_for(nginx_server, 10, port=port) as again:
        assert again.port == port
        assert get(f"{again.url}/manifest.json")[1] == (served_files / "manifest.json").read_bytes()


@pytest.mark.timeout(60)
def test_port_in_use_is_one_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            LatencyProxy("127.0.0.1", 1, 10, port=port).start()


@pytest.mark.timeout(60)
def test_command_line_runs_until_interrupted(nginx_server, served_files):
    process = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "latency_proxy.py"), "--upstream",
                                f"127.0.0.1:{nginx_server.port}", "--latency-ms", "25"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = process.stdout.readline().split()[0]
        assert url.startswith("http://127.0.0.1:"), url
        assert get(f"{url}/manifest.json")[1] == (served_files / "manifest.json").read_bytes()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, err
    assert "1 connections" in out


@pytest.mark.timeout(60)
def test_nginx_delays_its_answers_and_still_serves_ranges(served_files, tmp_path):
    from benchmarks.loopback_servers import ECHO_MODULE, Nginx
    if not ECHO_MODULE.exists():
        pytest.skip("nginx's echo module is not installed (libnginx-mod-http-echo)")
    local = (served_files / SHARD).read_bytes()
    server = Nginx(served_files, tmp_path / "nginx", delay_ms=200)
    try:
        start = time.perf_counter()
        answer = get(f"{server.url}/{SHARD}", {"Range": "bytes=1000-300000"})
        took = time.perf_counter() - start
    finally:
        server.stop()
    assert answer == (206, local[1000:300001])
    assert took >= 0.2, f"an answer came after {took:.3f} s, before the 0.2 s delay"


@pytest.mark.timeout(60)
def test_serve_runs_a_command_against_nginx_and_gives_back_its_status(served_files, tmp_path):
    serve = [sys.executable, str(ROOT / "benchmarks" / "loopback_servers.py"), "--serve"]
    fetch = ("import sys, urllib.request; request = urllib.request.Request(sys.argv[1] + sys.argv[2], "
             "headers={'Range': 'bytes=10-19'}); sys.stdout.buffer.write(urllib.request.urlopen(request).read()); "
             "sys.exit(3)")
    result = subprocess.run([*serve, str(served_files), "--", sys.executable, "-c", fetch, "{url}", f"/{SHARD}"],
                            capture_output=True, timeout=50)
    assert result.returncode == 3, result.stderr.decode()[-2000:]
    assert result.stdout == (served_files / SHARD).read_bytes()[10:20]
    errors = result.stderr.decode()
    assert "nginx answered 1 requests" in errors
    port = int(errors.split("at http://127.0.0.1:")[1].split()[0])
    with pytest.raises(ConnectionRefusedError):          # stopped with the command
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    missing = subprocess.run([*serve, str(tmp_path / "absent"), "--", "true"], capture_output=True, text=True,
                             timeout=50)
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'absent'} is not a folder"
