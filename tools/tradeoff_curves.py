"""The arithmetic of quality-versus-time tradeoff curves (MosaicML's way of judging a method),
and the report `tools/tradeoff.py` writes from a sweep's points.

A point is one whole training run: a recipe at one duration and seed, with its final top-1 and
its training wall time. Over seeds a (recipe, duration) becomes a mean with a min-max range;
a recipe's curve is its means ordered by time. Time to reach an accuracy is read on the curve
by linear interpolation between neighbouring points, never extrapolated: below a curve's
fastest point it is only known to be at most that point's time, above its best point unknown.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from pipeline.machine import cpu_words


@dataclass(frozen=True)
class CurvePoint:
    recipe: str
    duration: str
    seconds: float          # mean train_wall_s over seeds
    top1: float             # mean final val_top1 over seeds
    top1_min: float
    top1_max: float
    seeds: int


def curves(points: list[dict]) -> dict[str, list[CurvePoint]]:
    """{recipe: its CurvePoints by time} from points.jsonl rows; failed points are left out."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for point in points:
        if point.get("error") is None and point.get("val_top1") is not None:
            groups.setdefault((point["recipe"], point["duration"]), []).append(point)
    result: dict[str, list[CurvePoint]] = {}
    for (recipe, duration), runs in groups.items():
        accuracies = [run["val_top1"] for run in runs]
        result.setdefault(recipe, []).append(CurvePoint(
            recipe, duration, statistics.fmean(run["train_wall_s"] for run in runs), statistics.fmean(accuracies),
            min(accuracies), max(accuracies), len(runs)))
    return {recipe: sorted(curve, key=lambda p: p.seconds) for recipe, curve in sorted(result.items())}


def pareto_frontier(all_curves: dict[str, list[CurvePoint]]) -> list[CurvePoint]:
    """The points no other point beats on both time and accuracy, fastest first."""
    frontier: list[CurvePoint] = []
    for point in sorted((p for curve in all_curves.values() for p in curve), key=lambda p: (p.seconds, -p.top1)):
        if not frontier or point.top1 > frontier[-1].top1:
            frontier.append(point)
    return frontier


def frontier_ranges(frontier: list[CurvePoint]) -> list[tuple[str, float, float | None]]:
    """(recipe, from seconds, to seconds or None for 'and beyond'): which recipe holds the
    frontier over which range of training time."""
    ranges: list[list] = []
    for point, following in zip(frontier, [*frontier[1:], None]):
        end = following.seconds if following else None
        if ranges and ranges[-1][0] == point.recipe:
            ranges[-1][2] = end
        else:
            ranges.append([point.recipe, point.seconds, end])
    return [tuple(r) for r in ranges]


def time_to_reach(curve: list[CurvePoint], top1: float) -> tuple[float | None, bool]:
    """(seconds, exact): the time at which the curve first reaches `top1`, interpolated between
    the two points around the crossing. (fastest point's time, False) when even the fastest point
    is already there (the true time is at most that); (None, False) when no point gets there."""
    if not curve:
        return None, False
    if curve[0].top1 >= top1:
        return curve[0].seconds, False
    for before, after in zip(curve, curve[1:]):
        if after.top1 >= top1 > before.top1:
            share = (top1 - before.top1) / (after.top1 - before.top1)
            return before.seconds + share * (after.seconds - before.seconds), True
    return None, False


def top1_at(curve: list[CurvePoint], seconds: float) -> float | None:
    """The curve's accuracy at `seconds`, interpolated; None outside its time range."""
    for before, after in zip(curve, curve[1:]):
        if before.seconds <= seconds <= after.seconds:
            span = after.seconds - before.seconds
            share = (seconds - before.seconds) / span if span > 0 else 0
            return before.top1 + share * (after.top1 - before.top1)
    if len(curve) == 1 and curve[0].seconds == seconds:
        return curve[0].top1
    return None


@dataclass(frozen=True)
class Comparison:
    recipe: str
    baseline_duration: str
    baseline_top1: float
    baseline_seconds: float
    seconds_to_reach: float | None
    exact: bool                    # False: seconds_to_reach is an upper bound (or None)
    speedup: float | None          # baseline_seconds / seconds_to_reach; a lower bound when not exact
    top1_gain_at_equal_time: float | None


