"""The GPU check's summary (tools/gpu_check.py): the stages' outcomes, then the figures they wrote
against their targets, in RESULTS_DIR/report/gpu-check-<machine>.md. Also where the stages' shared
parameters live (the e2e epochs, the scaling stage's vCPU counts), so that a stage and its part
of the report cannot disagree.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.hardware import cpu_words, slug
from pipeline.storage.atomic_files import write_bytes_atomic

ROOT = Path(__file__).resolve().parents[1]
RECIPES = "algorithms/recipes"
PYTEST_SUMMARY = re.compile(r"^(\d+ (passed|failed|skipped|errors?)(, )?)+.* in [\d.]+s")
# pytest -v's line per test, with xdist ("[gw0] [ 50%] PASSED tests/x.py::t") or without ("tests/x.py::t PASSED")
TEST_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR)\s+tests/\S+::(\S+)"
                          r"|tests/\S+::(\S+)\s+(PASSED|FAILED|SKIPPED|ERROR)\b")
# The loader's rate per vCPU count, and end to end with the whole run pinned to each of these
SCALING_CORES = (4, 8, 16)
SCALING_TARGET = 0.10       # a projection from the scaling curve and the model-bound rate within 10%
# The target: end to end at 176 px (resnet50_mild's final side) reaches 95% of the
# model's img/s alone, i.e. the loader costs the train step at most 5%.
E2E_TARGET = 0.95
# Fed over HTTP, end to end stays within 3% of the same fed from local disk.
REMOTE_TARGET = 0.97
# resnet50_mild's 36 epochs (0.4 x 90) train at 176 px from epoch 29 to the last, 35, at 132 px
# at epoch 21 (the ramp's middle) and at 88 px from epoch 0 (pipeline/schedules.ComposerRamp);
# the JSONs record the side each measured, and the projection reads that, not these numbers;
# tests/test_gpu_check.py checks these epochs against the trainer's own schedule.
E2E_EPOCHS = {176: 35, 132: 21, 88: 0}


def rows_of(results: Path, machine: str, since: float, benchmark: str) -> list[dict]:
    path = results / f"{machine}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("benchmark") == benchmark and r.get("unix_time", since) >= since]


def report(work: Path, results: Path, hardware: dict) -> str:
    """The summary: stage outcomes, then the figures this check wrote, in markdown."""
    record = json.loads((work / "stages.json").read_text()) if (work / "stages.json").exists() else {}
    since = record.get("started", 0)
    machine = slug(hardware)
    lines = [f"# GPU check on {hardware.get('gpu_model')} x{hardware.get('gpu_count')}, "
             f"{cpu_words(hardware)}, {hardware['cpu_cores']} cores", "",
             "| stage | outcome | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds']:.0f} |" for s in record.get("stages", [])]
    test_log = work / "tests.log"
    if test_log.exists():
        lines += ["", *cuda_test_lines(test_log.read_text().splitlines())]
    loaders = rows_of(results, machine, since, "loaders")
    if loaders:
        lines += ["", "## Loaders, img/s delivered on the GPU (photos-large)", "",
                  "| loader | split | res | img/s | share of CPU decode bound |", "|---|---|---|---|---|"]
        for r in loaders:
            name = r["backend"] + (f" hw {r['hw_decoder_load']:g}" if r.get("hw_decoder_load") is not None else "")
            share = f"{r['share_of_decode_bound']:.2f}" if r.get("share_of_decode_bound") else ""
            lines.append(f"| {name} | {r['split']} | {r['resolution']} | {r['img_per_s']:,.0f} | {share} |")
    models = rows_of(results, machine, since, "models")
    if models:
        lines += ["", "## Model-bound img/s (synthetic batches on the GPU)", "",
                  "| model | res | step | precision | channels-last | compile | img/s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['resolution']} | {r['step']} | {r['precision']} | "
                  f"{'on' if r['channels_last'] else 'off'} | {'on' if r['compile'] else 'off'} | {r['img_per_s']:,.0f} |"
                  for r in models]
    for path in sorted(work.glob("diagnose-*.json")):
        figures = json.loads(path.read_text())
        lines += ["", f"Diagnose {path.stem[9:]} ({figures['backend']}, {figures['num_workers']} workers): "
                      f"**{figures['verdict']}**: loader alone {figures['loader_img_per_s']:,.0f} img/s, model alone "
                      f"{figures['model_img_per_s']:,.0f}, together {figures['together_img_per_s']:,.0f}, waiting for "
                      f"data {figures['wait_share']:.0%} of the time. {figures['verdict_text']}"]
    lines += end_to_end_lines(work, results, machine) + compare_lines(work) + remote_lines(work)
    lines += scaling_lines(work, results, hardware)
    run = work / "resnet50_mild"
    if (run / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [m["train_loss"] for m in metrics if "train_loss" in m]
        rates = [m["img_per_s"] for m in metrics if "img_per_s" in m]
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        resumed = "resumed from" in (work / "train.log").read_text() if (work / "train.log").exists() else False
        if losses:
            lines += ["", f"Short resnet50_mild run: train loss {losses[0]:.3f} -> {losses[-1]:.3f} over "
                          f"{len(losses)} logged intervals; img/s per interval min {min(rates):,.0f}, "
                          f"median {sorted(rates)[len(rates) // 2]:,.0f}, max {max(rates):,.0f}; "
                          f"resumed from a checkpoint: {'yes' if resumed else 'no'}; "
                          f"final top-1 {summary.get('last_val_top1', float('nan')):.2f}% after "
                          f"{summary.get('epochs', '?')} epochs"]
    return "\n".join(lines) + "\n"


def cuda_test_lines(log: list[str]) -> list[str]:
    """pytest's summary line, and each test's outcome from -v's lines: a run the deadline cut
    has no summary, and the names say what ran."""
    summaries = [line.strip("= ") for line in log if PYTEST_SUMMARY.match(line.strip("= "))]
    outcomes = {}
    for line in log:
        if match := TEST_OUTCOME.search(line):
            first, name, later_name, later = match.groups()
            outcomes[name or later_name] = first or later
    lines = [f"Tests (`pytest -m cuda`): {summaries[-1] if summaries else 'no summary line (cut short?)'}"]
    if outcomes:
        by_outcome = {}
        for name, outcome in outcomes.items():
            by_outcome.setdefault(outcome.lower(), []).append(name)
        lines.append("Per test: " + "; ".join(f"{outcome} {len(names)}: {', '.join(names)}"
                                              for outcome, names in sorted(by_outcome.items())))
    return lines


def end_to_end_lines(work: Path, results: Path, machine: str) -> list[str]:
    """The e2e stage's runs, the 95% check at 176 px, and the projection to 8 GPUs."""
    runs = {path.stem[4:]: json.loads(path.read_text()) for path in work.glob("e2e-*.json")
            if not path.stem.startswith(("e2e-compare", "e2e-remote"))}
    if not runs:
        return []
    lines = ["", "## End to end against model-bound (resnet50_mild from photos-large, one GPU)", "",
             "img/s; synced: a sync after every step (diagnose's verdict); as training: none (free-running).", "",
             "| run | side | compile | loader | loader alone | model synced | together synced | "
             "model as training | together as training | together / model as training |", "|" + "---|" * 10]
    for name, f in sorted(runs.items(), key=lambda item: (-item[1]["side"], item[0])):
        free = f.get("free_running")
        loader = f"{f['backend']}, {f['num_workers']} threads" + (
            f", hw decoder {f['hw_decoder_load']:g}" if f["backend"] == "dali" else "")
        lines.append(f"| {name} | {f['side']} | {'on' if f['compile'] else 'off'} | {loader} | "
                     f"{f['loader_img_per_s']:,.0f} | {f['model_img_per_s']:,.0f} | {f['together_img_per_s']:,.0f} | "
                     + (f"{free['model_img_per_s']:,.0f} | {free['together_img_per_s']:,.0f} | "
                        f"{free['together_img_per_s'] / free['model_img_per_s']:.1%} |" if free else "| | |"))
    if "176" in runs:
        free = runs["176"].get("free_running")
        how, figures = ("as training runs", free) if free else \
            ("with a sync per step (no free-running figures)", runs["176"])
        share = figures["together_img_per_s"] / figures["model_img_per_s"]
        lines += ["", f"At 176 px, compiled, {how}: end to end is {share:.1%} of model-bound; the target is "
                      f"{E2E_TARGET:.0%}: **{'met' if share >= E2E_TARGET else 'not met'}**."]
    return lines + projection_lines(work, results, machine)


