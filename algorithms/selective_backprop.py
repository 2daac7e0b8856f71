"""Selective Backprop (Jiang et al. 2019, arXiv:1910.00762; MosaicML Composer's `SelectiveBackprop`).

What: on chosen steps, an extra no-grad forward pass scores every sample by its loss, and the
step then trains on a subset that favours the hard (high-loss) ones. Selection is Composer's:
rank the losses, give the sample at loss percentile p the weight p^(1/keep - 1), and draw the
subset without replacement with those weights (so easy samples are still kept sometimes).
When it helps: cuts the forward+backward work of the chosen steps; Composer reports ~10% less
training time for ImageNet/CIFAR ResNets at little accuracy cost.
Cost: the scoring pass (about a third of a step; `scale_factor` < 1 makes it cheaper), and the
extra forward updates BatchNorm running statistics, as in Composer (the model is in train mode).
Hyperparameters (Composer's defaults and advice):
  start=0.5, end=0.9   active while the run's progress (step / total_steps) is in [start, end)
  keep=0.5             share of the batch kept (rounded to a multiple of grad_accum)
  interrupt=2          every `interrupt`-th step trains on the full batch (2: alternate); 0: never
  scale_factor=1.0     resolution scale of the scoring pass (Composer suggests 0.5 for images)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.base import Algorithm, Event


def select_hard_examples(images: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, keep: float = 0.5,
                         generator: torch.Generator | None = None, multiple_of: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The subset of (images, targets) to train on, in batch order: `keep` x N samples (to the
    nearest multiple of `multiple_of`, at least one multiple), drawn without replacement with
    weight percentile^(1/keep - 1) of their per-sample `losses` (Composer's scheme)."""
    n = losses.shape[0]
    count = min(n, max(multiple_of, round(keep * n / multiple_of) * multiple_of))
    percentiles = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    weights = percentiles ** (1.0 / keep - 1.0)                     # by rank, lowest loss first
    generator_device = generator.device if generator is not None else "cpu"
    drawn = torch.multinomial(weights.to(generator_device), count, replacement=False, generator=generator)
    ranked = torch.argsort(losses.detach().float())                 # sample indices, lowest loss first
    chosen = torch.sort(ranked[drawn.to(losses.device)]).values
    return images[chosen.to(images.device)], targets[chosen.to(targets.device)]


def per_sample_losses(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor,
                      scale_factor: float = 1.0) -> torch.Tensor:
    """Cross-entropy per sample (targets: class indices or probabilities), without gradients;
    the images scaled by `scale_factor` first. Runs under the caller's autocast."""
    with torch.no_grad():
        if scale_factor != 1:
            images = F.interpolate(images, scale_factor=scale_factor, mode="bilinear", align_corners=False,
                                   recompute_scale_factor=False)
        return F.cross_entropy(model(images).float(), targets, reduction="none")


class SelectiveBackprop(Algorithm):
    """Shrinks the chosen steps' batches at AFTER_DATALOADER (before the micro-batch split)."""

    def __init__(self, start: float = 0.5, end: float = 0.9, keep: float = 0.5, interrupt: int = 2,
                 scale_factor: float = 1.0):
        if not 0 <= start <= end <= 1 or not 0 < keep <= 1 or interrupt < 0 or not 0 < scale_factor <= 1:
            raise ValueError(f"need 0 <= start <= end <= 1, 0 < keep <= 1, interrupt >= 0 and 0 < scale_factor <= 1; "
                             f"got start={start}, end={end}, keep={keep}, interrupt={interrupt}, "
                             f"scale_factor={scale_factor}")
        self.start, self.end, self.keep, self.interrupt, self.scale_factor = start, end, keep, interrupt, scale_factor

    def match(self, event: Event, state) -> bool:
        if event != Event.AFTER_DATALOADER or self.keep == 1:
            return False
        progress = state.step / state.total_steps
        full_batch_step = self.interrupt > 0 and (state.step + 1) % self.interrupt == 0
        return self.start <= progress < self.end and not full_batch_step

    def apply(self, event: Event, state) -> None:
        with state.autocast():
            losses = per_sample_losses(state.model, state.images, state.targets, self.scale_factor)
        state.images, state.targets = select_hard_examples(state.images, state.targets, losses, self.keep,
                                                           multiple_of=state.config.grad_accum)
