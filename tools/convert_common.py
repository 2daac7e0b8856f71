"""What the FFCV and WebDataset converters share: the CLI, robust image loading, the
manifest, atomic output, and the driver that turns a folder into one output per split.

Policy for bad input: everything decodable is converted (to RGB, EXIF rotation applied);
everything else is skipped, listed with its reason in the manifest and on stderr; the run
never stops half-way; outputs are written under temporary names and renamed at the end, and
`manifest.json` is written last, so an output that has a manifest is complete.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

import cv2
import numpy as np
from PIL import Image, ImageFile, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from pipeline.atomic_files import check_writable, write_bytes_atomic  # noqa: E402
from pipeline.progress import Progress  # noqa: E402
from pipeline.imagefolder import LayoutError, Sample, Skipped, empty_classes, find_classes, scan_split  # noqa: E402
from worker_pool import WorkerDied, forked_map  # noqa: E402

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is a skip, never half an image
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ConversionError(Exception):
    """A problem with the whole run (not one file): reported as one line, exit code 2."""


class ConversionFault(Exception):
    """A fault met on the way (a full disk, an I/O error): one line, exit code 1; the split being
    written leaves nothing behind, and what earlier runs wrote is untouched."""


class UnusableFile(Exception):
    """One file cannot be a sample; the message is the reason recorded for it."""


def open_image(path: str) -> Image.Image:
    if os.path.getsize(path) == 0:
        raise UnusableFile("empty file (0 bytes)")
    return Image.open(path)


# --- images -------------------------------------------------------------------------------

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


def load_rgb(path: str, max_resolution: int | None = None) -> np.ndarray:
    """Decode any Pillow-readable image to (H, W, 3) uint8 RGB, EXIF rotation applied, shrunk
    to max_resolution.

    JPEGs much larger than the target are decoded with DCT scaling (`Image.draft`) first,
    which is several times faster on 8000x6000 photos; the final size is computed from the
    full-size dimensions, so it is the same as a full decode would give.
    Raises on anything that is not a complete, decodable image.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with open_image(path) as image:
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


