"""Shared fixtures: running the tools as a user does (subprocesses), or their command lines in the
test's process where a run needs no process of its own; the sample sets, made once per run for all
pytest-xdist workers; the `alone` mark, for tests whose figures must not share the CPU with another
worker's test; a small real file system to fill (`tmpfs`, `fill`); and the hooks that end a test
past its time limit (`suite_timeouts.py`) and report each test's CPU (`cpu_report.py`)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import http.server
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from cpu_report import (pytest_addoption, pytest_runtest_protocol, pytest_sessionstart,  # noqa: F401 (pytest's hooks)
                        pytest_terminal_summary)
from suite_timeouts import pytest_runtest_logreport, pytest_timeout_set_timer  # noqa: F401 (pytest's hooks)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"            # on the path through pytest's `pythonpath` setting (pyproject.toml)


def batch_recorder(event):
    """An algorithm that keeps a copy of (state.images, state.targets) each time `event` fires."""
    from algorithms.base import Algorithm

    class BatchRecorder(Algorithm):
        def __init__(self):
            self.seen = []

        def match(self, fired, state):
            return fired == event

        def apply(self, fired, state):
            self.seen.append((state.images.clone(), state.targets.clone()))

    return BatchRecorder()


def tiny_trainer(tmp_path, algorithms, *overrides):
    """An in-process, one-process Trainer on synthetic data: a tiny small ResNet, 2 epochs of 4
    steps at 16 px; `overrides` are config overrides as on the command line."""
    import torch
    from training.config import load_config
    from training.distributed import World
    from training.trainer import Trainer
    config = load_config(None, ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=32",
                                "data.batch_size=8", "data.resolution=16", "data.val_resolution=16",
                                "model.name=small_resnet", "model.width=4", "model.blocks_per_stage=1",
                                "max_duration=2ep", "precision=fp32", "log.progress=false", "log.tensorboard=false",
                                f"run_dir={tmp_path}", *overrides])
    return Trainer(config, World(0, 0, 1, torch.device("cpu")), algorithms)


def run_tool(script: str, *args, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """python tools/SCRIPT ARGS..., as a user runs it; stdout and stderr captured as text."""
    result = subprocess.run([sys.executable, str(TOOLS / script), *map(str, args)],
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


@contextlib.contextmanager
def logging_as_in_a_process():
    """The root logger bare, as a new process has it, while a tool's or a run's main runs in the
    test's process: their logging.basicConfig then writes to the test's captured stderr, in their
    own format and level, where under pytest's handlers it would do nothing. Then pytest's back."""
    import logging
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def command_here(script: str, *args) -> int:
    """The exit code of tools/SCRIPT's command line (its `command`, else its `main`) called in this
    process, for a run that needs no process of its own: no signal, no kill, no exit from inside.
    A script named with its folder (benchmarks/loaders.py) is that package's module."""
    tool = importlib.import_module(script[:-3].replace("/", ".") if "/" in script else Path(script).stem)
    try:
        with logging_as_in_a_process():
            return (getattr(tool, "command", None) or tool.main)([str(arg) for arg in args])
    except SystemExit as stop:                       # argparse's usage errors, a command's exit code
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1


def run_tool_here(capsys, script: str, *args, check: bool = False) -> subprocess.CompletedProcess:
    """run_tool's answer from command_here, its output from pytest's `capsys`."""
    code = command_here(script, *args)
    output = capsys.readouterr()
    if check and code != 0:
        raise AssertionError(f"{script} exited {code}:\n{output.err[-3000:]}")
    return subprocess.CompletedProcess([script, *map(str, args)], code, output.out, output.err)


def loaders_here(capsys, monkeypatch, *args) -> subprocess.CompletedProcess:
    """benchmarks/loaders.py ARGS run by run_tool_here from the repository's root, as the docs run it: the
    processes it starts for its figures (`python -m benchmarks.loader_run`) find the package there."""
    monkeypatch.chdir(ROOT)
    return run_tool_here(capsys, "benchmarks/loaders.py", *args)


