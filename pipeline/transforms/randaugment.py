"""RandAugment on one PIL image, with the operations and magnitude ranges of DALI's
`nvidia.dali.auto_aug.rand_augment` suite, so `randaugment=(depth, severity)` means the same
thing in the PIL backends (folder, webdataset) and in the `dali` backend.

Each sample gets `depth` operations drawn uniformly (with replacement) from the 14 below,
all at one strength: `severity` in 0..10 is the magnitude bin of an 11-bin range (Composer's
0..10 scale; DALI is given `num_magnitude_bins=11, m=severity`). Signed operations flip their
sign at random. Geometric operations fill with grey (128), as DALI's do. The randomness comes
from a numpy Generator the caller seeds per sample, so augmentation is reproducible.
"""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

SEVERITY_BINS = 11            # severities 0..10
FILL = (128, 128, 128)
MAX_TRANSLATE = 100 / 224     # share of the side, DALI's default with a shape


def _affine(image: Image.Image, matrix) -> Image.Image:
    return image.transform(image.size, Image.AFFINE, matrix, resample=Image.BILINEAR, fillcolor=FILL)


def _shift(image: Image.Image, dx: float, dy: float) -> Image.Image:
    return _affine(image, (1, 0, -dx, 0, 1, -dy))


# name -> (magnitude at severity 0, at severity 10, randomly negated, op(image, magnitude))
OPERATIONS = {
    "translate_x": (0.0, MAX_TRANSLATE, True, lambda im, m: _shift(im, m * im.width, 0)),
    "translate_y": (0.0, MAX_TRANSLATE, True, lambda im, m: _shift(im, 0, m * im.height)),
    "shear_x": (0.0, 0.3, True, lambda im, m: _affine(im, (1, m, -m * im.height / 2, 0, 1, 0))),
    "shear_y": (0.0, 0.3, True, lambda im, m: _affine(im, (1, 0, 0, m, 1, -m * im.width / 2))),
    "rotate": (0.0, 30.0, True, lambda im, m: im.rotate(m, resample=Image.BILINEAR, fillcolor=FILL)),
    "brightness": (0.0, 0.9, True, lambda im, m: ImageEnhance.Brightness(im).enhance(1 + m)),
    "contrast": (0.0, 0.9, True, lambda im, m: ImageEnhance.Contrast(im).enhance(1 + m)),
    "color": (0.0, 0.9, True, lambda im, m: ImageEnhance.Color(im).enhance(1 + m)),
    "sharpness": (0.0, 0.9, True, lambda im, m: ImageEnhance.Sharpness(im).enhance(1 + m)),
    "posterize": (8.0, 4.0, False, lambda im, m: ImageOps.posterize(im, min(8, max(1, round(m))))),
    "solarize": (256.0, 0.0, False, lambda im, m: ImageOps.solarize(im, m)),
    "equalize": (0.0, 0.0, False, lambda im, m: ImageOps.equalize(im)),
    "auto_contrast": (0.0, 0.0, False, lambda im, m: ImageOps.autocontrast(im)),
    "identity": (0.0, 0.0, False, lambda im, m: im),
}
NAMES = tuple(OPERATIONS)


def check_randaugment(depth: int, severity: int) -> None:
    if not (isinstance(depth, int) and depth >= 1 and isinstance(severity, int) and 0 <= severity < SEVERITY_BINS):
        raise ValueError(f"randaugment needs an integer depth >= 1 and severity in 0..{SEVERITY_BINS - 1}, "
                         f"got depth={depth!r}, severity={severity!r}")


def magnitude(name: str, severity: int, negate: bool = False) -> float:
    """The argument operation `name` gets at this severity (before its random sign)."""
    low, high, signed, _ = OPERATIONS[name]
    value = low + (high - low) * severity / (SEVERITY_BINS - 1)
    return -value if signed and negate else value


def randaugment_image(image: Image.Image, depth: int = 2, severity: int = 9,
                      rng: np.random.Generator | None = None) -> Image.Image:
    """`depth` random operations at `severity` applied in turn to an RGB image; returns a new image."""
    rng = rng if rng is not None else np.random.default_rng()
    for index, negate in zip(rng.integers(len(NAMES), size=depth), rng.random(depth) < 0.5):
        name = NAMES[index]
        image = OPERATIONS[name][3](image, magnitude(name, severity, bool(negate)))
    return image
