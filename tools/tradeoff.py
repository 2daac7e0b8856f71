"""Quality-versus-time tradeoff curves in one command: a sweep of whole training runs.

    python tools/tradeoff.py --recipes fashion_baseline,fashion_mild --durations 1ep,2ep,4ep \\
        [--seeds 0,1,2] [--nproc 2] [--baseline fashion_baseline] [--out runs/tradeoff/NAME] [key=value ...]
    python tools/tradeoff.py --ablate fashion_hot --durations 4ep [--pairs] [--seeds ...] [...]

Each point (recipe x duration x seed) is a real run, launched as users launch one:
`torchrun --nproc_per_node=N training/main.py --config RECIPE max_duration=D seed=S ...`, so
every schedule given in fractions of the run stretches to D. Points run shortest first, every
recipe at seed 0 before further seeds, so a usable curve exists early. The key=value overrides
apply to every run (e.g. data.path=...). A recipe is a name in algorithms/recipes or a YAML path.

OUT holds: runs/<point>/ (the run directories), points/<point>.json (one row per point, written
when it ends), points.jsonl (all rows), report.md and tradeoff.png (tools/tradeoff_curves.py:
each recipe's curve, the Pareto frontier, speed-up over the baseline at equal quality, top-1
gain at equal time) and sweep.json, the conditions every point shares (overrides, processes,
machine): an OUT of other conditions is refused, while recipes, durations and seeds can be added
to it. Resumable: a finished point is never run again; a point killed half-way resumes from its
last checkpoint (the trainer's resume=auto; its training time counts both parts); a failed
point is reported with its error, the sweep goes on, and the next sweep tries it again.

--ablate RECIPE: the recipe, its baseline, the recipe without each of its methods in turn and
the baseline with each method alone (with --pairs also every pair), written as YAMLs under
OUT/recipes/; the report adds each method's effect on top-1 and time, in the recipe and alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import yaml

from benchmarks.hardware import git_commit, signature, slug
from pipeline.storage.atomic_files import write_bytes_atomic
import tradeoff_curves
from algorithms.durations import Duration
from training.typed_config import load_recipe

RECIPES = ROOT / "algorithms" / "recipes"
SET_BY_THE_SWEEP = ("max_duration", "seed", "run_dir", "resume")


class SweepError(Exception):
    """A bad argument or OUT directory: one line, exit 2."""


@dataclass(frozen=True)
class Point:
    recipe: str               # the name the report uses
    recipe_path: Path
    duration: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.duration}-s{self.seed}"


def recipe_path(name: str) -> Path:
    path = Path(name) if name.endswith((".yaml", ".yml")) else RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise SweepError(f"unknown recipe {name!r}: no file {path} (recipes: {known})")
    return path


def recipe_name(name_or_path: str) -> str:
    """A recipe's name in the report: its file's name without .yaml; a name as given (Path.stem
    would cut 'baseline_lr0.8' to 'baseline_lr0')."""
    name = Path(name_or_path).name
    return name.rsplit(".", 1)[0] if name.endswith((".yaml", ".yml")) else name


def check_recipes(names: list[str], overrides: list[str]) -> None:
    """Every recipe exists and takes the overrides: a typo fails here, not in every point."""
    from training.config import ConfigError, load_config
    if len({recipe_name(n) for n in names}) < len(names):
        raise SweepError(f"--recipes {','.join(names)}: a recipe named twice")
    for name in names:
        try:
            load_config(str(recipe_path(name)), overrides)
        except ConfigError as error:
            raise SweepError(f"recipe {name}: {error}") from None


def parse_durations(text: str) -> list[str]:
    durations = []
    for item in filter(None, text.split(",")):
        try:
            duration = Duration.parse(item)
        except ValueError as error:
            raise SweepError(f"--durations: {error}") from None
        if duration.unit == "dur" or duration.value <= 0:
            raise SweepError(f"--durations: bad duration {item!r}: a run's length is a positive count of ep or ba")
        durations.append(str(duration))
    if not durations:
        raise SweepError("--durations: give at least one, e.g. 1ep,2ep,4ep")
    return durations


def plan(recipes: list[tuple[str, Path]], durations: list[str], seeds: list[int]) -> list[Point]:
    """Shortest first and seed by seed: the first len(recipes) x len(durations) points draw every curve once."""
    by_length = sorted(durations, key=lambda d: (Duration.parse(d).unit, Duration.parse(d).value))
    return [Point(name, path, duration, seed) for seed in seeds for duration in by_length for name, path in recipes]


def ablation_recipes(recipe: str, baseline: str, out: Path, pairs: bool) -> tuple[list[tuple[str, Path]], list[str]]:
    """The variants of --ablate, each a YAML under OUT/recipes/, and the recipe's method names."""
    full, base = load_recipe(recipe_path(recipe)), load_recipe(recipe_path(baseline))
    methods = list(full.get("algorithms") or {})
    if not methods:
        raise SweepError(f"--ablate {recipe}: the recipe names no algorithms, so there is nothing to ablate")
    # named as the report names them: a recipe given as a path is its file's name
    name, base_name = recipe_name(recipe), recipe_name(baseline)
    variants = [(name, recipe_path(recipe)), (base_name, recipe_path(baseline))]
    pair_sets = [[a, b] for i, a in enumerate(methods) for b in methods[i + 1:]] if pairs else []
    chosen = [[m] for m in methods] + pair_sets
    written = {tradeoff_curves.variant_name(name, without=m): {**full, "algorithms": {
        k: v for k, v in full["algorithms"].items() if k != m}} for m in methods}
    written |= {tradeoff_curves.variant_name(base_name, with_=names): {**base, "algorithms": {
        **(base.get("algorithms") or {}), **{m: full["algorithms"][m] for m in names}}} for names in chosen}
    for variant, settings in written.items():
        path = out / "recipes" / f"{variant}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = f"# written by tools/tradeoff.py --ablate {recipe} (baseline {baseline})\n"
        write_bytes_atomic(path, (header + yaml.safe_dump(settings, sort_keys=False)).encode(), durable=False)
        variants.append((variant, path))
    return variants, methods


