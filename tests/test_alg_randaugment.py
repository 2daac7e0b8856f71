"""RandAugment: the PIL operations against DALI's suite and their defining effects, and the
loader-side form in folder, webdataset and DALI (seeded, train only), refused by FFCV."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from algorithms.base import RunPlan
from algorithms.durations import Duration
from algorithms.randaugment import RandAugment
from conftest import tiny_trainer
from pipeline import LoaderSpec, build_loader
from pipeline.transforms.randaugment import FILL, NAMES, OPERATIONS, magnitude, randaugment_image
from training.config import ConfigError

UNIT = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))   # "normalized" pixels stay in 0..255


@pytest.fixture(scope="module")
def photo(converted_sets) -> Image.Image:
    """A real photo tile, cropped to 224 x 224."""
    path = sorted(converted_sets["photos"]["folder"].glob("train/*/*"))[0]
    return Image.open(path).convert("RGB").resize((224, 224))


def test_operations_and_ranges_are_dalis():
    from nvidia.dali.auto_aug import rand_augment
    suite = {aug.name: (tuple(aug.mag_range or (0.0, 0.0)), aug.randomly_negate)
             for aug in rand_augment.get_rand_augment_suite(use_shape=True)}
    ours = {name: ((low, high), signed) for name, (low, high, signed, _) in OPERATIONS.items()}
    assert ours == suite


def test_severity_zero_changes_nothing_but_the_histogram_operations(photo):
    pixels = np.asarray(photo)
    for name in NAMES:
        out = np.asarray(OPERATIONS[name][3](photo, magnitude(name, 0)))
        assert out.shape == pixels.shape
        assert np.array_equal(out, pixels) == (name not in ("equalize", "auto_contrast")), name


def test_operations_at_full_severity(photo):
    pixels = np.asarray(photo).astype(int)
    apply = lambda name, negate=False: np.asarray(OPERATIONS[name][3](photo, magnitude(name, 10, negate))).astype(int)
    assert np.array_equal(apply("solarize"), 255 - pixels)                  # threshold 0: every pixel inverted
    assert set(np.unique(apply("posterize") % 16)) == {0}                   # 4 bits kept
    shifted = apply("translate_x")                                          # 100 px right at 224
    assert np.array_equal(shifted[:, 100:], pixels[:, :124]) and (shifted[:, :100] == FILL[0]).all()
    assert np.array_equal(apply("translate_y", negate=True)[:124], pixels[100:])   # 100 px up
    rotated = apply("rotate")
    assert (rotated[0, 0] == FILL).all() and np.abs(rotated[112, 112] - pixels[112, 112]).max() <= 2
    assert apply("brightness").mean() > pixels.mean() + 40 and apply("brightness", negate=True).mean() < 30
    gray = apply("color", negate=True)                                      # saturation 0.1: nearly grey
    assert np.abs(gray - gray.mean(axis=2, keepdims=True)).mean() < 0.2 * np.abs(pixels - pixels.mean(axis=2, keepdims=True)).mean()


def test_randaugment_image_is_seeded_and_applies_depth_operations(photo, monkeypatch):
    seeded = lambda seed, depth=2: np.asarray(randaugment_image(photo, depth, 9, np.random.default_rng(seed)))
    assert np.array_equal(seeded(1), seeded(1))
    assert sum(not np.array_equal(seeded(1), seeded(seed)) for seed in range(2, 8)) >= 5
    applied = []
    counting = {name: (*spec[:3], lambda im, m, name=name, op=spec[3]: applied.append(name) or op(im, m))
                for name, spec in OPERATIONS.items()}
    monkeypatch.setattr("pipeline.transforms.randaugment.OPERATIONS", counting)
    seeded(3, depth=3)
    assert len(applied) == 3


@pytest.mark.parametrize("backend,form", [("folder", "folder"), ("webdataset", "webdataset"), ("dali", "webdataset")])
def test_loader_side_randaugment_is_seeded_and_train_only(converted_sets, backend, form):
    def first_batch(split, randaugment, seed=0, by_algorithm=False):
        spec = LoaderSpec(backend, path=str(converted_sets["photos"][form]), split=split, batch_size=16,
                          resolution=64, val_resolution=64, num_workers=0 if backend != "dali" else 1, seed=seed,
                          randaugment=None if by_algorithm else randaugment, **UNIT)
        if by_algorithm:                      # as the trainer settles it, before it builds the loader
            spec = RandAugment(*randaugment).loader_spec(spec, RunPlan(Duration(1, "ep"), steps_per_epoch=1))
        images, labels = next(iter(build_loader(spec)))
        return images.clone(), labels.clone()

    plain, augmented, again = first_batch("train", None), first_batch("train", (2, 9)), first_batch("train", (2, 9))
    assert torch.equal(augmented[0], again[0]) and torch.equal(augmented[1], plain[1])
    assert torch.equal(first_batch("train", (2, 9), by_algorithm=True)[0], augmented[0])
    changed = (augmented[0] - plain[0]).abs().flatten(1).amax(dim=1) > 0
    assert changed.float().mean() > 0.6                          # identity alone is drawn twice in 1 of 196
    assert not torch.equal(first_batch("train", (2, 9), seed=1)[0], augmented[0])
    assert torch.equal(first_batch("val", (2, 9))[0], first_batch("val", None)[0])


def test_ffcv_refuses_randaugment_with_one_line(converted_sets, tmp_path):
    path = str(converted_sets["fashion"]["ffcv"])
    with pytest.raises(ValueError, match="randaugment cannot run in the ffcv backend"):
        LoaderSpec("ffcv", path=path, randaugment=(2, 9))
    with pytest.raises(ValueError, match="severity in 0..10"):
        LoaderSpec("folder", path=path, randaugment=(2, 11))
    with pytest.raises(ConfigError, match="'algorithms'.*ffcv backend") as error:
        tiny_trainer(tmp_path, [RandAugment()], "data.backend=ffcv", f"data.path={path}", "data.resolution=28",
                     "data.val_resolution=28")
    assert "\n" not in str(error.value)
