"""Converting to object storage (tools/convert_upload.py) against moto's S3 server: what lands in
the bucket equals the staging folder byte for byte, the manifest (with each file's sha256) comes
last, a re-run uploads nothing, a killed upload leaves no manifest and resumes, and a bad
destination is a one-line error. Buckets are versioned, so every PUT of an object leaves a
version behind: counting versions counts uploads."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.loopback_servers import free_port, wait_listening
from conftest import TOOLS, run_tool, run_tool_here, versions

def objects(client, bucket: str, prefix: str) -> dict[str, dict]:
    """{name under prefix: its listing entry} of the current objects."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        found.update((entry["Key"][len(prefix) + 1:], entry) for entry in page.get("Contents", []))
    return found


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_upload(client, bucket: str, prefix: str, staging: Path) -> dict:
    """The uploaded objects are the staging folder's files, and each file's sha256 is in the
    manifest and in its object's metadata; the manifest."""
    manifest = json.loads((staging / "manifest.json").read_text())
    listed = [name for record in manifest["splits"].values() for name in record["files"]]
    assert set(objects(client, bucket, prefix)) == {*listed, "manifest.json"}
    recorded = {}
    for split, record in manifest["splits"].items():
        for shard in record.get("shards", []):
            recorded[f"{split}/{shard['tar']}"] = (shard["bytes"], shard["sha256"])
            recorded[f"{split}/{shard['index']}"] = (shard["index_bytes"], shard["index_sha256"])
            recorded[f"{split}/{shard['checksums']}"] = (shard["checksums_bytes"], shard["checksums_sha256"])
        if "shards" in record:
            pack = record["index_pack"]
            recorded[f"{split}/{pack['file']}"] = (pack["bytes"], pack["sha256"])
        else:
            recorded[record["files"][0]] = (record["bytes"], record["sha256"])
            recorded[record["checksums"]] = (record["checksums_bytes"], record["checksums_sha256"])
    assert set(recorded) == set(listed)
    for name in [*listed, "manifest.json"]:
        local = (staging / name).read_bytes()
        remote = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")
        assert remote["Body"].read() == local, name
        assert remote["Metadata"]["sha256"] == sha256(local), name
        if name in recorded:
            assert recorded[name] == (len(local), sha256(local)), name
    return manifest


@pytest.mark.timeout(300)
def test_wds_upload_equals_staging_and_a_rerun_uploads_nothing(sample_sets, bucket, tmp_path, monkeypatch):
    client, name = bucket
    # where the default staging folder goes; read once by a process (tempfile), so the tool runs in its own
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = (sample_sets / "fashion", f"s3://{name}/wds", "--shard-size-mb", 0.1, "--num-workers", 1)
    first = run_tool("convert_wds.py", *args, check=True)
    staged = list(tmp_path.glob(f"fastpipe-staging-{os.getuid()}/webdataset-*"))
    assert len(staged) == 1 and staged[0].name in first.stderr
    manifest = check_upload(client, name, "wds", staged[0])
    assert len(manifest["splits"]["train"]["shards"]) > 1
    before_puts, _ = versions(client, name, "wds")
    assert set(before_puts.values()) == {1}
    def stamps():
        return {key: (entry["ETag"], entry["LastModified"]) for key, entry in objects(client, name, "wds").items()}
    before = stamps()

    again = run_tool("convert_wds.py", *args, check=True)
    assert "train is up to date" in again.stderr and "up to date (" in again.stderr.splitlines()[-1]
    assert versions(client, name, "wds") == (before_puts, {})
    assert stamps() == before


@pytest.mark.timeout(300)
def test_ffcv_upload_goes_in_parts_and_a_rerun_uploads_nothing(sample_sets, bucket, tmp_path, capsys):
    client, name = bucket
    staging = tmp_path / "staging"
    args = (sample_sets / "fashion", f"s3://{name}/ffcv", "--staging", staging, "--num-workers", 1)
    run_tool_here(capsys, "convert_ffcv.py", *args, check=True)
    manifest = check_upload(client, name, "ffcv", staging)
    beton = manifest["splits"]["train"]["files"][0]
    assert manifest["splits"]["train"]["bytes"] > 8 << 20          # FFCV's pages: larger than one part
    assert "-" in client.head_object(Bucket=name, Key=f"ffcv/{beton}")["ETag"]   # a multipart upload's ETag
    before, _ = versions(client, name, "ffcv")

    again = run_tool_here(capsys, "convert_ffcv.py", *args, check=True)
    assert "up to date (5 objects)" in again.stderr          # two .betons, their checksums, the manifest
    assert versions(client, name, "ffcv") == (before, {})


