"""The README's tour leaves the checkout as it was: a command that writes a file names it in its
output and writes it where it was told (the cost plot under runs/); a benchmark keeps its rows in
its output unless told --save or --results-dir; what `pip wheel .` leaves is ignored."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def porcelain() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def test_the_tours_cost_plot_is_named_in_its_output_and_leaves_the_checkout_as_it_was(tmp_path):
    before = porcelain()
    plot = ROOT / "runs" / f"cost-{tmp_path.name}.png"
    try:
        result = subprocess.run([sys.executable, "tools/instance_cost.py", "--config", "resnet50_mild",
                                 "--data-from", "local,s3", "--plot", str(plot.relative_to(ROOT))],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"wrote {plot.relative_to(ROOT)}" in result.stdout and plot.stat().st_size > 0
        assert porcelain() == before
    finally:
        plot.unlink(missing_ok=True)


def test_a_benchmark_writes_its_rows_only_where_it_is_told(converted_sets, tmp_path):
    command = [sys.executable, "benchmarks/checksums.py", str(converted_sets["photos"]["webdataset"]), "--split",
               "val", "--repeats", "1"]
    before = porcelain()
    unsaved = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert unsaved.returncode == 0, unsaved.stderr[-2000:]
    assert "not saved: --save appends them to benchmarks/results/" in unsaved.stdout
    assert porcelain() == before
    saved = subprocess.run([*command, "--results-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    [written] = tmp_path.glob("*.jsonl")
    assert f"appended to {written}" in saved.stdout and written.read_text().count("\n") >= 1


def test_what_building_a_wheel_leaves_is_ignored():
    ignored = subprocess.run(["git", "check-ignore", "build/lib/x.py", "dist/fastpipe.whl", "fastpipe.egg-info/x"],
                             cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == ["build/lib/x.py", "dist/fastpipe.whl", "fastpipe.egg-info/x"]
