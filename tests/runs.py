"""Running `training/main.py` as users do, for the tests of runs: a tiny run's overrides, plain and
torchrun launches, and killing a process tree the way a node failure does.

A process costs the suite more than the tiny run in it: on a 2-core AMD EPYC without AVX-512,
`import torch` takes 3.3 s, and a training process's first optimizer 2.4 s more (torch.optim's
`add_param_group` imports torch._dynamo). A 2-rank torchrun of a run that trains for 2.9 s takes
11.7 s. So tests share launches where they can (conftest's `straight_run`, tests/recipes_run.py).
`pytest --cpu-report=FILE` (tests/cpu_report.py) says which tests cost the suite most."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.loopback_servers import free_port  # noqa: F401 (the tests of runs take it from here)

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "training" / "main.py"
RECIPE = ROOT / "algorithms" / "recipes" / "fashion_baseline.yaml"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def tiny_run(path, backend: str, run_dir: Path, *extra) -> list[str]:
    """Overrides for a few-second run of the fashion recipe on the test's small sample; fp32, not the
    recipe's auto: runs compared with each other must not each measure which precision is faster."""
    return ["precision=fp32", f"data.backend={backend}", f"data.path={path}", "data.batch_size=8", "data.num_workers=1",
            "model.width=4", "model.blocks_per_stage=1", "log.progress=false", "log.tensorboard=false",
            f"run_dir={run_dir}", *extra]


def main_py(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MAIN), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def main_here(capsys, *args) -> subprocess.CompletedProcess:
    """training/main.py's `main` called in this process, for what needs no process of its own: a
    one-process run that returns, at its end or at an error every rank meets (a bad config, a full
    disk). A signal, a kill or a fault one rank meets alone ends the process: those runs get theirs.
    Its exit code and output, as main_py gives them."""
    from conftest import logging_as_in_a_process
    from training.main import main
    arguments = [str(arg) for arg in args]
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with logging_as_in_a_process():
            code = main(arguments)
    finally:
        torch.use_deterministic_algorithms(deterministic)      # a run's setting, not the next test's
    output = capsys.readouterr()
    return subprocess.CompletedProcess([str(MAIN), *arguments], code, output.out, output.err)


def main_in_process(capsys, *args) -> tuple[int, str]:
    """main_here's exit code and stderr."""
    result = main_here(capsys, *args)
    return result.returncode, result.stderr


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def torchrun_2(data, run_dir: Path, common: list[str], *launcher_flags: str) -> list[str]:
    """A 2-process torchrun of a tiny run on the `folder` backend."""
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", *launcher_flags, str(MAIN), "--config", str(RECIPE),
            *tiny_run(data, "folder", run_dir, *common)]


# A deterministic 6-epoch run of 7 steps an epoch whose checkpoints, every 5 steps, all fall
# mid-epoch (up to the last at step 42), with a metrics line every step: what the kill-, signal- and
# resume tests stop and restart, all compared with one run never stopped (conftest's straight_run).
MID_EPOCH_CHECKPOINTS = ["max_duration=6ep", "deterministic=true", "checkpoint.interval=5ba", "checkpoint.keep=3",
                         "data.scale=[0.35,1]", "log.interval=1"]


def reference_run(data, run_dir: Path, common: list[str]) -> None:
    """The run never stopped, that a stopped and resumed one must end equal to."""
    subprocess.run(torchrun_2(data, run_dir, common), check=True, capture_output=True, timeout=300, cwd=ROOT)


def assert_ends_alike(expected_dir: Path, actual_dir: Path, steps: int) -> None:
    """Same final step, weights and momentum bitwise, same final accuracy."""
    expected, actual = final_weights(expected_dir), final_weights(actual_dir)
    assert expected["counters"]["step"] == actual["counters"]["step"] == steps
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, actual["model"][key]), key
    for index, buffers in expected["optimizer"]["state"].items():
        assert torch.equal(buffers["momentum_buffer"], actual["optimizer"]["state"][index]["momentum_buffer"])
    assert json.loads((actual_dir / "summary.json").read_text())["last_val_top1"] == \
        json.loads((expected_dir / "summary.json").read_text())["last_val_top1"]


def processes() -> dict[int, tuple[int, int]]:
    """Every process now: pid -> (parent pid, start time in clock ticks)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = (int(fields[1]), int(fields[19]))
    return found


def children(pid: int) -> list[int]:
    """The child processes of `pid`, oldest first."""
    return [child for _, child in sorted((info[1], child) for child, info in processes().items() if info[0] == pid)]


def rank_of(pid: int) -> int | None:
    """The torchrun rank of a worker process (its RANK variable), None for any other."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


def wait_until(done, process: subprocess.Popen, what: str, seconds: float = 240) -> None:
    """Poll `done()` while `process` runs; fail if it ends first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not done():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.02)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (torchrun starts its workers in
    sessions of their own, so killing its process group would leave them running)."""
    parents = {child: info[0] for child, info in processes().items()}
    tree, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | below, bool(below)
    for member in tree:
        try:
            os.kill(member, signal.SIGSTOP)        # freeze all first, so none acts on another's death
        except ProcessLookupError:
            pass
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def final_weights(run_dir: Path) -> dict:
    newest = sorted((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.stem.split("-ba")[1]))[-1]
    return torch.load(newest, weights_only=True)


def flip_a_tensor_byte(checkpoint: Path) -> None:
    """Damage a checkpoint as a bad sector or a flipped bit in a copy does: one byte in the middle
    of its largest tensor, where the file still loads (torch checks no CRC of a stored tensor)."""
    import zipfile
    with zipfile.ZipFile(checkpoint) as archive:
        entry = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda info: info.file_size)
    data = bytearray(checkpoint.read_bytes())
    name_length, extra_length = (int.from_bytes(data[entry.header_offset + at:entry.header_offset + at + 2], "little")
                                 for at in (26, 28))
    start = entry.header_offset + 30 + name_length + extra_length
    data[start + entry.file_size // 2] ^= 0x40
    checkpoint.write_bytes(bytes(data))