def convert_here(script: str, *args) -> None:
    """A conversion the tests read from, made by command_here in made_once's worker; it must succeed."""
    code = command_here(script, *args)
    if code != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))}: exit {code}")


def run_tool_without(modules: tuple[str, ...], script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """run_tool with `modules` unimportable (None in sys.modules makes `import` raise ImportError), as on
    a machine without them: a GPU image without matplotlib, a node where DALI is not installed yet."""
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({modules!r})); sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, str(TOOLS / script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def two_ranks(script: str, out: Path, *args, timeout: float = 600) -> list:
    """Runs the Python source `script` as two gloo ranks under torchrun, with `args` and then
    `out` as its arguments; returns what each rank wrote to OUT/rank<r>.json."""
    path = out / "ranks.py"
    path.write_text(script)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(path),
               *map(str, args), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def read_manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def flip(path: Path, at: int, mask: int = 0x10) -> None:
    """One byte of the file at `path` changed in place, as a bad sector or a faulty cache would."""
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def as_converted_before_index_packs(out: Path) -> None:
    """Make the webdataset conversion in `out` what the converters wrote before index packs: no
    `shard-indexes.pack`, no record of it."""
    manifest = read_manifest(out)
    for split, record in manifest["splits"].items():
        pack = record.pop("index_pack", None)
        if pack is not None:
            (out / split / pack["file"]).unlink()
            record["files"].remove(f"{split}/{pack['file']}")
    (out / "manifest.json").write_text(json.dumps(manifest))


def as_converted_before_checksums(out: Path) -> None:
    """Make the webdataset conversion in `out` what the converters wrote before per-sample
    checksums (and index packs): manifest version 1, no `.crc32` files, no record of them."""
    as_converted_before_index_packs(out)
    manifest = read_manifest(out)
    manifest["manifest_version"] = 1
    for split, record in manifest["splits"].items():
        for shard in record["shards"]:
            (out / split / shard.pop("checksums")).unlink()
            del shard["checksums_bytes"], shard["checksums_sha256"]
        record["files"] = [name for name in record["files"] if not name.endswith(".crc32")]
        del record["sample_checksum"]
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="session")
def debian_cache(request, tmp_path_factory) -> Path:
    """Where make_sample_data unpacks the Debian packages it needs (about 170 MB): the set-up's
    own folder when `make demo` made one (so a node without internet, given only that folder,
    can run the suite), else pytest's cache folder, so that later sessions do not download
    them again."""
    if (ROOT / "data" / "sample" / ".debian").is_dir():
        return ROOT / "data" / "sample" / ".debian"
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    return cache.mkdir("debian-packages") if cache else tmp_path_factory.mktemp("debian")


