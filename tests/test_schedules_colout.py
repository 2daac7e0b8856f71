"""Resolution schedules (FFCV and Composer forms) and ColOut (sample and batch forms)."""
import numpy as np
import pytest
import torch

from pipeline.transforms.colout import colout_batch, colout_sample, kept_size
from pipeline.schedules import ComposerRamp, ConstantResolution, FFCVRamp, resolution_schedule


def test_ffcv_ramp_holds_ramps_in_multiples_and_holds_again():
    ramp = FFCVRamp(min_res=128, max_res=256, start_ramp=2, end_ramp=6)
    assert [ramp(e) for e in range(9)] == [128, 128, 128, 160, 192, 224, 256, 256, 256]
    # ffcv-imagenet's ResNet-50 values: the ramp snaps to multiples of 32.
    rn50 = FFCVRamp(min_res=160, max_res=192, start_ramp=65, end_ramp=76)
    assert rn50(65) == 160 and rn50(70) == 160 and rn50(72) == 192 and rn50(88) == 192


def test_composer_ramp_follows_delay_ramp_and_finetune():
    ramp = ComposerRamp(final_res=224, total_epochs=10, initial_scale=0.5, delay_fraction=0.5,
                        finetune_fraction=0.2, size_increment=4)
    # each epoch at its middle: epoch 5 (0.55): 0.5 + 0.5 * (0.05 / 0.3) = 7/12 -> 130.7 -> 132;
    # epoch 6 (0.65): 3/4 -> 168; epoch 7 (0.75): 11/12 -> 205.3 -> 204; from 0.8 on, full size
    assert [ramp(e) for e in range(10)] == [112] * 5 + [132, 168, 204, 224, 224]


@pytest.mark.parametrize("total_epochs, sides", [(1, [28]), (2, [20, 28]), (3, [20, 24, 28]),
                                                 (2.25, [20, 24, 28])])
def test_composer_ramp_ends_short_runs_at_full_size(total_epochs, sides):
    """With a finetune, the epoch the run ends in is at full size, however few epochs there are
    (a fractional total is what ScaleSchedule makes); without one, the ramp alone decides."""
    ramp = ComposerRamp(final_res=28, total_epochs=total_epochs, initial_scale=0.75, delay_fraction=0.4,
                        finetune_fraction=0.2, size_increment=4)
    assert [ramp(e) for e in range(len(sides))] == sides
    no_finetune = ComposerRamp(28, 2, initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.0)
    assert [no_finetune(e) for e in range(2)] == [16, 20]    # 0.25 -> 0.5 (14 -> 16); 0.75 -> 0.75 (21 -> 20)


def test_schedules_from_config_values():
    assert resolution_schedule(160)(7) == 160 and isinstance(resolution_schedule(160), ConstantResolution)
    ramp = resolution_schedule({"form": "ffcv", "min_res": 160, "max_res": 192, "start_ramp": 1, "end_ramp": 3})
    assert ramp == FFCVRamp(160, 192, 1, 3)
    with pytest.raises(ValueError, match=r"unknown keys \['max_resolution'\]"):
        resolution_schedule({"form": "ffcv", "max_resolution": 3})
    with pytest.raises(ValueError, match="form"):
        resolution_schedule({"min_res": 160})
    with pytest.raises(ValueError, match="min_res <= max_res"):
        FFCVRamp(200, 100, 0, 1)
    with pytest.raises(ValueError, match="sum <= 1"):
        ComposerRamp(224, 10, delay_fraction=0.7, finetune_fraction=0.5)


def test_colout_batch_drops_the_same_counts_different_rows_per_sample():
    images = torch.arange(4 * 3 * 20 * 10, dtype=torch.float32).reshape(4, 3, 20, 10)
    out = colout_batch(images, p_row=0.25, p_col=0.2, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 3, 15, 8)
    # every kept pixel is the source pixel at a kept (row, col), rows and columns in order
    per_sample_rows = []
    for n in range(4):
        values = out[n, 0]
        rows = ((values[:, 0] - images[n, 0, 0, 0]) // 10).long()
        cols = (values[0] - images[n, 0, 0, 0] - 10 * rows[0]).long()
        assert torch.equal(out[n], images[n][:, rows][:, :, cols])
        assert bool((rows.diff() > 0).all()) and bool((cols.diff() > 0).all())
        per_sample_rows.append(tuple(rows.tolist()))
    assert len(set(per_sample_rows)) > 1, "every sample lost the same rows"
    again = colout_batch(images, p_row=0.25, p_col=0.2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_colout_sample_keeps_a_sorted_subset():
    image = np.arange(30 * 40).reshape(30, 40, 1)
    out = colout_sample(image, 0.1, 0.5, np.random.default_rng(0))
    assert out.shape == (27, 20, 1)
    rows, cols = out[:, 0, 0] // 40, out[0, :, 0] % 40
    assert (np.diff(rows) > 0).all() and (np.diff(cols) > 0).all()
    assert (out[:, :, 0] == rows[:, None] * 40 + cols[None, :]).all()
    assert kept_size(224, 224, 0, 0) == (224, 224)
    with pytest.raises(ValueError):
        kept_size(10, 10, 1.0, 0)
