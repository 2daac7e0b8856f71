"""Stochastic depth: identity at eval, linear rates, dropped blocks pass their shortcut, unbiased
in expectation, survives deepcopy, the hook in a real run."""
from __future__ import annotations

import copy

import pytest
import torch

from algorithms.stochastic_depth import StochasticDepth, drop_path, residual_blocks, stochastic_depth_model
from training.models import build_model
from conftest import tiny_trainer


def small_model(**kwargs):
    torch.manual_seed(0)
    # no zero-init, so that every residual branch contributes
    return build_model("small_resnet", 10, zero_init_residual=False, width=8, **kwargs)


@pytest.mark.parametrize("mode", ["sample", "batch"])
def test_eval_output_is_exactly_the_plain_models(mode):
    model = small_model().eval()
    x = torch.randn(4, 3, 16, 16)
    before = model(x)
    stochastic_depth_model(model, drop_rate=0.5, mode=mode)
    assert torch.equal(model(x), before)
    model.train()
    torch.manual_seed(0)
    assert not torch.equal(model(x), model(x))       # BN batch statistics are the same; the drops differ


def test_rates_rise_linearly_with_depth_or_are_uniform():
    model = small_model(blocks_per_stage=2)           # 6 blocks
    rates = stochastic_depth_model(model, drop_rate=0.3)
    assert rates == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25, 0.3])
    assert [block.drop_rate for block in residual_blocks(model)] == rates
    assert stochastic_depth_model(small_model(blocks_per_stage=2), 0.3, "uniform") == [0.3] * 6
    with pytest.raises(ValueError, match="drop_distribution"):
        StochasticDepth(drop_distribution="exponential")
    with pytest.raises(ValueError, match="drop_rate"):
        StochasticDepth(drop_rate=1.5)


@pytest.mark.parametrize("mode", ["sample", "batch"])
def test_dropped_blocks_pass_only_their_shortcut(mode):
    model = small_model()
    stochastic_depth_model(model, drop_rate=1.0, drop_distribution="uniform", mode=mode)
    model.train()
    x = torch.randn(4, 8, 16, 16)
    for block in residual_blocks(model):
        shortcut = x if block.downsample is None else block.downsample(x)
        torch.testing.assert_close(block(x), torch.relu(shortcut), rtol=0, atol=0)
        x = block(x)


def test_drop_path_is_unbiased_and_drops_whole_samples():
    torch.manual_seed(0)
    branch = torch.randn(20_000, 3, 2, 2)
    dropped = drop_path(branch, 0.3, "sample")
    kept = (dropped != 0).flatten(1).all(1)
    assert ((dropped == 0).flatten(1).all(1) | kept).all()                  # all or nothing per sample
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.02)
    torch.testing.assert_close(dropped[kept], branch[kept] / 0.7)
    batch = torch.stack([drop_path(branch[:4], 0.3, "batch") for _ in range(200)])
    assert set(torch.unique((batch != 0).flatten(1).float().mean(1)).tolist()) == {0.0, 1.0}  # whole batch


def test_train_output_of_a_block_averages_to_its_eval_output():
    torch.manual_seed(0)
    model = small_model()
    stochastic_depth_model(model, drop_rate=0.5, drop_distribution="uniform")
    block = residual_blocks(model)[1]                 # has a projection shortcut
    block.relu = torch.nn.Identity()                  # E[relu(.)] != relu(E[.]): check the sum itself
    x = torch.randn(1, 8, 8, 8)
    expected = block.eval()(x)
    block.train()
    for module in block.modules():                    # BN on running stats: only the drop is random
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()
    with torch.no_grad():
        samples = block(x.expand(4000, -1, -1, -1))   # a fresh keep/drop per sample
    assert not torch.equal(samples[0], samples[1]) or not torch.equal(samples[0], samples[2])
    branch = block.residual(x)
    torch.testing.assert_close(samples.mean(0, keepdim=True), expected, atol=0.1 * branch.abs().max().item(), rtol=0)


def test_deepcopy_keeps_stochastic_depth_on_the_copy():
    model = small_model()
    stochastic_depth_model(model, drop_rate=1.0, drop_distribution="uniform")
    twin = copy.deepcopy(model).train()
    block, twin_block = residual_blocks(model)[0], residual_blocks(twin)[0]
    assert twin_block.forward.__self__ is twin_block
    x = torch.randn(2, 8, 8, 8)
    torch.testing.assert_close(twin_block(x), torch.relu(x))
    with torch.no_grad():
        twin_block.bn2.bias.fill_(5.0)                # the copy's parameters, not the original's
    twin_block.eval()
    assert not torch.equal(twin_block(x), block.eval()(x))


def test_hook_in_a_trainer_run(tmp_path):
    trainer = tiny_trainer(tmp_path, [StochasticDepth(drop_rate=0.2)])
    blocks = residual_blocks(trainer.state.model)
    assert [block.drop_rate for block in blocks] == pytest.approx([0.2 / 3, 0.4 / 3, 0.2])
    summary = trainer.fit()
    assert summary["steps"] == 8 and summary["last_val_top1"] is not None
