"""benchmarks/loaders.py end to end on the test photos: it converts what it needs, measures a
bound, our backend and the bare FFCV and DALI loaders, and appends complete rows. Its `main` runs
in the test's process (`loaders_here`); each figure still has a process of its own."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from urllib.parse import unquote

import pytest

from conftest import ROOT, loaders_here

HARDWARE_KEYS = {"cpu_model", "cpu_cores", "ram_gb", "gpu_model", "gpu_count", "driver", "instance_type"}


def test_loaders_benchmark_rows(sample_sets, tmp_path, capsys, monkeypatch):
    backends = ["decode_bound", "decode_floor", "webdataset", "ffcv-bare", "dali-bare"]
    result = loaders_here(capsys, monkeypatch, "--source", sample_sets / "photos", "--cache", tmp_path / "cache",
                          "--results-dir", tmp_path / "results", "--backends", ",".join(backends), "--splits", "train",
                          "--resolutions", "64", "--workers", "1", "--epochs", "1", "--batch-size", "16",
                          "--instance-type", "test.2xlarge")
    assert result.returncode == 0, result.stderr[-3000:]
    [results] = (tmp_path / "results").glob("*.jsonl")
    assert results.name == "test.2xlarge.jsonl"
    rows = {row["backend"]: row for row in map(json.loads, results.read_text().splitlines())}
    assert set(rows) == set(backends), result.stdout
    bound = rows["decode_bound"]["img_per_s"]
    for name, row in rows.items():
        assert HARDWARE_KEYS <= set(row["hardware"]) and row["hardware"]["instance_type"] == "test.2xlarge"
        assert row["benchmark"] == "loaders" and row["split"] == "train" and row["resolution"] == 64
        assert row["commit"] and row["date"] and "torch" in row["versions"]
        assert row["img_per_s"] > 0 and row["share_of_decode_bound"] == pytest.approx(row["img_per_s"] / bound)
        if name not in ("decode_bound", "decode_floor"):
            assert row["images_per_epoch"] == 92 // 16 * 16 and row["peak_rss_mb"] > 50 and 0 < row["cpu_util"] <= 1
    assert "max side 512" in rows["webdataset"]["dataset"] and "ffcv jpg" in rows["ffcv-bare"]["dataset"]
    stages = rows["webdataset"]["engine_us_per_image"]          # where the engine's time went
    assert set(stages) == {"read", "entry", "decode", "resize_across", "resize_down", "write", "python"}
    assert stages["decode"] > 0 and stages["resize_across"] > 0 and stages["write"] > 0
    assert "engine, CPU us per image: read" in result.stdout
    floor = rows["decode_floor"]        # every sample's crop entropy-decoded, per resolution
    assert floor["images_per_epoch"] == 92 and floor["resolution"] == 64 and floor["img_per_s"] > 0
    assert rows["webdataset"]["share_of_decode_floor"] == pytest.approx(rows["webdataset"]["img_per_s"] / floor["img_per_s"])
    # the decode stage split: the floor's entropy decoding of the same crops, and the rest of it
    entropy, rest = rows["webdataset"]["decode_stage_us"]["entropy"], rows["webdataset"]["decode_stage_us"]["idct_upsampling_colour"]
    assert entropy == pytest.approx(floor["engine_us_per_image"]["decode"]) and entropy > 0
    assert entropy + rest == pytest.approx(stages["decode"])
    assert f"decode {stages['decode']:.0f} (entropy {entropy:.0f}, IDCT + upsampling + colour {rest:.0f})" in result.stdout
    bound_row = rows["decode_bound"]
    assert bound_row["images_per_epoch"] == 92 and set(bound_row["by_decoder"]) == {
        f"{decoder}, {form}" for decoder in ("simplejpeg", "jpeg_roi") for form in ("stored", "no markers")}
    assert bound_row["decoder"] in bound_row["by_decoder"] and bound_row["img_per_s"] == max(bound_row["by_decoder"].values())
    printed = {fields[0]: fields for fields in map(str.split, result.stdout.splitlines()) if fields[:1] and
               fields[0] in backends}
    assert printed["decode_bound"][-2:] == printed["decode_floor"][-2:] == ["-", "-"], result.stdout   # no loader's CPU or memory
    assert printed["webdataset"][-2].endswith("%") and float(printed["webdataset"][-1]) > 50


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA answer")
def test_device_cuda_without_cuda_is_a_one_line_answer(tmp_path, capsys, monkeypatch):
    result = loaders_here(capsys, monkeypatch, "--device", "cuda", "--source", tmp_path / "not-made-yet",
                          "--results-dir", tmp_path)
    assert result.returncode == 2 and "CUDA is not available" in result.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("cache", ["streamed", "kept"])
def test_remote_rows_sit_beside_local_ones(sample_sets, tmp_path, cache, capsys, monkeypatch):
    """--remote http --latency-ms: each webdataset figure again from nginx behind the latency proxy,
    streamed through a cache half the split (or filling one twice its size in the first epoch),
    with its share of local disk's, the bytes and requests per epoch and the first batch's time."""
    result = loaders_here(capsys, monkeypatch, "--source", sample_sets / "photos", "--cache", tmp_path / "cache",
                          "--results-dir", tmp_path / "results", "--backends", "webdataset", "--splits", "val",
                          "--val-resolutions", "64", "--workers", "1", "--epochs", "1", "--batch-size", "16",
                          "--remote", "http", "--latency-ms", "5", "--remote-cache", cache)
    assert result.returncode == 0, result.stderr[-3000:]
    [results] = (tmp_path / "results").glob("*.jsonl")
    rows = {row["backend"]: row for row in map(json.loads, results.read_text().splitlines())}
    local, remote = rows["webdataset"], rows["webdataset@remote"]
    assert remote["share_of_local"] == pytest.approx(remote["img_per_s"] / local["img_per_s"])
    assert remote["first_epoch_share_of_local"] == pytest.approx(
        remote["images_per_epoch"] / remote["warmup_seconds"] / (local["images_per_epoch"] / local["warmup_seconds"]))
    assert "+5 ms" in remote["remote"] and remote["images_per_epoch"] == local["images_per_epoch"] > 0
    assert remote["first_batch_seconds"] > 0
    assert "x local; per epoch" in result.stdout
    assert remote["server_cpu_s_per_epoch"] >= 0 and "server here" in result.stdout
    if cache == "kept":     # the first epoch filled the cache: the timed one fetched nothing, and no process did
        assert not remote["streamed_in_memory"] and remote["fetched_bytes_per_epoch"] == 0
        assert remote["fetch_process_cpu_s_per_epoch"] == 0
        return
    assert remote["fetch_process_cpu_s_per_epoch"] >= 0
    # every epoch streamed, none fetched twice; on this three-block split, the blocks the next epoch
    # reads first may be fetched in the epoch before, or kept from it
    assert remote["streamed_in_memory"] and 0 < remote["cache_limit"] < remote["sample_bytes_per_epoch"]
    assert 0 <= remote["fetched_bytes_per_epoch"] < 2 * remote["sample_bytes_per_epoch"]


@pytest.mark.parametrize("where,scheme,kind", [("s3-nginx", "s3", "S3 requests"), ("gs-nginx", "gs", "GCS requests")])
def test_nginx_answers_the_object_store_clients(served_files, monkeypatch, where, scheme, kind):
    """--remote s3-nginx and gs-nginx: the loaders' S3 and GCS clients, pointed at the loopback
    nginx, read the conversions as the bucket `bench`, path-style, bit for bit."""
    from benchmarks.remote_sources import RemoteSource
    from pipeline.storage.object_store import open_store
    shard = "train/shard-000000.tar"
    local = (served_files / shard).read_bytes()
    with RemoteSource(where, served_files.parent) as source:
        for name, value in source.environment.items():
            monkeypatch.setenv(name, value)
        url = source.url_for(served_files)
        assert url == f"{scheme}://bench/{served_files.name}" and kind in source.describe()
        store = open_store(url)
        assert store.read_ranges(shard, [(0, 100), (5000, 9000)]) == [local[:100], local[5000:9000]]
        [nginx] = source._servers
        # GCS's client sends the object's name percent-encoded, slashes included
        asked = {unquote(line.split('"')[1].split()[1]) for line in nginx.access_log.read_text().splitlines()}
        assert f"/bench/{served_files.name}/{shard}" in asked


BURN = "import time\nwhile time.process_time() < {seconds}: pass\n"


def test_the_servers_cpu_time_is_counted_with_their_workers():
    """`cpu_seconds`: a process's CPU time with its descendants' (nginx's workers), or its own alone."""
    from benchmarks.remote_sources import cpu_seconds
    child = BURN.format(seconds=0.3) + "import sys; sys.stdin.read()"
    parent = (f"import subprocess, sys\nworker = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE)\n"
              + BURN.format(seconds=0.2) + "print('burnt', flush=True)\nsys.stdin.read()\nworker.communicate()\n")
    process = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "burnt\n"
        alone = cpu_seconds(process.pid, descendants=False)
        deadline = time.monotonic() + 60
        while cpu_seconds(process.pid) < alone + 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)       # the worker may still be burning
        assert 0.15 < alone < 0.5
        assert cpu_seconds(process.pid) >= alone + 0.25
    finally:
        process.communicate("")
    assert cpu_seconds(process.pid) == 0        # gone


