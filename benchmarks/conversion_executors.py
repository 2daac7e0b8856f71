"""The WebDataset converter's ways of running on one machine, timed against each other: the local
process pool; Ray (`--executor ray`), started by the converter, or already running as on a cluster
(`ray start --head` on this machine, `--ray-address auto`); N parts side by side then `--finish` (as
a Slurm array runs them); and a run killed half-way then run again.

    python benchmarks/conversion_executors.py SRC [--workers 2] [--shard-size-mb 4] [--repeats 3]

Each runs as a user runs it (subprocesses, into a new folder), the repeats going round the ways.
Every way must end with the same files as the local pool (checked each time; a difference stops the
benchmark). Prints the median wall-clock seconds (start-up included) and images/s, and with --save
appends one JSON line per way to this machine's file in benchmarks/results/ (benchmarks/hardware.py). Run it on
a quiet machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.hardware import add_results_options, append_results, cpu_words, results_folder, signature
from pipeline.formats.manifest import MANIFEST

CONVERT = [sys.executable, str(ROOT / "tools" / "convert_wds.py")]


def files(out: Path) -> dict[str, str]:
    """{file: sha256} of OUT, the manifest without its date."""
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == MANIFEST:
            data = json.dumps({k: v for k, v in json.loads(data).items() if k != "created"}).encode()
        found[str(path.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return found


def local(src: Path, out: Path, common: list[str], workers: int) -> None:
    subprocess.run([*CONVERT, str(src), str(out), *common, "--num-workers", str(workers)], check=True,
                   capture_output=True)


def ray(src: Path, out: Path, common: list[str], workers: int) -> None:
    subprocess.run([*CONVERT, str(src), str(out), *common, "--num-workers", str(workers), "--executor", "ray"],
                   check=True, capture_output=True)


def ray_cluster(src: Path, out: Path, common: list[str], workers: int) -> None:
    """On a Ray cluster already running (`ray start --head`, started by `main`), as on a cluster."""
    subprocess.run([*CONVERT, str(src), str(out), *common, "--executor", "ray", "--ray-address", "auto"],
                   check=True, capture_output=True)


def parts(src: Path, out: Path, common: list[str], workers: int) -> None:
    """`workers` parts of one worker each, at once, then --finish."""
    running = [subprocess.Popen([*CONVERT, str(src), str(out), *common, "--num-workers", "1",
                                 "--part", f"{part}/{workers}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE) for part in range(workers)]
    for process in running:
        if process.wait():
            raise RuntimeError(process.stderr.read().decode()[-2000:])
    subprocess.run([*CONVERT, str(src), str(out), *common, "--finish", str(workers)], check=True,
                   capture_output=True)


def killed_then_resumed(src: Path, out: Path, common: list[str], workers: int) -> None:
    """Killed (SIGKILL) once half the shards are finished, then run again."""
    process = subprocess.Popen([*CONVERT, str(src), str(out), *common, "--num-workers", str(workers)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        records = list(out.glob(".converting/*.done/*.json"))
        plans = [json.loads(path.read_text())["plan"] for path in out.glob(".converting/*.plan.json")]
        shards = sum(-(-plan["count"] // plan["per_shard"]) for plan in plans)
        if plans and len(records) * 2 >= shards:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    process.wait()
    local(src, out, common, workers)


WAYS = {"local": local, "ray": ray, "ray-cluster": ray_cluster, "parts": parts, "killed+resumed": killed_then_resumed}
RAY = [str(Path(sys.executable).with_name("ray"))]


def measure(args, ways: list[str], common: list[str]) -> dict[str, list[float]]:
    """{way: seconds of each of `args.repeats` runs}, the repeats going round the ways; each run's
    files must be the first run's."""
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    reference = None
    with tempfile.TemporaryDirectory(prefix="executors-") as tmp:
        for repeat in range(args.repeats):
            for way in ways:
                out = Path(tmp) / f"{way}-{repeat}"
                started = time.perf_counter()
                WAYS[way](args.src, out, common, args.workers)
                seconds[way].append(time.perf_counter() - started)
                written = files(out)
                reference = reference or written
                if written != reference:
                    raise SystemExit(f"{way}: its files differ from the first run's")
                subprocess.run(["rm", "-rf", str(out)], check=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="an ImageNet-layout folder (train and val)")
    parser.add_argument("--workers", type=int, default=2, help="processes (Ray CPUs, parts)")
    parser.add_argument("--shard-size-mb", type=float, default=4)
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated: " + ", ".join(WAYS))
    parser.add_argument("--repeats", type=int, default=3)
    add_results_options(parser)
    args = parser.parse_args()
    hardware = signature()
    common = ["--shard-size-mb", str(args.shard_size_mb)]
    ways = [way for way in args.ways.split(",") if way]
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores, {hardware['ram_gb']} GiB; {args.src}, "
          f"{args.workers} workers, --shard-size-mb {args.shard_size_mb}")
    print(f"{'way':<16} {'images':>7} {'median s':>9} {'img/s':>7} {'vs local':>9}")
    if "ray-cluster" in ways:
        subprocess.run([*RAY, "start", "--head", "--num-cpus", str(args.workers), "--include-dashboard=false",
                        "--disable-usage-stats"], check=True, capture_output=True)
    try:
        seconds = measure(args, ways, common)
    finally:
        if "ray-cluster" in ways:
            subprocess.run([*RAY, "stop"], capture_output=True)
    images = sum(1 for split in ("train", "val") for _ in (args.src / split).glob("*/*"))
    rows = []
    base = statistics.median(seconds["local"]) if "local" in seconds else None
    for way in ways:
        median = statistics.median(seconds[way])
        share = base / median if base else None
        print(f"{way:<16} {images:>7} {median:>9.2f} {images / median:>7.0f} "
              f"{share if share is not None else float('nan'):>9.2f}")
        rows.append({"benchmark": "conversion_executors", "way": way, "workers": args.workers,
                     "shard_size_mb": args.shard_size_mb, "source": str(args.src), "images": images,
                     "seconds_median": median, "seconds_all": seconds[way], "img_per_s": images / median,
                     "speed_vs_local": share})
    append_results(rows, hardware, results_folder(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
