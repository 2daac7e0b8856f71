"""Draw what a training run logged: one PNG, several runs overlaid under their names.

    python tools/plot_run.py RUN_DIR [RUN_DIR ...] [--out PNG]

From each run directory's metrics.jsonl (training/run_log.py): validation top-1 and loss,
train loss, learning rate, resolution and img/s, against the run's wall time (top two rows)
and against optimizer steps (bottom two). One run is drawn to RUN_DIR/plot.png unless --out
says otherwise; several need --out. A run still going can be drawn: its lines so far are read.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from benchmarks.report import MATPLOTLIB_MISSING
from pipeline.storage.atomic_files import write_bytes_atomic
from training.run_log import cannot_write

# (key in metrics.jsonl, panel title); resolution is logged as [height, width]: its height is drawn
PANELS = [("val_top1", "validation top-1 (%)"), ("val_loss", "validation loss"), ("train_loss", "train loss"),
          ("lr", "learning rate"), ("resolution", "train resolution (px)"), ("img_per_s", "train img/s")]


class PlotError(Exception):
    """A run directory that cannot be drawn, in one line."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such file (is {run_dir} a run directory?)")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise PlotError(f"cannot read {path} ({error.strerror or error})") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue                       # a line cut short by a killed run
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise PlotError(f"{path}: no metrics lines yet")
    return records


def series(records: list[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    points = [(r[x_key], r[key][0] if key == "resolution" else r[key])
              for r in records if key in r and x_key in r]
    return [x for x, _ in points], [y for _, y in points]


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name; parent/name where two runs share a name."""
    names = [d.resolve().name for d in run_dirs]
    return [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def draw(runs: dict[str, list[dict]]) -> bytes:
    try:
        import matplotlib
    except ImportError:     # a GPU image without it: one line, as benchmarks/report.py says it
        raise PlotError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max((r.get("wall_s", 0) for records in runs.values() for r in records), default=0)
    minutes = longest > 600
    figure, axes = plt.subplots(4, 3, figsize=(16, 13))
    for block, (x_key, x_label) in enumerate([("wall_s", "wall time (min)" if minutes else "wall time (s)"),
                                              ("step", "optimizer steps")]):
        for index, (key, title) in enumerate(PANELS):
            ax = axes[2 * block + index // 3][index % 3]
            for name, records in runs.items():
                xs, ys = series(records, key, x_key)
                if x_key == "wall_s" and minutes:
                    xs = [x / 60 for x in xs]
                ax.plot(xs, ys, marker="o" if key.startswith("val_") else None, markersize=3, label=name)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(x_label, fontsize=9)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="the PNG to write (default, for one run: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    out = args.out or args.run_dirs[0] / "plot.png"
    try:
        if args.out is None and len(args.run_dirs) > 1:
            raise PlotError("several runs: say where the plot goes with --out PNG")
        runs = {name: read_metrics(run_dir) for name, run_dir in zip(run_names(args.run_dirs), args.run_dirs)}
        write_bytes_atomic(out, draw(runs))
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: {cannot_write(error, out)}", file=sys.stderr)
        return 1
    print(f"{out}: {len(runs)} run{'s' * (len(runs) > 1)} ({', '.join(runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