def compare_to_baseline(all_curves: dict[str, list[CurvePoint]], baseline: str) -> list[Comparison]:
    """For each baseline point and each other recipe: the speed-up at equal quality and the
    accuracy gain at equal time."""
    rows = []
    for anchor in all_curves.get(baseline, []):
        for recipe, curve in all_curves.items():
            if recipe == baseline:
                continue
            seconds, exact = time_to_reach(curve, anchor.top1)
            gain = top1_at(curve, anchor.seconds)
            rows.append(Comparison(recipe, anchor.duration, anchor.top1, anchor.seconds, seconds, exact,
                                   anchor.seconds / seconds if seconds else None,
                                   None if gain is None else gain - anchor.top1))
    return rows


def at_default_durations(all_curves: dict[str, list[CurvePoint]], points: list[dict],
                         baseline: str) -> list[tuple[CurvePoint, float | None, float | None]]:
    """(point, its time as a share of the baseline's, top-1 minus the baseline's) for each recipe
    at its own default duration (the `default_duration` its points recorded), against the
    baseline at its default: how the recipes compare as users would run them."""
    defaults = {p["recipe"]: p.get("default_duration") for p in points if p.get("default_duration")}
    chosen = {recipe: next((p for p in curve if p.duration == defaults.get(recipe)), None)
              for recipe, curve in all_curves.items()}
    anchor = chosen.get(baseline)
    if anchor is None:
        return [(p, None, None) for p in chosen.values() if p is not None]
    return [(p, p.seconds / anchor.seconds, p.top1 - anchor.top1) for p in chosen.values() if p is not None]


# --- ablation ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodEffect:
    method: str
    duration: str
    in_recipe_top1: float | None       # full recipe minus the recipe without it
    in_recipe_seconds: float | None
    alone_top1: float | None           # baseline with it alone minus the baseline
    alone_seconds: float | None


def ablation_effects(all_curves: dict[str, list[CurvePoint]], recipe: str, baseline: str,
                     methods: list[str]) -> tuple[list[MethodEffect], list[tuple[str, str, str, float]]]:
    """Each method's effect in the recipe (leave-one-out) and alone (on the baseline), per
    duration, from the variants `variant_name` names; and, where pair runs exist, the pairs
    whose joint accuracy effect differs from the sum of their single ones:
    (duration, method a, method b, joint minus sum, in points of top-1)."""
    at = {(name, p.duration): p for name, curve in all_curves.items() for p in curve}
    durations = [p.duration for p in all_curves.get(recipe, [])]

    def delta(a, b, field):
        return None if a is None or b is None else getattr(a, field) - getattr(b, field)
    effects, interactions = [], []
    for duration in durations:
        full, base = at.get((recipe, duration)), at.get((baseline, duration))
        for method in methods:
            without = at.get((variant_name(recipe, without=method), duration))
            alone = at.get((variant_name(baseline, with_=[method]), duration))
            if without is not None or alone is not None:      # the recipe's other durations were not ablated
                effects.append(MethodEffect(method, duration, delta(full, without, "top1"),
                                            delta(full, without, "seconds"), delta(alone, base, "top1"),
                                            delta(alone, base, "seconds")))
        for i, a in enumerate(methods):
            for b in methods[i + 1:]:
                pair, one, two = (at.get((variant_name(baseline, with_=names), duration))
                                  for names in ([a, b], [a], [b]))
                if None not in (pair, one, two, base):
                    interactions.append((duration, a, b, (pair.top1 - base.top1) - (one.top1 - base.top1)
                                         - (two.top1 - base.top1)))
    return effects, interactions


def variant_name(recipe: str, without: str | None = None, with_: list[str] | None = None) -> str:
    if without:
        return f"{recipe}-no-{without}"
    return recipe + "".join(f"+{name}" for name in with_ or [])


