"""Which instance, which loader, what it costs: a recipe's hours and dollars on each cloud
instance type and loader, projected from measured throughput.

    python tools/instance_cost.py --config resnet50_mild [key=value ...] [--dataset imagenet|TRAIN,VAL[,MEAN_BYTES]]
        [--instances p4d.24xlarge,g6e.*] [--backends webdataset,ffcv,dali] [--data-from local|s3|local,s3]
        [--catalog MY_PRICES.csv ...] [--scaling 1.0] [--results-dir benchmarks/results]
        [--json PATH] [--plot PATH.png] [--markdown PATH.md]

For each instance and backend, a GPU's rate at each side the recipe trains at is the lowest of:
- the GPU's model-bound img/s (benchmarks/models.py; else published, carried along a measured GPU's curve),
  for DALI times the share of it the step keeps beside DALI's GPU decode, measured end to end;
- what the loader delivers on the instance's vCPUs per GPU (benchmarks/loaders.py --cores), on that
  kind of CPU or a kin one;
- from s3, the node's network share per GPU over the bytes per image.
Which one binds is reported. The recipe's epochs and sides are the trainer's own (training/projection.py,
as tools/project_time.py), so progressive resizing and the scale schedule act as in training; evaluation
runs at the lowest of the GPU's eval-step rate and the loader's val rate. Time x GPUs x `--scaling` (the
share of linear speed-up kept across GPUs, 1.0 by default: an upper bound on speed), then dollars at the
catalog's on-demand and spot prices (benchmarks/catalog/instances.csv, each with its source and date;
`--catalog` adds rows or overrides prices). Not counted: start-up, compile, checkpoints, queueing, storage
and egress fees. An instance whose GPU or CPU has no figure is left out, with one line naming the missing
figure and the command that measures it.

--json: per row `instance`, `gpus`, `vcpus_per_gpu`, `backend`, `data_from`, `binds`, `binds_share`, `sides`
(bounds' img/s), `minutes_per_epoch`, `hours`, `on_demand_usd`, `spot_usd`, `price`, `gpu_source`,
`loader_source`, `step_share` (DALI's), `sources`; and `left_out`.
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import json
import sys
from pathlib import Path

from benchmarks.hardware import RESULTS
from benchmarks.instance_catalog import CATALOG, CatalogError, Instance, load_catalog
from benchmarks.measured_figures import (GPU_DECODE, LOADER_ROWS, PUBLISHED, Figure, LoaderRates, ModelRates,
                                         NoFigure, StepShares, result_rows)
from pipeline.storage.atomic_files import write_bytes_atomic
from training.config import ConfigError, load_config, recipe_file, shareable_overrides
from training.projection import IMAGENET_TRAIN, IMAGENET_VAL, recipe_schedule, walk
from training.run import USAGE_ERROR

# ILSVRC2012_img_train.tar: 147,897,477,120 bytes for 1,281,167 JPEGs, as published
IMAGENET_MEAN_BYTES = 115_441
LOADER_SIDE_METHODS = ("randaugment", "colout")    # work in the loader the loader benchmark does not do
KINDS = {"measured": "M", "kin": "K", "published": "P", "catalog": "C"}


def parse_dataset(text: str) -> dict:
    if text == "imagenet":
        return {"name": "imagenet", "train_images": IMAGENET_TRAIN, "val_images": IMAGENET_VAL,
                "mean_bytes": IMAGENET_MEAN_BYTES}
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3) or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give imagenet, or TRAIN,VAL[,MEAN_BYTES] as whole numbers above 0")
    return {"name": text, "train_images": numbers[0], "val_images": numbers[1],
            "mean_bytes": numbers[2] if len(numbers) == 3 else IMAGENET_MEAN_BYTES}


def binding(**figures: Figure | None) -> tuple[str, Figure]:
    """Which figure binds: the lowest of those given."""
    name = min((n for n, f in figures.items() if f is not None), key=lambda n: figures[n].img_per_s)
    return name, figures[name]


def network_figure(instance: Instance, mean_bytes: int) -> Figure:
    if instance.network_gbps is None:
        raise NoFigure("no network bandwidth in the catalog, so no figure from s3 (add network_gbps with --catalog)")
    return Figure(instance.network_gbps * 1e9 / 8 / instance.gpu_count / mean_bytes, "catalog",
                  f"{instance.network_gbps:g} Gbit/s over {instance.gpu_count} GPUs, {mean_bytes:,} bytes per image")


def project_one(instance: Instance, backend: str, data_from: str, recipe: dict, schedule: dict, dataset: dict,
                models: ModelRates, loaders: LoaderRates, shares: StepShares, scaling: float) -> dict:
    """One instance x backend x data source: rates, binding side, hours and dollars; NoFigure if a figure is missing."""
    if data_from == "local":
        needed_gb = dataset["train_images"] * dataset["mean_bytes"] / 1e9
        if not instance.local_nvme_gb or instance.local_nvme_gb < needed_gb:
            raise NoFigure(f"the dataset's {needed_gb:,.0f} GB do not fit the local NVMe: read it from s3")
    network = network_figure(instance, dataset["mean_bytes"]) if data_from == "s3" else None
    gpu = instance.gpu_model
    step = {k: recipe[k] for k in ("precision", "channels_last", "compile")}
    sources: set[tuple[str, str]] = set()
    kinds: dict[str, str] = {}
    step_share = shares.share(gpu, backend, recipe["model"]) if backend in GPU_DECODE else None
    if step_share:
        sources.add(("measured", step_share.source))

    def gpu_figure(split: str, side: int) -> Figure:
        model = models.rate(gpu, recipe["model"], "train" if split == "train" else "eval", side, **step,
                            instance=instance.name)
        if step_share is None or split != "train":      # eval: no end-to-end figure, so the model's alone
            return model
        return Figure(model.img_per_s * step_share.share, model.kind, model.source)

    def rate_at(side: int, split: str = "train") -> dict:
        figures = {"GPU": gpu_figure(split, side),
                   "data": loaders.rate(instance.cpu, instance.cpu_isa, backend, split, side, instance.vcpus_per_gpu,
                                        instance.name),
                   "network": network}
        binds, figure = binding(**figures)
        sources.update((f.kind, f.source) for f in figures.values() if f is not None)
        kinds.update(gpu=figures["GPU"].kind, loader=figures["data"].kind)
        return {"img_per_s": figure.img_per_s, "binds": binds,
                **{f"{name.lower()}_img_per_s": f.img_per_s for name, f in figures.items() if f is not None}}

    rows = walk(schedule, rate_at, instance.gpu_count, scaling)
    evaluation = rate_at(schedule["val_side"], "val")
    eval_minutes = (schedule["evaluations"] * schedule["val_images"]
                    / (instance.gpu_count * scaling * evaluation["img_per_s"]) / 60)
    train_minutes = sum(row["minutes"] for row in rows)
    hours = (train_minutes + eval_minutes) / 60
    shares = {}
    for row in rows:
        shares[row["binds"]] = shares.get(row["binds"], 0.0) + row["minutes"] / train_minutes
    binds = max(shares, key=shares.get)
    return {"instance": instance.name, "cloud": instance.cloud, "region": instance.region,
            "gpus": f"{instance.gpu_count}x{gpu}", "gpu_count": instance.gpu_count, "gpu_model": gpu,
            "vcpus_per_gpu": instance.vcpus_per_gpu, "cpu": instance.cpu, "backend": backend, "data_from": data_from,
            "binds": binds, "binds_share": shares[binds], "sides": rows, "eval": evaluation,
            "train_minutes": train_minutes, "eval_minutes": eval_minutes,
            "minutes_per_epoch": train_minutes / schedule["epochs"], "hours": hours,
            "on_demand_usd": hours * instance.on_demand_usd_per_h,
            "spot_usd": hours * instance.spot_usd_per_h if instance.spot_usd_per_h is not None else None,
            "price": {"on_demand_usd_per_h": instance.on_demand_usd_per_h,
                      "spot_usd_per_h": instance.spot_usd_per_h, "source": instance.price_source,
                      "date": instance.price_date},
            "gpu_source": kinds["gpu"], "loader_source": kinds["loader"],
            "step_share": step_share.share if step_share else None,
            "sources": sorted(f"{kind}: {source}" for kind, source in sources)}


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both hours and on-demand dollars."""
    return [row for row in rows if not any(
        other["hours"] <= row["hours"] and other["on_demand_usd"] <= row["on_demand_usd"]
        and (other["hours"], other["on_demand_usd"]) != (row["hours"], row["on_demand_usd"]) for other in rows)]


