"""The benchmark report: loader and model-bound img/s per machine and across machines, as
Markdown tables and PNG plots.

    python benchmarks/report.py [--results-dir benchmarks/results] [--out benchmarks/results/report]
                                [--resolution 160]

Reads every *.jsonl in --results-dir and keeps the `loaders` and `models` rows (other
benchmarks' rows are left out; a line that is not valid JSON is skipped with a warning naming
its file and line). Rows are grouped by the hardware slug of their `hardware` signature.
"Latest" means last in file order (files by name; rows of a later date sort after earlier
ones, so a machine's rows spread over two files still resolve to the newest).

OUT/report.md has, per machine: its signature; loader img/s, one row per (backend, workers),
one column per split and resolution, each cell the latest figure and its share of the
`decode_bound` (the decode-only ceiling) at that split and resolution (the one with the same
workers, else the highest); model-bound img/s, the best precision / channels-last / compile
per model, resolution, step and device, naming the settings that won; a plot of train img/s
against resolution (loaders solid, ceilings dashed, each model's best train rate dotted).
Then one table across machines (each machine's best workers count) and a grouped-bar plot of
train img/s at --resolution. Every file is written to a temporary name and renamed into place.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import RESULTS, cpu_words, slug
from pipeline.storage.atomic_files import write_bytes_atomic

CEILINGS = ("decode_bound", "gpu_decode_bound")   # not loaders: what decoding alone allows
DECODE_BOUND = "decode_bound"
REQUIRED = {"loaders": ("backend", "split", "resolution", "img_per_s", "hardware"),
            "models": ("model", "resolution", "step", "img_per_s", "hardware")}
SPLIT_ORDER = {"train": 0, "val": 1}


def warn(message: str) -> None:
    print(f"report: warning: {message}", file=sys.stderr)


def read_rows(directory: Path) -> list[dict]:
    """The loaders and models rows of every results file, each with `machine` (the hardware
    slug) added, oldest first."""
    rows = []
    for path in sorted(directory.glob("*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    warn(f"{path}:{number}: not valid JSON, skipped")
                    continue
                if not isinstance(row, dict) or not isinstance(row.get("benchmark"), str) \
                        or row["benchmark"] not in REQUIRED:
                    continue
                missing = [key for key in REQUIRED[row["benchmark"]] if key not in row]
                rate = row.get("img_per_s")
                if missing or not isinstance(row["hardware"], dict) \
                        or not {"cpu_model", "cpu_cores"} <= row["hardware"].keys():
                    warn(f"{path}:{number}: {row['benchmark']} row without "
                         f"{', '.join(missing) or 'a hardware signature (benchmarks/hardware.py)'}, skipped")
                elif not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                    warn(f"{path}:{number}: img_per_s {rate!r} is not a positive number, skipped")
                elif not isinstance(row["resolution"], int) or isinstance(row["resolution"], bool):
                    warn(f"{path}:{number}: resolution {row['resolution']!r} is not an integer, skipped")
                else:
                    for key in ("backend", "split", "model", "step", "device", "precision"):   # names sort as text
                        if key in row:
                            row[key] = str(row[key])
                    rows.append({**row, "machine": slug(row["hardware"])})
    rows.sort(key=lambda row: str(row.get("date") or ""))   # stable: file order within a date
    return rows


def latest(rows: list[dict], key) -> dict:
    """key(row) -> the last such row (rows are oldest first)."""
    return {key(row): row for row in rows}


def best(rows, key) -> dict:
    """key(row) -> the row with the highest img/s."""
    chosen = {}
    for row in rows:
        k = key(row)
        if k not in chosen or row["img_per_s"] > chosen[k]["img_per_s"]:
            chosen[k] = row
    return chosen


def loader_name(row: dict) -> str:
    """The backend, and where it delivered (`-> cuda`) and DALI's hardware-decoder share when
    they were set: one table row each."""
    name = row["backend"]
    if str(row.get("device", "cpu")).startswith("cuda") and name not in CEILINGS:
        name += " -> cuda"
    if row.get("hw_decoder_load") is not None:
        name += f" hw {row['hw_decoder_load']:g}"
    return name


def loader_key(row: dict) -> tuple:
    return loader_name(row), row["split"], row["resolution"], row.get("workers")


def model_settings_key(row: dict) -> tuple:
    return (row["model"], row["resolution"], row["step"], row.get("device", "?"), row.get("precision", "fp32"),
            bool(row.get("channels_last")), bool(row.get("compile")), row.get("batch_size"), row.get("threads"))


def backend_order(backend: str) -> tuple:
    return backend in CEILINGS, backend


def workers_order(workers) -> tuple:
    return not isinstance(workers, int), workers if isinstance(workers, int) else 0, str(workers)


def column_order(column: tuple) -> tuple:
    return SPLIT_ORDER.get(column[0], 2), column[0], column[1]


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list], numeric) -> list[str]:
    """Lines of a Markdown table; the `numeric` columns are right-aligned."""
    align = ["---:" if i in numeric else "---" for i in range(len(header))]
    return ["| " + " | ".join(map(cell, line)) + " |" for line in (header, align, *rows)]


def rate(value: float) -> str:
    return f"{value:,.0f}"


def describe(hardware: dict) -> str:
    gpu = f"{hardware['gpu_count']}x {hardware['gpu_model']}" + (f" (driver {hardware['driver']})"
                                                                 if hardware.get("driver") else "") \
        if hardware.get("gpu_count") else "no GPU"
    parts = [f"{cpu_words(hardware)}, {hardware['cpu_cores']} cores", f"{hardware.get('ram_gb')} GiB RAM", gpu]
    if hardware.get("instance_type"):
        parts.append(f"instance type {hardware['instance_type']}")
    if hardware.get("python"):
        parts.append(f"Python {hardware['python']}")
    return "; ".join(parts)


def decode_share(row: dict, ceilings: dict) -> float | None:
    """row's img/s as a share of the decode_bound at its split and resolution: the one measured
    with the same workers count, else the highest there; None where there is none."""
    at = {workers: r["img_per_s"] for (backend, split, res, workers), r in ceilings.items()
          if (split, res) == (row["split"], row["resolution"])}
    bound = at.get(row.get("workers"), max(at.values(), default=None))
    return row["img_per_s"] / bound if bound else None


def loader_section(rows: list[dict]) -> list[str]:
    current = latest(rows, loader_key)
    if not current:
        return ["No loader figures for this machine."]
    ceilings = {k: r for k, r in current.items() if k[0] == DECODE_BOUND}
    columns = sorted({(k[1], k[2]) for k in current}, key=column_order)
    lines_by_row = defaultdict(dict)
    for (backend, split, res, workers), row in current.items():
        share = None if backend in CEILINGS else decode_share(row, ceilings)
        lines_by_row[backend, workers][split, res] = rate(row["img_per_s"]) + (f" ({share:.0%})" if share else "")
    table = []
    for backend, workers in sorted(lines_by_row, key=lambda k: (backend_order(k[0]), workers_order(k[1]))):
        name = f"{backend} (ceiling)" if backend in CEILINGS else backend
        table.append([name, "?" if workers is None else workers,
                      *(lines_by_row[backend, workers].get(c, "") for c in columns)])
    datasets = sorted({str(r["dataset"]) for r in current.values() if r.get("dataset")})
    note = ("Cells: img/s, latest measurement; in parentheses the share of the decode_bound at the same split and "
            "resolution." if ceilings else "Cells: img/s, latest measurement (no decode_bound measured here).")
    header = ["backend", "workers", *(f"{split} {res}" for split, res in columns)]
    return [*markdown_table(header, table, range(1, len(header))), "", note] + \
        ([f"Datasets: {'; '.join(datasets)}."] if datasets else [])


def model_section(rows: list[dict]) -> list[str]:
    winners = best(latest(rows, model_settings_key).values(), lambda r: (r["model"], r["resolution"], r["step"],
                                                                        r.get("device", "?")))
    if not winners:
        return ["No model-bound figures for this machine."]
    table = []
    for (model, res, step, device), row in sorted(winners.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                     kv[0][2] != "train", kv[0][3])):
        settings = [row.get("precision", "fp32"), "channels-last" if row.get("channels_last") else "contiguous",
                    "compiled" if row.get("compile") else "eager"]
        if row.get("batch_size"):
            settings.append(f"batch {row['batch_size']}")
        if row.get("threads") and row.get("device") == "cpu":
            settings.append(f"{row['threads']} thread{'s' if row['threads'] > 1 else ''}")
        table.append([model, res, step, device, rate(row["img_per_s"]), ", ".join(settings)])
    return [*markdown_table(["model", "resolution", "step", "device", "img/s", "best settings"], table, {1, 4}), "",
            "Best over precision, channels-last, torch.compile and, on a CPU, threads (latest figure of each)."]


def machine_plot(plt, machine: str, loaders: list[dict], models: list[dict]):
    """Train img/s against resolution: loaders solid, ceilings dashed, model-bound dotted; None
    when there is nothing to draw."""
    curves = defaultdict(dict)                       # label -> {resolution: img/s}, with a line style
    styles = {}
    for (backend, split, res, _), row in latest(loaders, loader_key).items():
        if split == "train":
            curves[backend][res] = max(row["img_per_s"], curves[backend].get(res, 0))
            styles[backend] = "--" if backend in CEILINGS else "-"
    for row in latest(models, model_settings_key).values():
        if row["step"] == "train":
            label = f"{row['model']} (model-bound)"
            curves[label][row["resolution"]] = max(row["img_per_s"], curves[label].get(row["resolution"], 0))
            styles[label] = ":"
    if not curves:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    for label in sorted(curves, key=lambda name: ({"-": 0, "--": 1, ":": 2}[styles[name]], name)):
        points = sorted(curves[label].items())
        axes.plot([p[0] for p in points], [p[1] for p in points], linestyle=styles[label], marker="o",
                  label=label, color="black" if label == DECODE_BOUND else None)
    values = [v for curve in curves.values() for v in curve.values()]
    axes.set_xticks(sorted({res for curve in curves.values() for res in curve}))
    if max(values) / min(values) > 20:               # a GPU model-bound rate would flatten the loaders
        axes.set_yscale("log")
    axes.set(xlabel="train resolution (px)", ylabel="img/s", title=f"{machine}: train throughput")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    return figure


def cross_plot(plt, best_rows: dict, machines: list[str], resolution: int):
    """Grouped bars: one group per backend, one bar per machine, train img/s at `resolution`."""
    at = {(backend, machine): row["img_per_s"] for (backend, split, res, machine), row in best_rows.items()
          if split == "train" and res == resolution}
    backends = sorted({backend for backend, _ in at}, key=backend_order)
    if not backends:
        return None
    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(backends) * max(1, len(machines)) ** 0.5 + 2), 5))
    width = 0.8 / len(machines)
    for i, machine in enumerate(machines):
        xs = [b + (i - (len(machines) - 1) / 2) * width for b in range(len(backends))]
        bars = axes.bar(xs, [at.get((backend, machine), 0) for backend in backends], width, label=machine)
        axes.bar_label(bars, labels=[rate(at[backend, machine]) if (backend, machine) in at else ""
                                     for backend in backends], fontsize=7)   # small bars stay readable
    axes.set_xticks(range(len(backends)), backends, rotation=30, ha="right")
    axes.set(ylabel="img/s", title=f"train img/s at {resolution} px, best workers count per machine")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def save_png(figure, path: Path) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    write_bytes_atomic(path, buffer.getvalue(), durable=False)   # a rerun recreates it: no fsync


MATPLOTLIB_MISSING = ("matplotlib is not installed; run `bash tools/bootstrap.sh` (a plain `pip install "
                      "matplotlib` would replace Pillow-SIMD with stock Pillow)")


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"report: error: {MATPLOTLIB_MISSING}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def build_report(rows: list[dict], out: Path, resolution: int, plt) -> tuple[str, list[Path]]:
    """report.md's text, and the PNGs written into out."""
    by_machine = defaultdict(list)
    for row in rows:
        by_machine[row["machine"]].append(row)
    machines = sorted(by_machine)
    text, images = ["# Benchmark report", ""], []
    if not machines:
        text += ["No loaders or models figures found.", ""]

    def add_plot(figure, name: str, caption: str) -> bool:
        """Saves a figure (None: nothing to plot) as OUT/name and links it; whether it did."""
        if figure is None:
            return False
        save_png(figure, out / name)
        plt.close(figure)
        images.append(out / name)
        text.extend([f"![{caption}]({name})", ""])
        return True

    for machine in machines:
        machine_rows = by_machine[machine]
        loaders = [r for r in machine_rows if r["benchmark"] == "loaders"]
        models = [r for r in machine_rows if r["benchmark"] == "models"]
        dates = sorted({str(r["date"]) for r in machine_rows if r.get("date")})
        measured = f" Measured {dates[0]}" + (f" to {dates[-1]}." if len(dates) > 1 else ".") if dates else ""
        text += [f"## {machine}", "", describe(machine_rows[-1]["hardware"]) + "." + measured, "",
                 "### Loader throughput (img/s)", "", *loader_section(loaders), "",
                 "### Model-bound throughput (img/s)", "", *model_section(models), ""]
        add_plot(machine_plot(plt, machine, loaders, models), f"{machine}-train-vs-resolution.png",
                 f"{machine}: train img/s against resolution")

    # Across machines: each machine's best workers count, since machines differ in cores.
    best_rows = {}                                   # (backend, split, resolution, machine) -> row
    for machine in machines:
        current = latest([r for r in by_machine[machine] if r["benchmark"] == "loaders"], loader_key).values()
        for (backend, split, res), row in best(current, lambda r: loader_key(r)[:3]).items():
            best_rows[backend, split, res, machine] = row
    text += ["## Across machines (loader img/s, best workers count per machine)", ""]
    keys = sorted({k[:3] for k in best_rows}, key=lambda k: (backend_order(k[0]), column_order(k[1:])))
    if keys:
        def entry(row: dict | None) -> str:
            return "" if row is None else f"{rate(row['img_per_s'])} ({row.get('workers') or '?'}w)"
        table = [[backend, split, res, *(entry(best_rows.get((backend, split, res, m))) for m in machines)]
                 for backend, split, res in keys]
        text += markdown_table(["backend", "split", "resolution", *machines], table, range(2, 3 + len(machines)))
    else:
        text.append("No loader figures.")
    text.append("")
    if not add_plot(cross_plot(plt, best_rows, machines, resolution), f"across-machines-train-{resolution}.png",
                    f"train img/s at {resolution} px across machines"):
        text += [f"No train loader figures at {resolution} px to plot across machines.", ""]
    return "\n".join(text), images


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=RESULTS / "report")
    parser.add_argument("--resolution", type=int, default=160, help="train resolution of the cross-machine plot")
    args = parser.parse_args()
    if not args.results_dir.is_dir():
        parser.error(f"--results-dir {args.results_dir} is not a folder")
    if not any(args.results_dir.glob("*.jsonl")):
        parser.error(f"no *.jsonl results files in {args.results_dir}")
    plt = pyplot()
    rows = read_rows(args.results_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    text, images = build_report(rows, args.out, args.resolution, plt)
    report = args.out / "report.md"
    write_bytes_atomic(report, text.encode("utf-8"), durable=False)
    print(f"{report}: {len(rows)} rows of {len({r['machine'] for r in rows})} machines, {len(images)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
