"""Faults a cluster user meets, with real processes: preemption signals (a checkpoint of the step
the ranks stop at, then an exact resume), a worker SIGKILLed under torchrun's restarts, a full
or read-only file system under the run directory and under the converters' output (real tmpfs
mounts; skipped where this user cannot mount), and a loader worker that dies mid-epoch."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import fill, run_tool
from runs import (MAIN, MID_EPOCH_CHECKPOINTS, RECIPE, ROOT, assert_ends_alike, children, main_here, main_in_process,
                  rank_of, read_jsonl, tiny_run, torchrun_2, wait_until)

SYNTHETIC = ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=64", "data.batch_size=8",
             "data.resolution=16", "data.val_resolution=16", "model.width=4", "model.blocks_per_stage=1",
             "log.progress=false", "log.tensorboard=false", "log.interval=1"]


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def the_error_line(stderr: str) -> str:
    """The one `error:` line among a tool's progress lines; no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def wait_for_step(run_dir: Path, process: subprocess.Popen, step: int) -> None:
    metrics = run_dir / "metrics.jsonl"

    def reached() -> bool:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return any(json.loads(line).get("step", 0) >= step for line in lines if line.endswith("}"))
    wait_until(reached, process, f"step {step}", seconds=120)


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("-ba")[1]) for p in (run_dir / "checkpoints").glob("ep*-ba*.pt"))