def claim_out(out: Path, conditions: dict) -> None:
    """OUT/sweep.json records what every point shares; an OUT of other conditions is refused."""
    record = out / "sweep.json"
    if record.exists():
        try:
            earlier = json.loads(record.read_text())
        except json.JSONDecodeError:
            raise SweepError(f"{record}: not a sweep record (unreadable JSON); use another --out") from None
        for key, value in conditions.items():
            if earlier.get(key) != value:
                raise SweepError(f"{out}: belongs to another sweep ({key} {earlier.get(key)!r} there, "
                                 f"{value!r} here); use another --out")
    elif out.exists() and any(out.iterdir()):
        raise SweepError(f"{out}: exists, is not empty and holds no sweep.json; use another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(record, (json.dumps(conditions, indent=2) + "\n").encode())


def run_point(point: Point, out: Path, nproc: int, overrides: list[str], hardware: dict) -> dict:
    run_dir = out / "runs" / point.name
    resumed = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "training" / "main.py"), "--config", str(point.recipe_path),
               f"max_duration={point.duration}", f"seed={point.seed}", f"run_dir={run_dir}", "resume=auto",
               "log.progress=false", *overrides]
    start = time.perf_counter()
    with open(run_dir / "sweep.log", "a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    row = {"recipe": point.recipe, "duration": point.duration, "seed": point.seed,
           "command_wall_s": round(time.perf_counter() - start, 2), "resumed": resumed, "run_dir": str(run_dir),
           "recipe_file": str(point.recipe_path), "default_duration": default_duration(point.recipe_path),
           "hardware": hardware, "commit": git_commit(),
           "date": time.strftime("%Y-%m-%d")}
    summary_path = run_dir / "summary.json"
    if returncode != 0 or not summary_path.is_file():
        return {**row, "error": _error_line(run_dir / "sweep.log", returncode)}
    summary = json.loads(summary_path.read_text())
    return {**row, "val_top1": summary["last_val_top1"], "best_val_top1": summary["best_val_top1"],
            "train_wall_s": summary["wall_s"], "train_img_per_s": summary["train_img_per_s"],
            "epochs": summary["epochs"], "steps": summary["steps"], "world_size": summary["world_size"],
            "precision": summary.get("precision"),
            "step_phases": summary.get("step_phases") or {}, "error": None}


