"""SAM: the perturbation's size, one step against a by-hand SAM step, and the hook's second
pass in a real run (every step or every other step)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from algorithms.base import Event
from algorithms.sam import SAM, sam_gradient, sam_perturbation
from conftest import tiny_trainer


def test_perturbation_has_norm_rho_along_the_gradient():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    params[0].grad, params[1].grad = torch.randn(3, 4), torch.randn(5)
    e = sam_perturbation(params, rho=0.3)
    norm = torch.sqrt(sum((t ** 2).sum() for t in e))
    torch.testing.assert_close(norm, torch.tensor(0.3))
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
    for t, p in zip(e, params):                            # along the gradient
        torch.testing.assert_close(t, p.grad * 0.3 / grad_norm)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params)   # nothing applied


def test_step_matches_a_manual_sam_step_on_a_linear_model():
    torch.manual_seed(0)
    x, y = torch.randn(16, 3), torch.randint(2, (16,))
    model = torch.nn.Linear(3, 2)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    rho, lr = 0.5, 0.1

    def loss_of(w, b):
        return F.cross_entropy(x @ w.T + b, y)

    # by hand: g at w, climb to w + rho g/||g||, step with the gradient there
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    gw, gb = torch.autograd.grad(loss_of(w, b), (w, b))
    scale = rho / torch.sqrt((gw ** 2).sum() + (gb ** 2).sum())
    w2, b2 = (w0 + scale * gw).requires_grad_(), (b0 + scale * gb).requires_grad_()
    hw, hb = torch.autograd.grad(loss_of(w2, b2), (w2, b2))
    expected_w, expected_b = w0 - lr * hw, b0 - lr * hb

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    F.cross_entropy(model(x), y).backward()
    sam_gradient(list(model.parameters()), lambda: F.cross_entropy(model(x), y), rho)
    assert torch.equal(model.weight, w0) and torch.equal(model.bias, b0)   # weights restored exactly
    optimizer.step()
    torch.testing.assert_close(model.weight, expected_w)
    torch.testing.assert_close(model.bias, expected_b)


@pytest.mark.parametrize("interval, expected", [(1, 8), (2, 6), (3, 5)])
def test_sam_steps_take_a_second_forward_pass(tmp_path, interval, expected):
    trainer = tiny_trainer(tmp_path, [SAM(rho=0.05, interval=interval)], "max_duration=1ep")
    forwards = []
    trainer.state.model.register_forward_hook(lambda module, args, out: forwards.append(module.training))
    trainer.fit()
    assert trainer.state.step == 4 and sum(forwards) == expected   # training-mode forwards only


def test_rho_zero_trains_the_same_weights_as_plain_sgd(tmp_path):
    plain = tiny_trainer(tmp_path / "plain", [])
    plain.fit()
    sam = tiny_trainer(tmp_path / "sam", [SAM(rho=0.0)])
    sam.fit()
    for (name, p), q in zip(plain.state.model.named_parameters(), sam.state.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_fp16_with_a_grad_scaler_is_refused():
    state = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=True), config=SimpleNamespace(grad_accum=1))
    with pytest.raises(ValueError, match="fp16"):
        SAM().apply(Event.FIT_START, state)
