"""Several recipes trained one after another by the same torchrun ranks: `torchrun ... recipes_run.py
RUN_DIR OVERRIDES_JSON RECIPE...`, each recipe into RUN_DIR/<its name> with its overrides from the
JSON mapping (recipe name -> list of key=value). A launch and each rank's start cost more than a
tiny run itself; the runs share them and nothing else (each builds its own Trainer as training/main.py
does). A recipe that fails stops the launch with its name on stderr."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from training import main as entry
from training.config import load_config
from training.distributed import close_world
from training.run import build_run


def train_each(run_dir: Path, overrides: dict[str, list[str]], recipes: list[str]) -> None:
    for recipe in recipes:
        name = Path(recipe).stem
        print(f"recipe {name}", file=sys.stderr, flush=True)
        build_run(load_config(recipe, [*overrides[name], f"run_dir={run_dir / name}"])).fit()


if __name__ == "__main__":
    train_each(Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:])
    close_world()
    entry.exit_after_success()
