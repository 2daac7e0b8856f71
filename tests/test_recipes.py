"""Every recipe in algorithms/recipes runs: 2 epochs (3 steps each) on the small fashion sample
under a real `torchrun --nproc_per_node=2` (gloo, CPU), with every algorithm it names; those
test_tradeoff.py's sweep runs, there. One ResNet-50 recipe trains ResNet-50 itself, the others
their settings on the small ResNet."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_tradeoff import SWEPT_RECIPES
from training.typed_config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# test_tradeoff.py's sweep runs its recipes the same way (2 processes, every algorithm), twice each
RECIPES = sorted(path for path in (ROOT / "algorithms" / "recipes").glob("*.yaml") if path.stem not in SWEPT_RECIPES)


# ResNet-50 itself trains in the recipe whose algorithms hold every other ResNet-50 recipe's (checked
# below); the others run their own settings and schedules on the small ResNet. On a 2-core CPU a
# ResNet-50 step costs about half a second whatever the side (its 25M parameters): 8-10 s a recipe.
FULL_RESNET50 = "resnet50_hot"


def overrides_for(recipe: Path, data: Path) -> list[str]:
    on_resnet50 = recipe.stem == FULL_RESNET50
    return ["max_duration=2ep", "data.backend=folder", f"data.path={data}", "data.batch_size=16",
            "data.num_workers=1", "log.progress=false", "log.tensorboard=false", "precision=fp32",
            "checkpoint.interval=2ep", "eval_interval=2ep",
            *(["data.resolution=32", "data.val_resolution=32"] if on_resnet50 else     # ResNet-50 on CPU: keep it small
              ["model.name=small_resnet", "model.width=4", "model.blocks_per_stage=1"])]


def test_the_recipe_trained_on_resnet50_holds_the_algorithms_of_every_other_resnet50_recipe():
    full = set(load_recipe(ROOT / "algorithms" / "recipes" / f"{FULL_RESNET50}.yaml").get("algorithms", {}))
    for path in RECIPES:
        recipe = load_recipe(path)
        if recipe.get("model", {}).get("name") == "resnet50":
            assert set(recipe.get("algorithms", {})) <= full, \
                f"{path.stem} has algorithms {FULL_RESNET50} lacks: train it on ResNet-50 in the test below"


@pytest.mark.timeout(600)
def test_every_recipe_runs_two_epochs_under_torchrun(converted_sets, tmp_path):
    """One launch trains them all in turn (tests/recipes_run.py): each run is its own Trainer, as
    training/main.py builds it, on the same two ranks."""
    overrides = {recipe.stem: overrides_for(recipe, converted_sets["fashion"]["folder"]) for recipe in RECIPES}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "tests" / "recipes_run.py"), str(tmp_path), json.dumps(overrides),
                             *map(str, RECIPES)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for recipe in RECIPES:
        summary = json.loads((tmp_path / recipe.stem / "summary.json").read_text())
        assert summary["world_size"] == 2 and math.isfinite(summary["last_val_top1"]), recipe.stem
        saved = yaml.safe_load((tmp_path / recipe.stem / "config.yaml").read_text())
        assert list(saved["algorithms"]) == list(load_recipe(recipe).get("algorithms", {})), recipe.stem


def _leaves(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_recipes_hold_only_what_they_change_from_their_base():
    """Every recipe but the baselines names a base, and sets no key to the value its base already has."""
    for recipe in sorted((ROOT / "algorithms" / "recipes").glob("*.yaml")):
        own = yaml.safe_load(recipe.read_text())
        if recipe.stem.endswith("_baseline"):
            assert "base" not in own, recipe.name
            continue
        assert "base" in own, f"{recipe.name} names no base"
        inherited = dict(_leaves(load_recipe(recipe.parent / f"{own.pop('base')}.yaml")))
        repeated = [key for key, value in _leaves(own) if key in inherited and inherited[key] == value]
        assert not repeated, f"{recipe.name} repeats its base's {repeated}"
