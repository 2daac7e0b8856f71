"""The suite's own guard (suite_timeouts.py): a test that never returns, even from inside C code,
fails by name after its time limit with the stacks of where it hung, the processes it started are
killed, and the tests after it still run; and its CPU report (cpu_report.py) counts each test's
children."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HUNG_SUITE = """
import ctypes, pathlib, subprocess, sys

BUSY = "import resource; sum(range(3 * 10**6)); used = resource.getrusage(resource.RUSAGE_SELF); "\\
       "print(used.ru_utime + used.ru_stime)"

def test_before():     # a child whose CPU time the report counts as this test's
    used = subprocess.run([sys.executable, "-c", BUSY], capture_output=True, text=True, check=True).stdout
    pathlib.Path({busy_file!r}).write_text(used)

def test_hangs_in_c():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    pathlib.Path({pid_file!r}).write_text(str(child.pid))
    ctypes.CDLL(None).sleep(600)        # libc's sleep: inside C, where no Python signal handler runs

def test_after():
    pass
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"      # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_hung_test_fails_by_name_and_the_rest_still_run(tmp_path):
    pid_file, busy_file, cpu_report = tmp_path / "child.pid", tmp_path / "busy.cpu", tmp_path / "cpu.jsonl"
    (tmp_path / "test_hung.py").write_text(HUNG_SUITE.format(pid_file=str(pid_file), busy_file=str(busy_file)))
    # The project's settings (pyproject: one xdist worker, thread method) and its hooks (suite_timeouts,
    # cpu_report), with a 5 s limit instead of the suite's.
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
               "-p", "suite_timeouts", "-p", "cpu_report", "-p", "no:cacheprovider", "--timeout", "5",
               f"--cpu-report={cpu_report}", str(tmp_path / "test_hung.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert time.monotonic() - started < 60, output[-3000:]
    assert "FAILED" in output and "test_hung.py::test_hangs_in_c" in output, output[-3000:]
    assert "2 passed" in output and "1 failed" in output, output[-3000:]            # before and after ran
    hung_at = output.split("where it hung", 1)[-1]                                   # the stacks came back
    assert re.search(r"test_hung.py\", line \d+ in test_hangs_in_c", hung_at), output[-3000:]
    child = int(pid_file.read_text())
    # and where its child waited, before it was killed
    assert re.search(rf"  {child}/{child} ppid \d+ \S+ \S+ \[python\S*\]: \S*python\S* -c import time", hung_at), \
        output[-3000:]
    assert not alive(child), "the hung test's child process was left running"
    # Each test that ended has its row, whichever worker ran it; the busy child's CPU is its test's
    rows = {row["test"].rpartition("::")[2]: row for row in map(json.loads, cpu_report.read_text().splitlines())}
    assert set(rows) == {"test_before", "test_after"}, rows
    assert rows["test_before"]["children_cpu_s"] >= float(busy_file.read_text()) > 0.05, rows
    assert "CPU per test" in output and "2 tests, " in output, output[-3000:]
