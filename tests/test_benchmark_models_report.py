"""benchmarks/models.py and benchmarks/report.py as users run them: a tiny model-bound run into a
temporary results folder, and a report built from rows the test makes up for two machines."""
from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import append_results, results_path, slug

MODEL_KEYS = {"benchmark", "model", "resolution", "precision", "channels_last", "compile", "step", "batch_size",
              "device", "img_per_s", "threads", "hardware", "versions", "commit", "date"}


def benchmark(script: str, *args, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=None if env is None else {**os.environ, **env})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# --- models.py ------------------------------------------------------------------------------
def test_models_tiny_run_writes_one_row_per_configuration(tmp_path):
    run = benchmark("models.py", "--models", "small_resnet", "--resolutions", "16", "--batch-size", "8",
                    "--warmup", "1", "--iters", "2", "--precisions", "fp32,fp16", "--channels-last", "on",
                    "--compile", "off", "--steps", "train,eval", "--device", "cpu", "--results-dir", tmp_path,
                    env={"OMP_NUM_THREADS": "1"})   # one thread: quick even on a busy machine, and recorded
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fp16 skipped" in run.stdout                       # needs CUDA: a note, not a failure
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1, files
    rows = read_jsonl(files[0])
    assert files[0] == results_path(rows[0]["hardware"], tmp_path)   # named after this machine
    assert sorted((r["channels_last"], r["step"]) for r in rows) == sorted(product((True,), ("train", "eval")))
    for row in rows:
        assert MODEL_KEYS <= row.keys(), MODEL_KEYS - row.keys()
        assert (row["benchmark"], row["model"], row["resolution"], row["precision"], row["compile"],
                row["batch_size"], row["device"]) == ("models", "small_resnet", 16, "fp32", False, 8, "cpu")
        assert math.isfinite(row["img_per_s"]) and row["img_per_s"] > 0 and row["threads"] == 1
        assert len(row["step_seconds"]) == 2                   # --iters timed steps, the warm-up not among them
        assert row["img_per_s"] == pytest.approx(statistics.median(8 / s for s in row["step_seconds"]))
        assert row["hardware"]["cpu_model"] and row["hardware"]["cpu_cores"] >= 1
        # each figure is printed as a line of the table
        assert re.search(rf"small_resnet\s+16 fp32\s+{'channels_last' if row['channels_last'] else 'contiguous'}"
                         rf"\s+off\s+{row['step']}\s+{row['img_per_s']:.1f}", run.stdout), run.stdout


def test_models_bad_option_is_a_one_line_error(tmp_path):
    run = benchmark("models.py", "--models", "resnet9", "--results-dir", tmp_path)
    assert run.returncode == 2
    assert "resnet9" in run.stderr.strip().splitlines()[-1] and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())


def test_a_failing_configuration_is_one_line():
    from benchmarks.models import run_isolated
    config = {"model": "no_such_model", "resolution": 16, "precision": "fp32", "channels_last": True,
              "compile": False, "step": "eval", "batch_size": 2, "device": "cpu", "warmup": 0, "iters": 1}
    figures, error = run_isolated(config, timeout=60)
    assert figures is None and "no_such_model" in error and "\n" not in error


