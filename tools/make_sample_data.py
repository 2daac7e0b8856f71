"""Write real sample datasets in ImageNet layout, for tests, demos and loader benchmarks.

    OUT/NAME/train/<class>/<file>.JPEG     OUT/NAME/val/<class>/<file>.JPEG

Two sets, both from Debian packages (no internet data set can be fetched here):

- fashion: Fashion-MNIST (package dataset-fashion-mnist): 60,000 train / 10,000 val RGB
  JPEGs at the native 28x28, quality 95, one folder per class; files are named after their
  index in the source IDX file. For quick training runs with known accuracy (~94% ResNet-18).
- photos: an ImageNet-like JPEG *decode* workload: tiles of ImageNet-like sizes (250-500 px
  a side, mean about 400x350, quality 85-95) cut at varying scales from 23 real photographs
  in mate-backgrounds and plasma-workspace-wallpapers; class = source photograph. Val tiles
  come from the bottom-right quarter of each photo, train tiles from the rest, so no val
  pixel is ever seen in training. OUT/photos/tiles.csv records every tile's source box.
- photos-large (on request only, not in `make demo`): the same photographs cut into 2,000
  train and 400 val tiles each (46,000 train, 9,200 val; about 1.4 GB): enough images that a
  GPU loader's epoch lasts seconds. Made by all cores (`--jobs`).
- photos-heavy (on request only): the photos set's tiles (the same boxes and sizes) with a
  camera's grain (Gaussian, sigma 6 of 255 per channel, seeded per tile) and quality 97:
  about 3.5x the bytes (mean about 85 kB against 25 kB), near ImageNet's bytes per pixel, so that
  the Huffman decoding weighs what it does on ImageNet. The wallpapers alone are smoother
  than camera photographs: quality 97 without grain gives only 46 kB.

Deterministic (the same arguments give byte-identical files) and idempotent: a finished set
has OUT/NAME/.done.json and a rerun only counts files; an interrupted run resumes, and
every JPEG is written under a temporary name and renamed, so none is ever partial.

The packages' files are read where they are installed; otherwise the .deb is fetched with
`apt-get download` (no root needed) and unpacked with `dpkg -x` into OUT/.debian/.

Usage: python tools/make_sample_data.py {fashion,photos,photos-large,photos-heavy,all} ... [--out data/sample]
       [--limit N (per class per split)] [--seed S] [--jobs N (default: all cores)]
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from debian_packages import DebianPackageError, package_root
from generated_set import (SPLITS, GeneratedSetError, atomic_write, claim_set_dir, disk_usage_mb,
                           finish_set, finished_counts, summarize, write_missing)


# --- fashion ---------------------------------------------------------------------------------
FASHION_PACKAGE = "dataset-fashion-mnist"
FASHION_DIR = "usr/share/datasets/fashion-mnist"
FASHION_FILES = {  # split -> (images, labels), as shipped in Debian bookworm
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# Label order of the source; loaders index classes by sorted folder name, which differs.
FASHION_CLASSES = ("T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot")
FASHION_QUALITY = 95
FASHION_VERSION = 1  # bump when the bytes written change

# --- photos ----------------------------------------------------------------------------------
# Photographs only, chosen by eye from thumbnails of every image in both packages. Left out
# as not photographs: mate abstract/* (Elephants is a painting; Arc-Colors, Flow, Gulp, Silk,
# Spring, Waves are vector art or gradients), mate desktop/* (logos, stripes, blurred aurora
# renders); plasma Altai, Autumn (painting), Canopee, Cascade, Cluster, Elarun, Flow,
# FlyingKonqui, Honeywave, IceCold, Kay, Kokkini, MilkyWay, Opal, PastelHills, Patak,
# SafeLanding, Shell, Volna (low-poly/abstract renders and illustrations).
# A plasma entry is a wallpaper folder: its largest image under contents/images/ is used.
MATE, PLASMA = "mate-backgrounds", "plasma-workspace-wallpapers"
PHOTO_SOURCES = (  # (class folder, package, path in the package)
    *((name, MATE, f"usr/share/backgrounds/mate/nature/{name}.jpg") for name in (
        "Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "LadyBird",
        "RainDrops", "Storm", "TwoWings", "Wood", "YellowFlower")),
    *((name, PLASMA, f"usr/share/wallpapers/{name}") for name in (
        "BytheWater", "ColdRipple", "ColorfulCups", "DarkestHour", "EveningGlow",
        "FallenLeaf", "Grey", "Kite", "OneStandsOut", "Path", "summer_1am")),
)
PHOTO_TILES_PER_CLASS = {"train": 100, "val": 25}  # 23 photos: 2,300 train, 575 val
LARGE_TILES_PER_CLASS = {"train": 2000, "val": 400}  # photos-large: 46,000 train, 9,200 val
MIN_SIDE, MAX_SIDE = 250, 500
MAX_SCALE = 3.0          # a tile shows a region up to 3x its size, downscaled
QUALITY_RANGE = (85, 95)  # inclusive
PHOTOS_VERSION = 1
HEAVY_GRAIN, HEAVY_QUALITY = 6.0, 97   # photos-heavy: ImageNet-like bytes per pixel


class SampleDataError(Exception):
    """A failure to report in one line, without a traceback."""


def jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


# --- fashion ---------------------------------------------------------------------------------
def read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte IDX array (the MNIST file format), gzip-compressed or not."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:3] != b"\0\0\x08":
        raise SampleDataError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    array = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if array.size != math.prod(shape):
        raise SampleDataError(f"{path}: {array.size} bytes of data for shape {shape}")
    return array.reshape(shape)


def make_fashion(out_dir, limit: int | None = None, seed: int = 0, progress: bool = True,
                 cache_dir=None) -> dict:
    """Fashion-MNIST as 28x28 RGB JPEGs; limit = first N of each class per split.
    seed is accepted for a uniform interface; nothing here is random."""
    out_dir = Path(out_dir)
    set_dir = out_dir / "fashion"
    content_params = {"set": "fashion", "version": FASHION_VERSION, "quality": FASHION_QUALITY}
    params = {**content_params, "limit": limit}
    counts = finished_counts(set_dir, params)
    if counts is not None:
        return summarize(set_dir, counts, written=0)

    claim_set_dir(set_dir, content_params)
    files = [f"{FASHION_DIR}/{name}" for pair in FASHION_FILES.values() for name in pair]
    root = package_root(FASHION_PACKAGE, files, Path(cache_dir or out_dir / ".debian"))
    images, plan = {}, {}
    for split, (image_file, label_file) in FASHION_FILES.items():
        images[split] = read_idx(root / FASHION_DIR / image_file)
        labels = read_idx(root / FASHION_DIR / label_file)
        if images[split].shape[1:] != (28, 28) or len(labels) != len(images[split]):
            raise SampleDataError(f"unexpected Fashion-MNIST shapes {images[split].shape}, "
                                  f"{labels.shape} in {root / FASHION_DIR}")
        taken = [0] * len(FASHION_CLASSES)
        for index, label in enumerate(labels.tolist()):
            if limit is None or taken[label] < limit:
                taken[label] += 1
                plan[f"{split}/{FASHION_CLASSES[label]}/{index:08d}.JPEG"] = (split, index)

    def render(job):
        split, index = job
        return jpeg_bytes(Image.fromarray(images[split][index], "L").convert("RGB"),
                          FASHION_QUALITY)

    written = write_missing(set_dir, plan, render, "fashion", progress)
    return finish_set(set_dir, params, written)


# --- photos ----------------------------------------------------------------------------------
def largest_image(folder: Path) -> Path:
    """The plasma wallpaper image with the most pixels (the smaller sizes are symlinks)."""
    candidates = [p for p in sorted((folder / "contents" / "images").iterdir()) if p.is_file()]
    if not candidates:
        raise SampleDataError(f"no images in {folder}/contents/images")
    def pixels(p):
        with Image.open(p) as im:
            return im.width * im.height
    return max(candidates, key=pixels)  # the first of equals, in name order


def val_block(width: int, height: int) -> tuple:
    """The bottom-right quarter of a photo, kept for val tiles: (x0, y0, x1, y1)."""
    return (width - width // 2, height - height // 2, width, height)


def boxes_overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def tile_size(rng: np.random.Generator) -> tuple:
    """(w, h) like ImageNet's: mostly landscape, long side 300-500, aspect 1-1.6;
    mean about 405x350, every side within MIN_SIDE..MAX_SIDE."""
    long_side = rng.triangular(300, 480, MAX_SIDE)
    short_side = max(MIN_SIDE, long_side / rng.triangular(1.0, 1.33, 1.6))
    landscape = rng.random() < 0.8
    w, h = (long_side, short_side) if landscape else (short_side, long_side)
    return round(w), round(h)


def plan_tiles(class_name: str, photo_size: tuple, split: str, count: int, seed: int) -> list:
    """`count` tiles of one photo for one split: [(box (x0, y0, x1, y1), (w, h), quality)].

    One random stream per (seed, class, split), so a --limit run makes a prefix of the full
    run's tiles and adding a photo changes no other class. Crops are at most a quarter of
    the photo (the val block's size) for both splits, so train and val scales match."""
    width, height = photo_size
    vx0, vy0, vx1, vy1 = block = val_block(width, height)
    vw, vh = vx1 - vx0, vy1 - vy0
    if vw < MAX_SIDE or vh < MAX_SIDE:
        raise SampleDataError(f"photo {class_name} ({width}x{height}) is too small for tiles")
    rng = np.random.default_rng([seed, zlib.crc32(class_name.encode()), SPLITS.index(split)])
    tiles = []
    for _ in range(count):
        w, h = tile_size(rng)
        max_scale = min(MAX_SCALE, vw / w, vh / h)
        scale = math.exp(rng.uniform(0.0, math.log(max_scale)))  # log-uniform in [1, max]
        cw, ch = min(vw, round(w * scale)), min(vh, round(h * scale))
        if split == "val":
            x0 = int(rng.integers(vx0, vx1 - cw + 1))
            y0 = int(rng.integers(vy0, vy1 - ch + 1))
        else:  # the L-shaped rest: the band above the val block or the band left of it
            above = (width - cw + 1) * (vy0 - ch + 1)
            left = (vx0 - cw + 1) * (height - ch + 1)
            if rng.random() * (above + left) < above:
                x0, y0 = int(rng.integers(0, width - cw + 1)), int(rng.integers(0, vy0 - ch + 1))
            else:
                x0, y0 = int(rng.integers(0, vx0 - cw + 1)), int(rng.integers(0, height - ch + 1))
        box = (x0, y0, x0 + cw, y0 + ch)
        quality = int(rng.integers(QUALITY_RANGE[0], QUALITY_RANGE[1] + 1))
        # The property val/train disjointness rests on; tests check it on the output too.
        assert boxes_overlap(box, block) == (split == "val"), (class_name, split, box)
        assert split == "train" or (box[0] >= vx0 and box[1] >= vy0), (class_name, box)
        tiles.append((box, (w, h), quality))
    return tiles


def render_tile(photo: Image.Image, box, size, quality, grain: float = 0.0, grain_seed=None) -> bytes:
    # Crop first, then resize: resizing with box= would let the filter read pixels
    # just outside the box, across the train/val border.
    region = photo.crop(box)
    if region.size != tuple(size):
        region = region.resize(size, Image.LANCZOS)
    if grain:
        noise = np.random.default_rng(grain_seed).normal(0.0, grain, (size[1], size[0], 3))
        region = Image.fromarray(np.clip(np.asarray(region, np.float32) + noise, 0, 255).round().astype(np.uint8))
    return jpeg_bytes(region, quality)


def make_photos(out_dir, limit: int | None = None, seed: int = 0, progress: bool = True,
                cache_dir=None, sources=PHOTO_SOURCES, set_name: str = "photos",
                tiles_per_class: dict = PHOTO_TILES_PER_CLASS, jobs: int = 1, grain: float = 0.0,
                quality: int | None = None) -> dict:
    """ImageNet-like tiles of real photographs (see the module docstring);
    limit = tiles per class per split (default 100 train, 25 val); `grain` and `quality` (instead
    of each tile's drawn one) make photos-heavy."""
    out_dir = Path(out_dir)
    set_dir = out_dir / set_name
    names = [name for name, _, _ in sources]
    content_params = {"set": set_name, "version": PHOTOS_VERSION, "seed": seed,
                      "sources": names, **({"grain": grain, "quality": quality} if grain or quality else {})}
    params = {**content_params, "limit": limit}
    counts = finished_counts(set_dir, params)
    if counts is not None:
        return summarize(set_dir, counts, written=0)

    claim_set_dir(set_dir, content_params)
    cache_dir = Path(cache_dir or out_dir / ".debian")
    roots = {pkg: package_root(pkg, [p for _, q, p in sources if q == pkg], cache_dir)
             for pkg in dict.fromkeys(pkg for _, pkg, _ in sources)}
    plan, manifest = {}, []
    for source_index, (name, package, path) in enumerate(sources):
        photo_path = roots[package] / path
        if photo_path.is_dir():
            photo_path = largest_image(photo_path)
        with Image.open(photo_path) as im:
            photo_size = im.size
        source = f"{package}:/{photo_path.relative_to(roots[package])}"
        for split in SPLITS:
            count = min(tiles_per_class[split], limit or tiles_per_class[split])
            tiles = plan_tiles(name, photo_size, split, count, seed)
            for i, (box, size, drawn_quality) in enumerate(tiles):
                rel = f"{split}/{name}/{name}_{i:04d}.JPEG"
                grain_seed = [seed, zlib.crc32(name.encode()), SPLITS.index(split), i]
                plan[rel] = (photo_path, box, size, quality or drawn_quality, grain_seed)
                manifest.append([split, name, rel, source, *box, *size, quality or drawn_quality])

    loaded = {}     # in each worker process, the photos it cuts: the plan is in photo order

    def render(job):
        photo_path, box, size, tile_quality, grain_seed = job
        if photo_path not in loaded:
            if len(loaded) > 1:                 # the photo in hand and the one before
                loaded.pop(next(iter(loaded)))
            with Image.open(photo_path) as im:
                loaded[photo_path] = im.convert("RGB")
        return render_tile(loaded[photo_path], box, size, tile_quality, grain, grain_seed)

    written = write_missing(set_dir, plan, render, set_name, progress, jobs)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["split", "class", "file", "source", "x0", "y0", "x1", "y1",
                     "width", "height", "quality"])
    writer.writerows(manifest)
    atomic_write(set_dir / "tiles.csv", buf.getvalue().encode())
    return finish_set(set_dir, params, written)


