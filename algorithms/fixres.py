"""FixRes: evaluate at a higher resolution than the training crops (Touvron et al. 2019,
"Fixing the train-test resolution discrepancy"; as ffcv-imagenet does).

What: the val loader is built at `eval_resolution` (and, if given, with the center crop's
share of the shorter side `eval_crop_ratio`), which INIT records in the run's config.
Random-resized crops make objects look larger in training than a center crop at the same size does at test time; testing at a higher
resolution brings their apparent sizes back in line. This hook is the test-time half of
FixRes only; the paper also fine-tunes the classifier and BN at the test resolution.
When: runs that train at low or progressively growing resolutions (ffcv-imagenet trains
ResNet-50 at 160-192 px and evaluates at 256 px); in the paper a ResNet-50 trained at
224 px scores higher when tested at larger sizes than 224.
Cost: evaluation only, growing with the pixel count ((256/224)^2 = 1.3x at 256 px).
Settings: eval_resolution=256 (ffcv-imagenet's validation.resolution); eval_crop_ratio=None
keeps data.val_crop_ratio (default 224/256, ffcv's and timm's center crop).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from algorithms.base import Algorithm, Event, RunPlan
from pipeline.spec import LoaderSpec


def fixres_spec(val_spec: LoaderSpec, eval_resolution: int, eval_crop_ratio: Optional[float] = None) -> LoaderSpec:
    """A val loader spec that evaluates at `eval_resolution` (and `eval_crop_ratio`, if given)."""
    crop = {} if eval_crop_ratio is None else {"val_crop_ratio": eval_crop_ratio}
    return dataclasses.replace(val_spec, val_resolution=eval_resolution, **crop)


class FixRes(Algorithm):
    def __init__(self, eval_resolution: int = 256, eval_crop_ratio: Optional[float] = None):
        if eval_resolution < 8 or (eval_crop_ratio is not None and not 0 < eval_crop_ratio <= 1):
            raise ValueError(f"FixRes needs eval_resolution >= 8 and 0 < eval_crop_ratio <= 1, "
                             f"got {eval_resolution}, {eval_crop_ratio}")
        self.eval_resolution, self.eval_crop_ratio = eval_resolution, eval_crop_ratio

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        return spec if spec.train else fixres_spec(spec, self.eval_resolution, self.eval_crop_ratio)

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        # Recorded in the config too, so the run's saved config says what evaluation used.
        state.config.data.val_resolution = self.eval_resolution
        if self.eval_crop_ratio is not None:
            state.config.data.val_crop_ratio = self.eval_crop_ratio
