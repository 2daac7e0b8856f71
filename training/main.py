"""The entry point: `torchrun --nproc_per_node=N training/main.py --config RECIPE.yaml [key=value ...]`.

Also runs as plain `python training/main.py ...` (one process). A bad config or dataset is
one line on stderr and exit code 2; rank 0 alone prints it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from algorithms import build_algorithms  # noqa: E402
from pipeline.datasets import DatasetError  # noqa: E402
from training.config import ConfigError, load_config  # noqa: E402
from training.distributed import close_world, init_world  # noqa: E402
from training.trainer import Trainer  # noqa: E402

USAGE_ERROR = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. algorithms/recipes/fashion_baseline.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=0.2")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    is_main = int(os.environ.get("RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.overrides)
        algorithms = algorithms_from_config(config.algorithms)
        world = init_world(config.device)
        try:
            Trainer(config, world, algorithms).fit()
        finally:
            close_world()
    except (ConfigError, DatasetError) as error:
        if is_main:
            print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def algorithms_from_config(settings: dict):
    try:
        return build_algorithms(settings)
    except ValueError as error:
        raise ConfigError(f"config key 'algorithms': {error}") from None


if __name__ == "__main__":
    sys.exit(main())
