"""The object-storage client layer (pipeline/storage/object_store.py) against real servers: nginx over
HTTP, moto's S3 server, and a stdlib server that fails its first requests."""
from __future__ import annotations

import http.server
import sys
import threading

import pytest

from pipeline.errors import RemoteDataError
from pipeline.storage.object_store import merge_ranges, open_store
from pipeline.storage.urls import is_url, redact
from benchmarks.loopback_servers import free_port
from conftest import checking_credentials, credential_process, without_aws_variables

SHARD = "train/shard-000000.tar"


def ranges():
    return [(0, 100), (50, 4000), (4100, 9000), (1 << 20, (1 << 20) + 777), ((3 << 20) - 10, 3 << 20)]


def test_is_url_and_redact():
    assert is_url("s3://b/p") and is_url("https://h/p") and is_url("gs://b/p")
    assert not is_url("/data/photos") and not is_url("photos-wds") and not is_url("file:///x")
    shown = redact("https://user:hunter2@host/p?X-Amz-Signature=abc123&part=1&token=zz")
    assert "hunter2" not in shown and "abc123" not in shown and "zz" not in shown
    assert "host/p" in shown and "part=1" in shown


def test_merge_ranges():
    assert merge_ranges([(10, 20), (0, 5), (15, 30)], gap=0) == [(0, 5), (10, 30)]
    assert merge_ranges([(0, 5), (6, 9)], gap=1) == [(0, 9)]


def test_http_whole_and_ranged_reads(nginx_server, served_files):
    local = (served_files / SHARD).read_bytes()
    store = open_store(nginx_server.url)
    assert store.read(SHARD) == local
    assert store.size(SHARD) == len(local)
    before = nginx_server.requests()
    assert store.read_ranges(SHARD, ranges()) == [local[s:e] for s, e in ranges()]
    merged_requests = nginx_server.requests() - before
    before = nginx_server.requests()
    separate = [store.read_ranges(SHARD, [r])[0] for r in ranges()]
    assert separate == [local[s:e] for s, e in ranges()]
    assert merged_requests < nginx_server.requests() - before


