"""Speed-up methods: each a pure function usable alone and an `Algorithm` hook (algorithms/base.py).

A recipe names algorithms under `algorithms:` as `name: {setting: value}`, in the order the
engine runs them; `build_algorithms` turns that mapping into hook objects.
"""
from __future__ import annotations

import importlib
from typing import Mapping

from algorithms.base import Algorithm, Event

# name in a recipe -> (module, hook class); imported only when a recipe asks for it
REGISTRY: dict[str, tuple[str, str]] = {
}


def check_algorithm_names(settings: Mapping[str, Mapping]) -> None:
    unknown = [name for name in settings if name not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown algorithm {unknown[0]!r}; known: {', '.join(sorted(REGISTRY)) or 'none yet'}")


def build_algorithms(settings: Mapping[str, Mapping]) -> list[Algorithm]:
    """Hook objects for `name: {setting: value}` entries, in order; a bad setting is a ValueError."""
    check_algorithm_names(settings)
    algorithms = []
    for name, options in settings.items():
        module, class_name = REGISTRY[name]
        try:
            algorithms.append(getattr(importlib.import_module(module), class_name)(**(options or {})))
        except TypeError as error:
            raise ValueError(f"algorithm {name!r}: {error}") from None
    return algorithms


__all__ = ["Algorithm", "Event", "REGISTRY", "build_algorithms", "check_algorithm_names"]
