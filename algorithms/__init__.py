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
    "scale_schedule": ("algorithms.scale_schedule", "ScaleSchedule"),
    "bce": ("algorithms.bce", "BCELogitBias"),
    "blurpool": ("algorithms.blurpool", "BlurPool"),
    "channels_last": ("algorithms.channels_last", "ChannelsLast"),
    "stochastic_depth": ("algorithms.stochastic_depth", "StochasticDepth"),
    "label_smoothing": ("algorithms.label_smoothing", "LabelSmoothing"),
    "progressive_resizing": ("algorithms.progressive_resizing", "ProgressiveResizing"),
    "colout": ("algorithms.colout", "ColOut"),
    "randaugment": ("algorithms.randaugment", "RandAugment"),
    "fixres": ("algorithms.fixres", "FixRes"),
    "mixup": ("algorithms.mixup", "MixUp"),
    "cutmix": ("algorithms.cutmix", "CutMix"),
    "cutout": ("algorithms.cutout", "CutOut"),
    "selective_backprop": ("algorithms.selective_backprop", "SelectiveBackprop"),
    "sam": ("algorithms.sam", "SAM"),
    "ema": ("algorithms.ema", "EMA"),
    "lookahead": ("algorithms.lookahead", "Lookahead"),
    "muon": ("algorithms.muon", "Muon"),
    "whitening_init": ("algorithms.whitening_init", "WhiteningInit"),
    "dirac_init": ("algorithms.dirac_init", "DiracInit"),
    "batchnorm_settings": ("algorithms.batchnorm_settings", "BatchNormSettings"),
    "flip_tta": ("algorithms.flip_tta", "FlipTTA"),
}

# pairs that work against each other, and why (MosaicML's method cards and recipes)
CLASHES = {
    frozenset({"mixup", "label_smoothing"}): "MixUp already softens the targets; MosaicML found the two together "
                                             "hurt accuracy on short runs",
    frozenset({"cutmix", "label_smoothing"}): "CutMix already softens the targets; with label smoothing on a short "
                                              "run the targets get too soft",
    frozenset({"mixup", "cutmix"}): "both mix every batch, so each batch gets both; recipes pick one",
    frozenset({"selective_backprop", "mixup"}): "Selective Backprop ranks mixed samples, whose losses are not "
                                                "comparable to clean ones",
}


def check_algorithm_names(settings: Mapping[str, Mapping]) -> None:
    unknown = [name for name in settings if name not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown algorithm {unknown[0]!r}; known: {', '.join(sorted(REGISTRY)) or 'none yet'}")


def clashes(names, label_smoothing: float = 0.0) -> list[str]:
    """Warnings for combinations in `names` (recipe names) known to clash; the loss's own
    label smoothing counts as `label_smoothing`."""
    present = set(names) | ({"label_smoothing"} if label_smoothing else set())
    return [f"{' + '.join(sorted(pair))}: {why}" for pair, why in CLASHES.items() if pair <= present]


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


__all__ = ["Algorithm", "Event", "REGISTRY", "build_algorithms", "check_algorithm_names", "clashes"]