@pytest.mark.timeout(300)
def test_a_changed_conversion_replaces_the_manifest_only_after_its_files(sample_sets, bucket, tmp_path, capsys):
    client, name = bucket
    staging = tmp_path / "staging"
    args = (sample_sets / "fashion", f"s3://{name}/wds", "--staging", staging, "--num-workers", 1,
            "--splits", "val")
    run_tool_here(capsys, "convert_wds.py", *args, check=True)
    old_manifest = client.get_object(Bucket=name, Key="wds/manifest.json")["Body"].read()
    changed = run_tool_here(capsys, "convert_wds.py", *args, "--jpeg-quality", 50, "--no-restart-markers", check=True)
    assert "uploaded" in changed.stderr
    check_upload(client, name, "wds", staging)
    assert client.get_object(Bucket=name, Key="wds/manifest.json")["Body"].read() != old_manifest
    puts, deletes = versions(client, name, "wds")
    # The old manifest was deleted (not merely overwritten) before the changed shards went up.
    assert deletes == {"manifest.json": 1} and puts["manifest.json"] == 2
    assert puts["val/shard-000000.tar"] == 2


@pytest.mark.timeout(300)
def test_a_killed_upload_leaves_no_manifest_and_the_rerun_resumes(sample_sets, bucket, tmp_path, capsys):
    client, name = bucket
    staging = tmp_path / "staging"
    # One sample a shard, uploaded one at a time: hundreds of objects, the manifest after them all.
    args = [sample_sets / "fashion", f"s3://{name}/wds", "--staging", staging, "--shard-size-mb", 0.001,
            "--num-workers", 1, "--upload-workers", 1]
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, str(TOOLS / "convert_wds.py"), *map(str, args)],
                                   stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        while not client.list_objects_v2(Bucket=name, Prefix="wds/", MaxKeys=1).get("KeyCount"):
            assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.05)            # each listing costs moto's server CPU that the upload needs
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    present = objects(client, name, "wds")
    splits = json.loads((staging / "manifest.json").read_text())["splits"]
    assert "manifest.json" not in present
    assert 0 < len(present) < sum(len(record["files"]) for record in splits.values())

    rerun = run_tool_here(capsys, "convert_wds.py", *args, check=True)
    assert "train is up to date" in rerun.stderr                # nothing converted twice
    check_upload(client, name, "wds", staging)
    puts, _ = versions(client, name, "wds")
    assert set(puts.values()) == {1}                             # nothing uploaded twice
    skipped = re.search(r"(\d+) were there already", rerun.stderr)
    assert skipped and int(skipped[1]) >= len(present)


def one_line(result: subprocess.CompletedProcess) -> str:
    """The error: one line, after the one naming the source's form."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2 and "ImageNet-layout folder" in lines[0], result.stderr[-3000:]
    return lines[1]


@pytest.mark.timeout(120)
def test_a_missing_bucket_another_scheme_or_a_stray_staging_is_a_one_line_error(sample_sets, bucket, tmp_path, capsys):
    src = sample_sets / "fashion"
    line = one_line(run_tool_here(capsys, "convert_wds.py", src, "s3://no-such-bucket-here/wds",
                                  "--staging", tmp_path / "s"))
    assert "s3://no-such-bucket-here/wds" in line and "does not exist" in line
    assert not (tmp_path / "s").exists()                        # refused before converting anything
    line = one_line(run_tool_here(capsys, "convert_ffcv.py", src, "https://user:hunter2@example.com/ffcv"))
    assert "s3:// or gs://" in line and "hunter2" not in line
    line = one_line(run_tool_here(capsys, "convert_wds.py", src, tmp_path / "local", "--staging", tmp_path / "s"))
    assert "--staging" in line and not (tmp_path / "local").exists()


def test_a_bucket_in_another_region_is_a_one_line_error_naming_it(sample_sets, s3_of_another_region, tmp_path, capsys):
    result = run_tool_here(capsys, "convert_wds.py", sample_sets / "fashion", "s3://moved/wds",
                           "--staging", tmp_path / "s")
    assert result.returncode == 2
    assert one_line(result) == ("error: s3://moved/wds: cannot list the destination: the bucket is in region "
                                "eu-west-1, not us-east-1 (S3 answered 301): set AWS_REGION=eu-west-1")
    assert not (tmp_path / "s").exists()                        # refused before converting anything


@pytest.mark.timeout(120)
def test_refused_credentials_are_a_one_line_error_without_the_secret(sample_sets, tmp_path, monkeypatch, capsys):
    """moto's server checking signatures: its IAM knows no key, so every request is refused."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, server)
        for name, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}"), ("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE"),
                            ("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        for script in ("convert_wds.py", "convert_ffcv.py"):
            line = one_line(run_tool_here(capsys, script, sample_sets / "fashion", "s3://photos/x",
                                          "--staging", tmp_path / "s"))
            assert "s3://photos/x" in line and "403" in line and "s3cr3t" not in line
    finally:
        server.terminate()
        server.wait()