# --- report.py ------------------------------------------------------------------------------
MACHINES = {
    "gpu": {"cpu_model": "Test EPYC", "cpu_cores": 32, "ram_gb": 250.0, "gpu_model": "Test GPU 80GB", "gpu_count": 8,
            "driver": "550.1", "instance_type": "", "python": "3.11.7"},
    "cpu": {"cpu_model": "Test Xeon", "cpu_cores": 4, "ram_gb": 16.0, "gpu_model": "", "gpu_count": 0, "driver": "",
            "instance_type": "", "python": "3.11.7"},
}
BACKENDS = ("folder", "webdataset", "ffcv", "dali-wds", "decode_bound")
POINTS = (("train", 128), ("train", 160), ("val", 224))
PNG_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def made_up_results(directory: Path, seed: int = 0) -> dict:
    """Loader rows for both machines (a superseded first figure for folder), model rows for the GPU
    machine only, a row of another benchmark and a broken line; returns what was written."""
    rng = random.Random(seed)
    written = {"loaders": {}, "models": {}, "superseded": {}}
    for name, hardware in MACHINES.items():
        workers = hardware["cpu_cores"] // 2
        rows = []
        for backend, (split, res) in product(BACKENDS, POINTS):
            figure = rng.uniform(200, 5000)
            if backend == "folder":                           # an earlier figure the latest replaces
                old = figure / 3
                rows.append({"benchmark": "loaders", "backend": backend, "split": split, "resolution": res,
                             "workers": workers, "batch_size": 128, "img_per_s": old, "dataset": "made up"})
                written["superseded"][name, split, res] = old
            rows.append({"benchmark": "loaders", "backend": backend, "split": split, "resolution": res,
                         "workers": workers, "batch_size": 128, "img_per_s": figure, "dataset": "made up"})
            written["loaders"][name, backend, split, res] = (figure, workers)
        if name == "gpu":
            for model, res, precision, compiled in product(("resnet50", "resnet18"), (128, 160), ("fp32", "bf16"),
                                                         (False, True)):
                figure = rng.uniform(1000, 20000)
                rows.append({"benchmark": "models", "model": model, "resolution": res, "precision": precision,
                             "channels_last": True, "compile": compiled, "step": "train", "batch_size": 256,
                             "device": "cuda", "img_per_s": figure, "threads": 16})
                written["models"].setdefault((model, res), []).append((figure, precision, compiled))
        rows.append({"benchmark": "conversion", "format": "ffcv", "img_per_s": 123.0})
        append_results(rows, hardware, directory)
    broken = results_path(MACHINES["cpu"], directory)
    with open(broken, "a", encoding="utf-8") as f:
        f.write('{"benchmark": "loaders", "backend": "fol\n')
    written["broken"] = (broken.name, len(broken.read_text().splitlines()))
    return written


def check_pngs(report: str, out: Path) -> list[Path]:
    links = PNG_LINK.findall(report)
    assert all(not Path(link).is_absolute() for link in links), links     # relative: the folder can move
    paths = [out / link for link in links]
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 100
            image.verify()
    return paths


