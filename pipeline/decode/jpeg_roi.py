"""Decode only the part of a JPEG a crop needs, at the coarsest DCT scale that keeps it sharp:
the decode step of the `webdataset` backend.

A RandomResizedCrop keeps on average about half of an image's area, and a val crop 77% of
it; Pillow decodes every pixel first. `jpeg_roi.c` (libjpeg-turbo, the library Pillow-SIMD
links) skips the rows above the crop without the IDCT, never decodes the rows below it and
leaves out the columns beside it, at 1/2, 1/4 or 1/8 scale when the crop is still at least
twice the output size there. The C file is compiled the first time this module is imported
(`pipeline/native/library.py`).
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from pipeline.native.library import load_library, source

SOURCE = source("jpeg_roi.c")
MESSAGE_SIZE = 200


class JPEGError(ValueError):
    """libjpeg refused the data (corrupt, truncated, not a JPEG, or CMYK)."""


def _load(library: Path | None = None) -> ctypes.CDLL:
    """The decoder compiled (by default into the per-user cache), checked and typed."""
    library = load_library(SOURCE, library=library, check="jpeg_roi_check")
    int_p, char_p = ctypes.POINTER(ctypes.c_int), ctypes.c_char_p
    library.jpeg_roi_size.argtypes = [char_p, ctypes.c_ulong, int_p, int_p, char_p, ctypes.c_int]
    library.jpeg_roi_decode.argtypes = [char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                                        int_p, int_p, int_p, int_p, char_p, ctypes.c_int]
    library.jpeg_roi_transcode.argtypes = [char_p, ctypes.c_ulong, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                           ctypes.POINTER(ctypes.c_ulong), char_p, ctypes.c_int]
    library.jpeg_roi_free.argtypes = [ctypes.c_void_p]
    return library


_library = _load()


def transcode(data: bytes, restart_markers: bool = True) -> bytes:
    """`data` rewritten losslessly (the same pixels) as one baseline scan with optimized
    Huffman tables and a restart marker after every MCU (a few % more bytes: the decode engine
    then decodes only a crop's MCUs), or with none."""
    out, size, message = ctypes.c_void_p(), ctypes.c_ulong(), ctypes.create_string_buffer(MESSAGE_SIZE)
    if _library.jpeg_roi_transcode(data, len(data), int(restart_markers), out, size, message, MESSAGE_SIZE) != 0:
        raise JPEGError(message.value.decode(errors="replace"))
    try:
        return ctypes.string_at(out, size.value)
    finally:
        _library.jpeg_roi_free(out)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the JPEG header."""
    width, height, message = ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(MESSAGE_SIZE)
    if _library.jpeg_roi_size(data, len(data), width, height, message, MESSAGE_SIZE) != 0:
        raise JPEGError(message.value.decode(errors="replace"))
    return width.value, height.value


def decode_region(data: bytes, width: int, height: int, box: tuple[int, int, int, int], reduction: int,
                  margin: int) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """The pixels around the crop `box` = (top, left, crop_height, crop_width) of a `width` x
    `height` JPEG, decoded at scale 1/`reduction` with `margin` scaled pixels around it (what a
    resampling filter reads beyond the box), as (rows, cols, 4) RGBX (the fourth byte is
    padding: Pillow's own layout, so `Image.frombuffer("RGBX", ...)` wraps it without a copy),
    and the crop's box within them as (x0, y0, x1, y1) floats: what
    `PIL.Image.resize(..., box=)` takes."""
    top, left, crop_height, crop_width = box
    scaled_width, scaled_height = -(-width // reduction), -(-height // reduction)
    x_scale, y_scale = scaled_width / width, scaled_height / height
    x0, y0 = left * x_scale, top * y_scale
    x1, y1 = (left + crop_width) * x_scale, (top + crop_height) * y_scale
    row0, row1 = max(0, math.floor(y0) - margin), min(scaled_height, math.ceil(y1) + margin)
    col0, col1 = max(0, math.floor(x0) - margin), min(scaled_width, math.ceil(x1) + margin)
    out = np.empty((row1 - row0) * scaled_width * 4, np.uint8)
    first_col, decoded_width, full_width, full_height = (ctypes.c_int() for _ in range(4))
    message = ctypes.create_string_buffer(MESSAGE_SIZE)
    status = _library.jpeg_roi_decode(data, len(data), reduction, row0, row1 - row0, col0, col1 - col0,
                                      out.ctypes.data, out.size, first_col, decoded_width, full_width, full_height,
                                      message, MESSAGE_SIZE)
    if status != 0:
        raise JPEGError(message.value.decode(errors="replace"))
    rows, cols, first = row1 - row0, decoded_width.value, first_col.value
    pixels = out[:rows * cols * 4].reshape(rows, cols, 4)
    return pixels, (x0 - first, y0 - row0, x1 - first, y1 - row0)