def compare_lines(work: Path) -> list[str]:
    """The e2e-compare stage: its table, and whether its best setting meets the target at 176 px."""
    path = work / "e2e-compare.json"
    if not path.exists():
        return []
    import compare_settings
    result = json.loads(path.read_text())
    best = next(s for s in result["settings"] if s["name"] == result["best"])
    share = best["median_share_of_model"]
    return ["", f"## Settings compared at {result['side']} px in alternating rounds (tools/compare_settings.py)", "",
            "```", compare_settings.report(result), "```", "",
            f"Best: {' '.join(best['overrides'])}, a median {share:.1%} of the model alone as training runs; the "
            f"target is {E2E_TARGET:.0%}: **{'met' if share >= E2E_TARGET else 'not met'}**."]


def remote_lines(work: Path) -> list[str]:
    """The e2e-remote stage, per core count it ran with: each remote setting's median share of
    the model alone against local disk's (A), and the 3% target."""
    import compare_settings
    lines = []
    for path in sorted(work.glob("e2e-remote-*c.json"), key=lambda p: -int(p.stem.split("-")[-1][:-1])):
        result = json.loads(path.read_text())
        shares = {s["name"]: s["median_share_of_model"] for s in result["settings"]}
        local = shares.pop("A")
        local_overrides = result["settings"][0]["overrides"]
        lines += ["", f"## Fed over HTTP from loopback nginx against local disk, {result['cpu_cores']} cores "
                      f"({result['side']} px)", "", "```", compare_settings.report(result), "```", ""]
        for s in result["settings"]:
            if s["name"] in shares:
                ratio = shares[s["name"]] / local
                changes = " ".join(o for o in s["overrides"] if o not in local_overrides)
                verdict = "met" if ratio >= REMOTE_TARGET else "not met"
                lines.append(f"- {s['name']} ({changes}): {ratio:.3f}x local disk's share; "
                             f"the target is {REMOTE_TARGET:.2f}x: **{verdict}**.")
    return lines


