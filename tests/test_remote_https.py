"""A dataset behind HTTPS, served by nginx on loopback with a certificate of a test CA made here
by openssl: refused in one line while the CA is not trusted (certificates are verified by
default), and read bit for bit as from local disk once SSL_CERT_FILE names it; through the S3
API (nginx answering path-style requests, as an S3-compatible store inside a cluster does) once
AWS_CA_BUNDLE or the AWS profile's `ca_bundle` names it. Streamed through memory, the fetch
process's own reads trust the same CA."""
from __future__ import annotations

import subprocess

import pytest

from benchmarks.loopback_servers import Nginx
from pipeline import LoaderSpec, build_loader
from pipeline.datasets import read_converted
from pipeline.errors import RemoteDataError


SETTINGS = dict(backend="webdataset", split="val", batch_size=16, val_resolution=64, num_workers=2)


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def https_server(converted_sets, tmp_path_factory):
    """nginx over HTTPS with a certificate for 127.0.0.1 signed by a CA of its own, and that CA's file."""
    keys = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=fastpipe test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign", cwd=keys)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=keys)
    (keys / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                                  "extendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=keys)
    # The photos conversion at /photos_wds and, for path-style S3 requests, in the bucket `datasets`
    served = tmp_path_factory.mktemp("https-root")
    (served / "photos_wds").symlink_to(converted_sets["photos"]["webdataset"], target_is_directory=True)
    (served / "datasets").symlink_to(served, target_is_directory=True)
    server = Nginx(served, tmp_path_factory.mktemp("nginx-tls"), tls=(keys / "server.pem", keys / "server.key"))
    yield server, keys / "ca.pem"
    server.stop()


def test_an_untrusted_certificate_is_refused_in_one_line(https_server, monkeypatch, tmp_path):
    server, _ = https_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(RemoteDataError) as caught:
        read_converted(f"{server.url}/photos_wds", "val", "webdataset", cache_dir=str(tmp_path))
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    assert message.startswith(f"{server.url}/photos_wds/manifest.json: ") and "certificate" in message


@pytest.mark.parametrize("streamed", [False, True], ids=["disk-cache", "streamed"])
def test_with_its_ca_trusted_the_batches_are_those_of_local_disk(converted_sets, https_server, monkeypatch, tmp_path,
                                                                 streamed):
    server, ca = https_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert_same_batches(converted_sets, f"{server.url}/photos_wds", tmp_path, streamed)


@pytest.mark.parametrize("named_by,streamed", [("AWS_CA_BUNDLE", False), ("profile", False), ("AWS_CA_BUNDLE", True)])
def test_s3_behind_a_private_ca_is_read_once_the_aws_way_names_it(converted_sets, https_server, monkeypatch,
                                                                  tmp_path, named_by, streamed):
    server, ca = https_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in (("AWS_ENDPOINT_URL", server.url), ("AWS_ACCESS_KEY_ID", "any"),
                        ("AWS_SECRET_ACCESS_KEY", "any"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(RemoteDataError) as caught:
        read_converted("s3://datasets/photos_wds", "val", "webdataset", cache_dir=str(tmp_path))
    assert "certificate" in str(caught.value)
    if named_by == "profile":
        (tmp_path / ".aws").mkdir()
        (tmp_path / ".aws" / "config").write_text(f"[default]\nca_bundle = {ca}\n")
    else:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
    assert_same_batches(converted_sets, "s3://datasets/photos_wds", tmp_path, streamed)


def assert_same_batches(converted_sets, url: str, tmp_path, streamed: bool) -> None:
    local = build_loader(LoaderSpec(path=str(converted_sets["photos"]["webdataset"]), **SETTINGS))
    remote = build_loader(LoaderSpec(path=url, cache_dir=str(tmp_path / "cache"), cache_limit=1 if streamed else None,
                                     **SETTINGS))
    assert remote.stored.in_memory == streamed
    pairs = list(zip(local, remote))
    assert len(pairs) == len(local) > 0
    for (x1, y1), (x2, y2) in pairs:
        assert x1.equal(x2) and y1.equal(y2)
    if streamed:        # the fetch process read every range itself, over TLS, trusting the same CA
        shared = remote.stored.sources.fetch_process.shared
        assert shared.direct_requests == shared.requests_made > 0
