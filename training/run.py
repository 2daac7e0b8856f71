"""A run from its config, built as training/main.py builds it: the algorithms the config names,
this process's place among the ranks, the Trainer. The tools that build a run to measure or
project it (tools/measuring.py, tools/project_time.py) build it here too, so they see the run
that training would train. A config that cannot run is a ConfigError, which these commands
print as one line and exit with USAGE_ERROR.
"""
from __future__ import annotations

from algorithms import build_algorithms
from algorithms.base import Algorithm
from training.config import Config, ConfigError
from training.distributed import World, init_world
from training.trainer import Trainer

USAGE_ERROR = 2         # the exit code of a bad config, dataset or run directory


def algorithms_from_config(settings: dict) -> list[Algorithm]:
    """The algorithms of the config's `algorithms` section, in order; a bad one is a ConfigError."""
    try:
        return build_algorithms(settings)
    except ValueError as error:
        raise ConfigError(f"config key 'algorithms': {error}") from None


def build_run(config: Config, world: World | None = None) -> Trainer:
    """The Trainer of `config` (loaders and model built, INIT fired; `fit()` trains it, `train_step()`
    takes one step), in `world`, else this process's: init_world joins torchrun's process group.
    The algorithms are built first, so a wrong one is refused before anything else starts."""
    algorithms = algorithms_from_config(config.algorithms)
    return Trainer(config, world or init_world(config.device), algorithms)
