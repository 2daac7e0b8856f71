"""Staging a file from object storage into a local folder (pipeline/storage/staged_file.py) against a real
nginx: one fetch, then none; checked against the manifest's sha256; resumed from a `.part`; one
copy for several processes; one-line errors naming the URL."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import fill
from pipeline.errors import RemoteDataError
from pipeline.storage.object_store import open_store
from pipeline.storage.staged_file import stage_file

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
SHARD = "train/shard-000000.tar"
CHUNK = 256 << 10          # many chunks of the 3 MiB object, several in flight
_LOG_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) [^"]*" (?P<status>\d{3}) (?P<bytes>\d+)')


@pytest.fixture
def beton(served_files):
    data = (served_files / SHARD).read_bytes()
    return data, hashlib.sha256(data).hexdigest()


def settled_log(server) -> list[str]:
    """The access log once every request made so far is in it: nginx's one worker logs a request
    when it is done with it, so a request answered after them is logged after them."""
    mark = f"/manifest.json?settled={time.monotonic_ns()}"
    urllib.request.urlopen(server.url + mark).read()
    while True:
        lines = server.access_log.read_text().splitlines()
        if any(mark in line for line in lines):
            return [line for line in lines if mark not in line and "settled=" not in line]
        time.sleep(0.01)     # polling for the log line to appear; the test's time limit bounds it


def fetched(lines: list[str], path: str = SHARD) -> int:
    """Body bytes nginx sent for `path` in these log lines (combined format)."""
    total = 0
    for line in lines:
        found = _LOG_LINE.search(line)
        if found and found["path"] == f"/{path}":
            total += int(found["bytes"])
    return total


def one_line(caught) -> str:
    text = str(caught.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def leftovers(dest: Path) -> set[str]:
    return {p.name for p in dest.parent.iterdir()} - {dest.name + ".lock"}


def test_stages_once_then_fetches_nothing(nginx_server, beton, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="pipeline")
    data, sha = beton
    store = open_store(nginx_server.url)
    dest = tmp_path / "cache" / "train.beton"
    before = settled_log(nginx_server)
    assert stage_file(store, SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False) == dest
    assert dest.read_bytes() == data
    assert leftovers(dest) == {"train.beton", "train.beton.verified"}
    after = settled_log(nginx_server)
    assert fetched(after[len(before):]) == len(data)
    assert sum(1 for line in after[len(before):] if f"/{SHARD}" in line) > len(data) // CHUNK
    assert capsys.readouterr().err == "" and not caplog.records

    assert stage_file(store, SHARD, dest, len(data), sha, chunk_bytes=CHUNK) == dest
    assert settled_log(nginx_server) == after
    assert dest.read_bytes() == data


def test_progress_shows_the_url_and_mib(nginx_server, beton, tmp_path, capsys):
    data, sha = beton
    stage_file(open_store(nginx_server.url), SHARD, tmp_path / "x.beton", len(data), sha, chunk_bytes=CHUNK)
    err = capsys.readouterr().err
    assert f"staging {nginx_server.url}/{SHARD}" in err and "3/3 MiB (100%)" in err, err


def test_wrong_sha256_leaves_no_copy(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    wrong = hashlib.sha256(b"another conversion").hexdigest()
    with pytest.raises(RemoteDataError) as caught:
        stage_file(open_store(nginx_server.url), SHARD, dest, len(data), wrong, chunk_bytes=CHUNK, progress=False)
    text = one_line(caught)
    assert f"{nginx_server.url}/{SHARD}" in text and "changed since it was converted" in text, text
    assert leftovers(dest) == set()


def test_wrong_size_fails_before_fetching(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    before = settled_log(nginx_server)
    with pytest.raises(RemoteDataError) as caught:
        stage_file(open_store(nginx_server.url), SHARD, dest, len(data) - 1, sha, progress=False)
    assert "changed since it was converted" in one_line(caught)
    assert fetched(settled_log(nginx_server)[len(before):]) == 0
    assert leftovers(dest) == set()


def test_resumes_from_a_part(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    (tmp_path / "train.beton.part").write_bytes(data[:1 << 20])
    before = settled_log(nginx_server)
    stage_file(open_store(nginx_server.url), SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)
    assert dest.read_bytes() == data
    assert fetched(settled_log(nginx_server)[len(before):]) == len(data) - (1 << 20)
    assert leftovers(dest) == {"train.beton", "train.beton.verified"}


def test_a_part_with_wrong_bytes_ends_in_the_sha256_error(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    (tmp_path / "train.beton.part").write_bytes(bytes(1 << 20))
    store = open_store(nginx_server.url)
    with pytest.raises(RemoteDataError) as caught:
        stage_file(store, SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)
    assert "sha256" in one_line(caught)
    assert leftovers(dest) == set()
    stage_file(store, SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)   # starts afresh
    assert dest.read_bytes() == data


def test_a_part_of_another_version_is_not_resumed(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    (tmp_path / "train.beton.part").write_bytes(bytes(1 << 20))
    (tmp_path / "train.beton.lock").write_text(hashlib.sha256(b"an older conversion").hexdigest())
    before = settled_log(nginx_server)
    stage_file(open_store(nginx_server.url), SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)
    assert dest.read_bytes() == data
    assert fetched(settled_log(nginx_server)[len(before):]) == len(data)


def test_a_copy_without_its_marker_is_checked_locally(nginx_server, beton, tmp_path):
    data, sha = beton
    store = open_store(nginx_server.url)
    dest = tmp_path / "train.beton"
    dest.write_bytes(data)                   # renamed into place, killed before the marker
    before = settled_log(nginx_server)
    stage_file(store, SHARD, dest, len(data), sha, progress=False)
    assert settled_log(nginx_server) == before
    assert (tmp_path / "train.beton.verified").read_text() == sha

    dest.write_bytes(bytes(len(data)))       # same size, other bytes, and no marker: fetched again
    (tmp_path / "train.beton.verified").unlink()
    stage_file(store, SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)
    assert dest.read_bytes() == data


def test_missing_object_is_one_line_naming_the_url(nginx_server, tmp_path):
    dest = tmp_path / "train.beton"
    secret = nginx_server.url.replace("http://", "http://alice:hunter2@")
    with pytest.raises(RemoteDataError) as caught:
        stage_file(open_store(secret), "train/nothing.beton", dest, 100, "0" * 64, progress=False)
    text = one_line(caught)
    assert "train/nothing.beton" in text and "404" in text and "hunter2" not in text, text
    assert leftovers(dest) == set()


def test_no_room_fails_before_fetching(nginx_server, beton, tmp_path):
    _, sha = beton
    dest = tmp_path / "train.beton"
    before = settled_log(nginx_server)
    with pytest.raises(RemoteDataError) as caught:
        stage_file(open_store(nginx_server.url), SHARD, dest, 1 << 60, sha, progress=False)
    text = one_line(caught)
    assert SHARD in text and "free in" in text and str(tmp_path) in text, text
    assert settled_log(nginx_server) == before
    assert leftovers(dest) == set()


def test_a_disk_that_fills_while_staging_is_one_line_and_a_rerun_resumes(served_files, beton, tmpfs,
                                                                         tmp_path):
    """Another writer fills the disk once the copy has begun (answers 50 ms late, so it is under way)."""
    from benchmarks.loopback_servers import Nginx
    data, sha = beton
    disk = tmpfs("disk", "6m")
    dest = disk / "train.beton"
    part = dest.with_name(dest.name + ".part")
    slow = Nginx(served_files, tmp_path / "slow-nginx", delay_ms=50)
    filler = threading.Thread(target=lambda: (wait_until(lambda: part.exists() and part.stat().st_size > 0),
                                              fill(disk)))
    try:
        filler.start()
        with pytest.raises(RemoteDataError) as caught:
            stage_file(open_store(slow.url), SHARD, dest, len(data), sha, chunk_bytes=CHUNK, progress=False)
        filler.join()
        text = one_line(caught)
        assert SHARD in text and "filled while staging" in text and str(disk) in text, text
        assert not dest.exists() and 0 < part.stat().st_size < len(data)
        assert data.startswith(part.read_bytes())
        staged = part.stat().st_size
        (disk / "filler").unlink()
        before = settled_log(slow)
        assert stage_file(open_store(slow.url), SHARD, dest, len(data), sha, chunk_bytes=CHUNK,
                          progress=False).read_bytes() == data
        assert fetched(settled_log(slow)[len(before):]) <= len(data) - staged + CHUNK     # resumed, not refetched
    finally:
        slow.stop()


def wait_until(condition, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


STAGER = """
import logging, sys
from pathlib import Path
from pipeline.storage.object_store import open_store
from pipeline.storage.staged_file import stage_file
url, name, dest, size, sha = sys.argv[1:]
logging.basicConfig(level=logging.INFO, format="%(message)s")      # as a command shows the library's messages
stage_file(open_store(url), name, Path(dest), int(size), sha, chunk_bytes=256 << 10)
print("staged", flush=True)
"""


def test_processes_on_one_node_share_one_copy(nginx_server, beton, tmp_path):
    data, sha = beton
    dest = tmp_path / "train.beton"
    before = settled_log(nginx_server)
    with open(tmp_path / "train.beton.lock", "a+") as held:
        # Held here until both have said they wait: then they race for it, as ranks starting together do.
        fcntl.flock(held, fcntl.LOCK_EX)
        ranks = [subprocess.Popen([sys.executable, "-c", STAGER, nginx_server.url, SHARD, str(dest), str(len(data)), sha],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        first_lines = [rank.stderr.readline() for rank in ranks]
        assert all("waiting for another process staging" in line for line in first_lines), first_lines
    outputs = [rank.communicate(timeout=60) for rank in ranks]
    for rank, first, (out, err) in zip(ranks, first_lines, outputs):
        err = first + err
        assert rank.returncode == 0 and out == "staged\n", err[-2000:]
        assert err.count("waiting for another process") == 1, err     # once, however long it waits
    assert dest.read_bytes() == data
    assert fetched(settled_log(nginx_server)[len(before):]) == len(data)
    assert leftovers(dest) == {"train.beton", "train.beton.verified"}
