"""Conversion throughput of tools/convert_ffcv.py and tools/convert_wds.py from every source form,
beside FFCV's own DatasetWriter and webdataset's ShardWriter on the same images, and output sizes.

    python benchmarks/conversion.py SRC [--forms imagefolder,imagenet,...] [--workers 1,2] [--repeats 3]

SRC is an ImageNet-layout folder; its images are written once in each other form a converter reads
(benchmarks/source_forms.py: official tars, Kaggle's layout, parquet, WebDataset tars, lists) in a
temporary folder, and each converter runs on each form as a user runs it (a subprocess, --force, into
a temporary folder) with each worker count, the repeats going round the forms. Prints the median
wall-clock images/s (start-up and imports included), per worker, the share of the folder form's
rate, and the output's size. The
peers: FFCV's DatasetWriter with its RGBImageField in jpg mode, fed Pillow-decoded arrays (what
ffcv-imagenet's writer does), and webdataset's ShardWriter storing each file's bytes as they are
(no decode, no re-encode, no index), in one process. With --save, appends one JSON line per figure to
this machine's file in benchmarks/results/ (benchmarks/hardware.py).
Run it on a quiet machine: anything else on the cores changes the figures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from benchmarks.source_forms import FORMS, write_forms
from pipeline.formats.manifest import MANIFEST, read_manifest

CONVERTERS = {"ffcv": "convert_ffcv.py", "webdataset": "convert_wds.py"}
PEERS = ("ffcv-writer", "wds-shardwriter")
PARQUET_ROWS = 100           # a row group, as the Hub's image datasets are written

PEER_SCRIPT = {
    "ffcv-writer": """
import sys, numpy as np
from pathlib import Path
from PIL import Image
import pipeline.formats.ffcv_import
from ffcv.fields import IntField, RGBImageField
from ffcv.writer import DatasetWriter
src, out, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
classes = sorted(p.name for p in (src / "train").iterdir())
files = [(p, classes.index(p.parent.name)) for p in sorted((src / "train").glob("*/*"))]
class Folder:
    def __len__(self): return len(files)
    def __getitem__(self, i): return np.asarray(Image.open(files[i][0]).convert("RGB")), files[i][1]
DatasetWriter(out, {"image": RGBImageField(write_mode="jpg", max_resolution=512), "label": IntField()},
              num_workers=workers).from_indexed_dataset(Folder())
""",
    "wds-shardwriter": """
import sys, webdataset as wds
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
classes = sorted(p.name for p in (src / "train").iterdir())
with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=256 << 20, verbose=0) as sink:
    for number, path in enumerate(sorted((src / "train").glob("*/*"))):
        sink.write({"__key__": f"{number:09d}", "jpg": path.read_bytes(), "cls": classes.index(path.parent.name)})
""",
}


def run_once(command: list[str], out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)


def converter_run(script: str, src: Path, workers: int) -> tuple[float, int, int]:
    """(seconds, images converted, output bytes) of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        seconds = run_once([sys.executable, str(ROOT / "tools" / script), str(src), str(out), "--force",
                            "--num-workers", str(workers)], out)
        return seconds, sum(read_manifest(out)["counts"].values()), output_bytes(out)


def peer_run(peer: str, src: Path, workers: int) -> tuple[float, int, int]:
    """A peer's run on SRC's train split."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / ("train.beton" if peer == "ffcv-writer" else "out")
        seconds = run_once([sys.executable, "-c", PEER_SCRIPT[peer], str(src), str(out), str(workers)], out)
        size = out.stat().st_size if out.is_file() else output_bytes(out)
    return seconds, sum(1 for _ in (src / "train").glob("*/*")), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="an ImageNet-layout folder (train and val)")
    parser.add_argument("--forms", default=",".join(("imagefolder", *FORMS)), help="source forms, comma-separated")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--formats", default=",".join(CONVERTERS), help="comma-separated: ffcv, webdataset")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated: ffcv-writer, wds-shardwriter, or none")
    parser.add_argument("--repeats", type=int, default=3)
    add_results_options(parser)
    args = parser.parse_args()
    hardware = signature()
    forms = [form for form in args.forms.split(",") if form]
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores, {hardware['ram_gb']} GiB; images of {args.src}")
    print(f"{'format':<16} {'source':<12} {'workers':>7} {'images':>7} {'median s':>9} {'img/s':>7} "
          f"{'/worker':>7} {'vs folder':>9} {'MiB':>7}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="forms-") as tmp:
        sources = {"imagefolder": args.src, **write_forms(args.src, Path(tmp), [f for f in forms if f != "imagefolder"],
                                                          parquet_rows=PARQUET_ROWS)}
        counts = [int(workers) for workers in args.workers.split(",")]
        groups = [[(name, form, workers, lambda f=form, w=workers, n=name: converter_run(CONVERTERS[n], sources[f], w))
                   for form in forms] for name in args.formats.split(",") for workers in counts]
        groups += [[(peer, "imagefolder", workers, lambda p=peer, w=workers: peer_run(p, args.src, w))]
                   for peer in args.peers.split(",") if peer in PEERS for workers in counts
                   if peer == "ffcv-writer" or workers == 1]
        folder_rate = {}
        for group in groups:
            # Repeats go round the group's forms, so that a drifting machine slows each form alike
            results = {form: [] for _, form, _, _ in group}
            for _ in range(args.repeats):
                for _, form, _, run in group:
                    results[form].append(run())
            for name, form, workers, _ in group:
                seconds_all = [seconds for seconds, _, _ in results[form]]
                _, images, size = results[form][0]
                seconds = statistics.median(seconds_all)
                rate = images / seconds
                if form == "imagefolder" and name in CONVERTERS:
                    folder_rate[name, workers] = rate
                share = rate / folder_rate[name, workers] if (name, workers) in folder_rate else float("nan")
                print(f"{name:<16} {form:<12} {workers:>7} {images:>7} {seconds:>9.2f} {rate:>7.0f} "
                      f"{rate / workers:>7.0f} {share:>9.2f} {size / 2**20:>7.1f}", flush=True)
                rows.append({"benchmark": "conversion", "format": name, "source_form": form, "workers": workers,
                             "source": str(args.src), "images": images, "seconds_median": seconds,
                             "seconds_all": seconds_all, "img_per_s": rate, "img_per_s_per_worker": rate / workers,
                             "share_of_folder_form": None if share != share else share, "output_bytes": size})
    append_results(rows, hardware, results_folder(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
