"""tools/project_time.py: the recipe's schedule read from the trainer, the interpolation
between measured sides, the projection against figures worked out here by hand, a real
diagnose JSON projected, and one-line errors for bad measurements."""
from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT, run_tool_here

import project_time
from project_time import ConfigError, measured_rates, project, recipe_schedule, seconds_per_image

RECIPES = ROOT / "algorithms" / "recipes"
MILD = str(RECIPES / "resnet50_mild.yaml")
MILD_ALGORITHMS = ["scale_schedule", "bce", "blurpool", "channels_last", "label_smoothing", "progressive_resizing",
                   "ema"]


def measurement(path, side: int, rate: float, **changes):
    figures = {"side": side, "together_img_per_s": rate, "model": "resnet50", "algorithms": MILD_ALGORITHMS,
               "batch_size": 256, **changes}
    path.write_text(json.dumps(figures))
    return path


def test_mild_schedule_is_the_trainers_ramp_and_a_scaled_run_ends_in_a_partial_epoch():
    mild = recipe_schedule(MILD, [], 8, project_time.IMAGENET_TRAIN, project_time.IMAGENET_VAL)
    assert mild["epochs"] == 36 and len(mild["sides"]) == 36 and mild["evaluations"] == 36
    # 0.4 x 36 = 14.4 epochs at half of 176; the last 0.2 x 36 = 7.2 at full size; a rising ramp between
    assert mild["sides"][:15] == [88] * 15 and mild["sides"][-8:] == [176] * 8
    assert mild["sides"] == sorted(mild["sides"]) and all(side % 4 == 0 for side in mild["sides"])
    longer = recipe_schedule(MILD, ["algorithms.scale_schedule.ratio=0.41"], 8, 1_281_167, 50_000)
    assert abs(sum(longer["shares"]) - 36.9) < 0.01 and abs(longer["shares"][-1] - 0.9) < 0.01
    baseline = recipe_schedule(str(RECIPES / "resnet50_baseline.yaml"), [], 8, 1_281_167, 50_000)
    assert baseline["sides"] == [224] * 90 and baseline["algorithms"] == []


def test_interpolation_is_linear_in_pixels_and_passes_through_the_measured_sides():
    rates = {88: 8000.0, 176: 4000.0}
    assert seconds_per_image(176, rates) == 1 / 4000 and seconds_per_image(88, rates) == 1 / 8000
    between = 1 / 8000 + (1 / 4000 - 1 / 8000) * (132 ** 2 - 88 ** 2) / (176 ** 2 - 88 ** 2)
    assert seconds_per_image(132, rates) == pytest.approx(between)
    beyond = 1 / 8000 + (1 / 4000 - 1 / 8000) * (224 ** 2 - 88 ** 2) / (176 ** 2 - 88 ** 2)
    assert seconds_per_image(224, rates) == pytest.approx(beyond)
    with pytest.raises(ConfigError, match="only side 176 is measured"):
        seconds_per_image(132, {176: 4000.0})


def test_projection_matches_the_sum_worked_out_by_hand(tmp_path):
    schedule = recipe_schedule(MILD, [], 8, 1_281_167, 50_000)
    rates = measured_rates([measurement(tmp_path / "a.json", 88, 8000.0),
                            measurement(tmp_path / "b.json", 176, 4000.0)], schedule)
    result = project(schedule, rates, 8, 0.9, 10_000.0)
    by_hand = sum(1_281_167 * seconds_per_image(side, rates) for side in schedule["sides"]) / (8 * 0.9) / 60
    assert result["train_minutes"] == pytest.approx(by_hand)
    assert result["eval_minutes"] == pytest.approx(36 * 50_000 / (8 * 10_000) / 60)
    rows = {row["side"]: row for row in result["rows"]}
    assert rows[88]["epochs"] == 15 and rows[88]["measured"] and not rows[132]["measured"]
    assert rows[176]["minutes"] == pytest.approx(8 * 1_281_167 / (8 * 4000 * 0.9) / 60)
    assert project(schedule, rates, 8, 1.0, None)["eval_minutes"] is None
    as_training = {"model_img_per_s": 9000.0, "together_img_per_s": 8500.0}   # diagnose's figures on CUDA
    assert measured_rates([measurement(tmp_path / "c.json", 88, 8000.0, free_running=as_training)],
                          schedule) == {88: 8500.0}


def test_a_real_diagnose_json_is_projected_and_the_figures_written(sample_sets, tmp_path, capsys, one_torch_thread):
    """The contract with tools/diagnose.py --json: a tiny fashion run on 2 cores, then its projection."""
    tiny = ["data.backend=folder", f"data.path={sample_sets / 'fashion'}", "data.batch_size=16",
            "data.num_workers=1", "model.width=4", "model.blocks_per_stage=1", "precision=fp32",
            "max_duration=4ep"]              # set here: the recipe's own length may change
    recipe = RECIPES / "fashion_baseline.yaml"
    measured = tmp_path / "diagnose.json"
    diagnosed = run_tool_here(capsys, "diagnose.py", "--config", recipe, *tiny, "--steps", "4", "--warmup", "1",
                              "--json", measured)
    assert diagnosed.returncode == 0, diagnosed.stderr[-2000:]
    rate = json.loads(measured.read_text())["together_img_per_s"]
    out = tmp_path / "projection.json"
    result = run_tool_here(capsys, "project_time.py", "--config", recipe, *tiny, "--measured", measured, "--gpus", "2",
                           "--train-images", "60000", "--val-images", "10000", "--json", out)
    assert result.returncode == 0, result.stderr
    saved = json.loads(out.read_text())
    assert saved["epochs"] == 4 and [row["side"] for row in saved["rows"]] == [28]
    assert saved["train_minutes"] == pytest.approx(4 * 60000 / (2 * rate) / 60)
    assert saved["eval_minutes"] is None and "eval not counted" in result.stdout
    printed = re.search(r"^train ([\d.]+) min;", result.stdout, re.M)
    assert printed and float(printed[1]) == pytest.approx(saved["train_minutes"], abs=0.05)
    assert result.stdout.count("\nhow: ") == 1 and "MLPerf Training v4.0" in result.stdout


@pytest.mark.parametrize("case, expected", [
    ("missing", "missing.json: cannot read it"),
    ("not_json", "not_json.json: not JSON"),
    ("no_side", "no_side.json: no key 'side'; write it with tools/diagnose.py --json"),
    ("other_recipe", "other_recipe.json: measured with algorithms []"),
    ("same_side", "same_side.json: side 176 is measured in"),
    ("one_side", "only side 176 is measured: measure two or more sides"),
])
def test_bad_measurements_are_one_line_and_exit_2(tmp_path, case, expected, capsys):
    good = measurement(tmp_path / "good.json", 176, 4000.0)
    path = tmp_path / f"{case}.json"
    if case == "not_json":
        path.write_text("{side: 1")
    elif case == "no_side":
        path.write_text(json.dumps({"together_img_per_s": 1.0}))
    elif case == "other_recipe":
        measurement(path, 88, 8000.0, algorithms=[])
    elif case == "same_side":
        measurement(path, 176, 3000.0)
    files = [good] if case == "one_side" else [good, path]
    code = project_time.main(["--config", MILD, "--measured", *map(str, files)])   # in this process: no run starts
    printed = capsys.readouterr()
    assert code == 2 and printed.out == ""
    assert len(printed.err.strip().splitlines()) == 1 and expected in printed.err, printed.err
