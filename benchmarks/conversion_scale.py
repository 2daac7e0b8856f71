"""Converting ImageNet's count of images from ImageNet's official tar form, against a hundredth of it:
time per image and peak memory, then one epoch of the output read by the decode engine.

    python benchmarks/conversion_scale.py --images 12800,1281167 --work /a/disk/with/10GB [--workers 2]

For each count, the official files (a train tar of 1,000 class tars, a val tar of count/25.6 images,
a devkit) are written in WORK from a pool of 4,096 distinct small JPEGs (32-48 px: the work per
image is the converter's own, not a decoder's), then tools/convert_wds.py converts them with
--num-workers W while the memory of its processes (PSS, so pages the forked workers share are
counted once; and its anonymous part, what they allocated, apart from file pages such as the mapped
columns of a scan, which the kernel drops as it needs) is sampled every 0.2 s; then the webdataset
backend reads one train epoch of the output. Prints a row per count; with --save, appends them to this machine's
results file and writes benchmarks/results/conversion-scale/<machine>.json. WORK is emptied after each count.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from benchmarks.memory import PeakMemory
from pipeline.machine import slug
from benchmarks.source_forms import write_official
from pipeline.formats.manifest import MANIFEST, read_manifest

CLASSES = [f"class{i:04d}" for i in range(1000)]
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000
POOL = 4096


def jpeg_pool(count: int = POOL, seed: int = 0) -> list[bytes]:
    from PIL import Image
    rng, pool = np.random.default_rng(seed), []
    for _ in range(count):
        height, width = rng.integers(32, 49, 2)
        pixels = (np.linspace(0, 180, width)[None, :, None] + rng.integers(0, 70, (height, width, 3))).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=85)
        pool.append(buffer.getvalue())
    return pool


def write_set(count: int, dest: Path, pool: list[bytes]) -> int:
    """The official files for `count` train images over the 1,000 classes; the val count."""
    def train():
        for number, name in enumerate(CLASSES):
            for i in range(count // len(CLASSES) + (number < count % len(CLASSES))):
                yield name, "", (lambda k=(number * 7919 + i) % len(pool): pool[k])
    val_count = max(len(CLASSES), round(count * IMAGENET_VAL / IMAGENET_TRAIN))
    val = [(CLASSES[i % len(CLASSES)], "", (lambda k=(i * 104729) % len(pool): pool[k])) for i in range(val_count)]
    write_official(train(), val, CLASSES, dest)
    return val_count


def convert(src: Path, out: Path, workers: int) -> dict:
    command = [sys.executable, str(ROOT / "tools" / "convert_wds.py"), str(src), str(out), "--num-workers",
               str(workers), "--splits", "train"]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    memory = PeakMemory(process.pid, every_s=0.2)
    memory.start()
    _, stderr = process.communicate()
    seconds = time.perf_counter() - started
    memory.running = False
    memory.join()
    if process.returncode:
        raise SystemExit(f"convert_wds.py exited {process.returncode}: {stderr[-2000:]}")
    return {"seconds": seconds, **{f"peak_{key}_bytes": value for key, value in memory.peaks.items()},
            "summary": stderr.strip().splitlines()[-1]}


def read_epoch(out: Path, threads: int) -> dict:
    import torch
    from pipeline import LoaderSpec, build_loader
    torch.set_num_threads(1)
    loader = build_loader(LoaderSpec("webdataset", path=str(out), split="train", batch_size=256, resolution=32,
                                     num_workers=threads, drop_last=False))
    loader.set_epoch(0)
    started, images = time.perf_counter(), 0
    for batch, labels in loader:
        images += len(labels)
    seconds = time.perf_counter() - started
    return {"epoch_images": images, "epoch_seconds": seconds, "epoch_img_per_s": images / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default=f"12800,{IMAGENET_TRAIN}", help="train image counts, comma-separated")
    parser.add_argument("--work", type=Path, required=True, help="an empty folder on a disk with room (about 10 GB)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    add_results_options(parser)
    args = parser.parse_args()
    hardware = signature()
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores, {hardware['ram_gb']} GiB; "
          f"convert_wds.py --num-workers {args.workers}, official tar form", flush=True)
    pool, rows = jpeg_pool(), []
    for count in map(int, args.images.split(",")):
        args.work.mkdir(parents=True, exist_ok=True)
        src, out = args.work / "imagenet", args.work / "wds"
        started = time.perf_counter()
        val_count = write_set(count, src, pool)
        written = time.perf_counter() - started
        source_bytes = sum(p.stat().st_size for p in src.iterdir())
        converted = convert(src, out, args.workers)
        manifest = read_manifest(out)
        epoch = read_epoch(out, args.workers)
        output = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
        row = {"benchmark": "conversion_scale", "source_form": "imagenet", "images": count, "val_images": val_count,
               "converted": manifest["counts"]["train"], "workers": args.workers, "source_bytes": source_bytes,
               "output_bytes": output, "generate_seconds": written, **converted,
               "us_per_image": converted["seconds"] / count * 1e6, **epoch}
        rows.append(row)
        mib = {key: converted[f"peak_{key}_bytes"] / 2**20 for key in ("pss", "pss_anon", "main_pss", "main_pss_anon")}
        print(f"{count:>9,} images: {converted['seconds']:8.1f} s, {row['us_per_image']:6.1f} us/img; peak PSS "
              f"{mib['pss']:.0f} MiB, anonymous {mib['pss_anon']:.0f} (main process {mib['main_pss']:.0f}, anonymous "
              f"{mib['main_pss_anon']:.0f}); output {output / 2**30:.2f} GiB; one epoch "
              f"{epoch['epoch_img_per_s']:,.0f} img/s", flush=True)
        shutil.rmtree(args.work)
    folder = results_folder(args)
    if append_results(rows, hardware, folder):
        report = folder / "conversion-scale" / f"{slug(hardware)}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"hardware": hardware, "rows": rows}, indent=2) + "\n")
        print(f"# wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
