"""A WebDataset conversion killed and run again, written on Ray, or written as parts of N and then
finished, ends byte for byte as one uninterrupted run on the local process pool; a killed
converter's workers die with it; and the refusals (another plan, a part missing, an unreachable
Ray, two converters in one OUT) are one line each."""
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

import numpy as np
import pytest
from PIL import Image

from conftest import TOOLS, run_tool, run_tool_here
from test_converters import jpeg, noisy_folder

SHARD = ("--shard-samples", "10")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """200 train and 40 val noisy JPEGs: slow enough to encode to be killed mid-way."""
    return noisy_folder(tmp_path_factory.mktemp("resume") / "src", {"train": 200, "val": 40}, 4, (240, 320), seed=3)


@pytest.fixture(scope="module")
def uninterrupted(source, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("whole") / "out"
    run_tool("convert_wds.py", source, out, *SHARD, "--num-workers", "2", check=True)
    return digest(out)


def digest(out: Path) -> dict[str, str]:
    """{file under OUT: sha256}, the manifest without its date."""
    found = {}
    for path in sorted(out.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "manifest.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k != "created"}).encode()
            found[str(path.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return found


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(source: Path, out, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TOOLS / "convert_wds.py"), str(source), str(out), *SHARD,
                             "--num-workers", "2", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def kill_when(process: subprocess.Popen, ready) -> list[int]:
    """SIGKILL the converter once ready() holds; its worker processes at that moment."""
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None, "the conversion ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    workers = children(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return workers


@pytest.mark.timeout(180)
def test_a_killed_conversion_run_again_writes_only_what_is_left_and_ends_as_one_uninterrupted(
        source, uninterrupted, tmp_path):
    out = tmp_path / "out"
    process = start(source, out)
    workers = kill_when(process, lambda: len(children(process.pid)) >= 2)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)], "workers outlived the killed converter"

    process = start(source, out)
    kill_when(process, lambda: len(list((out / ".converting/val.done").glob("*.json"))) >= 2)
    finished = {f"{record.stem}.tar": (out / ".converting/val" / f"{record.stem}.tar").stat().st_ino
                for record in (out / ".converting/val.done").glob("shard-*.json")}
    assert finished and not (out / "manifest.json").exists() and not (out / "val").exists()

    again = run_tool("convert_wds.py", source, out, *SHARD, "--num-workers", "2", check=True)
    assert "were finished already" in again.stderr
    assert digest(out) == uninterrupted     # nothing more in OUT either: no staging, scan or work left
    assert {name: (out / "val" / name).stat().st_ino for name in finished} == finished


@pytest.mark.timeout(240)
def test_a_killed_conversion_to_a_bucket_run_again_uploads_what_one_run_does(source, bucket, tmp_path):
    from test_convert_upload import objects
    client, name = bucket
    staging = tmp_path / "staging"
    whole = run_tool("convert_wds.py", source, f"s3://{name}/whole", *SHARD, "--staging", tmp_path / "s1",
                     check=True)
    assert whole.returncode == 0
    process = start(source, f"s3://{name}/resumed", "--staging", staging)
    kill_when(process, lambda: len(list((staging / ".converting/val.done").glob("*.json"))) >= 1)
    run_tool("convert_wds.py", source, f"s3://{name}/resumed", *SHARD, "--staging", staging, check=True)

    def contents(prefix: str) -> dict[str, bytes]:
        found = {}
        for key in objects(client, name, prefix):
            data = client.get_object(Bucket=name, Key=f"{prefix}/{key}")["Body"].read()
            if key == "manifest.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k != "created"}).encode()
            found[key] = hashlib.sha256(data).hexdigest()
        return found
    assert contents("resumed") == contents("whole")
    assert not list(staging.glob(".*")), "a killed run's work is left in the staging folder"


def fails_once(job):
    """Ray's task, whose first attempt at shard 1 dies as a crashed worker does."""
    from pipeline.convert.ray_executor import write_shard
    marker = Path(os.environ["FASTPIPE_TEST_MARKER"])
    if job.number == 1 and not marker.exists():
        marker.touch()
        os._exit(1)
    return write_shard(job)


def always_fails(job):
    raise OSError(5, "Input/output error")


@pytest.mark.timeout(240)
def test_ray_with_a_task_that_dies_once_ends_as_the_local_pool(source, uninterrupted, tmp_path, monkeypatch,
                                                               capsys):
    import ray
    from pipeline.convert import ray_executor
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setenv("FASTPIPE_TEST_MARKER", str(tmp_path / "died"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_executor, "TASK", fails_once)
    out = tmp_path / "out"
    run_tool_here(capsys, "convert_wds.py", source, out, *SHARD, "--num-workers", "2", "--executor", "ray",
                  check=True)
    assert (tmp_path / "died").exists(), "no task died"
    assert digest(out) == uninterrupted
    assert not ray.is_initialized(), "the converter left its Ray running"

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)     # a process connected already
    try:
        monkeypatch.setattr(ray_executor, "TASK", always_fails)
        monkeypatch.setattr(ray_executor, "RETRIES", 1)
        failed = run_tool_here(capsys, "convert_wds.py", source, tmp_path / "failed", *SHARD, "--num-workers", "2",
                               "--executor", "ray", "--splits", "val")
        assert ray.is_initialized(), "the converter ended a Ray connection it did not make"
    finally:
        ray.shutdown()
    said = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]   # among Ray's own lines
    assert failed.returncode == 1 and len(said) == 1
    assert re.search(r"/val/shard-00000\d: failed 2 times on Ray \(OSError: .*Input/output", said[0])
    assert not (tmp_path / "failed/manifest.json").exists()


def test_an_unreachable_ray_cluster_is_one_line(source, tmp_path, capsys):
    from benchmarks.loopback_servers import free_port
    address = f"127.0.0.1:{free_port()}"
    result = run_tool_here(capsys, "convert_wds.py", source, tmp_path / "out", "--executor", "ray",
                           "--ray-address", address)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: cannot reach the Ray cluster at {address}")


@pytest.mark.timeout(180)
def test_parts_then_finish_end_as_the_local_pool_and_refuse_what_does_not_fit(source, uninterrupted, tmp_path,
                                                                              capsys):
    out = tmp_path / "out"
    run_tool_here(capsys, "convert_wds.py", source, out, *SHARD, "--num-workers", "2", "--part", "1/2", check=True)
    early = run_tool_here(capsys, "convert_wds.py", source, out, *SHARD, "--finish", "2")
    assert early.returncode == 2 and "by part 0/2; run them, then --finish" in early.stderr.splitlines()[-1]
    other = run_tool_here(capsys, "convert_wds.py", source, out, *SHARD, "--seed", "5", "--part", "0/2")
    assert other.returncode == 2 and "were run with another plan (it differs in: params" in other.stderr
    assert not (out / "manifest.json").exists()

    # as a Slurm array starts them: at once, into a new OUT
    together = tmp_path / "together"
    parts = [start(source, together, "--part", f"{part}/2") for part in range(2)]
    assert [part.wait(timeout=120) for part in parts] == [0, 0]
    run_tool_here(capsys, "convert_wds.py", source, together, *SHARD, "--finish", "2", check=True)
    assert digest(together) == uninterrupted


def test_a_second_converter_in_the_same_out_is_refused(source, tmp_path, capsys):
    from pipeline.convert.out_lock import out_lock
    out = tmp_path / "out"
    with out_lock(out):
        result = run_tool_here(capsys, "convert_wds.py", source, out, *SHARD)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"error: {out}: another conversion is writing there; wait for "
                                                      "it to end, or give another OUT")
    assert not (out / "manifest.json").exists()


def test_a_shard_whose_every_sample_is_skipped_is_left_out_and_the_rest_verify(tmp_path, capsys):
    src, rng = tmp_path / "src", np.random.default_rng(0)
    for split, count in (("train", 2), ("val", 8)):
        for i in range(count):
            path = src / split / "c0" / f"{i}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            damaged = split == "val" and i in (4, 5)
            path.write_bytes(b"not a jpeg" if damaged else jpeg(Image.fromarray(rng.integers(0, 255, (40, 50, 3),
                                                                                              dtype=np.uint8))))
    out = tmp_path / "out"
    run_tool_here(capsys, "convert_wds.py", src, out, "--shard-samples", "2", "--num-workers", "2", check=True)
    record = json.loads((out / "manifest.json").read_text())["splits"]["val"]
    assert [shard["tar"] for shard in record["shards"]] == ["shard-000000.tar", "shard-000001.tar", "shard-000003.tar"]
    assert record["count"] == 6 and [skip["entry"] for skip in record["skipped"]] == [4, 5]
    assert all(skip["path"].endswith(f"val/c0/{n}.JPEG") for skip, n in zip(record["skipped"], (4, 5)))
    assert run_tool_here(capsys, "verify_dataset.py", out).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train", "val"]
