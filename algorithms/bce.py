"""BCELogitBias: train with binary cross-entropy, the classifier's bias starting at the prior
(Wightman et al. 2021, "ResNet strikes back"; MosaicML's ResNet recipes).

What: at INIT the run's loss becomes BCE (one sigmoid per class, `loss.kind=bce`) and the
final linear layer's bias is set to -log(num_classes), so every sigmoid starts at
1/(num_classes + 1), about 1/num_classes, the prior of each one-vs-rest target. With a zero
bias the C sigmoids would start at 1/2 and the first steps would go to pushing all logits
down (a loss of C * log 2 instead of about log C + 1): the bias skips that phase.
When: BCE scores classes independently, which pairs well with MixUp/CutMix (targets that
are not one class); RSB's A1-A3 ResNet-50 procedures and MosaicML's ResNet recipes use it.
Cost: none. The loss is summed over classes and averaged over the batch
(`loss.bce_reduction=sum_over_classes`, Composer's `binary_cross_entropy_with_logits`), the
scale of cross-entropy, so learning rates tuned for CE still fit; `mean` would be C times
smaller. Label smoothing, if set in `loss.label_smoothing`, applies to the BCE targets.
Settings: none. Equivalent to `loss.kind=bce model.bce_bias_init=true` in a config; the
bias is set on `model.fc` (Composer's initializer "linear_log_constant_bias").
"""
from __future__ import annotations

import math

import torch
from torch import nn

from algorithms.base import Algorithm, Event


@torch.no_grad()
def init_logit_bias(linear: nn.Linear, num_classes: int | None = None) -> nn.Linear:
    """Set the classifier's bias to -log(num_classes) (default: its output count); returns it."""
    if linear.bias is None:
        raise ValueError("the classifier has no bias to initialise")
    linear.bias.fill_(-math.log(num_classes or linear.out_features))
    return linear


class BCELogitBias(Algorithm):
    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state) -> None:
        init_logit_bias(state.model.fc, state.num_classes)
        state.config.loss.kind = "bce"     # the trainer builds loss_fn from config.loss after INIT
