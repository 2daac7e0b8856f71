"""FixRes: evaluate at a higher resolution than the training crops (Touvron et al. 2019,
"Fixing the train-test resolution discrepancy"; as ffcv-imagenet does).

What: at INIT the val loader is set to `eval_resolution` (and, if given, the center crop's
share of the shorter side, `eval_crop_ratio`). Random-resized crops make objects look larger
in training than a center crop at the same size does at test time; testing at a higher
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

from typing import Optional

from algorithms.base import Algorithm, Event


def fixres_loader(val_loader, eval_resolution: int, eval_crop_ratio: Optional[float] = None):
    """Set a val loader (before its first iteration) to evaluate at `eval_resolution`; returns it."""
    val_loader.reconfigure(val_resolution=eval_resolution, val_crop_ratio=eval_crop_ratio)
    return val_loader


class FixRes(Algorithm):
    def __init__(self, eval_resolution: int = 256, eval_crop_ratio: Optional[float] = None):
        if eval_resolution < 8 or (eval_crop_ratio is not None and not 0 < eval_crop_ratio <= 1):
            raise ValueError(f"FixRes needs eval_resolution >= 8 and 0 < eval_crop_ratio <= 1, "
                             f"got {eval_resolution}, {eval_crop_ratio}")
        self.eval_resolution, self.eval_crop_ratio = eval_resolution, eval_crop_ratio

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        fixres_loader(state.val_loader, self.eval_resolution, self.eval_crop_ratio)
        # Recorded in the config too, so the run's saved config says what evaluation used.
        state.config.data.val_resolution = self.eval_resolution
        if self.eval_crop_ratio is not None:
            state.config.data.val_crop_ratio = self.eval_crop_ratio