# --- the report -------------------------------------------------------------------------------
def report_markdown(points: list[dict], baseline: str, ablation: dict | None = None, plot_name: str = "") -> str:
    """OUT/report.md's text. `ablation`: {"recipe", "baseline", "methods"} for an --ablate sweep."""
    all_curves = curves(points)
    done = [p for p in points if p.get("error") is None]
    failed = [p for p in points if p.get("error") is not None]
    hardware = done[0]["hardware"] if done else (points[0]["hardware"] if points else {})
    commits = sorted({p.get("commit", "?") for p in points})
    lines = ["# Quality against training time", "",
             f"{cpu_words(hardware)}, {hardware.get('cpu_cores', '?')} cores"
             + (f", {hardware['gpu_count']}x {hardware['gpu_model']}" if hardware.get("gpu_count") else ", no GPU")
             + f"; {len(done)} runs finished, {len(failed)} failed; commit {', '.join(commits)}.", "",
             "Time is the training loop's wall time (evaluations and checkpoints included, start-up not); "
             "top-1 is the final evaluation's, the mean over seeds with the min-max range.", ""]
    if trained_in := precisions(done):
        lines += [f"Precision as trained: {trained_in}.", ""]
    if plot_name:
        lines += [f"![top-1 against training time]({plot_name})", ""]
    lines += ["| recipe | duration | seeds | top-1 % (min-max) | train s |", "|---|---|---:|---|---:|"]
    for recipe, curve in all_curves.items():
        for p in curve:
            lines.append(f"| {recipe} | {p.duration} | {p.seeds} | {p.top1:.2f} ({p.top1_min:.2f}-{p.top1_max:.2f}) "
                         f"| {_seconds(p.seconds)} |")
    frontier = pareto_frontier(all_curves)
    if frontier:
        lines += ["", "**Pareto frontier** (the fastest recipe to each accuracy):", ""]
        for recipe, start, end in frontier_ranges(frontier):
            until = f" to {_seconds(end)} s" if end is not None else " on"
            lines.append(f"- {recipe}: from {_seconds(start)} s{until}")
    comparisons = compare_to_baseline(all_curves, baseline)
    if comparisons:
        lines += ["", f"**Against {baseline}** (speed-up: the baseline point's time over the time the recipe needs "
                  "to reach its accuracy, interpolated on the recipe's curve; '>=' where the recipe's fastest point "
                  "is already there, so only a bound is known):", "",
                  "| baseline point | recipe | time to reach | speed-up | top-1 gain at equal time |",
                  "|---|---|---:|---:|---:|"]
        for c in comparisons:
            reach = "not reached" if c.seconds_to_reach is None else \
                f"{'' if c.exact else '<= '}{_seconds(c.seconds_to_reach)} s"
            speedup = "-" if c.speedup is None else f"{'' if c.exact else '>= '}{c.speedup:.2f}x"
            gain = "-" if c.top1_gain_at_equal_time is None else f"{c.top1_gain_at_equal_time:+.2f}"
            anchor = f"{c.baseline_duration}: {c.baseline_top1:.2f}% in {_seconds(c.baseline_seconds)} s"
            lines.append(f"| {anchor} | {c.recipe} | {reach} | {speedup} | {gain} |")
    defaults = at_default_durations(all_curves, points, baseline)
    if len(defaults) > 1:
        lines += ["", f"**Each recipe at its default duration** (its `max_duration`), against {baseline} at its own:",
                  "", f"| recipe | duration | top-1 % | train s | time / {baseline}'s | top-1 - {baseline}'s |",
                  "|---|---|---:|---:|---:|---:|"]
        for p, share, gain in defaults:
            lines.append(f"| {p.recipe} | {p.duration} | {p.top1:.2f} | {_seconds(p.seconds)} | "
                         f"{'-' if share is None else f'{100 * share:.0f}%'} | {_signed(gain, '.2f')} |")
    phases = phase_shares(points)
    if phases:
        names = [name for name in PHASES if any(shares.get(name) for _, _, shares in phases.values())]
        lines += ["", "**Where the step time goes** (rank 0, each recipe's longest runs, pooled over seeds; "
                  "training/step_phases.py):", "",
                  "| recipe | duration | ms/step | " + " | ".join(names) + " |",
                  "|---|---|---:|" + "---:|" * len(names)]
        for recipe, (duration, ms, shares) in phases.items():
            lines.append(f"| {recipe} | {duration} | {ms:.0f} | "
                         + " | ".join(f"{100 * shares.get(name, 0):.0f}%" for name in names) + " |")
    if ablation:
        effects, interactions = ablation_effects(all_curves, ablation["recipe"], ablation["baseline"],
                                                 ablation["methods"])
        lines += ["", f"**Methods of {ablation['recipe']}** (in the recipe: the recipe minus the recipe without "
                  f"the method; alone: {ablation['baseline']} with the method minus {ablation['baseline']}):", "",
                  "| method | duration | top-1 in recipe | s in recipe | top-1 alone | s alone |",
                  "|---|---|---:|---:|---:|---:|"]
        for e in effects:
            cells = [_signed(e.in_recipe_top1, ".2f"), _signed(e.in_recipe_seconds, ".0f"),
                     _signed(e.alone_top1, ".2f"), _signed(e.alone_seconds, ".0f")]
            lines.append(f"| {e.method} | {e.duration} | " + " | ".join(cells) + " |")
        for duration, a, b, excess in interactions:
            if abs(excess) >= 0.1:
                lines.append(f"- {duration}: {a} with {b} gives {excess:+.2f} points beyond the sum of their "
                             "single effects")
    if failed:
        lines += ["", "**Failed runs:**", ""] + [f"- {p['recipe']} {p['duration']} seed {p['seed']}: {p['error']}"
                                                for p in failed]
    return "\n".join(lines) + "\n"


