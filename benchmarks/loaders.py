"""Loader throughput per backend x split x resolution x worker count, against the decode-only
bound and the loaders users write from FFCV's and DALI's examples.

    python benchmarks/loaders.py [--source data/sample/photos] [--backends ...] [--resolutions 160,128]
                                 [--val-resolutions 224] [--workers 2 | --cores 1,2,4] [--epochs 3] [--instance-type p4d.24xlarge]
                                 [--device cuda] [--hw-decoder-loads 0,0.65,1] [--remote http|s3|s3-nginx|gs-nginx|URL [--latency-ms 25 [--latency-in proxy|server]] [--remote-cache streamed|kept]]

Data: the raw ImageNet-layout `--source` and its conversions, made (once; the converters skip
an up-to-date output) under `--cache`:
- `wds`: tools/convert_wds.py, max side 512, which keeps the photo sample's sizes: the same
  pixels as the photos, rewritten losslessly with a restart marker after every MCU
  (webdataset, dali and the decode bound read it; the bound is also taken without the markers,
  and is the faster of the two);
- `wds-plain`: the same with --no-restart-markers, the photos' own bytes (`webdataset-plain`:
  the engine where it must entropy-decode every MCU above and beside a crop);
- `wds-shards`: the same in shards of 4 MB (`webdataset-shards`: a split of many shards, as a URL's
  first epoch is measured on too);
- `ffcv`: tools/convert_ffcv.py --write-mode jpg, max side 512: the same pixels, re-encoded
  at quality 90 (FFCV always re-encodes);
- `ffcv-proportion`: FFCV's recommended storage, half the images as raw pixels and half as
  JPEG, max side 256 (near a 160-224 training size): its speed comes from the storage.
`--cores 1,2,4`: how each loader scales with CPU cores. Each figure's process is pinned to that
many vCPUs (hyperthread siblings together, as a cloud counts vCPUs: benchmarks/hardware.py),
with as many workers (threads for DALI and the engine); every row records its `cores`, which
tools/instance_cost.py reads as the loader's rate on an instance's vCPUs per GPU. Without it,
a figure runs on all of this machine's CPUs, and records their count.

`decode_floor` (per resolution and worker count) is what no decode of the same crops can go below:
their MCUs Huffman-decoded, nothing more (benchmarks/bare_loaders.py); the webdataset rows
state their share of it, and the engine's CPU microseconds per image in each of its stages
(`pipeline.decode.engine.STAGES`: the read, the entry at the crop, the decode, the resize across
and down, the write), the decode split in two where the floor ran beside it: the entropy decoding
(the floor's own) and the rest (IDCT, upsampling, colour conversion).

Each figure runs in a fresh process (`benchmarks/loader_run.py`; no backend pays for another's
threads or memory): one warm-up epoch (worker start-up, FFCV's compilation), then `--epochs` timed epochs; the
figure is the median epoch's img/s. With `--rounds N`, the backends of a split and resolution,
the decode bound among them (then measured at each resolution, not once per split), are measured
N times over, in turn, and each keeps its median round (every round's img/s is recorded): a
machine's drift over minutes then falls on a backend and its bound alike. Also recorded: the
whole machine's CPU utilisation during the timed epochs (/proc/stat: run it on a quiet machine)
and the peak summed PSS of the process and its workers. With --save (or --results-dir DIR), one
JSON line per figure goes to this machine's file in benchmarks/results/ (or DIR; benchmarks/hardware.py).

`--device cuda`: every loader delivers its batches on the GPU (DALI decodes there with
`mixed`; the CPU backends copy from pinned memory), and an epoch's clock stops only once the
GPU has finished its work; `--hw-decoder-loads` then measures DALI at each share sent to
the hardware JPEG decoder (the other backends ignore it).

`--remote`: each backend that reads a URL (webdataset) is measured again, right after its
local-disk figure, from the same conversion in object storage or behind HTTP
(`benchmarks/remote_sources.py`), with a cache limit of half the split, so that every
epoch streams as a dataset larger than a node's disk does (through memory, nothing kept on
disk; the bytes fetched per epoch show it), or with `--remote-cache kept` twice the split, so
that the first epoch (the warm-up) fills the cache and later ones read it. Also recorded then
(`benchmarks/remote_figures.py`):
its img/s as a share of local disk's, and its first epoch's of local disk's first, the bytes and requests fetched per
epoch (and in the first) against the bytes of the samples read (each from its image to its label in the shard),
the time from building the loader to its first batch, and the CPU time per epoch of the fetch
process and of the servers on this machine (nginx, the latency proxy, moto), with which a
loopback figure here shares the cores, as a node reading a real store does not (on loopback, a
server's time also holds part of the TCP receive work that a node pays in its network card's interrupts).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.hardware import (add_results_options, append_results, cpu_words, cpus_by_core, results_folder,
                                 signature)
from benchmarks.loader_run import BOUNDS, FLOORS, first_epoch_rate
from benchmarks.remote_figures import remote_line, split_bytes
from benchmarks.remote_sources import RemoteSource
from pipeline.datasets import REMOTE_BACKENDS

ROOT = Path(__file__).resolve().parents[1]

# name -> (how it is built, the data form it reads)
CONFIGURATIONS = {
    "folder": ("folder", "raw"), "webdataset": ("webdataset", "wds"), "webdataset-pillow": ("webdataset", "wds"),
    "webdataset-plain": ("webdataset", "wds-plain"), "webdataset-unverified": ("webdataset", "wds"),
    "webdataset-shards": ("webdataset", "wds-shards"),
    "ffcv": ("ffcv", "ffcv"),
    "ffcv-proportion": ("ffcv", "ffcv-proportion"), "ffcv-bare": ("ffcv-bare", "ffcv"),
    "dali-folder": ("dali", "raw"), "dali-wds": ("dali", "wds"), "dali-wds-unverified": ("dali", "wds"),
    "dali-bare": ("dali-bare", "wds"),
    "synthetic": ("synthetic", None)}
# name -> LoaderSpec options it sets beyond the benchmark's own
SPEC_OPTIONS = {"webdataset-pillow": {"native_decode": False},   # the webdataset backend's Pillow path
                "webdataset-unverified": {"verify": False}, "dali-wds-unverified": {"verify": False}}   # what checks cost
REFERENCES = (*BOUNDS, *FLOORS)                   # no loader: they read the wds form and measure no CPU or memory
# form -> (converter, its options, how `dataset` describes it)
CONVERSIONS = {
    "wds": ("convert_wds.py", ["--max-resolution", "512"], "wds, max side 512 (photos kept at their size)"),
    "wds-plain": ("convert_wds.py", ["--max-resolution", "512", "--no-restart-markers"],
                  "wds, max side 512, no restart markers (the photos' own bytes)"),
    "wds-shards": ("convert_wds.py", ["--max-resolution", "512", "--shard-size-mb", "4"],
                   "wds, max side 512, shards of 4 MB (a split of many shards)"),
    "ffcv": ("convert_ffcv.py", ["--write-mode", "jpg", "--max-resolution", "512"],
             "ffcv jpg q90, max side 512 (same pixels, re-encoded)"),
    "ffcv-proportion": ("convert_ffcv.py", ["--write-mode", "proportion", "--compress-probability", "0.5",
                                            "--max-resolution", "256"],
                        "ffcv proportion 0.5 q90, max side 256 (FFCV's recommended storage)")}


def split_decode_stage(engine_us: dict, floor_us: dict) -> dict:
    """The engine's `decode` stage in two: the Huffman decoding of the crop's MCUs (with libjpeg's
    start), which is the floor's own `decode` stage over the same crops, and the rest, libjpeg's
    IDCT, upsampling and colour conversion."""
    entropy = floor_us["decode"]
    return {"entropy": entropy, "idct_upsampling_colour": engine_us["decode"] - entropy}


def convert(form: str, source: Path, cache: Path) -> Path:
    """The conversion `form` of `source` under `cache`, made now unless already up to date."""
    script, options, _ = CONVERSIONS[form]
    out = cache / f"{source.name}-{form}"
    converter = "pipeline.convert." + script.removeprefix("convert_").removesuffix(".py")   # what the script runs
    result = subprocess.run([sys.executable, "-m", converter, str(source), str(out), *options],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {script} {source} {out} failed: {result.stderr.strip().splitlines()[-1]}")
    return out


def form_of(name: str) -> str | None:
    """The data form a backend, bound or floor reads."""
    return "wds" if name in REFERENCES else CONFIGURATIONS[name][1]


def known_backends(text: str) -> list[str]:
    """An argparse type: comma-separated names of bounds and configurations."""
    names = text.split(",")
    unknown = [name for name in names if name not in CONFIGURATIONS and name not in REFERENCES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend {unknown[0]!r}; choose from "
                                         f"{', '.join([*REFERENCES, *CONFIGURATIONS])}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/sample/photos"),
                        help="ImageNet-layout folder (make demo writes data/sample/photos)")
    parser.add_argument("--cache", type=Path, default=Path("data/bench"), help="where conversions are kept")
    parser.add_argument("--backends", type=known_backends, default="decode_bound,gpu_decode_bound,decode_floor,folder,webdataset,webdataset-plain,webdataset-pillow,ffcv,ffcv-proportion,"
                        "ffcv-bare,dali-folder,dali-wds,dali-bare",
                        help="comma-separated: " + ", ".join([*REFERENCES, *CONFIGURATIONS]))
    parser.add_argument("--splits", default="train,val")
    parser.add_argument("--resolutions", default="160", help="train resolutions, comma-separated")
    parser.add_argument("--val-resolutions", default="224")
    parser.add_argument("--workers", default="2", help="worker counts (threads for DALI), comma-separated")
    parser.add_argument("--cores", help="vCPU counts to pin each figure to, comma-separated, with as many workers "
                        "(instead of --workers): how each loader scales with cores")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up one")
    parser.add_argument("--rounds", type=int, default=1, help="each backend measured this many times, alternating "
                        "with the others of its split and resolution; the median round is kept")
    parser.add_argument("--instance-type", help="e.g. p4d.24xlarge, recorded with the hardware")
    parser.add_argument("--device", default="cpu", help="where the loaders deliver batches: cpu or cuda")
    parser.add_argument("--hw-decoder-loads", default=None,
                        help="dali on CUDA: shares of JPEGs for the hardware decoder, comma-separated (default 0.65)")
    parser.add_argument("--remote", help="also read each webdataset conversion from a URL, beside local disk: "
                        "'http', 's3', 's3-nginx' or 'gs-nginx' (a server started here on loopback over --cache: nginx, "
                        "moto's S3 server, or S3 or GCS requests answered by nginx; benchmarks/remote_sources.py) or the "
                        "URL of a folder holding the conversions under their --cache names")
    parser.add_argument("--fetch-size", help="with --remote: the loaders' data.fetch_size (default 1MiB), e.g. "
                        "64KiB where one batch reads from every 1 MiB block of a small split")
    parser.add_argument("--latency-ms", type=float, default=0,
                        help="with --remote: this round trip added to each request (see --latency-in)")
    parser.add_argument("--latency-in", choices=("proxy", "server"), default="proxy",
                        help="with --latency-ms: a user-space proxy in front of the server (any plain-http one), or "
                        "nginx's own answers delayed (--remote http, s3-nginx or gs-nginx; needs libnginx-mod-http-echo), which spares "
                        "the machine's cores the proxy's copies")
    parser.add_argument("--remote-cache", choices=("streamed", "kept"), default="streamed",
                        help="with --remote: a cache limit of half the split, so that every epoch streams through "
                        "memory, or of twice the split, so that the first epoch fills the cache on disk")
    add_results_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    backends = list(args.backends)
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if not args.source.is_dir():
        parser.error(f"--source {args.source}: no such folder (make demo writes data/sample/photos)")
    hw_loads = [float(load) for load in args.hw_decoder_loads.split(",")] if args.hw_decoder_loads else [None]
    if "gpu_decode_bound" in backends and not torch.cuda.is_available():
        backends.remove("gpu_decode_bound")
        print("# no CUDA: gpu_decode_bound left out")
    forms = {"raw": (args.source, f"{args.source.name} (raw folder)")}
    for name in backends:
        form = form_of(name)
        if form and form not in forms:
            forms[form] = (convert(form, args.source, args.cache), f"{args.source.name} ({CONVERSIONS[form][2]})")

    if args.latency_ms and not args.remote:
        parser.error("--latency-ms needs --remote")
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(RemoteSource(args.remote, args.cache, args.latency_ms, args.latency_in)) if args.remote else None
        return run_all(args, backends, forms, hw_loads, source)


def _options(name: str, hw_load: float | None) -> dict:
    return {**SPEC_OPTIONS.get(name, {}), **({} if hw_load is None else {"hw_decoder_load": hw_load})}


def _config(args, variant: tuple, split: str, resolution: int, cores: int, workers: int, forms: dict, source,
            all_cpus: int) -> dict:
    """What `measure` is given for one variant (backend, hardware-decoder share, from a URL or not)."""
    name, hw_load, remote = variant
    kind, form = name if name in REFERENCES else CONFIGURATIONS[name][0], form_of(name)
    config = {"kind": kind, "path": str(forms[form][0]) if form else None, "split": split,
              "options": _options(name, hw_load), "resolution": resolution, "workers": workers,
              "batch_size": args.batch_size, "epochs": args.epochs, "device": args.device,
              "cores": cores if cores < all_cpus else None,
              "synthetic_size": 2300 if split == "train" else 575}
    if remote:      # a cache of half the split, where every epoch streams, or one that keeps it
        stored = split_bytes(forms[form][0], split)
        config.update(path=source.url_for(forms[form][0]),
                      remote={"environment": source.environment, "server_cpu_ids": source.cpu_ids(),
                              "cache_limit": stored // 2 if args.remote_cache == "streamed" else 2 * stored})
        if args.fetch_size:
            config["options"] = {**config["options"], "fetch_size": args.fetch_size}
    return config


def _measure_variant(config: dict) -> dict | str:
    """`benchmarks/loader_run.py`'s measure(config) in a fresh process: its figures, or the last
    line of its error."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.loader_run", json.dumps(config)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        return (run.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(run.stdout.strip().splitlines()[-1])


def median_round(runs: list[dict]) -> dict:
    """Of one variant's rounds, the figures of the round with the median img/s (the lower of the
    middle two), with every round's img/s beside them where there were several."""
    figures = dict(sorted(runs, key=lambda run: run["img_per_s"])[(len(runs) - 1) // 2])
    if len(runs) > 1:
        figures["img_per_s_rounds"] = [run["img_per_s"] for run in runs]
    return figures


def run_all(args, backends: list[str], forms: dict, hw_loads: list, source) -> int:
    hardware = signature(args.instance_type)
    print(f"# {cpu_words(hardware)}, {hardware['cpu_cores']} cores, {hardware['gpu_count']} GPUs; batch "
          f"{args.batch_size}; median of {args.epochs} epochs after a warm-up" +
          (f"; the median of {args.rounds} alternating rounds" if args.rounds > 1 else ""))
    print(f"{'backend':<16} {'split':<5} {'res':>4} {'workers':>7} {'img/s':>7} {'x bound':>7} {'cpu':>5} {'MiB':>6}")
    all_cpus = len(cpus_by_core())
    # (vCPUs pinned to, workers): matched when scaling with cores, else the whole machine
    placements = ([(cores, cores) for cores in map(int, args.cores.split(","))] if args.cores
                  else [(all_cpus, workers) for workers in map(int, args.workers.split(","))])
    # DALI on CUDA once per hardware-decoder share asked for; everything else once
    on_gpu = args.device.startswith("cuda")
    variants = [(name, load, False) for name in backends
                for load in (hw_loads if on_gpu and name.startswith("dali") else [None])]
    if source:      # each remote reading right after the same backend from local disk
        variants = [v for name, load, _ in variants
                    for v in [(name, load, False)] + ([(name, load, True)] if CONFIGURATIONS.get(name, ("",))[0]
                                                      in REMOTE_BACKENDS else [])]
        print(f"# remote: {source.describe()}; " + ("a cache of half the split, so that every epoch streams"
                                                      if args.remote_cache == "streamed" else
                                                      "a cache of twice the split, filled in the first epoch"))
    local_figures = {}
    written, bound, floor, path = 0, {}, {}, None
    for split in args.splits.split(","):
        resolutions = args.resolutions if split == "train" else args.val_resolutions
        for resolution in map(int, resolutions.split(",")):
            for cores, workers in placements:
                # Every round measures each variant once, in order, so that the machine's drift falls on all alike.
                # A bound is resolution-independent: once per split and cores, unless rounds ask for it beside
                # each resolution's loaders.
                bound_at = (split, cores, resolution) if args.rounds > 1 else (split, cores)
                rounds, failed = {variant: [] for variant in variants}, {}
                for _ in range(args.rounds):
                    for variant in variants:
                        if (variant[0] in BOUNDS and (variant[0], bound_at) in bound) or variant in failed:
                            continue
                        result = _measure_variant(_config(args, variant, split, resolution, cores, workers, forms,
                                                          source, all_cpus))
                        if isinstance(result, str):
                            failed[variant] = result
                        else:
                            rounds[variant].append(result)
                for variant in variants:
                    name, hw_load, remote = variant
                    label = (name if hw_load is None else f"{name}@hw{hw_load:g}") + ("@remote" if remote else "")
                    options = _options(name, hw_load)
                    if variant in failed:
                        print(f"{label:<16} {split:<5} {resolution:>4} {workers:>7} failed: {failed[variant]}",
                              flush=True)
                        continue
                    if name in BOUNDS and (name, bound_at) in bound:
                        figures = bound[(name, bound_at)]
                    else:
                        figures = median_round(rounds[variant])
                        if name in BOUNDS:
                            bound[(name, bound_at)] = figures
                    reference = bound.get(("decode_bound", bound_at), {}).get("img_per_s")
                    share = figures["img_per_s"] / reference if reference else None
                    if remote and (name, split, resolution, workers) in local_figures:
                        local_rate, local_first = local_figures[(name, split, resolution, workers)]
                        figures["share_of_local"] = figures["img_per_s"] / local_rate
                        # against local disk's own first epoch, which also starts cold (threads, the decoder's buffers)
                        figures["first_epoch_share_of_local"] = first_epoch_rate(figures) / local_first
                        figures["remote"] = source.describe()
                    elif not remote and "warmup_seconds" in figures:     # a loader, not a bound
                        local_figures[(name, split, resolution, workers)] = figures["img_per_s"], first_epoch_rate(figures)
                    if name in FLOORS:
                        floor[(split, resolution, workers, cores)] = figures
                    elif name == "webdataset" and (split, resolution, workers, cores) in floor:
                        floor_figures = floor[(split, resolution, workers, cores)]
                        figures["share_of_decode_floor"] = figures["img_per_s"] / floor_figures["img_per_s"]
                        if "engine_us_per_image" in figures and "engine_us_per_image" in floor_figures:
                            figures["decode_stage_us"] = split_decode_stage(
                                figures["engine_us_per_image"], floor_figures["engine_us_per_image"])
                    form = form_of(name)
                    # A bound measures neither a loader's CPU share nor its memory: a dash, not a 0
                    cpu, memory = (None, None) if name in REFERENCES else (figures.get("cpu_util"), figures.get("peak_rss_mb"))
                    print(f"{label:<16} {split:<5} {resolution:>4} {workers:>7} {figures['img_per_s']:>7.0f} "
                          f"{share if share is not None else float('nan'):>7.2f} "
                          f"{'-' if cpu is None else format(cpu, '.0%'):>5} "
                          f"{'-' if memory is None else format(memory, '.0f'):>6}", flush=True)
                    if remote:
                        print(" " * 18 + remote_line(figures))
                    if "engine_us_per_image" in figures and name not in FLOORS:
                        split_line = figures.get("decode_stage_us")
                        print(" " * 18 + "engine, CPU us per image: " + ", ".join(
                            f"{stage} {us:.0f}" + (f" (entropy {split_line['entropy']:.0f}, IDCT + upsampling + colour "
                                                   f"{split_line['idct_upsampling_colour']:.0f})"
                                                   if stage == "decode" and split_line else "")
                            for stage, us in figures["engine_us_per_image"].items()) +
                            (f"; {figures['share_of_decode_floor']:.2f}x the decode floor's img/s"
                             if "share_of_decode_floor" in figures else ""))
                    # Written as each split and resolution ends, so that an interrupted long run keeps what it measured.
                    path = append_results([{
                        "benchmark": "loaders", "backend": name + ("@remote" if remote else ""), "split": split, "resolution": resolution,
                        "workers": workers if name != "decode_bound" else cores, "cores": cores,
                        "batch_size": args.batch_size, "dataset": forms[form][1] if form else "synthetic",
                        "device": "cuda" if name == "gpu_decode_bound" else args.device, **options,
                        "share_of_decode_bound": share, **figures}], hardware, results_folder(args), quiet=True)
                    written += 1
    print(f"# {written} rows appended to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}" if path else
          f"# {written} rows not saved: --save or --results-dir DIR keeps them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