def make_photos_large(out_dir, limit: int | None = None, seed: int = 0, progress: bool = True,
                      cache_dir=None, jobs: int = 1) -> dict:
    """The photos set's photographs cut into 20x more tiles, for timing GPU loaders."""
    return make_photos(out_dir, limit, seed, progress, cache_dir, set_name="photos-large",
                       tiles_per_class=LARGE_TILES_PER_CLASS, jobs=jobs)


def make_photos_heavy(out_dir, limit: int | None = None, seed: int = 0, progress: bool = True,
                      cache_dir=None, jobs: int = 1) -> dict:
    """The photos set's tiles with a camera's grain at quality 97: ImageNet-like bytes per pixel."""
    return make_photos(out_dir, limit, seed, progress, cache_dir, set_name="photos-heavy", jobs=jobs,
                       grain=HEAVY_GRAIN, quality=HEAVY_QUALITY)


SETS = {"fashion": make_fashion, "photos": make_photos, "photos-large": make_photos_large,
        "photos-heavy": make_photos_heavy}
DEFAULT_SETS = ("fashion", "photos")   # `all`: photos-large and photos-heavy only when named


# --- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", choices=[*SETS, "all"],
                        help="fashion, photos, photos-large, photos-heavy or all (fashion and photos)")
    parser.add_argument("--out", type=Path, default=Path("data/sample"),
                        help="output folder (default: data/sample)")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most N images per class per split (for tests)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes rendering photo tiles; default: all cores")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    names = list(DEFAULT_SETS) if "all" in args.names else list(dict.fromkeys(args.names))
    try:
        for name in names:
            jobs = {} if name == "fashion" else {"jobs": args.jobs}
            summary = SETS[name](args.out, limit=args.limit, seed=args.seed, **jobs)
            print(f"{summary['path']}: {summary['classes']} classes, train {summary['train']}, "
                  f"val {summary['val']}, {disk_usage_mb(Path(summary['path'])):.1f} MB on disk"
                  f" ({summary['written']} files written)", file=sys.stderr)
    except (SampleDataError, DebianPackageError, GeneratedSetError) as err:
        print(f"make_sample_data: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"make_sample_data: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("make_sample_data: interrupted; run again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