def table(rows: list[dict], projection: dict) -> str:
    r = projection
    lines = [f"{r['recipe']}: {r['schedule']['epochs']:g} epochs of {r['dataset']['train_images']:,} images "
             f"({r['dataset']['name']}), {r['schedule']['evaluations']} evaluations of {r['dataset']['val_images']:,}; "
             f"scaling {r['scaling']:g}; ranked by on-demand dollars",
             f"{'':>3} {'instance':<24} {'GPUs':<12} {'vCPU/GPU':>8} {'backend':<10} {'data':<5} {'binds':<13} "
             f"{'min/epoch':>9} {'hours':>6} {'$ on-demand':>11} {'$ spot':>8} {'src':>4}"]
    front = {id(row) for row in pareto(rows)}
    for rank, row in enumerate(rows, 1):
        spot = f"{row['spot_usd']:,.1f}" if row["spot_usd"] is not None else "-"
        binds = f"{row['binds']} {row['binds_share']:.0%}"
        lines.append(f"{rank:>3} {row['instance'] + (' *' if id(row) in front else ''):<24} {row['gpus']:<12} "
                     f"{row['vcpus_per_gpu']:>8g} {row['backend']:<10} {row['data_from']:<5} {binds:<13} "
                     f"{row['minutes_per_epoch']:>9.2f} {row['hours']:>6.2f} {row['on_demand_usd']:>11,.1f} {spot:>8} "
                     f"{KINDS[row['gpu_source']]}{KINDS[row['loader_source']]:>3}")
    lines.append("* on the Pareto front of hours and dollars. src: the GPU figure, then the loader's: M measured "
                 "on this kind of machine, K measured on a kin CPU (same family, other vector extension), "
                 "P published (the GPU never measured here)")
    lines.append("binds: what limits the train steps (GPU: the model, beside dali the share of it the step keeps "
                 "next to DALI's GPU decode; data: the loader on these vCPUs; network: s3 over the NIC's share), "
                 "with its share of the train time")
    if projection["loader_side_methods"]:
        lines.append(f"not in the loaders' figures (plain crop and flip): this recipe's "
                     f"{' and '.join(projection['loader_side_methods'])}; its data rates are upper bounds")
    lines.append("prices: " + "; ".join(sorted({f"{p['source']} ({p['date']})" for p in
                                                (row["price"] for row in rows)})))
    lines.append("figures:")
    lines += [f"  {source}" for source in sorted({s for row in rows for s in row["sources"]})]
    return "\n".join(lines)