# --- preemption -------------------------------------------------------------------------------
# The resume after either stop is the same code; it is run after one of them.
@pytest.mark.parametrize("stop_signal, flags, then_resume", [
    (signal.SIGTERM, [], True),                                           # Slurm's, Kubernetes' last word
    (signal.SIGUSR1, ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"], False),   # Slurm's warning
])
def test_a_signal_to_torchrun_checkpoints_the_step_the_ranks_stop_at_and_resume_is_bitwise_equal(
        stop_signal, flags, then_resume, sample_sets, straight_run, tmp_path):
    data = sample_sets / "fashion"
    common, stopped = MID_EPOCH_CHECKPOINTS, tmp_path / "stopped"

    command = torchrun_2(data, stopped, common, *flags)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_step(stopped, process, 9)
    process.send_signal(stop_signal)            # to torchrun, which passes it on to its workers
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    line = re.search(rf"stopped by {stop_signal.name} after step (\d+): checkpoint (\S+) written", stdout)
    assert line, stdout[-2000:] + stderr[-3000:]
    step = int(line[1])
    assert Path(line[2]).name.endswith(f"-ba{step}.pt") and step in checkpoint_steps(stopped)
    assert step < 42 and not (stopped / "summary.json").exists()
    assert "Traceback" not in stdout
    if not then_resume:
        return

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"-ba{step}.pt: " in resumed.stdout
    straight = straight_run(common)
    assert_ends_alike(straight, stopped, 42)
    evals = [line["step"] for line in read_jsonl(stopped / "metrics.jsonl") if "val_top1" in line]
    assert evals == [line["step"] for line in read_jsonl(straight / "metrics.jsonl") if "val_top1" in line]


def test_sigusr1_stops_a_single_process_run_with_exit_code_138_after_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(MAIN), "--config", str(RECIPE), *SYNTHETIC,
                                "max_duration=200ep", f"run_dir={run_dir}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_step(run_dir, process, 3)
    process.send_signal(signal.SIGUSR1)          # Slurm's early warning (--signal=USR1@120)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    step = int(re.search(r"stopped by SIGUSR1 after step (\d+)", stdout)[1])
    assert checkpoint_steps(run_dir)[-1] == step
    assert max(line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")) == step



def ignored_signals(pid: int) -> set[int]:
    """The signals process `pid` ignores, from the SigIgn mask in /proc/PID/status."""
    mask = int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("SigIgn:")).split()[1], 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def test_loader_workers_leave_the_trainer_s_stop_signals_to_it(sample_sets):
    """While a trainer's stop requests are installed, the loader workers it starts ignore its
    STOP_SIGNALS (the rank stops them after its checkpoint); workers started without them do not."""
    from pipeline import LoaderSpec, build_loader
    from training.distributed import World
    from training.stop_requests import STOP_SIGNALS, StopRequests

    def worker_ignores() -> set[int]:
        loader = build_loader(LoaderSpec("folder", path=str(sample_sets / "photos"), batch_size=4, resolution=32,
                                         num_workers=1))
        before = set(children(os.getpid()))
        batches = iter(loader)
        next(batches)                                     # its worker is up
        (worker,) = set(children(os.getpid())) - before
        ignored = ignored_signals(worker)
        del batches, loader
        return ignored

    stops = StopRequests(World(0, 0, 1, torch.device("cpu"))).install()
    try:
        assert set(STOP_SIGNALS) <= worker_ignores()
    finally:
        stops.uninstall()
    assert not set(STOP_SIGNALS) & worker_ignores()

# --- a worker killed under torchrun's restarts -------------------------------------------------
def test_a_worker_sigkilled_under_max_restarts_is_restarted_and_ends_as_if_never_stopped(sample_sets, straight_run,
                                                                                         tmp_path):
    data = sample_sets / "fashion"
    common = MID_EPOCH_CHECKPOINTS
    straight, killed = straight_run(common), tmp_path / "killed"

    command = torchrun_2(data, killed, common, "--max-restarts=1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_until((killed / "checkpoints" / "ep1-ba10.pt").exists, process, "checkpoint ep1-ba10.pt")
    rank1 = next(pid for pid in children(process.pid) if rank_of(pid) == 1)
    os.kill(rank1, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert re.search(r"resumed from \S+-ba(\d+)\.pt", stdout), stdout[-3000:]
    # Searched for anywhere in a line. A fresh clone's make test once found no line starting with
    # it; torchrun's SIGTERM reaching rank 0 first still gives the line (tried by sending it), so
    # the likelier cause is gloo's C++ warnings, written to the same pipe in pieces, ahead of ours
    # (ours is one write() of under PIPE_BUF bytes). Should it fail again, the message shows every
    # line that names a rank or a signal, not the last 3,000 characters of warnings.
    survivor = re.findall(r"error: rank 0: .*", stderr)
    said = "\n".join(line for line in stderr.splitlines() if "rank" in line or "signal" in line)[-3000:]
    assert len(survivor) == 1 and "a collective failed in " in survivor[0], said   # one line, no traceback
    assert "Traceback" not in stderr
    assert_ends_alike(straight, killed, 42)


# --- unwritable and full places ---------------------------------------------------------------
@pytest.mark.parametrize("place", ["read-only file system", "a file in the way"])
def test_a_run_dir_that_cannot_be_written_is_one_line_and_exit_2(place, tmpfs, tmp_path, capsys):
    if place == "a file in the way":
        (tmp_path / "taken").write_text("a file")
        run_dir, cause = tmp_path / "taken" / "run", "Not a directory"
    else:
        run_dir, cause = tmpfs("ro", "1m", read_only=True) / "run", "Read-only file system"
    # met before training starts: training/main.py's `main` in this process says it as a run would
    code, stderr = main_in_process(capsys, "--config", RECIPE, *SYNTHETIC, "max_duration=1ep", f"run_dir={run_dir}")
    assert code == 2
    line = one_error_line(stderr)
    assert f"run_dir {run_dir}" in line and cause in line


def test_a_disk_that_fills_mid_run_is_one_line_exit_1_earlier_checkpoints_intact_then_resumes(tmpfs, capsys):
    disk = tmpfs("disk", "640k")
    run_dir = disk / "run"
    arguments = ["--config", RECIPE, *SYNTHETIC, "max_duration=6ep", "checkpoint.interval=2ba", "checkpoint.keep=1000",
                 "deterministic=true", f"run_dir={run_dir}"]
    result = main_here(capsys, *arguments)             # a full disk ends the run, not its process
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert re.search(rf"cannot write {re.escape(str(run_dir))}\S* \(No space left on device\)", line), line
    saved = checkpoint_steps(run_dir)
    assert saved and not (run_dir / "summary.json").exists()
    for step in saved:                                   # every checkpoint under its final name is whole
        assert torch.load(next((run_dir / "checkpoints").glob(f"*-ba{step}.pt")), weights_only=True)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]
    read_jsonl(run_dir / "metrics.jsonl")                # no torn line

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)   # the user frees space
    resumed = main_here(capsys, *arguments)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"-ba{saved[-1]}.pt: " in resumed.stdout
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 6


def test_a_metrics_line_that_does_not_fit_leaves_no_torn_line(tmpfs):
    from training.run_log import RunLog
    disk = tmpfs("disk", "16k")
    log = RunLog(disk, active=True, progress=False, tensorboard=False)
    log.metrics({"step": 1, "train_loss": 1.0})
    fill(disk)
    log.metrics({"step": 2, "train_loss": 0.5, "padding": "x" * 20000})
    assert "No space left on device" in log.fault and str(disk / "metrics.jsonl") in log.fault
    assert (disk / "metrics.jsonl").read_text() == '{"step": 1, "train_loss": 1.0}\n'


@pytest.mark.parametrize("converter", ["convert_wds.py", "convert_ffcv.py"])
def test_converters_name_an_unwritable_or_full_output_in_one_line(converter, sample_sets, tmpfs, tmp_path):
    source = sample_sets / "fashion"
    (tmp_path / "a-file").write_text("not a folder")
    result = run_tool(converter, source, tmp_path / "a-file")
    assert result.returncode == 2 and str(tmp_path / "a-file") in the_error_line(result.stderr)

    read_only = tmpfs("ro", "1m", read_only=True)
    result = run_tool(converter, source, read_only / "out")
    assert result.returncode == 2
    assert "Read-only file system" in the_error_line(result.stderr)

    disk = tmpfs("disk", "64m")       # FFCV writes in pages of 8 MB
    run_tool(converter, source, disk / "out", "--splits", "val", check=True)
    before = {p.name: p.read_bytes() for p in (disk / "out").iterdir() if p.is_file()}
    fill(disk)
    result = run_tool(converter, source, disk / "out", "--force")
    assert result.returncode == 1
    line = the_error_line(result.stderr)
    assert str(disk / "out") in line and "No space left on device" in line
    after = {p.name: p.read_bytes() for p in (disk / "out").iterdir() if p.is_file()}
    assert after == before                            # the earlier output, manifest included, untouched
    assert not [p for p in (disk / "out").iterdir() if ".tmp" in p.name]


# --- a loader worker that dies ----------------------------------------------------------------
def test_a_loader_worker_killed_mid_epoch_is_one_line_naming_the_backend_not_a_hang(converted_sets, tmp_path):
    data = converted_sets["fashion"]["webdataset"]        # RandAugment: its Pillow work runs in workers
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(MAIN), "--config", str(RECIPE),
                                *tiny_run(data, "webdataset", run_dir, "max_duration=50ep", "log.interval=1",
                                          "algorithms.randaugment={depth: 1, severity: 5}")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_step(run_dir, process, 2)
    workers = children(process.pid)
    assert workers, "no loader worker process to kill"
    os.kill(workers[0], signal.SIGKILL)                  # what the out-of-memory killer does
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    line = one_error_line(stderr)
    assert "error: rank 0: webdataset loader" in line and "out-of-memory killer" in line, line


def test_a_worker_death_signalled_while_exiting_does_not_follow_the_line_with_a_traceback():
    """The race behind one failure of the test above: torch's SIGCHLD handler raised while exit_now
    was printing its line. Here a handler that raises as torch's does is installed, and a SIGCHLD
    arrives while exit_now flushes stdout: the line alone comes out, and the exit code."""
    code = ("import os, signal, sys; from training import main\n"
            "def handler(*_): raise RuntimeError('DataLoader worker (pid 1) is killed by signal: Killed.')\n"
            "signal.signal(signal.SIGCHLD, handler)\n"
            "class Stdout:\n"
            "    def write(self, text): return len(text)\n"
            "    def flush(self): os.kill(os.getpid(), signal.SIGCHLD); [None for _ in range(1000)]\n"
            "sys.stdout = Stdout()\n"
            "main.exit_now('error: rank 0: webdataset loader, train split: a worker process died')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (result.returncode, result.stderr) == (1, "error: rank 0: webdataset loader, train split: a worker "
                                                     "process died\n"), result.stderr[-2000:]


def test_every_way_torch_reports_a_dead_worker_is_taken_for_one_and_a_workers_own_error_is_not():
    """Which error a killed worker causes depends on where the main process is: torch's SIGCHLD
    handler (a RuntimeError), or, in the middle of fetching a batch's shared tensor from the dead
    worker, a broken connection or an EOFError (seen once in the test above, a 1-in-400 race).
    An error raised inside a live worker is re-raised with its own type, and is not a death."""
    from pipeline.loader.base import LoaderWorkerDied
    deaths = [RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed. "), EOFError(),
              ConnectionResetError(104, "Connection reset by peer"), ConnectionRefusedError(111, "refused")]
    assert all(LoaderWorkerDied.says_so(error) for error in deaths)
    faults = [EOFError("Caught EOFError in DataLoader worker process 0.\nOriginal Traceback ..."),
              RuntimeError("shape mismatch"), ValueError("DataLoader worker")]
    assert not any(LoaderWorkerDied.says_so(error) for error in faults)
    assert "(mid-handover of a batch)" in str(LoaderWorkerDied("webdataset", str(EOFError())))


def test_a_loader_worker_killed_under_max_restarts_is_one_line_then_the_run_goes_on(sample_sets, tmp_path):
    run_dir = tmp_path / "run"
    command = torchrun_2(sample_sets / "fashion", run_dir,
                         ["max_duration=6ep", "checkpoint.interval=5ba", "log.interval=1"], "--max-restarts=1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_until((run_dir / "checkpoints" / "ep0-ba5.pt").exists, process, "checkpoint ep0-ba5.pt")
    rank0 = next(pid for pid in children(process.pid) if rank_of(pid) == 0)
    os.kill(children(rank0)[0], signal.SIGKILL)          # rank 0's DataLoader worker
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: rank 0: folder loader")]
    assert len(lines) == 1 and "out-of-memory killer" in lines[0], stderr[-3000:]
    assert "resumed from" in stdout and json.loads((run_dir / "summary.json").read_text())["epochs"] == 6
