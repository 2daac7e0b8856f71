"""The converters' image handling, on a sample's bytes from any source: open them as an image or
say why they cannot be one, decode them to RGB pixels (EXIF rotation applied, shrunk to
--max-resolution with FFCV's size rule), encode JPEGs as FFCV's writer does, and tell an RGB JPEG
that can be stored unchanged.

Policy for bad input: everything decodable is converted; everything else is a skip with a
one-line reason (`describe_failure`), never a stop.
"""
from __future__ import annotations

import io
import warnings

import cv2
import numpy as np
from PIL import Image, ImageFile, ImageOps

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is a skip, never half an image


class UnusableFile(Exception):
    """One file cannot be a sample; the message is the reason recorded for it."""


def open_image(data: bytes) -> Image.Image:
    if len(data) == 0:
        raise UnusableFile("empty file (0 bytes)")
    return Image.open(io.BytesIO(data))


def target_size(width: int, height: int, max_resolution: int | None) -> tuple[int, int]:
    """(w, h) with the longest side at most max_resolution: FFCV's `resizer` rule, truncating."""
    if not max_resolution or max(width, height) <= max_resolution:
        return width, height
    ratio = max_resolution / max(width, height)
    return int(ratio * width), int(ratio * height)


ROTATED = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees: width and height swap


def oriented_size(image: Image.Image) -> tuple[int, int, int]:
    """(width, height, EXIF orientation) as the image is meant to be shown."""
    orientation = image.getexif().get(0x0112, 1)
    width, height = image.size
    return (height, width, orientation) if orientation in ROTATED else (width, height, orientation)


def usable_as_is(image: Image.Image, max_resolution: int | None) -> bool:
    """An RGB JPEG with no EXIF rotation and no resize to do: its bytes can be stored unchanged."""
    width, height, orientation = oriented_size(image)
    return (image.format == "JPEG" and image.mode == "RGB" and orientation == 1
            and target_size(width, height, max_resolution) == (width, height))


def load_rgb(data: bytes, max_resolution: int | None = None) -> np.ndarray:
    """Decode any Pillow-readable image to (H, W, 3) uint8 RGB, EXIF rotation applied, shrunk
    to max_resolution.

    JPEGs much larger than the target are decoded with DCT scaling (`Image.draft`) first,
    which is several times faster on 8000x6000 photos; the final size is computed from the
    full-size dimensions, so it is the same as a full decode would give.
    Raises on anything that is not a complete, decodable image.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with open_image(data) as image:
            width, height, orientation = oriented_size(image)
            out_w, out_h = target_size(width, height, max_resolution)
            if image.format == "JPEG" and (out_w, out_h) != (width, height):
                image.draft("RGB", (out_h, out_w) if orientation in ROTATED else (out_w, out_h))
            image.load()
            image = ImageOps.exif_transpose(image) if orientation != 1 else image
            pixels = np.asarray(image.convert("RGB"))
    if pixels.shape[1::-1] != (out_w, out_h):
        pixels = cv2.resize(pixels, (out_w, out_h), interpolation=cv2.INTER_AREA)
    return np.ascontiguousarray(pixels)


def encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    """RGB pixels -> JPEG bytes with OpenCV's libjpeg, the encoder FFCV's writer uses."""
    ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR),
                               [int(cv2.IMWRITE_JPEG_QUALITY), quality])
    if not ok:
        raise ValueError("OpenCV could not encode the image as JPEG")
    return encoded.tobytes()


def describe_failure(error: BaseException) -> str:
    """One line saying why a file was skipped."""
    if isinstance(error, UnusableFile):
        return str(error)
    if isinstance(error, Image.UnidentifiedImageError):
        return "not a decodable image (Pillow cannot identify it)"
    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"too large to decode safely ({error})"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"decode failed: {text}"


def probe(data: bytes) -> str | None:
    """None when the bytes decode completely, else the reason it cannot be used.

    Decodes JPEGs at 1/8 scale: the whole entropy-coded stream is still read, so truncation
    shows, at a fraction of the cost of a full decode.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open_image(data) as image:
                if image.format == "JPEG":
                    image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                image.load()
        return None
    except Exception as error:  # noqa: BLE001 - any failure of any decoder is a skip
        return describe_failure(error)