def run_folder(tmp_path_factory) -> Path:
    """A folder of this test run that every xdist worker sees (each has a base folder of its own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make) -> Path:
    """RUN_FOLDER/name, filled by `make(folder)` by the first worker to ask; the others wait for it.
    What is in it is shared: tests read it and write elsewhere."""
    folder = run_folder(tmp_path_factory) / name
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)         # a worker that died half-way
            folder.mkdir()
            make(folder)
            (folder / ".complete").touch()
    return folder


@pytest.fixture(scope="session")
def sample_sets(tmp_path_factory, debian_cache) -> Path:
    """Both sample sets, a few images per class, in ImageNet layout."""
    from make_sample_data import make_fashion, make_photos

    def make(root):
        make_fashion(root, limit=12, progress=False, cache_dir=debian_cache)
        make_photos(root, limit=4, progress=False, cache_dir=debian_cache)
    return made_once(tmp_path_factory, "sample", make)


@pytest.fixture(scope="session")
def converted_sets(sample_sets, tmp_path_factory) -> dict:
    """Both sample sets in every form a loader reads: {set: {"folder"|"ffcv"|"webdataset": path}}."""
    def make(out):
        for name in ("fashion", "photos"):
            convert_here("convert_ffcv.py", sample_sets / name, out / f"{name}_ffcv")
            convert_here("convert_wds.py", sample_sets / name, out / f"{name}_wds")
    out = made_once(tmp_path_factory, "converted", make)
    return {name: {"folder": sample_sets / name, "ffcv": out / f"{name}_ffcv", "webdataset": out / f"{name}_wds"}
            for name in ("fashion", "photos")}


@pytest.fixture(scope="session")
def straight_run(sample_sets, tmp_path_factory):
    """straight_run(common) -> the run directory of a never-stopped 2-rank torchrun on the fashion
    sample (folder backend) with the overrides `common`, made once per suite run: the tests that
    stop and resume a run with the same overrides all compare with it. Read it; write elsewhere."""
    from runs import reference_run
    data = sample_sets / "fashion"

    def made(common: list[str]) -> Path:
        name = "straight-" + hashlib.sha1("\0".join(common).encode()).hexdigest()[:12]
        return made_once(tmp_path_factory, name, lambda out: reference_run(data, out / "run", common)) / "run"
    return made


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_per_worker():
    """pyproject runs two xdist workers on a 2-core machine: one torch thread each fills the
    cores without the two OpenMP teams spinning against each other."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        import torch
        torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread(monkeypatch):
    """The model on one thread, as torchrun runs each rank, for the measuring tools run in the test's
    process (run_tool_here) and in processes of their own: on a shared 2-core machine, two threads
    beside a busy loader worker (or other jobs) slow tiny steps down 30-fold, which would make the
    figures, and verdicts drawn from them, depend on the machine's load."""
    import torch
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """The `alone` tests first: the exclusive lock waits for the other worker's test in hand to end,
    and at the start that is one of the first, not one of the minute-long runs that come later."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)


@pytest.fixture(autouse=True)
def cpu_share(request, tmp_path_factory):
    """A test marked `alone` runs while no other worker's test does (its figures are timings);
    every other test shares the machine. A run-wide lock, shared by most, exclusive for those."""
    alone = request.node.get_closest_marker("alone") is not None
    with open(run_folder(tmp_path_factory) / "cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, size, read_only=False) -> a fresh tmpfs under tmp_path: a real file system that
    fills up. Unmounted at the end; the test is skipped where mounting is not allowed."""
    mounted = []

    def mount(name: str, size: str, read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(folder: Path, leave_bytes: int = 0) -> None:
    """Writes `folder`/filler until its file system has about `leave_bytes` free, or none."""
    stat = os.statvfs(folder)
    room = stat.f_bavail * stat.f_frsize - leave_bytes
    try:
        with open(folder / "filler", "wb", buffering=0) as f:
            while room > 0:
                room -= f.write(b"\0" * min(room, 1 << 20))
            while not leave_bytes:
                f.write(b"\0" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error


@pytest.fixture(scope="session")
def served_files(tmp_path_factory) -> Path:
    """A small dataset-like folder of random bytes, served by the object-storage fixtures."""
    import numpy as np
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(0)
    (root / "train").mkdir()
    (root / "manifest.json").write_text(json.dumps({"format": "webdataset"}))
    (root / "train" / "shard-000000.tar").write_bytes(rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    (root / "denied").mkdir()
    (root / "denied" / "secret.bin").write_bytes(b"no")
    return root


@pytest.fixture(scope="session")
def nginx_server(served_files, tmp_path_factory):
    from benchmarks.loopback_servers import Nginx
    server = Nginx(served_files, tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_s3(served_files):
    """moto's S3 server holding `served_files` in bucket `photos`, uploaded with obstore."""
    import boto3   # obstore has no bucket creation; boto3 comes with moto
    import obstore
    from obstore.store import S3Store
    from benchmarks.loopback_servers import MotoS3
    server = MotoS3()
    boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="photos")
    store = S3Store("photos", endpoint=server.url, region="us-east-1", access_key_id="testing",
                    secret_access_key="testing", client_options={"allow_http": True})
    for path in served_files.rglob("*"):
        if path.is_file():
            obstore.put(store, f"wds/{path.relative_to(served_files)}", path.read_bytes())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_reader(moto_s3) -> dict:
    """An IAM user of moto's allowed everything in S3: its access key (AccessKeyId, SecretAccessKey),
    for the tests that turn moto's checking of keys on (`checking_credentials`)."""
    import boto3
    iam = boto3.client("iam", endpoint_url=moto_s3.url, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    return iam.create_access_key(UserName="reader")["AccessKey"]


@contextlib.contextmanager
def checking_credentials(moto_s3):
    """moto checks keys and signatures while the context lasts: it does once its count of
    unauthenticated actions is 0 (its reset-auth API)."""
    def set_auth(count: bytes):
        request = urllib.request.Request(f"{moto_s3.url}/moto-api/reset-auth", data=count,
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request).read()

    set_auth(b"0")
    try:
        yield
    finally:
        set_auth(b"inf")


def without_aws_variables(monkeypatch, home: Path) -> None:
    """No AWS_* variable set (the metadata service a closed local port), HOME at `home`, with an
    empty ~/.aws."""
    from benchmarks.loopback_servers import free_port
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HOME", str(home))
    (home / ".aws").mkdir()


def credential_process(folder: Path, key: dict, expires_in_s: float) -> tuple[str, Path]:
    """A credential_process command giving `key`, valid for expires_in_s from each run, and the
    file it adds a line to at each run."""
    ran = folder / "credential-process-runs"
    script = folder / "credential_process.py"
    script.write_text(f"""import datetime, json
open({str(ran)!r}, "a").write("ran\\n")
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds={expires_in_s})
print(json.dumps({{"Version": 1, "AccessKeyId": {key['AccessKeyId']!r}, "SecretAccessKey": {key['SecretAccessKey']!r},
                  "Expiration": expires.isoformat()}}))
""")
    return f"{sys.executable} {script}", ran


class AnswersAsS3ToAnotherRegion(http.server.BaseHTTPRequestHandler):
    """What S3 answers a request signed for another region than the bucket's: bucket `moved`
    301 with the region in a header only (a HEAD of the bucket too, as S3 does), bucket `signed`
    400 AuthorizationHeaderMalformed naming it in the body, bucket `lost` 301 without it; any other
    bucket a 400 of another kind."""

    def do_HEAD(self):
        self.do_GET(body=False)

    def do_GET(self, body: bool = True):
        bucket = urlsplit(self.path).path.strip("/").split("/")[0]
        if bucket in ("moved", "lost"):
            status, code, message = (301, "PermanentRedirect", "The bucket you are attempting to access must be "
                                     "addressed using the specified endpoint.")
        elif bucket == "signed":
            status, code, message = (400, "AuthorizationHeaderMalformed",
                                     "the region 'us-east-1' is wrong; expecting 'ap-south-1'")
        else:
            status, code, message = 400, "InvalidArgument", "Invalid argument."
        payload = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message>"
                   + ("<Region>ap-south-1</Region>" if bucket == "signed" else "") + "</Error>").encode()
        self.send_response(status)
        if bucket == "moved":
            self.send_header("x-amz-bucket-region", "eu-west-1")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def s3_of_another_region(monkeypatch):
    """The S3 variables pointing at a server that answers as S3 does to another region's requests."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AnswersAsS3ToAnotherRegion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    yield server
    server.shutdown()


KEY_ID, SECRET = "testing", "testing"


@pytest.fixture
def bucket(moto_s3, monkeypatch):
    """A new, versioned bucket on moto's server, with the environment the tools read it with."""
    import boto3
    for name, value in (("AWS_ENDPOINT_URL", moto_s3.url), ("AWS_ACCESS_KEY_ID", KEY_ID),
                        ("AWS_SECRET_ACCESS_KEY", SECRET), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PROGRESS_EVERY_S", "0")
    client = boto3.client("s3", endpoint_url=moto_s3.url, region_name="us-east-1", aws_access_key_id=KEY_ID,
                          aws_secret_access_key=SECRET)
    name = f"up-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return client, name


def versions(client, bucket: str, prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """How many times each object was put, and deleted, under prefix."""
    puts, deletes = {}, {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for kind, counts in (("Versions", puts), ("DeleteMarkers", deletes)):
            for entry in page.get(kind, []):
                name = entry["Key"][len(prefix) + 1:]
                counts[name] = counts.get(name, 0) + 1
    return puts, deletes
