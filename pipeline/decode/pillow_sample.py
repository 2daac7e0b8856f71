"""One sample decoded the way the Pillow-based backends (folder, webdataset's worker path) do it:
decode + crop + resize + RandAugment + flip + ColOut with PIL (Pillow-SIMD here), and the
samples of a batch collated into one uint8 tensor. Where this runs (DataLoader workers, or the
training process) is pipeline/loader/workers.py's business.

`roi=True` decodes only the crop's region of a JPEG (`pipeline/decode/jpeg_roi.py`), at 1/2, 1/4
or 1/8 scale (DCT scaling) when the crop is still at least twice the target size there, so
the decoder does less work and the resize sees no fewer pixels than it outputs. The
`folder` backend keeps it off (stock semantics: Pillow, full decode); `webdataset` turns it on.
"""
from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from pipeline.decode import jpeg_roi
from pipeline.transforms.colout import colout_sample, sample_generator
from pipeline.transforms.crops import center_crop, sample_seed, sample_uniforms, train_crop
from pipeline.errors import CorruptSample
from pipeline.transforms.randaugment import randaugment_image
from pipeline.spec import LoaderSpec

DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
RANDAUGMENT_STREAM = 2    # a random stream of its own per sample, apart from the crop's uniforms


def draft_reduction(crop_height: int, crop_width: int, side: int) -> int:
    """The largest DCT scale denominator (1, 2, 4, 8) that keeps the crop at least 2 x `side` pixels."""
    reduction = 1
    while reduction < 8 and min(crop_height, crop_width) >= 2 * reduction * side:
        reduction *= 2
    return reduction


def load_sample(source, spec: LoaderSpec, *, name: str, sample_id: int, epoch: int, side: int,
                roi: bool) -> np.ndarray:
    """(side', side', 3) uint8: one stored image (a path or JPEG bytes), augmented as the spec says.
    `roi=True` decodes JPEG bytes with `pipeline.decode.jpeg_roi` (only the crop, DCT-scaled where it
    allows); anything else, and a JPEG it refuses, goes through Pillow."""
    uniforms = sample_uniforms(spec.seed, epoch, sample_id)
    try:
        image, flip = None, False
        if roi and isinstance(source, bytes):
            try:
                image, flip = _roi_crop(source, spec, uniforms, side)
            except jpeg_roi.JPEGError:
                pass    # CMYK, or damaged: Pillow decodes the first and names the damage of the second
        if image is None:
            image, flip = _pil_crop(source, spec, uniforms, side, draft=roi)
        if spec.randaugment and spec.train:
            seed = sample_seed(spec.seed, epoch, sample_id)
            image = randaugment_image(image.convert("RGB"), *spec.randaugment,
                                      np.random.default_rng((seed, RANDAUGMENT_STREAM)))
        pixels = np.asarray(image)[:, :, :3]    # the ROI path's images are RGBX
    except DECODE_ERRORS as error:
        raise CorruptSample(f"{name}: cannot decode ({error})") from None
    if flip:
        pixels = pixels[:, ::-1]    # a view: assembling the batch makes the one copy
    if spec.colout and spec.train:
        pixels = colout_sample(pixels, *spec.colout, sample_generator(uniforms))
    return pixels


def _crop_box(height: int, width: int, spec: LoaderSpec, uniforms) -> tuple[tuple[int, int, int, int], bool]:
    if spec.train:
        return train_crop(height, width, spec.scale, spec.ratio, uniforms)
    return center_crop(height, width, spec.val_crop_ratio), False


def _roi_crop(jpeg: bytes, spec: LoaderSpec, uniforms, side: int) -> tuple[Image.Image, bool]:
    width, height = jpeg_roi.image_size(jpeg)
    box, flip = _crop_box(height, width, spec, uniforms)
    reduction = draft_reduction(box[2], box[3], side)
    # Bilinear resampling reads up to (shrink factor) pixels beyond the box: decode those too,
    # and one more, since libjpeg upsamples the chroma of a region's edge columns as if they
    # were the image's; so the result is the one a full decode gives.
    margin = math.ceil(max(box[2], box[3]) / reduction / side) + 2
    pixels, region_box = jpeg_roi.decode_region(jpeg, width, height, box, reduction, margin)
    region = Image.frombuffer("RGBX", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGBX", 0, 1)
    return region.resize((side, side), Image.BILINEAR, box=region_box), flip


def _pil_crop(source, spec: LoaderSpec, uniforms, side: int, draft: bool) -> tuple[Image.Image, bool]:
    image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    width, height = image.size
    (top, left, crop_height, crop_width), flip = _crop_box(height, width, spec, uniforms)
    if draft and image.format == "JPEG":
        reduction = draft_reduction(crop_height, crop_width, side)
        if reduction > 1:
            # Pillow picks the scale from size // request, so ask for floor sizes: ceil ones
            # make it decode at full size whenever a side is odd.
            image.draft("RGB", (width // reduction, height // reduction))
    x_scale, y_scale = image.size[0] / width, image.size[1] / height
    box = (left * x_scale, top * y_scale, (left + crop_width) * x_scale, (top + crop_height) * y_scale)
    return image.convert("RGB").resize((side, side), Image.BILINEAR, box=box), flip


def load_or_report(source, spec: LoaderSpec, **options) -> np.ndarray | str:
    """load_sample, with an undecodable sample reported as its error message instead of raised:
    the main process decides (spec.on_corrupt) and its error stays one line, not a worker traceback."""
    try:
        return load_sample(source, spec, **options)
    except CorruptSample as error:
        return str(error)


def collate(images: list, labels: list) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Decoded samples (error messages where one failed) -> an (N, 3, H, W) uint8 view of an
    NHWC batch, int64 labels, and the error messages. uint8, for any device: a quarter of the
    bytes of float32 to pass between processes and to copy to a GPU, which normalizes after
    the copy; on a CPU the main process normalizes into reused memory
    (`pipeline/transforms/normalize.py`), cheaper than a worker normalizing into fresh shared memory."""
    kept = [(image, label) for image, label in zip(images, labels) if not isinstance(image, str)]
    errors = [image for image in images if isinstance(image, str)]
    labels = torch.tensor([label for _, label in kept], dtype=torch.int64)
    if not kept:
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8), labels, errors
    batch = torch.empty((len(kept), *kept[0][0].shape), dtype=torch.uint8)
    if get_worker_info() is not None:
        batch.share_memory_()    # made in shared memory, the DataLoader sends it without another copy
    np.stack([image for image, _ in kept], out=batch.numpy())
    return batch.permute(0, 3, 1, 2), labels, errors