PHASES = ("data", "forward", "loss", "backward", "optimizer", "hooks", "other")   # training/step_phases.py


def precisions(points: list[dict]) -> str:
    """Each recipe's precision as its runs trained (precision=auto picks it per run: a recipe whose
    runs differ shows the count of each); empty for points from before the field."""
    by_recipe: dict[str, Counter] = {}
    for p in points:
        if p.get("precision"):
            by_recipe.setdefault(p["recipe"], Counter())[p["precision"]] += 1
    return ", ".join(f"{recipe} " + (next(iter(counts)) if len(counts) == 1 else
                                     "mixed: " + " ".join(f"{n}x {name}" for name, n in sorted(counts.items())))
                     for recipe, counts in sorted(by_recipe.items()))


def phase_shares(points: list[dict]) -> dict[str, tuple[str, float, dict]]:
    """{recipe: (duration, ms per step, {phase: share})} at each recipe's longest duration (by steps)
    among the points that recorded phases, pooled over its seeds: Amdahl's view of what a recipe
    shrank. Points from before checkpoints carried the phases (fashion-hot-width/'s resumed seed)
    cover only the steps after a resume, the largest under progressive resizing, so where a whole
    run is there such a partial one is left out."""
    timed: dict[str, list[dict]] = {}
    for point in points:
        if point.get("error") is None and point.get("step_phases", {}).get("steps"):
            timed.setdefault(point["recipe"], []).append(point)
    result = {}
    for recipe, runs in sorted(timed.items()):
        longest = max(run["steps"] for run in runs)
        runs = [run for run in runs if run["steps"] == longest]
        runs = [run for run in runs if run["step_phases"]["steps"] == run["steps"]] or runs
        seconds = sum(run["step_phases"]["seconds"] for run in runs)
        shares = {name: sum(run["step_phases"].get(name, 0) * run["step_phases"]["seconds"] for run in runs) / seconds
                  for name in PHASES}
        ms = 1000 * seconds / sum(run["step_phases"]["steps"] for run in runs)
        result[recipe] = (runs[0]["duration"], ms, shares)
    return result


def _seconds(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _signed(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, "+" + spec)


def plot(points: list[dict], path) -> bool:
    """Top-1 against time per recipe (min-max bars) and the frontier, as a PNG; False without
    matplotlib or without points."""
    all_curves = curves(points)
    if not all_curves:
        return False
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for recipe, curve in all_curves.items():
        axes.errorbar([p.seconds for p in curve], [p.top1 for p in curve], marker="o", capsize=3, label=recipe,
                      yerr=[[p.top1 - p.top1_min for p in curve], [p.top1_max - p.top1 for p in curve]])
    frontier = pareto_frontier(all_curves)
    axes.step([p.seconds for p in frontier], [p.top1 for p in frontier], where="post", color="black",
              linestyle="--", linewidth=1, label="Pareto frontier")
    axes.set_xlabel("training wall time (s)")
    axes.set_ylabel("final top-1 (%)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