def default_duration(recipe: Path) -> str | None:
    """The recipe's own max_duration: the point its author put on the frontier, which the report
    compares with the baseline's."""
    value = load_recipe(recipe).get("max_duration")
    return None if value is None else str(Duration.parse(str(value)))


def _error_line(log: Path, returncode: int) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:")] or [line for line in lines if "Error" in line]
    return f"exit {returncode}: " + (said[-1] if said else (lines[-1] if lines else "no output"))[:300]


def finished(point: Point, out: Path) -> dict | None:
    path = out / "points" / f"{point.name}.json"
    if not path.is_file():
        return None
    row = json.loads(path.read_text())
    return row if row.get("error") is None and (out / "runs" / point.name / "summary.json").is_file() else None


def seconds_left(remaining: list[Point], rows: list[dict]) -> float | None:
    """From the finished points: seconds per unit of duration, per recipe (any recipe's where a
    recipe has none yet), summed over the points still to run."""
    rates: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row.get("error") is None:
            length = Duration.parse(row["duration"])
            rates.setdefault((row["recipe"], length.unit), []).append(row["command_wall_s"] / length.value)
            rates.setdefault(("*", length.unit), []).append(row["command_wall_s"] / length.value)
    total = 0.0
    for point in remaining:
        length = Duration.parse(point.duration)
        known = rates.get((point.recipe, length.unit)) or rates.get(("*", length.unit))
        if not known:
            return None
        total += length.value * sum(known) / len(known)
    return total


def default_baseline(names: list[str], out: Path) -> str:
    """The recipe compared against when --baseline is not given: one named '*baseline*', among
    this run's recipes first, then those OUT already holds points of (a sweep resumed for one
    recipe, `--recipes fashion_hot`, keeps comparing with the baseline it ran before); else the
    first recipe of this run."""
    points = out / "points.jsonl"
    earlier = [json.loads(line)["recipe"] for line in points.read_text().splitlines()] if points.exists() else []
    return next((n for n in [*names, *earlier] if "baseline" in n), names[0])


