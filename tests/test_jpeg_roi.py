"""pipeline/decode/jpeg_roi.py, the webdataset backend's decoder: a region decoded alone equals the
same region of a full decode, the loader's ROI path gives Pillow's pixels, and bad data fails."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.decode import jpeg_roi
from pipeline.transforms.crops import sample_uniforms
from pipeline.spec import LoaderSpec
from pipeline.decode.pillow_sample import _pil_crop, load_sample


@pytest.fixture(scope="module")
def jpegs(converted_sets) -> list[bytes]:
    return [path.read_bytes() for path in sorted(converted_sets["photos"]["folder"].glob("*/*/*"))[:40]]


@pytest.mark.parametrize("reduction", [1, 2, 4])
def test_region_equals_the_same_region_of_a_full_decode(jpegs, reduction):
    for data in jpegs[:10]:
        width, height = jpeg_roi.image_size(data)
        assert (width, height) == Image.open(io.BytesIO(data)).size
        full, _ = jpeg_roi.decode_region(data, width, height, (0, 0, height, width), reduction, 0)
        box = (height // 3, width // 5, height // 2, width // 2)    # top, left, height, width
        region, (x0, y0, _, _) = jpeg_roi.decode_region(data, width, height, box, reduction, 3)
        scale_x, scale_y = full.shape[1] / width, full.shape[0] / height
        left, top = round(box[1] * scale_x - x0), round(box[0] * scale_y - y0)
        same = full[top:top + region.shape[0], left:left + region.shape[1]]
        # libjpeg upsamples chroma at a region's first and last columns as at an image edge
        assert np.array_equal(same[:, 1:-1], region[:, 1:-1])


def test_a_jpeg_with_restart_markers_gives_the_same_region(jpegs):
    """With a restart marker after every MCU, the region is decoded from the MCUs around it alone
    (cut out, then Huffman-decoded segment by segment): the very pixels of the same JPEG without
    markers, at every scale, at the image's edges, in 4:2:0, 4:4:4 and grey."""
    rng = np.random.default_rng(3)
    layouts = list(jpegs[:6])
    for subsampling, mode in ((0, "RGB"), (2, "L")):
        out = io.BytesIO()
        Image.open(io.BytesIO(jpegs[6])).convert(mode).save(out, "JPEG", quality=90, subsampling=subsampling)
        layouts.append(out.getvalue())
    for plain in layouts:
        marked = jpeg_roi.transcode(plain)
        assert marked.count(b"\xff\xd0")
        width, height = jpeg_roi.image_size(plain)
        boxes = [(0, 0, height, width), (0, 0, 9, 9), (height - 9, width - 9, 9, 9)]
        for _ in range(12):
            crop_height, crop_width = (int(rng.integers(8, n + 1)) for n in (height, width))
            boxes.append((int(rng.integers(0, height - crop_height + 1)), int(rng.integers(0, width - crop_width + 1)),
                          crop_height, crop_width))
        for box in boxes:
            for reduction in (1, 2, 4, 8):
                margin = int(rng.integers(0, 4))
                theirs, their_box = jpeg_roi.decode_region(plain, width, height, box, reduction, margin)
                ours, our_box = jpeg_roi.decode_region(marked, width, height, box, reduction, margin)
                assert our_box == their_box and np.array_equal(ours, theirs), (box, reduction, margin)


@pytest.mark.parametrize("split,side", [("train", 160), ("train", 64), ("val", 224), ("val", 96)])
def test_roi_path_gives_pillows_pixels(jpegs, split, side):
    spec = LoaderSpec("webdataset", path="unused", split=split)
    for sample_id, data in enumerate(jpegs):
        ours = load_sample(data, spec, name="x", sample_id=sample_id, epoch=0, side=side, roi=True)
        image, flip = _pil_crop(data, spec, sample_uniforms(0, 0, sample_id), side, draft=True)
        pillow = np.asarray(image)[:, ::-1] if flip else np.asarray(image)
        assert np.abs(ours.astype(int) - pillow).max() <= 1, sample_id


def test_damaged_jpegs_fail_and_cmyk_falls_back_to_pillow(jpegs):
    data = jpegs[0]
    width, height = jpeg_roi.image_size(data)
    with pytest.raises(jpeg_roi.JPEGError):
        jpeg_roi.decode_region(data[:len(data) // 2], width, height, (0, 0, height, width), 1, 0)
    with pytest.raises(jpeg_roi.JPEGError):
        jpeg_roi.image_size(b"not a jpeg at all")
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("CMYK").save(cmyk, "JPEG")
    with pytest.raises(jpeg_roi.JPEGError, match="CMYK"):
        jpeg_roi.decode_region(cmyk.getvalue(), width, height, (0, 0, height, width), 1, 0)
    spec = LoaderSpec("webdataset", path="unused", split="val")
    assert load_sample(cmyk.getvalue(), spec, name="x", sample_id=0, epoch=0, side=64, roi=True).shape == (64, 64, 3)