def scaling_lines(work: Path, results: Path, hardware: dict) -> list[str]:
    """The scaling stage: end to end at 176 px with 4, 8 and 16 vCPUs against what tools/instance_cost.py
    predicts for them from this machine's loader curve and model-bound rate; the errors also go to
    WORK/scaling-check.json."""
    from benchmarks.measured_figures import LoaderRates, ModelRates, NoFigure, gpu_model, result_rows
    measured = {n: json.loads(path.read_text()) for n in SCALING_CORES if (path := work / f"scaling-{n}c.json").exists()}
    if not measured:
        return []
    mine = [row for row in result_rows(results) if row["_file"] == f"{slug(hardware)}.jsonl"]
    loaders, models = LoaderRates(mine), ModelRates(mine)
    gpu, cpu = gpu_model(hardware.get("gpu_model", "")), hardware["cpu_model"]
    lines = ["", "## Scaling with vCPUs: end to end at 176 px against the projection", "",
             "| vCPUs | measured img/s | projected (binds) | error | from the 2-vCPU figure alone | error |",
             "|---|---|---|---|---|---|"]
    checks = []
    for n, figures in sorted(measured.items()):
        actual = (figures.get("free_running") or figures)["together_img_per_s"]
        try:
            model = models.rate(gpu, "resnet50", "train", 176, "bf16", True, False).img_per_s
            loader = loaders.rate(cpu, hardware.get("cpu_isa", ""), "webdataset", "train", 176, n).img_per_s
            two = LoaderRates([r for r in mine if r.get("cores") == 2]).rate(
                cpu, hardware.get("cpu_isa", ""), "webdataset", "train", 176, n).img_per_s
        except NoFigure as missing:
            lines.append(f"| {n} | {actual:,.0f} | not made: {missing} | | | |")
            continue
        projected, from_two = min(model, loader), min(model, two)
        check = {"vcpus": n, "measured": actual, "projected": projected, "error": projected / actual - 1,
                 "binds": "GPU" if model <= loader else "data", "from_two_vcpus": from_two,
                 "error_from_two": from_two / actual - 1}
        checks.append(check)
        lines.append(f"| {n} | {actual:,.0f} | {projected:,.0f} ({check['binds']}) | {check['error']:+.1%} | "
                     f"{from_two:,.0f} | {check['error_from_two']:+.1%} |")
    if checks:
        worst = max(abs(c["error"]) for c in checks)
        lines.append(f"The target: every projection within {SCALING_TARGET:.0%}: **{'met' if worst <= SCALING_TARGET else 'missed'}** "
                     f"(worst {worst:.1%}).")
        write_bytes_atomic(work / "scaling-check.json", json.dumps(checks, indent=1).encode())
    return lines


def projection_lines(work: Path, results: Path, machine: str) -> list[str]:
    """resnet50_mild's time on 8 GPUs like this one, from the compiled e2e runs (tools/project_time.py)."""
    import project_time
    measured = [work / f"e2e-{side}.json" for side in E2E_EPOCHS if (work / f"e2e-{side}.json").exists()]
    if len(measured) < 2:
        return ["", "Projection to 8 GPUs: not made, fewer than two sides measured end to end."]
    evals = [r for r in rows_of(results, machine, 0, "models") if (r["model"], r["step"], r["resolution"],
             r["precision"], r["channels_last"], r["compile"]) == ("resnet50", "eval", 224, "bf16", True, False)]
    vals = [r for r in rows_of(results, machine, 0, "loaders")
            if (r["backend"], r["split"], r["resolution"], r.get("hw_decoder_load")) == ("dali-wds", "val", 224, None)]
    sources = [(rows[-1]["img_per_s"], what) for rows, what in ((evals, "the model's eval step"),
                                                                  (vals, "DALI's val loader")) if rows]
    eval_rate, eval_source = min(sources) if sources else (None, "")
    try:
        schedule = project_time.recipe_schedule(str(ROOT / RECIPES / "resnet50_mild.yaml"), [], 8,
                                                project_time.IMAGENET_TRAIN, project_time.IMAGENET_VAL)
        projection = project_time.project(schedule, project_time.measured_rates(measured, schedule), 8, 1.0,
                                          eval_rate)
    except project_time.ConfigError as error:
        return ["", f"Projection to 8 GPUs: not made ({error})."]
    return ["", "## Projected: resnet50_mild on ImageNet, 8 such GPUs, ideal scaling", "", "```",
            project_time.report(projection), "```"] + (
        [f"Eval rate: {eval_rate:,.0f} img/s per GPU, {eval_source}'s: the lower of this machine's latest figures "
         f"at 224 px for {' and '.join(what for _, what in sources)}."] if sources else [])