def test_s3_whole_and_ranged_reads(moto_s3, served_files, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    local = (served_files / SHARD).read_bytes()
    store = open_store("s3://photos/wds")
    assert store.read(SHARD) == local
    assert store.read("manifest.json") == (served_files / "manifest.json").read_bytes()
    assert store.read_ranges(SHARD, ranges()) == [local[s:e] for s, e in ranges()]
    with pytest.raises(RemoteDataError) as caught:
        store.read("missing.tar")
    assert "s3://photos/wds/missing.tar" in str(caught.value) and "not found" in str(caught.value)


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and len(text) < 400
    return text


def test_http_errors_name_the_redacted_url(nginx_server):
    secret_url = nginx_server.url.replace("http://", "http://alice:hunter2@")
    with pytest.raises(RemoteDataError) as caught:
        open_store(secret_url).read("nothing-here.tar")
    text = one_line(caught)
    assert "hunter2" not in text and "nothing-here.tar" in text and "404" in text
    with pytest.raises(RemoteDataError) as caught:
        open_store(nginx_server.url).read("denied/secret.bin")
    assert "403" in one_line(caught)
    closed = f"http://bob:pa55@127.0.0.1:{free_port()}/data?X-Amz-Signature=s3cr3t&part=1"
    with pytest.raises(RemoteDataError) as caught:
        open_store(closed).read("manifest.json")
    text = one_line(caught)
    assert "s3cr3t" not in text and "pa55" not in text and "connection refused" in text
    assert "127.0.0.1" in text and "/data/manifest.json?" in text


def test_s3_wrong_credentials_and_wrong_endpoint(moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RemoteDataError) as caught:
        open_store("s3://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert "s3://photos/wds/manifest.json" in text and "connection refused" in text


def test_s3_unknown_credentials_are_denied(moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(RemoteDataError) as caught, checking_credentials(moto_s3):
        open_store("s3://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert "403" in text and "s3://photos/wds/manifest.json" in text and "wrong-secret-value" not in text


def test_s3_missing_credentials(moto_s3, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    # without credentials the client asks the instance metadata service: here a closed local port
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RemoteDataError) as caught:
        open_store("s3://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert text.startswith("s3://photos/wds") and "no credentials found" in text and "AWS_PROFILE" in text


def test_s3_keys_region_and_endpoint_come_from_the_aws_profile(moto_s3, moto_reader, served_files, monkeypatch,
                                                               tmp_path):
    """As `aws configure` writes them: keys in ~/.aws/credentials, region and endpoint in
    ~/.aws/config, the profile named by AWS_PROFILE. moto checks the keys and the signature."""
    key = moto_reader
    without_aws_variables(monkeypatch, tmp_path)
    (tmp_path / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = AKIANOTTHISONE\naws_secret_access_key = not-this-one\n\n"
        f"[team]\naws_access_key_id = {key['AccessKeyId']}\naws_secret_access_key = {key['SecretAccessKey']}\n")
    (tmp_path / ".aws" / "config").write_text(f"[profile team]\nregion = us-east-1\nendpoint_url = {moto_s3.url}\n")
    monkeypatch.setenv("AWS_PROFILE", "team")
    with checking_credentials(moto_s3):
        assert open_store("s3://photos/wds").read_ranges(SHARD, [(10, 5000)])[0] == \
            (served_files / SHARD).read_bytes()[10:5000]
        # The default profile's keys are refused by moto: the file is what signs
        monkeypatch.setenv("AWS_PROFILE", "default")
        (tmp_path / ".aws" / "config").write_text(f"[default]\nregion = us-east-1\nendpoint_url = {moto_s3.url}\n")
        with pytest.raises(RemoteDataError) as caught:
            open_store("s3://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert "403" in text and "s3://photos/wds/manifest.json" in text and "not-this-one" not in text


@pytest.mark.parametrize("profiles, named, expected", [
    ("[profile corp]\nsso_session = corp\nregion = eu-west-1\n", "corp",
     "AWS profile corp gets its credentials through sso_session"),
    ("[profile ops]\nrole_arn = arn:aws:iam::1:role/x\nsource_profile = default\n", "ops",
     "credential_process = aws configure export-credentials --profile ops --format process"),
    ("[profile corp]\nregion = eu-west-1\n", "missing", "AWS_PROFILE=missing: no such profile in"),
    ("[profile corp\nregion = eu-west-1 secret-looking-value\n", "corp", "cannot be read (not an INI file"),
])
def test_an_aws_profile_that_cannot_sign_is_one_line_naming_it(profiles, named, expected, monkeypatch, tmp_path):
    without_aws_variables(monkeypatch, tmp_path)
    (tmp_path / ".aws" / "config").write_text(profiles)
    monkeypatch.setenv("AWS_PROFILE", named)
    with pytest.raises(RemoteDataError) as caught:
        open_store("s3://photos/wds")
    text = one_line(caught)
    assert text.startswith("s3://photos/wds: ") and expected in text and "secret-looking-value" not in text


@pytest.mark.parametrize("expires_in_s, runs", [(3600, 1), (-1, 2)], ids=["valid-an-hour", "expired"])
def test_s3_keys_from_a_credential_process_are_asked_for_again_as_they_expire(
        moto_s3, moto_reader, served_files, monkeypatch, tmp_path, expires_in_s, runs):
    """The profile's credential_process gives the keys (moto checks them), run once while they
    hold and again once they expire, as obstore asks for them again."""
    without_aws_variables(monkeypatch, tmp_path)
    command, ran = credential_process(tmp_path, moto_reader, expires_in_s)
    (tmp_path / ".aws" / "config").write_text(f"[profile job]\ncredential_process = {command}\nregion = us-east-1\n"
                                              f"endpoint_url = {moto_s3.url}\n")
    monkeypatch.setenv("AWS_PROFILE", "job")
    with checking_credentials(moto_s3):
        store = open_store("s3://photos/wds")
        for _ in range(2):
            assert store.read_ranges(SHARD, [(7, 900)])[0] == (served_files / SHARD).read_bytes()[7:900]
    times_run = len(ran.read_text().splitlines())
    if runs == 1:
        assert times_run == 1      # its keys kept while they hold: not run again for the first read
    else:
        assert times_run >= runs


@pytest.mark.parametrize("script, expected", [
    ("import sys; print('Error: the SSO session has expired', file=sys.stderr); sys.exit(3)",
     "the credential_process of AWS profile job exited with 3: Error: the SSO session has expired"),
    ("print('{\"AccessKeyId\": \"AKIA\", \"SecretAccessKey\": \"secret-looking-value\"')",
     "the credential_process of AWS profile job did not print the JSON the AWS CLI reads"),
    # keys that expire at once, then a failure when they are asked for again, at the read
    ("import json, os, sys\nif os.path.exists('ran'): sys.exit('Error: the SSO session has expired')\n"
     "open('ran', 'w').close()\nprint(json.dumps({'AccessKeyId': 'AKIA', 'SecretAccessKey': 'secret-looking-value', "
     "'Expiration': '2000-01-01T00:00:00Z'}))",
     "the credential_process of AWS profile job exited with 1: Error: the SSO session has expired"),
], ids=["exits-3", "not-json", "fails-when-asked-again"])
def test_a_credential_process_that_fails_is_one_line_naming_the_profile(script, expected, monkeypatch, tmp_path):
    without_aws_variables(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    (tmp_path / "process.py").write_text(script)
    (tmp_path / ".aws" / "config").write_text(f"[profile job]\ncredential_process = {sys.executable} "
                                              f"{tmp_path / 'process.py'}\n")
    monkeypatch.setenv("AWS_PROFILE", "job")
    with pytest.raises(RemoteDataError) as caught:
        open_store("s3://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert text.split(": ", 1)[1].startswith(expected) and "secret-looking-value" not in text


def test_gcs_missing_credentials(monkeypatch):
    for name in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")       # no gcloud login there
    # without a key file the client asks the instance's metadata server: here a closed local port
    closed = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("GCE_METADATA_HOST", closed)
    monkeypatch.setenv("GCE_METADATA_IP", closed)
    with pytest.raises(RemoteDataError) as caught:
        open_store("gs://photos/wds").read("manifest.json")
    text = one_line(caught)
    assert text.startswith("gs://photos/wds") and "no credentials found" in text
    assert "GOOGLE_APPLICATION_CREDENTIALS" in text


class Silent:
    """A TCP server that takes every connection and never answers: a metadata address where, off a
    cloud instance, nothing replies."""

    def __init__(self):
        import socket
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.connections = []
        threading.Thread(target=self._take, daemon=True).start()

    def _take(self):
        while True:
            try:
                self.connections.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self):
        import socket
        for connection in self.connections:
            connection.close()
        self.socket.shutdown(socket.SHUT_RDWR)      # wakes the accepting thread, which close alone leaves waiting
        self.socket.close()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_no_credentials_where_no_metadata_service_answers_is_said_after_one_try(scheme, monkeypatch, tmp_path):
    """Off a cloud instance obstore would wait on the metadata address through its retries (a
    minute) before failing: the store asks it once, briefly, and says so."""
    silent = Silent()
    without_aws_variables(monkeypatch, tmp_path)
    for name in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://{silent.address}")
    monkeypatch.setenv("GCE_METADATA_HOST", silent.address)
    monkeypatch.setenv("GCE_METADATA_IP", silent.address)
    try:
        with pytest.raises(RemoteDataError) as caught:
            open_store(f"{scheme}://photos/wds").read("manifest.json")
    finally:
        silent.close()
    text = one_line(caught)
    assert text.startswith(f"{scheme}://photos/wds: no credentials found")
    # one probe (two for GCS: its host name, then its address), none of obstore's retries
    assert len(silent.connections) == (1 if scheme == "s3" else 2)


def answer(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class FailingFirst(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first `failures` requests, then the payload."""
    failures = 2
    seen = 0

    def do_GET(self):
        type(self).seen += 1
        if type(self).seen <= self.failures:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        answer(self, b"payload-bytes")

    def log_message(self, *args):
        pass


def test_503_then_success_is_retried():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingFirst)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert open_store(f"http://127.0.0.1:{server.server_address[1]}").read("x.bin") == b"payload-bytes"
        assert FailingFirst.seen == 3
    finally:
        server.shutdown()


class ShortFirst(http.server.BaseHTTPRequestHandler):
    """Answers range requests from PAYLOAD, the first `short` of them with half the bytes
    (a 206 whose Content-Range says so)."""
    PAYLOAD = bytes(range(256)) * 4096
    short = 1
    seen = 0

    def do_GET(self):
        type(self).seen += 1
        first, last = self.headers["Range"].removeprefix("bytes=").split("-")
        start = int(first)
        body = self.PAYLOAD[start:int(last) + 1]
        if type(self).seen <= self.short:
            body = body[:len(body) // 2]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(self.PAYLOAD)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("short", [1, 5])
def test_a_short_range_response_is_read_again_once(short):
    handler = type("Short", (ShortFirst,), {"short": short, "seen": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = open_store(f"http://127.0.0.1:{server.server_address[1]}")
        if short == 1:
            assert store.read_ranges("x.tar", [(1000, 300000)]) == [ShortFirst.PAYLOAD[1000:300000]]
        else:
            with pytest.raises(RemoteDataError) as caught:
                store.read_ranges("x.tar", [(1000, 300000)])
            assert "x.tar" in one_line(caught)
        assert handler.seen == 2
    finally:
        server.shutdown()


class StallFirst(http.server.BaseHTTPRequestHandler):
    """Holds its first request unanswered until released; answers the others at once."""
    seen = 0
    release = threading.Event()

    def do_GET(self):
        type(self).seen += 1
        if type(self).seen == 1:
            self.release.wait(60)
            return
        answer(self, b"after-a-stall")

    def log_message(self, *args):
        pass


def test_a_stalled_request_times_out_and_is_retried():
    from pipeline.storage.object_store import ObjectStore
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StallFirst)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = ObjectStore(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=1)
        assert store.read("x.bin") == b"after-a-stall"
        assert StallFirst.seen == 2
    finally:
        StallFirst.release.set()
        server.shutdown()


@pytest.mark.parametrize("bucket, expected", [
    ("moved", "the bucket is in region eu-west-1, not us-east-1 (S3 answered 301): set AWS_REGION=eu-west-1"),
    ("signed", "the bucket is in region ap-south-1, not us-east-1 (S3 answered 400): set AWS_REGION=ap-south-1"),
    ("lost", "the bucket is in another region than us-east-1 (S3 answered 301): set AWS_REGION to its region"),
    ("other", "the server answered 400 (InvalidArgument: Invalid argument.)"),
])
def test_a_bucket_in_another_region_is_named_with_the_region_to_set(s3_of_another_region, bucket, expected):
    with pytest.raises(RemoteDataError) as caught:
        open_store(f"s3://{bucket}/wds").read("manifest.json")
    assert one_line(caught) == f"s3://{bucket}/wds/manifest.json: {expected}"
