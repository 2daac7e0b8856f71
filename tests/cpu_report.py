"""`pytest --cpu-report=FILE`: the CPU time each test costs, its own process's and that of the processes
it started and waited for (a torchrun, its ranks, a tool), as pytest hooks that tests/conftest.py
takes in. On a 2-core machine the suite is CPU-bound, so CPU, not a test's wall time (which
another worker's test stretches), says where its minutes go.

Each test's row is appended to FILE as a JSON line by the worker that ran it (`test`, `wall_s`,
`own_cpu_s`, `children_cpu_s`); the run's end prints the heaviest and the total. A child's CPU
counts once it has been waited for, with that of its own waited-for descendants (getrusage's
RUSAGE_CHILDREN): a process a test leaves running is counted where it is reaped, or not at all.

The `=` matters: pytest reads a separate FILE as the path of the tests to run, before it loads
tests/conftest.py, which declares the option; it then finds no conftest and stops at the option.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

SHOWN = 15


def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="FILE", help="append each test's CPU seconds, its own and its "
                     "children's, to FILE (JSON lines) and print the heaviest at the end")


def _report(config) -> Path | None:
    path = config.getoption("cpu_report", None)
    return Path(path) if path else None


def pytest_sessionstart(session):
    report = _report(session.config)
    if report is not None and not hasattr(session.config, "workerinput"):     # the controller, once
        report.write_text("")


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    report = _report(item.config)
    if report is None:
        yield
        return
    own, children, started = _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - started, 3),
           "own_cpu_s": round(_cpu_s(resource.RUSAGE_SELF) - own, 3),
           "children_cpu_s": round(_cpu_s(resource.RUSAGE_CHILDREN) - children, 3)}
    # One write of one line, appended: the workers' rows do not interleave
    with open(report, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    report = _report(config)
    if report is None or hasattr(config, "workerinput") or not report.exists():
        return
    rows = [json.loads(line) for line in report.read_text().splitlines() if line]
    total = sum(row["own_cpu_s"] + row["children_cpu_s"] for row in rows)
    children = sum(row["children_cpu_s"] for row in rows)
    terminalreporter.section("CPU per test")
    terminalreporter.write_line(f"{len(rows)} tests, {total:,.1f} CPU-s ({children:,.1f} in their child processes); "
                                f"rows in {report}")
    for row in sorted(rows, key=lambda row: -(row["own_cpu_s"] + row["children_cpu_s"]))[:SHOWN]:
        terminalreporter.write_line(f"{row['own_cpu_s'] + row['children_cpu_s']:7.1f} CPU-s "
                                    f"({row['children_cpu_s']:6.1f} children, {row['wall_s']:6.1f} s wall)  {row['test']}")