def test_loader_start_benchmark_sets_this_tree_against_a_revision(tmp_path):
    """benchmarks/loader_start.py times reading the indexes and planning an epoch, in this tree and in a
    git revision's, and appends a row per figure."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loader_start.py"), "--against", "HEAD",
                             "--samples", "3000", "--shards", "3", "--batch-size", "16", "--world-sizes", "1,2",
                             "--rounds", "1", "--results-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    [results] = tmp_path.glob("*.jsonl")
    rows = {row["what"]: row for row in map(json.loads, results.read_text().splitlines())}
    assert set(rows) == {"index_s", "members_from_pack_s", "plan_s_world_1", "plan_s_world_2"}, result.stdout
    for row in rows.values():
        assert row["benchmark"] == "loader_start" and row["against"] == "HEAD" and row["samples"] == 3000
        assert row["seconds"] > 0 and row["seconds_against"] > 0 and HARDWARE_KEYS <= set(row["hardware"])


def test_rounds_alternate_and_keep_the_median_round(sample_sets, tmp_path, capsys, monkeypatch):
    """--rounds 2: each backend measured twice in turn at each resolution, the decode bound too
    (then beside each resolution's loaders, not once per split); the median round's figures kept
    with every round's img/s beside them, and the share taken against that resolution's bound."""
    result = loaders_here(capsys, monkeypatch, "--source", sample_sets / "photos", "--cache", tmp_path / "cache",
                          "--results-dir", tmp_path / "results", "--backends", "decode_bound,decode_floor",
                          "--splits", "train", "--resolutions", "32,48", "--workers", "1", "--epochs", "1",
                          "--batch-size", "16", "--rounds", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the median of 2 alternating rounds" in result.stdout
    rows = {(row["backend"], row["resolution"]): row
            for row in map(json.loads, next((tmp_path / "results").glob("*.jsonl")).read_text().splitlines())}
    assert set(rows) == {(name, side) for name in ("decode_bound", "decode_floor") for side in (32, 48)}
    assert rows["decode_bound", 32]["img_per_s_rounds"] != rows["decode_bound", 48]["img_per_s_rounds"]
    for (name, side), row in rows.items():
        assert len(row["img_per_s_rounds"]) == 2 and all(rate > 0 for rate in row["img_per_s_rounds"])
        assert row["img_per_s"] == min(row["img_per_s_rounds"])
        assert row["share_of_decode_bound"] == pytest.approx(row["img_per_s"] / rows["decode_bound", side]["img_per_s"])


def test_median_round_is_the_lower_middle_one():
    from benchmarks.loaders import median_round
    runs = [{"img_per_s": rate, "round": k} for k, rate in enumerate([30.0, 10.0, 40.0, 20.0])]
    kept = median_round(runs)
    assert kept["round"] == 3 and kept["img_per_s_rounds"] == [30.0, 10.0, 40.0, 20.0]
    assert "img_per_s_rounds" not in median_round(runs[:1]) and median_round(runs[:1])["round"] == 0
