"""tools/tradeoff.py: a real sweep under torchrun, killed and restarted; the curve arithmetic
(tools/tradeoff_curves.py) against hand-made points; the ablation variants; one-line errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

import tradeoff
import tradeoff_curves as tc
from conftest import TOOLS
from training.typed_config import load_recipe

# The small ResNet at width 4 on the fashion sample's 120 training images: 4 steps an epoch on
# each of 2 ranks. These 2-epoch runs are also test_recipes.py's for these recipes (SWEPT_RECIPES).
SWEPT_RECIPES = ("fashion_baseline", "fashion_mild", "fashion_medium")
TINY = ["data.backend=folder", "data.batch_size=16", "data.num_workers=0", "model.width=4",
        "model.blocks_per_stage=1", "log.tensorboard=false", "checkpoint.interval=2ba"]


def test_a_killed_sweep_continues_without_running_a_finished_point_again(sample_sets, tmp_path):
    out = tmp_path / "sweep"
    command = [sys.executable, str(TOOLS / "tradeoff.py"), "--recipes", ",".join(SWEPT_RECIPES),
               "--durations", "2ep", "--nproc", "2", "--out", str(out),
               f"data.path={sample_sets / 'fashion'}", *TINY]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((out / "points").glob("*.json")) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)             # the sweep and whatever it runs by now
    first.wait()
    second_point = out / "runs" / "fashion_mild-2ep-s0" / "checkpoints"
    second_was_under_way = second_point.is_dir() and any(second_point.iterdir())
    done_first = [json.loads(p.read_text()) for p in (out / "points").glob("*.json")]
    assert [(row["recipe"], row["duration"], row["error"]) for row in done_first] == \
        [("fashion_baseline", "2ep", None)], "the first recipe first"
    finished_summary = out / "runs" / "fashion_baseline-2ep-s0" / "summary.json"
    stamp = finished_summary.stat().st_mtime_ns

    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "3 points, 1 already finished, 2 to run" in second.stdout
    assert finished_summary.stat().st_mtime_ns == stamp
    assert "fashion_baseline 2ep" not in second.stdout
    progress = [line for line in second.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == 2 and "min left" in progress[0], second.stdout

    rows = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert sorted((r["recipe"], r["duration"]) for r in rows) == [(recipe, "2ep") for recipe in sorted(SWEPT_RECIPES)]
    for row in rows:
        assert row["error"] is None and row["seed"] == 0 and row["world_size"] == 2
        assert 0 <= row["val_top1"] <= 100 and row["train_wall_s"] > 0
        assert row["resumed"] == (second_was_under_way and row["recipe"] == "fashion_mild")
        if not row["resumed"]:
            assert row["train_wall_s"] < row["command_wall_s"]
        assert row["hardware"]["cpu_model"] and row["commit"] and row["train_img_per_s"] > 0
        assert row["default_duration"] == str(load_recipe(tradeoff.recipe_path(row["recipe"]))
                                              ["max_duration"])
        assert row["step_phases"]["steps"] > 0 and row["step_phases"]["forward"] > 0
        assert row["precision"] in ("fp32", "bf16")              # the recipes' auto, as picked on this machine
        summary = json.loads((out / "runs" / f"{row['recipe']}-{row['duration']}-s0" /
                              "summary.json").read_text())
        assert row["val_top1"] == summary["last_val_top1"]        # the final evaluation, not the best
        launched = (out / "runs" / f"{row['recipe']}-{row['duration']}-s0" / "sweep.log").read_text()
        assert f" max_duration={row['duration']} seed=0 " in launched
        saved = yaml.safe_load((out / "runs" / f"{row['recipe']}-{row['duration']}-s0" / "config.yaml").read_text())
        recipe = load_recipe(tradeoff.recipe_path(row["recipe"]))
        assert list(saved["algorithms"]) == list(recipe.get("algorithms", {}))
    report = (out / "report.md").read_text()
    assert "fashion_mild" in report and "Pareto frontier" in report and "Against fashion_baseline" in report
    assert "Where the step time goes" in report and "Precision as trained: fashion_baseline " in report
    assert (out / "tradeoff.png").stat().st_size > 1000

    other = subprocess.run([*command[:-1], "data.batch_size=32"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "belongs to another sweep" in other.stderr


def test_the_plan_runs_the_shortest_points_first_and_the_seeds_in_turn():
    recipes = [("a", None), ("b", None)]
    order = [(p.recipe, p.duration, p.seed) for p in tradeoff.plan(recipes, ["2ep", "1ep", "10ba"], [0, 1])]
    assert order[:6] == [("a", "10ba", 0), ("b", "10ba", 0), ("a", "1ep", 0), ("b", "1ep", 0), ("a", "2ep", 0),
                         ("b", "2ep", 0)]
    assert order[6:] == [(recipe, duration, 1) for recipe, duration, _ in order[:6]]


def point(recipe, duration, seconds, top1, seed=0):
    return {"recipe": recipe, "duration": duration, "seed": seed, "train_wall_s": seconds, "val_top1": top1,
            "error": None}


def test_speedup_and_gain_are_read_on_the_curves_by_interpolation():
    points = [point("base", "1ep", 100, 80), point("base", "2ep", 200, 86), point("base", "4ep", 400, 90),
              point("fast", "1ep", 50, 78), point("fast", "1ep", 50, 82, seed=1),       # mean 80
              point("fast", "2ep", 100, 88), point("fast", "4ep", 200, 89)]
    curves = tc.curves(points)
    assert [(p.duration, p.top1, p.top1_min, p.top1_max, p.seeds) for p in curves["fast"]][0] == ("1ep", 80, 78, 82, 2)
    rows = {c.baseline_duration: c for c in tc.compare_to_baseline(curves, "base")}
    # 80% at 1ep: fast's fastest point already has it, so 100 / 50 is only a lower bound
    assert rows["1ep"].seconds_to_reach == 50 and not rows["1ep"].exact and rows["1ep"].speedup == 2
    # 86%: between fast's 80% at 50 s and 88% at 100 s, 6/8 of the way: 87.5 s
    assert rows["2ep"].exact and rows["2ep"].seconds_to_reach == pytest.approx(87.5)
    assert rows["2ep"].speedup == pytest.approx(200 / 87.5)
    assert rows["2ep"].top1_gain_at_equal_time == pytest.approx(89 - 86)     # fast at 200 s
    # 90%: fast never gets there; at 400 s fast has no point (no extrapolation)
    assert rows["4ep"].seconds_to_reach is None and rows["4ep"].speedup is None
    assert rows["4ep"].top1_gain_at_equal_time is None
    assert rows["1ep"].top1_gain_at_equal_time == pytest.approx(88 - 80)


def test_each_recipe_is_compared_at_its_own_default_duration():
    points = [{**p, "default_duration": default} for p, default in [
        (point("base", "2ep", 200, 86), "4ep"), (point("base", "4ep", 400, 90), "4ep"),
        (point("fast", "2ep", 100, 88), "2ep"), (point("fast", "2ep", 120, 89, seed=1), "2ep"),
        (point("fast", "4ep", 200, 91), "2ep"), (point("long", "2ep", 300, 80), "8ep")]]   # long: 8ep not run
    rows = {p.recipe: (p.duration, p.seconds, share, gain)
            for p, share, gain in tc.at_default_durations(tc.curves(points), points, "base")}
    assert rows.keys() == {"base", "fast"}
    assert rows["fast"][:2] == ("2ep", 110)
    assert rows["fast"][2] == pytest.approx(110 / 400) and rows["fast"][3] == pytest.approx(88.5 - 90)
    assert rows["base"][2:] == (1, 0)
    report = tc.report_markdown([{**p, "hardware": {"cpu_model": "x", "cpu_cores": 2}} for p in points], "base")
    assert "| fast | 2ep | 88.50 | 110 | 28% | -1.50 |" in report


def test_the_report_names_the_precision_each_recipe_trained_in():
    points = [{**point("a", "1ep", 10, 70), "precision": "bf16"}, {**point("a", "2ep", 20, 80), "precision": "bf16"},
              {**point("b", "1ep", 15, 75), "precision": "fp32"}, {**point("b", "1ep", 16, 75, seed=1), "precision": "bf16"},
              {**point("b", "2ep", 30, 79), "precision": "fp32"}, point("c", "1ep", 5, 50)]    # c: before the field
    assert tc.precisions(points) == "a bf16, b mixed: 1x bf16 2x fp32"
    report = tc.report_markdown([{**p, "hardware": {"cpu_model": "x", "cpu_cores": 2}} for p in points], "a")
    assert "Precision as trained: a bf16, b mixed: 1x bf16 2x fp32." in report
    assert tc.precisions([point("c", "1ep", 5, 50)]) == ""


def test_step_phases_pool_whole_runs_and_leave_out_a_resumed_runs_tail():
    def timed(recipe, steps, seconds, forward, phase_steps=None, seed=0):
        phases = {"seconds": seconds, "steps": phase_steps or steps, "forward": forward, "backward": 1 - forward}
        return {**point(recipe, "8ep", 800, 94, seed), "steps": steps, "step_phases": phases}
    points = [timed("a", 100, 10.0, 0.3), timed("a", 100, 20.0, 0.6, seed=1),
              timed("a", 100, 9.0, 0.9, phase_steps=10, seed=2),         # resumed: only its last 10 steps
              timed("a", 50, 1.0, 0.5), timed("b", 100, 3.0, 0.5, phase_steps=10)]
    phases = tc.phase_shares(points)
    duration, ms, shares = phases["a"]
    assert ms == pytest.approx(1000 * 30 / 200) and shares["forward"] == pytest.approx((3 + 12) / 30)
    assert phases["b"][1] == pytest.approx(300)       # no whole run: the partial one is all there is


def test_the_frontier_keeps_only_unbeaten_points_and_names_its_ranges():
    points = [point("a", "1ep", 10, 70), point("a", "2ep", 20, 80), point("a", "4ep", 40, 84),
              point("b", "1ep", 15, 75), point("b", "2ep", 30, 79), point("b", "4ep", 60, 90),
              point("c", "1ep", 5, 50), {**point("c", "2ep", 1, 99), "error": "exit 1: boom", "val_top1": None}]
    frontier = tc.pareto_frontier(tc.curves(points))
    assert [(p.recipe, p.duration) for p in frontier] == [("c", "1ep"), ("a", "1ep"), ("b", "1ep"), ("a", "2ep"),
                                                          ("a", "4ep"), ("b", "4ep")]
    assert tc.frontier_ranges(frontier) == [("c", 5, 10), ("a", 10, 15), ("b", 15, 20), ("a", 20, 60), ("b", 60, None)]
    report = tc.report_markdown([{**p, "hardware": {"cpu_model": "x", "cpu_cores": 2}} for p in points], "a")
    assert "c 2ep seed 0: exit 1: boom" in report


def test_ablation_variants_and_effects(tmp_path):
    variants, methods = tradeoff.ablation_recipes("fashion_mild", "fashion_baseline", tmp_path, pairs=True)
    mild = load_recipe(tradeoff.recipe_path("fashion_mild"))
    assert methods == list(mild["algorithms"]) and len(methods) >= 2
    by_name = {name: load_recipe(path) for name, path in variants}
    first, second = methods[:2]
    assert list(by_name[f"fashion_mild-no-{first}"]["algorithms"]) == methods[1:]
    assert by_name[f"fashion_baseline+{first}"]["algorithms"] == {first: mild["algorithms"][first]}
    assert set(by_name[f"fashion_baseline+{first}+{second}"]["algorithms"]) == {first, second}
    assert len(variants) == 2 + 2 * len(methods) + len(methods) * (len(methods) - 1) // 2

    own = tmp_path / "mine" / "fast.yaml"            # a recipe given as a path: named by its file, variants in OUT
    own.parent.mkdir()
    own.write_text(f"base: {tradeoff.recipe_path('fashion_mild')}\n")
    variants, _ = tradeoff.ablation_recipes(str(own), "fashion_baseline", tmp_path / "out", pairs=False)
    assert [name for name, _ in variants][:3] == ["fast", "fashion_baseline", f"fast-no-{first}"]
    assert all(path.parent == tmp_path / "out" / "recipes" for _, path in variants[2:])
    assert sorted(path.name for path in own.parent.iterdir()) == ["fast.yaml"]

    points = [point("r", "1ep", 60, 90), point("base", "1ep", 100, 85), point("r-no-x", "1ep", 70, 88),
              point("r-no-y", "1ep", 90, 89), point("base+x", "1ep", 80, 86), point("base+y", "1ep", 110, 87),
              point("base+x+y", "1ep", 95, 90), point("r", "2ep", 120, 91)]     # 2ep: the recipe's curve only
    effects, interactions = tc.ablation_effects(tc.curves(points), "r", "base", ["x", "y"])
    x = next(e for e in effects if e.method == "x")
    assert (x.in_recipe_top1, x.in_recipe_seconds, x.alone_top1, x.alone_seconds) == (2, -10, 1, -20)
    assert interactions == [("1ep", "x", "y", pytest.approx(5 - 1 - 2))]
    assert {e.duration for e in effects} == {"1ep"}


def test_the_time_left_comes_from_finished_points():
    rows = [{**point("a", "1ep", 9, 1), "command_wall_s": 10}, {**point("a", "2ep", 18, 1), "command_wall_s": 20}]
    remaining = [tradeoff.Point("a", None, "4ep", 0), tradeoff.Point("b", None, "2ep", 0)]
    assert tradeoff.seconds_left(remaining, rows) == pytest.approx(40 + 20)
    assert tradeoff.seconds_left([tradeoff.Point("a", None, "100ba", 0)], rows) is None


@pytest.mark.parametrize("arguments, message", [
    (["--recipes", "fashion_nosuch", "--durations", "1ep"], "unknown recipe 'fashion_nosuch'"),
    (["--recipes", "fashion_baseline", "--durations", "1ep,0.5dur"], "--durations: bad duration '0.5dur'"),
    (["--recipes", "fashion_baseline", "--durations", "1ep", "seed=3"], "'seed=3'"),
    (["--recipes", "fashion_baseline", "--durations", "1ep", "optim.nosuch=1"], "recipe fashion_baseline:"),
    (["--durations", "1ep"], "give --recipes or --ablate"),
])
def test_bad_arguments_are_one_line(arguments, message, tmp_path, capsys):
    assert tradeoff.main([*arguments, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_recipe_keeps_its_whole_name_dots_included():
    assert tradeoff.recipe_name("runs/tune/baseline_lr0.8.yaml") == "baseline_lr0.8"
    assert tradeoff.recipe_name("baseline_lr0.8") == "baseline_lr0.8"
    assert tradeoff.recipe_name("fashion_mild") == "fashion_mild"


def test_the_default_baseline_is_a_baseline_recipe_of_this_run_or_of_the_points_already_there(tmp_path):
    assert tradeoff.default_baseline(["fashion_mild", "fashion_baseline"], tmp_path) == "fashion_baseline"
    assert tradeoff.default_baseline(["fashion_hot"], tmp_path) == "fashion_hot"      # nothing else to go by
    (tmp_path / "points.jsonl").write_text("".join(json.dumps(point(recipe, "4ep", 300.0, 91.0)) + "\n"
                                                   for recipe in ("fashion_mild", "fashion_baseline")))
    assert tradeoff.default_baseline(["fashion_hot"], tmp_path) == "fashion_baseline"  # resumed for one recipe
