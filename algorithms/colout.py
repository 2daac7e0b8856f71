"""ColOut: drop a random share of each image's rows and columns, so every image gets smaller.

What: each sample loses its own random `p_row` of rows and `p_col` of columns (the same
counts for all, so the batch stays rectangular); the content is squeezed, not cropped.
Two variants:
- `mode="loader"` (default): the loader drops them right after decode and crop
  (pipeline/transforms/colout.py), so less data goes through the rest of the pipeline and to the device;
- `mode="batch"`: Composer's form, on the device after loading.
When it helps: model-bound training, like a lower resolution but with a regularising
effect; MosaicML's hot ResNet-50 recipe uses it. Costs: some accuracy at equal epochs.
Defaults (Composer): p_row = p_col = 0.15, batch-side; here loader-side by default.
"""
from __future__ import annotations

import dataclasses

from algorithms.base import Algorithm, Event, RunPlan
from pipeline.transforms.colout import colout_batch
from pipeline.spec import LoaderSpec


class ColOut(Algorithm):
    def __init__(self, p_row: float = 0.15, p_col: float = 0.15, mode: str = "loader"):
        if mode not in ("loader", "batch"):
            raise ValueError(f"mode must be 'loader' or 'batch', got {mode!r}")
        self.p_row, self.p_col, self.mode = p_row, p_col, mode

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        if self.mode != "loader" or not spec.train:
            return spec
        return dataclasses.replace(spec, colout=(self.p_row, self.p_col))

    def match(self, event: Event, state) -> bool:
        return self.mode == "batch" and event == Event.AFTER_DATALOADER

    def apply(self, event: Event, state) -> None:
        state.images = colout_batch(state.images, self.p_row, self.p_col)
