"""Faults of a server that still answers, met by `training/main.py` while it builds a run from a
URL (a server that stops answering mid-run is tests/test_remote_training.py's): a refusal (403)
or a missing shard index is one line and exit 2, with nothing written and no credentials shown."""
from __future__ import annotations

import functools
import http.server
import re
import shutil
import threading
from pathlib import Path

import pytest

from benchmarks.loopback_servers import Nginx
from conftest import as_converted_before_index_packs
from runs import RECIPE, main_here, tiny_run


def served_copy(conversion, root, under: str = ""):
    """A copy of the conversion under nginx's root (at `under`), for the test to take files from."""
    copy = root / under / conversion.name
    shutil.copytree(conversion, copy)
    return copy


@pytest.mark.timeout(120)      # with the conversions made first, when run alone
@pytest.mark.parametrize("problem", ["refused (403)", "a shard index missing"])
def test_a_server_refusing_or_missing_a_file_while_the_run_is_built_is_one_line_and_exit_2(
        converted_sets, tmp_path, problem, capsys):
    local = converted_sets["fashion"]["webdataset"]
    if problem == "refused (403)":
        copy = served_copy(local, tmp_path / "served", "denied")      # nginx's `deny all;` location
        missing = copy / "manifest.json"
    else:
        copy = served_copy(local, tmp_path / "served")
        as_converted_before_index_packs(copy)      # else the index comes from the split's pack
        missing = sorted((copy / "train").glob("*.idx"))[0]
        missing.unlink()
    server = Nginx(tmp_path / "served", tmp_path / "nginx")
    path = copy.relative_to(tmp_path / "served").as_posix()
    run_dir = tmp_path / "run"
    try:
        url = f"http://alice:hunter2@127.0.0.1:{server.port}/{path}"
        result = main_here(capsys, "--config", RECIPE, *tiny_run(url, "webdataset", run_dir, "max_duration=1ep",
                                                                 f"data.cache_dir={tmp_path / 'cache'}"))
    finally:
        server.stop()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout, result.stderr[-3000:]
    what = {"refused (403)": "access denied (403)", "a shard index missing": "not found (404)"}[problem]
    where = f"http://***@127.0.0.1:{server.port}/{missing.relative_to(tmp_path / 'served').as_posix()}"
    assert lines[0].startswith(f"error: {where}: {what}"), lines[0]
    written = [p.read_text(errors="replace") for p in tmp_path.joinpath("cache").rglob("*") if p.is_file()]
    assert all("hunter2" not in text for text in [result.stdout, result.stderr, *written])
    assert not (run_dir / "checkpoints").exists()


class _StallFirstRequest(http.server.SimpleHTTPRequestHandler):
    """Serves a folder, ranges included, leaving its first request unanswered until the test ends."""
    seen = 0
    unblock = threading.Event()

    def do_GET(self):
        type(self).seen += 1
        if type(self).seen == 1:
            self.unblock.wait(120)
            return
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if not wanted:
            return super().do_GET()
        data = Path(self.translate_path(self.path)).read_bytes()
        start, end = int(wanted[1]), min(int(wanted[2]) + 1, len(data))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        self.wfile.write(data[start:end])

    def log_message(self, *args):
        pass


@pytest.mark.timeout(20, func_only=True)   # with the default 30 s a request, the loader would still be waiting
def test_data_fetch_timeout_bounds_a_stalled_request(converted_sets, tmp_path):
    from pipeline import build_loader
    from training.config import DataConfig
    local = converted_sets["photos"]["webdataset"]
    handler = functools.partial(_StallFirstRequest, directory=str(local.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        data = DataConfig(backend="webdataset", path=f"http://127.0.0.1:{server.server_address[1]}/{local.name}",
                          batch_size=16, cache_dir=str(tmp_path), fetch_timeout=1)
        loader = build_loader(data.loader_spec("val"))
        loader.set_epoch(0)
        assert sum(len(labels) for _, labels in loader) > 0
        assert _StallFirstRequest.seen > 1          # the stalled manifest request was given up and made again
    finally:
        _StallFirstRequest.unblock.set()
        server.shutdown()
