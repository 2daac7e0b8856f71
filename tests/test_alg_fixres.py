"""FixRes: evaluation runs at its own resolution and crop while training keeps the train one."""
from __future__ import annotations

import pytest

from algorithms.fixres import FixRes
from conftest import tiny_trainer


def test_evaluation_sees_the_eval_resolution_and_training_the_train_one(tmp_path):
    trainer = tiny_trainer(tmp_path, [FixRes(eval_resolution=24, eval_crop_ratio=0.5)], "max_duration=1ep")
    state = trainer.state
    assert state.val_loader.resolution == (24, 24) and state.val_loader.spec.val_crop_ratio == 0.5
    assert state.train_loader.resolution == (16, 16)
    assert (state.config.data.val_resolution, state.config.data.val_crop_ratio) == (24, 0.5)
    sizes = {True: set(), False: set()}
    state.model.register_forward_hook(lambda module, args, out: sizes[module.training].add(args[0].shape[-1]))
    trainer.fit()
    assert sizes == {True: {16}, False: {24}}


def test_crop_ratio_defaults_to_the_configs(tmp_path):
    state = tiny_trainer(tmp_path, [FixRes(eval_resolution=32)], "data.val_crop_ratio=0.75").state
    assert state.val_loader.resolution == (32, 32) and state.val_loader.spec.val_crop_ratio == 0.75


@pytest.mark.parametrize("settings", [{"eval_resolution": 4}, {"eval_crop_ratio": 1.5}, {"eval_crop_ratio": 0}])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        FixRes(**settings)
