"""SAM: sharpness-aware minimization (Foret et al. 2021; MosaicML Composer's SAM).

What: before the optimizer steps, the weights move uphill by e = rho * g / (||g|| + eps), the
loss of the batch is computed and differentiated again there, and the weights move back:
the optimizer then steps with the gradient at w + e, which favours flat minima.
When: better generalization and robustness to label noise, mostly in longer runs;
`interval` > 1 does this only every interval-th step to buy back most of the cost.
Cost: a second forward and backward pass on each SAM step (about 2x that step's time), and
one copy of the weights plus one of the perturbation while it runs.
Differences from Composer: the first gradient is the one the loop already reduced over ranks
(Composer perturbs with each rank's own gradient), so e is the same on every rank; the second
backward goes through DDP and is reduced too. BN running stats see the batch twice, as in
Composer. Limits: the second pass uses `state.images`/`state.targets`, the last micro-batch,
so with grad_accum > 1 the sharpness-aware gradient comes from that micro-batch alone, and
algorithms acting on BEFORE_FORWARD..AFTER_LOSS do not run in it; fp16 (GradScaler) is
refused at FIT_START (use bf16 or fp32).
Settings: rho=0.05, epsilon=1e-12, interval=1 (Composer's defaults; rho from the paper).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from algorithms.base import Algorithm, Event

log = logging.getLogger("algorithms")


@torch.no_grad()
def sam_perturbation(params: Sequence[torch.Tensor], rho: float, epsilon: float = 1e-12) -> list[torch.Tensor]:
    """e = rho * g / (||g|| + epsilon) for each parameter's gradient g (all must have one), with
    ||g|| the norm over all of them together; nothing is applied."""
    grads = [p.grad for p in params]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return list(torch._foreach_mul(grads, rho / (norm + epsilon)))


def sam_gradient(params: Sequence[torch.Tensor], compute_loss: Callable[[], torch.Tensor], rho: float,
                 epsilon: float = 1e-12) -> torch.Tensor:
    """Replace the gradients in `params` (those that have one) by the gradient at w + e: perturb,
    run `compute_loss()` and backward, restore the weights exactly. Returns the perturbed loss."""
    params = [p for p in params if p.grad is not None]
    with torch.no_grad():
        weights = [p.detach().clone() for p in params]   # restore by copy: (w + e) - e is not always w
        torch._foreach_add_(params, sam_perturbation(params, rho, epsilon))
    for p in params:
        p.grad = None
    with torch.enable_grad():
        loss = compute_loss()
        loss.backward()
    with torch.no_grad():
        torch._foreach_copy_(params, weights)
    return loss.detach()


class SAM(Algorithm):
    def __init__(self, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1):
        if rho < 0 or epsilon < 0 or interval < 1:
            raise ValueError(f"SAM needs rho >= 0, epsilon >= 0 and interval >= 1, got {rho}, {epsilon}, {interval}")
        self.rho, self.epsilon, self.interval = rho, epsilon, interval

    def match(self, event: Event, state) -> bool:
        # state.step counts the steps already taken: steps interval, 2 * interval, ... (1-based) use SAM.
        return event == Event.FIT_START or (event == Event.BEFORE_OPTIMIZER_STEP
                                            and (state.step + 1) % self.interval == 0)

    def apply(self, event: Event, state) -> None:
        if event == Event.FIT_START:
            if state.scaler is not None and state.scaler.is_enabled():
                raise ValueError("SAM does not support fp16 with a GradScaler: its second backward pass would "
                                 "need its own scaling and inf checks; use precision=bf16 or fp32")
            if getattr(state.config, "grad_accum", 1) > 1:
                log.warning("SAM with grad_accum > 1 takes its second gradient on the last micro-batch only")
            return

        def perturbed_loss() -> torch.Tensor:
            with state.autocast():
                return state.loss_fn(state.train_model(state.images), state.targets)

        sam_gradient(list(state.model.parameters()), perturbed_loss, self.rho, self.epsilon)