def test_report_of_two_machines(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    written = made_up_results(results)
    run = benchmark("report.py", "--results-dir", results, "--out", out, "--resolution", 160)
    assert run.returncode == 0, run.stderr[-2000:]
    file_name, line = written["broken"]
    assert f"{file_name}:{line}" in run.stderr and "not valid JSON" in run.stderr
    report = (out / "report.md").read_text(encoding="utf-8")
    slugs = {name: slug(hardware) for name, hardware in MACHINES.items()}

    for name in MACHINES:
        assert f"## {slugs[name]}" in report and MACHINES[name]["cpu_model"] in report
    for (name, backend, split, res), (figure, workers) in written["loaders"].items():
        assert backend in report
        if backend != "decode_bound":                         # each loader's share of the decode bound
            bound = written["loaders"][name, "decode_bound", split, res][0]
            assert f"{figure:,.0f} ({figure / bound:.0%})" in report, (name, backend, split, res)
    for (name, split, res), old in written["superseded"].items():
        assert f"| {old:,.0f} (" not in report and f"| {old:,.0f} |" not in report   # only the latest counts

    # the cross-machine table: one line per loader, split and resolution, the machines side by side
    columns = sorted(slugs.values())
    assert f"| backend | split | resolution | {' | '.join(columns)} |" in report
    by_slug = {slugs[name]: name for name in MACHINES}
    for backend, (split, res) in product(BACKENDS, POINTS):
        cells = [f"{written['loaders'][by_slug[s], backend, split, res][0]:,.0f} "
                 f"({written['loaders'][by_slug[s], backend, split, res][1]}w)" for s in columns]
        assert f"| {backend} | {split} | {res} | {' | '.join(cells)} |" in report

    # model-bound: the best settings per model and resolution, named; none for the CPU machine
    for (model, res), measured in written["models"].items():
        figure, precision, compiled = max(measured)
        settings = f"{precision}, channels-last, {'compiled' if compiled else 'eager'}, batch 256"
        assert f"| {model} | {res} | train | cuda | {figure:,.0f} | {settings} |" in report
    assert report.count("No model-bound figures") == 1

    pngs = check_pngs(report, out)
    assert len(pngs) == len(MACHINES) + 1 and any("160" in p.name for p in pngs)
    assert not [p for p in out.iterdir() if ".tmp" in p.name]   # atomic writes leave no temporary names


def test_report_of_one_machine_with_kinds_of_rows_missing(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    rows = [{"benchmark": "loaders", "backend": "webdataset", "split": "val", "resolution": 224, "workers": 1,
             "img_per_s": 321.0}]
    append_results(rows, MACHINES["cpu"], results)          # no decode bound, no train rows, no models
    run = benchmark("report.py", "--results-dir", results, "--out", out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| webdataset | 1 | 321 |" in report and "no decode_bound" in report
    assert "No model-bound figures" in report and "No train loader figures at 160 px" in report
    assert check_pngs(report, out) == []                    # nothing at a train resolution to draw

    empty = tmp_path / "empty"
    empty.mkdir()
    run = benchmark("report.py", "--results-dir", empty, "--out", out)
    assert run.returncode == 2 and "no *.jsonl" in run.stderr.strip().splitlines()[-1]


def test_report_keeps_loaders_on_the_gpu_and_each_hardware_decoder_share_apart(tmp_path):
    """The same backend delivering to the CPU, to the GPU, and (DALI) at two hardware-decoder
    shares: four rows, none hiding another as the 'latest' of one key."""
    results, out = tmp_path / "results", tmp_path / "out"
    base = {"benchmark": "loaders", "backend": "dali-wds", "split": "train", "resolution": 176, "workers": 16}
    rows = [{**base, "img_per_s": 1111.0}, {**base, "device": "cuda", "img_per_s": 2222.0},
            {**base, "device": "cuda", "hw_decoder_load": 0.0, "img_per_s": 3333.0},
            {**base, "device": "cuda", "hw_decoder_load": 1.0, "img_per_s": 4444.0}]
    append_results(rows, MACHINES["gpu"], results)
    run = benchmark("report.py", "--results-dir", results, "--out", out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = (out / "report.md").read_text(encoding="utf-8")
    for name, figure in (("dali-wds", "1,111"), ("dali-wds -> cuda", "2,222"), ("dali-wds -> cuda hw 0", "3,333"),
                         ("dali-wds -> cuda hw 1", "4,444")):
        assert f"| {name} | 16 | {figure} |" in report, name


def test_a_later_figure_on_fewer_cpu_threads_does_not_replace_the_best(tmp_path):
    """Thread count is a setting like precision: a one-thread figure measured after a two-thread
    one is its own row, and the table names the threads of the figure it shows."""
    results, out = tmp_path / "results", tmp_path / "out"
    base = {"benchmark": "models", "model": "small_resnet", "resolution": 28, "step": "train", "device": "cpu",
            "precision": "bf16", "channels_last": True, "compile": False, "batch_size": 128}
    append_results([{**base, "threads": 2, "img_per_s": 1542.0}, {**base, "threads": 1, "img_per_s": 924.0}],
                   MACHINES["cpu"], results)
    run = benchmark("report.py", "--results-dir", results, "--out", out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| small_resnet | 28 | train | cpu | 1,542 | bf16, channels-last, eager, batch 128, 2 threads |" in report
