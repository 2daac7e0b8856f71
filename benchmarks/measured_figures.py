"""The figures a projection stands on, each with where it comes from: a GPU's model-bound img/s
(benchmarks/models.py rows, else a published figure), a loader's img/s on so many vCPUs
(benchmarks/loaders.py rows, on this kind of CPU or a kin one), and, for a loader that decodes on
the GPU, the share of the model-bound rate the step keeps beside it (`e2e` rows of
tools/diagnose.py and tools/compare_settings.py).

Three kinds of source, always said:
- measured: rows of a machine of this kind (same GPU model; same CPU family and vector extension);
- kin: a loader measured on a CPU of the same family with the other vector extension
  (AMD EPYC with AVX-512 for one without), which decodes at a different speed per core;
- published: a GPU never measured here, from NVIDIA's or MLPerf's tables (catalog/published_rates.csv).
  Those are at 224 px in fp16 AMP; the figure at another side and precision follows the measured
  GPU's own curve: published x measured(side, precision) / measured(224, the published precision).

A figure that cannot be had is a NoFigure naming what is missing and the command that measures it:
nothing is invented.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import re
import statistics
from pathlib import Path

from benchmarks.hardware import cpu_words
from training.config import ConfigError
from training.projection import seconds_per_image

PUBLISHED = Path(__file__).resolve().parent / "catalog" / "published_rates.csv"
# the planner's backends -> their name in the loader benchmark's rows
LOADER_ROWS = {"webdataset": "webdataset", "ffcv": "ffcv", "dali": "dali-wds", "folder": "folder"}
GPU_DECODE = {"dali"}           # measured only where it decodes: rows with device cuda
GPU_NAMES = [("H200", r"H200"), ("H100-80GB", r"H100"), ("A100-80GB", r"A100.*80\s*GB"), ("A100-40GB", r"A100"),
             ("L40S", r"L40S"), ("A10G", r"A10G"), ("L4", r"\bL4\b")]


class NoFigure(LookupError):
    """What is missing, and the command that would measure it."""


@dataclasses.dataclass(frozen=True)
class Figure:
    img_per_s: float
    kind: str           # measured | kin | published
    source: str         # where, in words a table can carry


def gpu_model(name: str) -> str:
    """nvidia-smi's name -> the catalog's: 'NVIDIA H100 80GB HBM3' -> 'H100-80GB'."""
    return next((short for short, pattern in GPU_NAMES if re.search(pattern, name, re.IGNORECASE)), name)


def cpu_family(cpu_model: str) -> str:
    """'AMD EPYC 7R13' and 'AMD EPYC' -> 'amd epyc'; 'Intel(R) Xeon(R) Platinum 8275CL' -> 'intel xeon'."""
    words = re.sub(r"\((r|tm)\)", "", cpu_model, flags=re.IGNORECASE).lower().split()
    return " ".join(words[:2])


def result_rows(directory: Path) -> list[dict]:
    """Every row of the results files directly in `directory` (one per kind of machine), with its file."""
    rows = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append({**json.loads(line), "_file": path.name})
    return rows


def by_pixels(rates: dict[int, float], side: int, measure: str) -> float:
    """img/s at `side` from img/s at other sides (training.projection's interpolation)."""
    try:
        return 1 / seconds_per_image(side, rates, measure)
    except ConfigError as error:
        raise NoFigure(str(error)) from None


class ModelRates:
    """A GPU's model-bound train- or eval-step img/s at a side, measured or published."""

    def __init__(self, rows: list[dict], published: Path = PUBLISHED):
        self.rows = [row for row in rows if row.get("benchmark") == "models" and row.get("device") == "cuda"]
        self.published = read_published(published)

    def measured(self, gpu: str, model: str, step: str, precision: str, channels_last: bool,
                 compile: bool, instance: str = "") -> tuple[dict[int, float], str]:
        """side -> median img/s of the matching rows (of `instance`'s own rows if named), and their files."""
        by_side: dict[int, list[float]] = {}
        files = set()
        for row in self.rows:
            on_it = (row["hardware"].get("instance_type") == instance if instance
                     else gpu_model(row["hardware"]["gpu_model"]) == gpu)
            if (on_it and row["model"] == model and row["step"] == step
                    and row["precision"] == precision and row["channels_last"] == channels_last
                    and row["compile"] == compile):
                by_side.setdefault(row["resolution"], []).append(row["img_per_s"])
                files.add(row["_file"])
        return {side: statistics.median(values) for side, values in by_side.items()}, ", ".join(sorted(files))

    def rate(self, gpu: str, model: str, step: str, side: int, precision: str, channels_last: bool,
             compile: bool, instance: str = "") -> Figure:
        command = (f"python benchmarks/models.py --models {model} --precisions {precision} --steps {step} "
                   f"--resolutions {side},224 --compile {'on' if compile else 'off'} --device cuda")
        for on in ([instance] if instance else []) + [""]:
            rates, files = self.measured(gpu, model, step, precision, channels_last, compile, on)
            if rates:
                return Figure(by_pixels(rates, side, command), "measured", f"{on or gpu}, {files}")
        published = [p for p in self.published if p["gpu_model"] == gpu and p["model"] == model]
        if not published:
            raise NoFigure(f"no {model} {step} figure for {gpu}, measured or published; on one, run {command}")
        figure = published[0]
        for reference in sorted({gpu_model(row["hardware"]["gpu_model"]) for row in self.rows}):
            shape, _ = self.measured(reference, model, step, precision, channels_last, compile)
            level, _ = self.measured(reference, model, "train", figure["precision"], channels_last, False)
            if shape and figure["resolution"] in level:
                try:
                    ratio = by_pixels(shape, side, command) / level[figure["resolution"]]
                except NoFigure:
                    continue
                return Figure(figure["img_per_s"] * ratio, "published",
                              f"{gpu}: {figure['what']}, {figure['img_per_s']:g} img/s at {figure['resolution']} px "
                              f"({figure['source']}, {figure['source_date']}); other sides, steps and precisions "
                              f"along the {reference}'s measured curve")
        raise NoFigure(f"{gpu} has a published {model} figure, but no GPU here is measured at {figure['resolution']} "
                       f"px {figure['precision']} to carry it to {side} px {precision}; on one, run {command}")


def read_published(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for row in rows:
        row["resolution"], row["img_per_s"] = int(row["resolution"]), float(row["img_per_s"])
    return rows


class LoaderRates:
    """A loader's img/s per split and side on so many vCPUs of a kind of CPU, from the loader
    benchmark's rows (`cores`: the vCPUs a figure was pinned to, else all of its machine's)."""

    def __init__(self, rows: list[dict]):
        self.rows = [row for row in rows if row.get("benchmark") == "loaders" and "@" not in row.get("backend", "")]
        # A projection asks for the same few curves hundreds of times (each instance, GPU count and side):
        # rows are grouped once by what a curve selects on first, and each curve is built once.
        self._by_backend_split: dict[tuple[str, str], list[tuple[str, dict]]] = {}
        for row in self.rows:
            self._by_backend_split.setdefault((row["backend"], row["split"]), []).append(
                (cpu_family(row["hardware"]["cpu_model"]), row))
        self._curves: dict[tuple, dict[int, dict[int, dict]]] = {}

    def kinds(self) -> list[tuple[str, str]]:
        return sorted({(family, row["hardware"].get("cpu_isa", "")) for rows in self._by_backend_split.values()
                       for family, row in rows})

    def curve(self, family: str, isa: str, backend: str, split: str, instance: str = "") -> dict[int, dict[int, dict]]:
        """side -> cores -> the newest row at that many cores, of rows measured on `instance` if named,
        else on CPUs of this family and vector extension."""
        key = (family, isa, backend, split, instance)
        if key in self._curves:
            return self._curves[key]
        curve: dict[int, dict[int, dict]] = {}
        for row_family, row in self._by_backend_split.get((LOADER_ROWS[backend], split), []):
            hardware = row["hardware"]
            on_it = (hardware.get("instance_type") == instance if instance else
                     row_family == family and hardware.get("cpu_isa", "") == isa)
            if not on_it or (backend in GPU_DECODE and row.get("device") != "cuda"):
                continue
            cores = row.get("cores") or hardware["cpu_cores"]
            at = curve.setdefault(row["resolution"], {})
            if cores not in at or row.get("unix_time", 0) >= at[cores].get("unix_time", 0):
                at[cores] = row
        self._curves[key] = curve
        return curve

    def rate(self, cpu: str, isa: str, backend: str, split: str, side: int, vcpus: float, instance: str = "") -> Figure:
        """On rows of `instance` itself (benchmarks run there with --instance-type) where it has them, else on
        this kind of CPU, else on a kin one."""
        family = cpu_family(cpu)
        command = (f"python benchmarks/loaders.py --cores 1,2,4,...,N --backends {LOADER_ROWS[backend]} "
                   f"--splits {split}" + (" --device cuda" if backend in GPU_DECODE else ""))
        places = [("measured", isa, instance)] if instance else []
        places += [("measured", isa, ""), *(("kin", other, "") for other in ("avx512", "avx2") if other != isa)]
        for kind, measured_isa, on in places:
            curve = self.curve(family, measured_isa, backend, split, on)
            if not curve:
                continue
            rates = {s: along_cores(points, vcpus) for s, points in curve.items()}
            cores = sorted({c for points in curve.values() for c in points})
            where = on or cpu_words(next(iter(next(iter(curve.values())).values()))["hardware"])
            how = (f"at {vcpus:g} vCPUs" if vcpus in cores else
                   f"{'interpolated' if cores[0] <= vcpus <= cores[-1] else 'extrapolated linearly'} "
                   f"from {', '.join(map(str, cores))} vCPUs")
            if side in rates or len(rates) > 1:
                return Figure(by_pixels(rates, side, command), kind, f"{where}, {how}")
            [(measured_side, rate)] = rates.items()
            ratio, shape = self.side_ratio(backend, split, measured_side, side, command)
            return Figure(rate * ratio, kind, f"{where}, {how}; {side} px along the {shape}'s curve")
        raise NoFigure(f"no {backend} {split} figure on {cpu_words({'cpu_model': cpu, 'cpu_isa': isa})} or a kin CPU; "
                       f"on one, run {command}")

    def side_ratio(self, backend: str, split: str, measured: int, side: int, command: str) -> tuple[float, str]:
        """img/s at `side` over img/s at `measured`, on the first kind of CPU measured at two sides or more:
        a kind measured at one side only takes the shape of its curve from another."""
        for family, isa in self.kinds():
            curve = self.curve(family, isa, backend, split)
            if len(curve) > 1 and measured in curve:
                rates = {s: along_cores(points, 1) for s, points in curve.items()}
                words = cpu_words(next(iter(curve[measured].values()))["hardware"])
                return by_pixels(rates, side, command) / rates[measured], words
        raise NoFigure(f"the recipe needs {backend} {split} at {side} px and no CPU is measured at {measured} px and "
                       f"another side; run {command} --resolutions {measured},{side}")


@dataclasses.dataclass(frozen=True)
class StepShare:
    share: float        # of the model alone, beside the loader
    source: str


class StepShares:
    """The train step's share of the model alone while a loader that decodes on the GPU feeds it:
    DALI's nvJPEG stages and resize take SMs from the step, which the model-bound rate does not
    see. The median of the `e2e` rows of local reads whose loader alone outran the model (so the
    share is the step's, not the loader's) on this GPU, else on every GPU measured so (said)."""

    def __init__(self, rows: list[dict]):
        self.rows = [row for row in rows if row.get("benchmark") == "e2e" and row.get("device", "").startswith("cuda")
                     and row.get("data_from") == "local" and row["loader_img_per_s"] > row["model_img_per_s"]]

    def share(self, gpu: str, backend: str, model: str) -> StepShare:
        beside = [row for row in self.rows if row["backend"] == backend and row["model"] == model]
        on_it = [row for row in beside if gpu_model(row["hardware"]["gpu_model"]) == gpu]
        rows = on_it or beside
        if not rows:
            raise NoFigure(f"no end-to-end {backend} figure on a GPU, and its decode takes from the step; on one, run "
                           f"python tools/diagnose.py --config RECIPE data.backend={backend} --results-dir "
                           f"benchmarks/results")
        shares = [row["share_of_model"] for row in rows]
        measured_on = ", ".join(sorted({gpu_model(row["hardware"]["gpu_model"]) for row in rows}))
        return StepShare(statistics.median(shares),
                         f"{model} step beside {backend} on {measured_on}: {statistics.median(shares):.0%} of the "
                         f"model alone, median of {len(shares)} end-to-end runs ({min(shares):.0%}-{max(shares):.0%})"
                         + ("" if on_it else f"; not measured so on {gpu}"))


def along_cores(points: dict[int, dict], vcpus: float) -> float:
    """img/s at `vcpus` from img/s at the measured core counts: linear between two of them, and
    in proportion to the nearest beyond them (a loader's decode work splits over its workers)."""
    cores = sorted(points)
    if vcpus <= cores[0]:
        return points[cores[0]]["img_per_s"] * vcpus / cores[0]
    if vcpus >= cores[-1]:
        return points[cores[-1]]["img_per_s"] * vcpus / cores[-1]
    high = next(c for c in cores if c >= vcpus)
    low = max(c for c in cores if c <= vcpus)
    if high == low:
        return points[low]["img_per_s"]
    weight = (vcpus - low) / (high - low)
    return points[low]["img_per_s"] * (1 - weight) + points[high]["img_per_s"] * weight
