"""ProgressiveResizing: train at low resolution first, at full resolution at the end.

What: the train images' side follows MosaicML's ramp: `initial_scale` of the full side for
the first `delay_fraction` of training, rising linearly to full size at the start of the
last `finetune_fraction`, rounded to a multiple of `size_increment`.
Two variants, so they can be compared:
- `mode="loader"` (default): the loader decodes and crops straight to the scheduled size
  (pipeline/schedules.ComposerRamp, at epoch granularity: each epoch at the ramp's value at
  its middle, and the last one at full size when there is a finetune, so a 1-epoch run has
  nothing to ramp). Decode and augmentation get cheaper too, which is where a data-bound run gains.
- `mode="batch"`: Composer's form: full-size batches are resized on the device after loading
  (bilinear, antialiased), at step granularity. Only the model's work shrinks.
When it helps: model-bound runs of CNNs (cost falls roughly with the pixel count); the
finetune phase at full size recovers the train/test resolution gap (see also FixRes).
Costs: accuracy at equal epochs, for speed; batch-side wastes decode at full size.
Defaults (Composer, and the MosaicML ResNet-50 mild recipe): initial_scale 0.5,
delay_fraction 0.5 (mild: 0.4), finetune_fraction 0.2, size_increment 4.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from algorithms.base import Algorithm, Event, RunPlan
from pipeline.schedules import ComposerRamp, ConstantResolution, ramp_scale  # noqa: F401  (ramp_scale: the ramp)
from pipeline.spec import LoaderSpec


def resize_batch(images: torch.Tensor, side: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, C, side, side), antialiased bilinear, memory format kept."""
    if images.shape[-2:] == (side, side):
        return images
    resized = F.interpolate(images, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return resized.contiguous(memory_format=torch.channels_last) \
        if images.is_contiguous(memory_format=torch.channels_last) else resized


class ProgressiveResizing(Algorithm):
    def __init__(self, mode: str = "loader", initial_scale: float = 0.5, delay_fraction: float = 0.5,
                 finetune_fraction: float = 0.2, size_increment: int = 4):
        if mode not in ("loader", "batch"):
            raise ValueError(f"mode must be 'loader' or 'batch', got {mode!r}")
        self.mode, self.initial_scale, self.delay_fraction = mode, initial_scale, delay_fraction
        self.finetune_fraction, self.size_increment = finetune_fraction, size_increment
        self.ramp(64, 1)       # checks the settings

    def ramp(self, final_res: int, total_epochs: int) -> ComposerRamp:
        """This ramp up to `final_res` over a run of `total_epochs`, at epoch granularity."""
        return ComposerRamp(final_res, total_epochs, self.initial_scale, self.delay_fraction,
                            self.finetune_fraction, self.size_increment)

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        if self.mode != "loader" or not spec.train:
            return spec
        if not isinstance(spec.schedule, ConstantResolution):
            raise ValueError("progressive_resizing (loader mode) needs data.resolution to be an int, "
                             "not a schedule: it makes the schedule itself")
        return dataclasses.replace(spec, resolution=self.ramp(spec.schedule.resolution, plan.total_epochs))

    def match(self, event: Event, state) -> bool:
        return self.mode == "batch" and event == Event.AFTER_DATALOADER

    def apply(self, event: Event, state) -> None:
        ramp = self.ramp(state.images.shape[-1], 1)
        state.images = resize_batch(state.images, ramp.side_at(state.step / state.total_steps))
