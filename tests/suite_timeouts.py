"""How the suite ends a test past its time limit (pyproject: `timeout`, thread method, one xdist
worker), as pytest hooks that tests/conftest.py takes in.

Only a timer thread can end a test stuck inside C code (a oneDNN kernel that never returns, a
rank waiting on a dead peer): a signal handler waits for the C call to return. pytest-timeout's
thread method then ends the whole process. Under pytest-xdist that process is a worker: xdist
reports the test failed by name ("worker crashed while running ...") and starts a new worker for
the rest of the suite. Two steps are added here, before the worker ends:
- the processes the test started (a torchrun and its ranks, a tool) are killed, so none runs on
  beside the tests that follow;
- every thread's stack is written to a file that the controller attaches to the test's failure
  report, since whatever a worker prints is lost with it, with a line for each thread of each
  process the test started: where in the kernel it waited (a rank in a collective, a read).
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import tempfile
import threading
from pathlib import Path

import pytest

STACKS = Path(tempfile.gettempdir()) / "pytest-timeouts"


def stacks_file(controller_pid: int, nodeid: str) -> Path:
    return STACKS / f"{controller_pid}-{re.sub(r'[^A-Za-z0-9_.-]', '_', nodeid)[-150:]}.txt"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc, whatever session or process
    group they put themselves in."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'
                parents[int(entry)] = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def process_table(pids: list[int]) -> str:
    """A line per process and per thread of it: state, the kernel function it sleeps in (wchan)
    and its command, so that a hang in a test's child (a rank, a tool) says where it waited."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    wchan = f.read().strip() or "-"
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                lines.append(f"  {pid}/{tid} ppid {int(fields[1])} {fields[0].decode()} {wchan} [{name}]"
                             + (f": {command}" if tid == str(pid) else ""))
        except (OSError, ValueError):
            continue
    return "\n".join(lines)


def end_hung_test(item, settings) -> None:
    import pytest_timeout
    children = descendants(os.getpid())
    table = process_table(children)     # before they are killed
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if hasattr(item.config, "workerinput"):             # an xdist worker, whose parent is the controller
        STACKS.mkdir(exist_ok=True)
        with open(stacks_file(os.getppid(), item.nodeid), "w") as out:
            out.write(f"{item.nodeid}: over its {settings.timeout:g} s limit; where each thread was "
                      f"(most recent call first):\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.write(f"\nThe processes it started, then killed (pid/thread, state, kernel wait, name):\n{table or '  none'}\n")
    pytest_timeout.timeout_timer(item, settings)     # dumps the stacks to the terminal, then os._exit(1)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method, ending with `end_hung_test`."""
    if settings.method != "thread" or settings.timeout <= 0:
        return None                                      # pytest-timeout's own handling
    timer = threading.Timer(settings.timeout, end_hung_test, (item, settings))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    """In the controller: a test whose worker ended it for its time limit gets the stacks."""
    if not report.failed or not hasattr(report, "node"):    # xdist's controller marks reports with their worker
        return
    path = stacks_file(os.getpid(), report.nodeid)
    if path.exists():
        report.sections.append(("where it hung", path.read_text()))
        path.unlink()
