"""RandAugment: `depth` random image operations per training sample, all at one `severity`.

What: each sample gets `depth` operations drawn from 14 (translations, shears, rotation,
brightness, contrast, colour, sharpness, posterize, solarize, equalize, auto-contrast,
identity), each at the strength `severity` (0..10) with a random sign. The pure function is
`pipeline.transforms.randaugment.randaugment_image` (one PIL image); the loader applies it right after
the crop, at the training resolution, in its workers (folder, webdataset) or as DALI's own
`rand_augment` (dali), with the same operations and magnitude ranges. FFCV cannot run it:
asking for it there is a config error.
When it helps: long runs of large models, where overfitting limits accuracy; MosaicML's hot
ResNet-50 recipe uses it. Costs: CPU time in the loader (on a CPU-bound loader it slows
every step) and accuracy on short runs, where the extra variety is never learned.
Defaults (Composer): depth 2, severity 9. One difference from Composer: its primitives draw
each operation's strength uniformly from [0.1, severity]; here, as in the paper and in DALI,
every operation uses the severity itself, so severity 9 is stronger here than in Composer.
"""
from __future__ import annotations

import dataclasses

from algorithms.base import Algorithm, RunPlan
from pipeline.transforms.randaugment import check_randaugment, randaugment_image  # noqa: F401  (the pure function)
from pipeline.spec import LoaderSpec


class RandAugment(Algorithm):
    def __init__(self, depth: int = 2, severity: int = 9):
        check_randaugment(depth, severity)
        self.depth, self.severity = depth, severity

    def loader_spec(self, spec: LoaderSpec, plan: RunPlan) -> LoaderSpec:
        return dataclasses.replace(spec, randaugment=(self.depth, self.severity)) if spec.train else spec