def left_out_lines(projection: dict) -> list[str]:
    """One line per reason, naming the instances (and, where not all, the backends or sources) it left out."""
    by_reason: dict[str, dict[str, set]] = {}
    for item in projection["left_out"]:
        which = by_reason.setdefault(item["reason"], {})
        which.setdefault(item["instance"], set()).add(f"{item['backend']} from {item['data_from']}")
    every = {f"{backend} from {source}" for backend in projection["backends"] for source in projection["data_from"]}
    def which(ways: set) -> str:
        if ways == every:
            return ""
        for source in projection["data_from"]:
            if ways == {f"{backend} from {source}" for backend in projection["backends"]}:
                return f" (from {source})"
        return f" ({', '.join(sorted(ways))})"
    return [f"{reason}: " + ", ".join(name + which(ways) for name, ways in instances.items())
            for reason, instances in sorted(by_reason.items())]


def markdown(projection: dict) -> str:
    """Per instance, the cheapest loader from each data source, as a table for the docs."""
    sources = projection["data_from"]
    head = "| instance | GPUs | vCPU/GPU | " + " | ".join(
        f"from {source}: loader, binds, hours, $ on demand / spot" for source in sources) + " | GPU, loader figures |"
    lines = [head, "|" + "---|" * (4 + len(sources))]
    by_instance: dict[str, dict[str, dict]] = {}
    for row in projection["rows"]:        # ranked by dollars: the first of each is the cheapest
        by_instance.setdefault(row["instance"], {}).setdefault(row["data_from"], row)
    for name, best in by_instance.items():
        first = next(iter(best.values()))
        cells = []
        for source in sources:
            row = best.get(source)
            spot = f"{row['spot_usd']:,.1f}" if row and row["spot_usd"] is not None else "-"
            cells.append(f"{row['backend']}, {row['binds']}, {row['hours']:.2f} h, {row['on_demand_usd']:,.1f} / {spot}"
                         if row else "left out")
        lines.append(f"| {name} | {first['gpus']} | {first['vcpus_per_gpu']:g} | " + " | ".join(cells)
                     + f" | {first['gpu_source']}, {first['loader_source']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(8, 5.5))
    for backend in sorted({row["backend"] for row in rows}):
        for source, marker in (("local", "o"), ("s3", "^")):
            mine = [row for row in rows if row["backend"] == backend and row["data_from"] == source]
            if mine:
                axes.scatter([r["hours"] for r in mine], [r["on_demand_usd"] for r in mine], marker=marker, alpha=0.7,
                             label=f"{backend}, {source}", color=f"C{sorted(LOADER_ROWS).index(backend)}")
    front = sorted(pareto(rows), key=lambda row: row["hours"])
    axes.plot([r["hours"] for r in front], [r["on_demand_usd"] for r in front], "k--", lw=1, label="Pareto front")
    labels: dict[tuple, list[str]] = {}      # a point reached two ways carries one label
    for row in front:
        labels.setdefault((row["hours"], row["on_demand_usd"]), []).append(
            f"{row['instance']} {row['backend']} {row['data_from']}")
    for point, names in labels.items():
        axes.annotate("\n".join(names), point, fontsize=7, xytext=(4, 4), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("hours to the recipe's end")
    axes.set_ylabel("dollars, on demand")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    write_bytes_atomic(path, buffer.getvalue())


def selected(catalog: dict[str, Instance], patterns: str | None) -> list[Instance]:
    if not patterns:
        return list(catalog.values())
    chosen = [i for i in catalog.values() if any(fnmatch.fnmatch(i.name, p) for p in patterns.split(","))]
    if not chosen:
        raise CatalogError(f"--instances {patterns}: no instance in the catalog matches")
    return chosen


def project_all(args) -> dict:
    catalog = load_catalog(args.catalog)
    instances = selected(catalog, args.instances)
    config = load_config(args.config, args.overrides)
    recipe = {"model": config.model.name, "precision": config.precision, "channels_last": config.channels_last,
              "compile": config.compile}
    rows_here = result_rows(args.results_dir)
    models, loaders, shares = ModelRates(rows_here, args.published), LoaderRates(rows_here), StepShares(rows_here)
    schedules: dict[int, dict] = {}
    rows, left_out = [], []
    for instance in instances:
        if instance.gpu_count not in schedules:
            schedules[instance.gpu_count] = recipe_schedule(args.config, args.overrides, instance.gpu_count,
                                                            args.dataset["train_images"], args.dataset["val_images"])
        for backend in args.backends:
            for data_from in args.data_from:
                try:
                    rows.append(project_one(instance, backend, data_from, recipe, schedules[instance.gpu_count],
                                            args.dataset, models, loaders, shares, args.scaling))
                except NoFigure as missing:
                    left_out.append({"instance": instance.name, "backend": backend, "data_from": data_from,
                                     "reason": str(missing)})
    rows.sort(key=lambda row: row["on_demand_usd"])
    schedule = next(iter(schedules.values()))
    return {"recipe": str(args.config), "overrides": shareable_overrides(args.overrides), "dataset": args.dataset, "scaling": args.scaling,
            "backends": args.backends, "data_from": args.data_from,
            "loader_side_methods": [name for name in config.algorithms if name in LOADER_SIDE_METHODS],
            "schedule": {k: schedule[k] for k in ("epochs", "sides", "shares", "evaluations", "val_side")},
            "catalog": [str(CATALOG), *map(str, args.catalog)], "results_dir": str(args.results_dir),
            "rows": rows, "pareto": [[r["instance"], r["backend"], r["data_from"]] for r in pareto(rows)],
            "left_out": left_out}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=recipe_file, help="a recipe: a shipped name or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as training/main.py")
    parser.add_argument("--dataset", type=parse_dataset, default="imagenet", help="imagenet (default), or "
                        "TRAIN,VAL[,MEAN_BYTES]: the images per split and the mean bytes per stored image")
    parser.add_argument("--instances", help="comma-separated names or patterns (g6e.*); default: the whole catalog")
    parser.add_argument("--backends", type=lambda text: text.split(","), default="webdataset,ffcv,dali",
                        help=f"comma-separated, of {', '.join(LOADER_ROWS)}")
    parser.add_argument("--data-from", type=lambda text: text.split(","), default="local",
                        help="local (the instance's NVMe), s3 (over its network), or local,s3")
    parser.add_argument("--catalog", type=Path, action="append", default=[],
                        help="a CSV of your own rows or prices (a subset of the catalog's columns, with name)")
    parser.add_argument("--scaling", type=float, default=1.0, help="share of linear speed-up kept across GPUs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="the measured figures (*.jsonl)")
    parser.add_argument("--published", type=Path, default=PUBLISHED, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the projection here")
    parser.add_argument("--plot", type=Path, help="also draw dollars against hours here (PNG)")
    parser.add_argument("--markdown", type=Path, help="also write per instance the cheapest loader per source here")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [b for b in args.backends if b not in LOADER_ROWS] + [d for d in args.data_from if d not in ("local", "s3")]
    if unknown or not 0 < args.scaling <= 1:
        parser.error(f"unknown backend or data source {unknown[0]!r}" if unknown else "need 0 < --scaling <= 1")
    try:
        projection = project_all(args)
    except (CatalogError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    if projection["rows"]:
        print(table(projection["rows"], projection), flush=True)
    if projection["left_out"]:
        print(f"left out ({len(projection['left_out'])} instance x backend x source):")
        print("\n".join(f"  {line}" for line in left_out_lines(projection)))
    for path in (args.json, args.markdown, args.plot):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        write_bytes_atomic(args.json, (json.dumps(projection, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    if args.markdown:
        write_bytes_atomic(args.markdown, markdown(projection).encode())
        print(f"wrote {args.markdown}")
    if args.plot and projection["rows"]:
        plot(projection["rows"], args.plot, f"{Path(projection['recipe']).stem} on "
             f"{projection['dataset']['name']}: hours and on-demand dollars per instance and loader")
        print(f"wrote {args.plot}")
    return 0 if projection["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