def write_outputs(out: Path, baseline: str, ablation: dict | None) -> list[dict]:
    rows = [json.loads(path.read_text()) for path in sorted((out / "points").glob("*.json"))]
    write_bytes_atomic(out / "points.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode(), durable=False)
    drawn = tradeoff_curves.plot(rows, out / "tradeoff.tmp.png")
    if drawn:
        os.replace(out / "tradeoff.tmp.png", out / "tradeoff.png")
    text = tradeoff_curves.report_markdown(rows, baseline, ablation, "tradeoff.png" if drawn else "")
    write_bytes_atomic(out / "report.md", text.encode(), durable=False)
    return rows


def sweep(points: list[Point], out: Path, nproc: int, overrides: list[str], baseline: str, hardware: dict,
          ablation: dict | None = None) -> int:
    """Runs the points not finished yet in OUT (claimed by claim_out); 1 if any failed."""
    (out / "points").mkdir(exist_ok=True)
    if ablation:
        write_bytes_atomic(out / "ablation.json", json.dumps(ablation).encode(), durable=False)
    to_run = [p for p in points if finished(p, out) is None]
    print(f"tradeoff: {len(points)} points, {len(points) - len(to_run)} already finished, {len(to_run)} to run; "
          f"out {out}", flush=True)
    failures = 0
    for index, point in enumerate(to_run, 1):
        row = run_point(point, out, nproc, overrides, hardware)
        write_bytes_atomic(out / "points" / f"{point.name}.json", (json.dumps(row) + "\n").encode())
        rows = write_outputs(out, baseline, ablation)
        left = seconds_left(to_run[index:], rows)
        eta = "" if index == len(to_run) else \
            f"; about {left / 60:.0f} min left" if left is not None else "; time left unknown yet"
        if row["error"] is None:
            outcome = f"{row['val_top1']:.2f}% in {row['train_wall_s']:,.0f} s (command {row['command_wall_s']:,.0f} s)"
        else:
            failures += 1
            outcome = f"FAILED, {row['error']}"
        print(f"[{index}/{len(to_run)}] {point.recipe} {point.duration} seed {point.seed}: {outcome}{eta}", flush=True)
    write_outputs(out, baseline, ablation)
    print(f"tradeoff: report {out / 'report.md'}" + (f"; {failures} point(s) failed" if failures else ""), flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="", help="comma-separated recipe names or YAML paths")
    parser.add_argument("--ablate", default="", metavar="RECIPE", help="leave-one-out and one-at-a-time variants")
    parser.add_argument("--pairs", action="store_true", help="with --ablate: also the baseline with every pair")
    parser.add_argument("--baseline", default="", help="the recipe others are compared with")
    parser.add_argument("--durations", required=True, help="e.g. 1ep,2ep,4ep,8ep")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun --nproc_per_node)")
    parser.add_argument("--out", default="", help="default runs/tradeoff/<recipes or ablate-RECIPE>")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    args = parser.parse_args(argv)
    try:
        if bool(args.recipes) == bool(args.ablate):
            raise SweepError("give --recipes or --ablate (one of them)")
        bad = [o for o in args.overrides if "=" not in o or o.split("=", 1)[0] in SET_BY_THE_SWEEP]
        if bad:
            raise SweepError(f"override {bad[0]!r}: write key=value; {', '.join(SET_BY_THE_SWEEP)} are set per point")
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s]
        except ValueError:
            raise SweepError(f"--seeds {args.seeds!r}: comma-separated integers") from None
        if args.nproc < 1:
            raise SweepError("--nproc: at least 1")
        durations = parse_durations(args.durations)
        hardware = signature()
        from training.config import shareable_overrides   # torch: only once the arguments are known good
        conditions = {"overrides": shareable_overrides(args.overrides), "nproc": args.nproc, "machine": slug(hardware)}
        if args.ablate:
            baseline = args.baseline or f"{recipe_name(args.ablate).split('_')[0]}_baseline"
            check_recipes([args.ablate, baseline], args.overrides)
            out = Path(args.out or f"runs/tradeoff/ablate-{recipe_name(args.ablate)}")
            claim_out(out, conditions)
            recipes, methods = ablation_recipes(args.ablate, baseline, out, args.pairs)
            check_recipes([str(path) for _, path in recipes[2:]], args.overrides)
            ablation = {"recipe": recipe_name(args.ablate), "baseline": recipe_name(baseline), "methods": methods}
        else:
            names = [n for n in args.recipes.split(",") if n]
            check_recipes(names, args.overrides)
            recipes = [(recipe_name(n), recipe_path(n)) for n in names]
            out = Path(args.out or f"runs/tradeoff/{'-'.join(n for n, _ in recipes)}")
            claim_out(out, conditions)
            baseline = args.baseline or default_baseline([n for n, _ in recipes], out)
            ablation = None
        return sweep(plan(recipes, durations, seeds or [0]), out, args.nproc, args.overrides, recipe_name(baseline),
                     hardware, ablation)
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
