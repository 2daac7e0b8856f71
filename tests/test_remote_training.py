"""Training from a URL through a server outage: the run ends with one line and exit 1, its
checkpoints intact, and `resume=auto` once the server is back ends exactly where a run that
never met the outage ends (the batches read from a URL are those of local disk). Bad URLs, and a
cache disk without room, are one line and exit 2 before training; credentials in a URL are never
shown or written."""
from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading

import pytest
import torch

from benchmarks.loopback_servers import Nginx, free_port
from conftest import fill
from runs import MAIN, RECIPE, ROOT, assert_ends_alike, main_here, main_py, tiny_run, wait_until

EPOCHS, STEPS_PER_EPOCH = 3, 15          # the fashion sample's 120 train images, batch 8, one process
# Nothing kept on disk, and a fetch per sample: blocks are fetched throughout, so the outage is met
# whenever it starts.
OUTAGE_RUN = [f"max_duration={EPOCHS}ep", "deterministic=true", "checkpoint.interval=5ba", "checkpoint.keep=3",
              "data.cache_limit=1", "data.fetch_size=4KiB"]


def arguments(path, run_dir, *extra) -> list[str]:
    return ["--config", str(RECIPE), *tiny_run(path, "webdataset", run_dir, *extra)]


@pytest.mark.timeout(300)
def test_an_outage_mid_run_exits_1_and_resume_auto_ends_as_a_run_never_interrupted(converted_sets, tmp_path, capsys):
    local = converted_sets["fashion"]["webdataset"]
    reference = tmp_path / "reference"
    done = main_here(capsys, *arguments(local, reference, *OUTAGE_RUN))
    assert done.returncode == 0, done.stderr[-3000:]

    port, run_dir = free_port(), tmp_path / "remote"
    url = f"http://alice:hunter2@127.0.0.1:{port}/{local.name}"    # nginx ignores the credentials
    remote = arguments(url, run_dir, *OUTAGE_RUN, f"data.cache_dir={tmp_path / 'cache'}", "log.tensorboard=true")
    server = Nginx(local.parent, tmp_path / "nginx", port=port)
    # torch's threads as in this process, where the reference and the resumed part run: another count
    # would sum in another order, and the weights would not end bitwise equal
    process = subprocess.Popen([sys.executable, str(MAIN), *remote], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        wait_until((run_dir / "checkpoints" / "ep1-ba20.pt").exists, process, "checkpoint ep1-ba20.pt")
    finally:
        server.stop()                                         # the outage, mid-epoch 2 or later
    stderr = process.communicate(timeout=200)[1]
    assert process.returncode == 1, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: rank 0: http://***@127.0.0.1") and "resume=auto" in error
    assert "***@127.0.0.1" in (run_dir / "config.yaml").read_text()
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    assert checkpoints and not (run_dir / "summary.json").exists()
    for checkpoint in checkpoints:
        torch.load(checkpoint, weights_only=True)             # whole: written atomically before the outage

    server = Nginx(local.parent, tmp_path / "nginx", port=port)   # back, where it was
    try:
        resumed = main_here(capsys, *remote)                  # the outage ended the process; this ends normally
    finally:
        server.stop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    # no file the run wrote carries the password: checkpoints (their config), TensorBoard, metrics, summary
    written = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    assert {path.suffix for path in written} >= {".pt", ".yaml", ".jsonl", ".json"}
    assert any("tfevents" in path.name for path in written)
    assert [path for path, data in written.items() if b"hunter2" in data] == []
    assert all("hunter2" not in text for text in [stderr, resumed.stdout, resumed.stderr])
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert torch.load(newest, weights_only=True)["config"]["data"]["path"].startswith("http://***@127.0.0.1")
    assert_ends_alike(reference, run_dir, EPOCHS * STEPS_PER_EPOCH)


@pytest.mark.parametrize("problem", ["connection refused", "no manifest", "credentials in the URL"])
def test_a_bad_url_is_one_line_and_exit_2_before_training(converted_sets, tmp_path, problem, capsys):
    local = converted_sets["fashion"]["webdataset"]
    server = Nginx(local.parent, tmp_path / "nginx")
    url = {"connection refused": f"http://127.0.0.1:{free_port()}/{local.name}",
           "no manifest": f"{server.url}/no-such-dataset",
           "credentials in the URL": f"http://alice:hunter2@127.0.0.1:{server.port}/no-such-dataset"}[problem]
    try:
        result = main_here(capsys, "--config", RECIPE,
                           *tiny_run(url, "webdataset", tmp_path / "run", "max_duration=1ep"))
    finally:
        server.stop()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert {"connection refused": "connection refused", "no manifest": "not a finished conversion",
            "credentials in the URL": "***@127.0.0.1"}[problem] in lines[0]
    written = [path.read_text(errors="replace") for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert all("hunter2" not in text for text in [result.stdout, result.stderr, *written])
    assert not (tmp_path / "run" / "checkpoints").exists()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_server_without_range_requests_is_one_line_and_exit_2_before_training(converted_sets, tmp_path):
    """Python's http.server sends the whole file whatever the Range asked: a first try of serving
    a dataset that many users make."""
    local = converted_sets["fashion"]["webdataset"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(local.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:                # a process of its own: this one's stderr gets the server thread's tracebacks
        result = main_py("--config", RECIPE, *tiny_run(f"http://127.0.0.1:{server.server_address[1]}/{local.name}",
                                                        "webdataset", tmp_path / "run", "max_duration=1ep"))
    finally:
        server.shutdown()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: http://127.0.0.1:{server.server_address[1]}/"), lines
    assert "the server does not answer range requests" in lines[0]
    assert "epoch 1/1" not in result.stdout                   # before training began
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_cache_disk_without_room_is_one_line_and_exit_2_before_training(converted_sets, tmp_path, tmpfs, capsys):
    local = converted_sets["fashion"]["webdataset"]
    disk = tmpfs("disk", "1m")
    fill(disk)
    server = Nginx(local.parent, tmp_path / "nginx")
    try:
        result = main_here(capsys, "--config", RECIPE, *tiny_run(f"{server.url}/{local.name}", "webdataset",
                                                                  tmp_path / "run", "max_duration=1ep",
                                                                  f"data.cache_dir={disk / 'cache'}"))
    finally:
        server.stop()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {disk / 'cache'}: no room on its disk"), lines