def probe(path: str) -> str | None:
    """None when the file decodes completely, else the reason it cannot be used.

    Decodes JPEGs at 1/8 scale: the whole entropy-coded stream is still read, so truncation
    shows, at a fraction of the cost of a full decode.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open_image(path) as image:
                if image.format == "JPEG":
                    image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                image.load()
        return None
    except Exception as error:  # noqa: BLE001 - any failure of any decoder is a skip
        return describe_failure(error)


# --- parallel work with a progress bar ----------------------------------------------------

def parallel_map(function: Callable, items: list, num_workers: int, desc: str,
                 chunksize: int = 16) -> Iterator:
    """function(item) for each item, in order, on num_workers processes (tools/worker_pool.py),
    with a progress bar; a worker that dies is a ConversionFault, not a hang."""
    progress = Progress(len(items), desc, unit="img")
    workers = num_workers if len(items) >= 2 * chunksize else 1
    try:
        with contextlib.closing(forked_map(function, items, workers, chunksize)) as results:
            for done, result in enumerate(results, 1):
                progress.update()
                if done == len(items):      # a caller may stop at the last item, before this generator ends
                    progress.close()
                yield result
    except WorkerDied:
        raise ConversionFault(f"{desc}: a worker process died (its traceback, if it crashed, is above); "
                              "--num-workers 1 runs the same work in this process") from None
    progress.close()


# --- outputs ------------------------------------------------------------------------------

def write_json_atomic(path: Path, content: dict) -> None:
    write_bytes_atomic(path, (json.dumps(content, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def library_versions(*names: str) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("numpy", "opencv-python", "pillow-simd", "pillow", *names):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def source_fingerprint(samples: Iterable[Sample]) -> str:
    """Changes when any file of the split is added, removed, resized or touched."""
    digest = hashlib.sha256()
    for sample in samples:
        stat = os.stat(sample.path)
        digest.update(f"{sample.relpath}\0{sample.label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# --- the driver ---------------------------------------------------------------------------

def common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("src", type=Path, help="ImageNet-layout folder: SRC/<split>/<class>/<image>")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--splits", default="train,val", help="comma-separated split folders to convert")
    parser.add_argument("--max-resolution", type=int, default=512,
                        help="shrink so the longest side is at most this (0: keep sizes)")
    parser.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality when (re-)encoding")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any file was skipped")
    parser.add_argument("--force", action="store_true", help="convert even if OUT is up to date")
    return parser


def check_common_args(args: argparse.Namespace) -> None:
    if args.max_resolution < 0:
        raise ConversionError(f"--max-resolution must be >= 0, got {args.max_resolution}")
    if not 1 <= args.jpeg_quality <= 100:
        raise ConversionError(f"--jpeg-quality must be in 1..100, got {args.jpeg_quality}")
    if args.num_workers < 1:
        raise ConversionError(f"--num-workers must be >= 1, got {args.num_workers}")
    args.splits = [s for s in args.splits.split(",") if s]
    if not args.splits:
        raise ConversionError("--splits is empty")


@dataclass
class SplitResult:
    count: int                                  # samples a reader will read back
    skipped: list[Skipped] = field(default_factory=list)
    files: list[str] = field(default_factory=list)   # outputs, relative to OUT
    extra: dict = field(default_factory=dict)   # format-specific manifest entries


def report_skips(skipped: list[Skipped]) -> None:
    for skip in skipped:
        print(f"skipped {skip.path}: {skip.reason}", file=sys.stderr)


# Options that do not change what is written: a manifest from a run that differed only in
# these is still up to date.
NON_OUTPUT_PARAMS = ("splits", "num_workers", "strict")


def run_conversion(args: argparse.Namespace, format_name: str, libraries: tuple[str, ...],
                   convert_split: Callable[[argparse.Namespace, str, list[Sample], Path], SplitResult]) -> int:
    """Scan SRC, convert each split with `convert_split`, write the manifest; the exit code.

    `convert_split(args, split, samples, out)` writes its outputs under temporary names and
    renames them into place before it returns; the manifest, written last, marks completion.
    Splits converted by an earlier run into the same OUT with the same classes and options
    stay in the manifest; a split whose source files are unchanged is not converted again.
    """
    check_common_args(args)
    src, out = args.src, args.out
    if not src.is_dir():
        raise ConversionError(f"{src}: source folder does not exist")
    if src.resolve() == out.resolve() or out.resolve() in src.resolve().parents:
        raise ConversionError(f"{out}: output folder must not contain the source folder")
    try:
        classes = find_classes(src, args.splits)
    except LayoutError as error:
        raise ConversionError(str(error)) from None
    scans = {split: scan_split(src, split, classes) for split in args.splits}
    if not any(samples for samples, _ in scans.values()):
        raise ConversionError(f"{src}: no image files under {', '.join(args.splits)}")

    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
              if k not in ("src", "out", "force")}
    output_params = {k: v for k, v in params.items() if k not in NON_OUTPUT_PARAMS}
    check_out_folder(out)
    manifest_path = out / MANIFEST
    previous = read_manifest(manifest_path)
    kept: dict[str, dict] = {}
    if previous and previous.get("format") == format_name and previous.get("classes") == classes \
            and previous.get("output_params") == output_params and previous.get("source") == str(src.resolve()):
        kept = {split: record for split, record in previous["splits"].items()
                if all((out / f).exists() for f in record["files"])}

    started, converted = time.perf_counter(), 0
    for split, (samples, name_skips) in scans.items():
        fingerprint = source_fingerprint(samples)
        if not args.force and kept.get(split, {}).get("source_fingerprint") == fingerprint:
            print(f"{out}: {split} is up to date ({kept[split]['count']} samples); --force converts again",
                  file=sys.stderr)
            continue
        report_skips(name_skips)
        missing_classes = empty_classes(samples, classes)
        if missing_classes:
            print(f"warning: {src / split}: no images for classes {missing_classes}", file=sys.stderr)
        try:
            result = convert_split(args, split, samples, out)
        except OSError as error:
            raise ConversionFault(f"{out}: {describe_os_error(error)} while writing the {split} split; its partial "
                                  f"output was removed and outputs of earlier runs are intact") from None
        report_skips(result.skipped)
        converted += len(samples)
        kept[split] = {"count": result.count, "files": result.files, "source_fingerprint": fingerprint,
                       "empty_classes": missing_classes,
                       "skipped": [s.as_dict() for s in name_skips + result.skipped], **result.extra}
    elapsed = time.perf_counter() - started

    splits = {split: kept[split] for split in sorted(kept)}
    skipped = [{**skip, "split": split} for split, record in splits.items() for skip in record["skipped"]]
    try:
        write_json_atomic(manifest_path, {
            "format": format_name,
            "manifest_version": MANIFEST_VERSION,
            "classes": classes,
            "counts": {split: record["count"] for split, record in splits.items()},
            "skipped": skipped,
            "params": params,
            "output_params": output_params,
            "source": str(src.resolve()),
            "versions": library_versions(*libraries),
            "splits": splits,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
    except OSError as error:
        raise ConversionFault(f"{out}: {describe_os_error(error)} while writing {MANIFEST}: the new files are in "
                              f"place but the manifest is the earlier one; run again once there is room") from None
    rate = f", {converted / elapsed:.0f} img/s" if converted else ""
    print(f"{out}: {format_name}, {len(classes)} classes, "
          + ", ".join(f"{split} {record['count']}" for split, record in splits.items())
          + f", {len(skipped)} skipped{rate}", file=sys.stderr)
    return 1 if args.strict and any(splits[s]["skipped"] for s in args.splits) else 0


def check_out_folder(out: Path) -> None:
    """OUT is, or can be made, a folder this process can write in; else a ConversionError."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; OUT must be a folder, new or from an earlier run")
    try:
        check_writable(out)
    except OSError as error:
        raise ConversionError(f"{out}: cannot write there ({describe_os_error(error)})") from None


def describe_os_error(error: OSError) -> str:
    return f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")


def read_manifest(path: Path) -> dict | None:
    """The manifest at path, or None when absent or unreadable (then everything is redone)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        print(f"warning: {path}: unreadable manifest ({error}); converting everything again", file=sys.stderr)
        return None


def main_guard(run: Callable[[], int]) -> None:
    """Exit with run()'s code; a ConversionError is one line on stderr and exit code 2."""
    try:
        sys.exit(run())
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except ConversionFault as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: nothing was renamed into place; outputs from earlier runs are intact",
              file=sys.stderr)
        sys.exit(130)
