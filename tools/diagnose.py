"""Is this run data-bound? Loader alone vs model alone vs both together, and a verdict.

    python tools/diagnose.py --config RECIPE.yaml [key=value ...] [--steps 100] [--warmup 10]
                             [--epoch 0] [--ranks-per-machine 1] [--free-running] [--json PATH]
                             [--results-dir benchmarks/results]

Takes what `training/main.py` takes (a recipe and dotted overrides; a bad config or dataset
is one line on stderr and exit 2) and measures, in ONE process, one rank's view of the run:
1. loader alone: the recipe's train loader, batches fetched and dropped;
2. model alone: the real train step (forward under autocast, loss, backward, optimizer
   step) with the recipe's model, batch, resolution, precision, channels_last and compile,
   fed by the `synthetic` backend (random batches already on the device);
3. together: the real loader feeding the real step; time blocked on the next batch is
   "waiting for data". On CUDA each step is synchronised, so step time is GPU time and
   waiting means the GPU sat idle (the loader's workers still prefetch during the step).
4. on CUDA (or with --free-running), model alone and together again without that sync, as
   training runs: the host fetches the next batch while the GPU computes, so the per-batch
   host work of a loader (DALI's output handling, say) hides behind the step. Their ratio is
   the share of model-bound that training reaches end to end.
Each figure is img/s over `--steps` steps after `--warmup` untimed ones (worker start-up,
FFCV's compilation, torch.compile). Every pass re-runs epoch `--epoch`, so a resolution
schedule stays at that epoch's size; when --warmup + --steps exceed one epoch of the data, the
timed steps include the loader's start of a new pass, which training pays once an epoch (and
DALI's loader starts during the previous one): the report says so (on an H100 with 179-batch
epochs, 400 steps cut DALI's loader-alone figure from 27,000-30,000 to 8,600-19,800 img/s).
Defaults: 100 timed steps after 10 warm-up ones per
figure, chosen so that the fashion recipe finishes in about 2 minutes on 2 CPU cores (longer
when other jobs share them); --steps 300 gives steadier figures.

The run is built as training builds it (training/run.py) and every step is the trainer's own
(`Trainer.train_step`), so the recipe's algorithms ARE applied as in training: the loader
specs they settle (progressive resizing, ColOut, RandAugment), their model surgery at INIT and
their per-step hooks (FIT_START once, then AFTER_DATALOADER to BATCH_END every step); nothing is
evaluated or saved.

Verdict (NOISE = 10%): DATA-BOUND when the loader alone delivers less than 90% of the model
alone's img/s, or the together run waits for data more than 10% of the time; otherwise
BALANCED when the loader alone is within 10% of the model alone, else MODEL-BOUND. On a
machine without an accelerator the loader workers and the model share the CPU cores, so
"together" can fall below both alone figures: flagged as CPU contention when it is more
than 10% below the slower one. On a GPU, when the step as training runs is more than 10% slower
beside the loader than alone although it hardly waits for data (at most 10% of the time), the
loader slows the step itself: flagged as `loader_slows_step`. Measured so on an H100 with DALI
`mixed` (resnet50_mild at 176 px: 72-86% of model-bound, waiting 2%): nvJPEG's CUDA stages and
the resize take SMs from the step, and the step plus the loader's GPU time per image predicts
the rate seen; with every JPEG on the hardware decoder (`data.hw_decoder_load=1`) the share rose
in each of three paired runs. Suggestions follow, with numbers, only those that apply.

Unless the run is data-bound, the model alone is also measured briefly at a lower resolution
and in the other of fp32 and bf16: which precision is faster on a CPU depends on the machine,
not on its name (bf16 about 1.4x faster on a 2-core AMD EPYC with avx512_bf16, 13-16x slower on an
AVX2-only one, slower on a 2-core Xeon that has avx512_bf16; docs/troubleshooting.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks.hardware import results_path, signature
from measuring import (add_results_dir_option, data_from, e2e_row, load_measuring_config, measure, measured_run,
                       run_one_rank, synthetic_twin)
from training.distributed import init_world
from training.precision import autocast_for
from training.trainer import Trainer

NOISE = 0.10          # relative differences below this are noise on shared machines
LOWER_SCALE = 0.75    # the lower resolution tried for the model: 224 -> 168 px


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. algorithms/recipes/fashion_baseline.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.num_workers=2")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each measurement (default 10)")
    parser.add_argument("--epoch", type=int, default=0, help="the epoch measured: its resolution (default 0)")
    parser.add_argument("--ranks-per-machine", type=int, default=1,
                        help="training processes per machine: they share its cores (default 1)")
    parser.add_argument("--free-running", action="store_true",
                        help="also model alone and together without a sync per step, as training runs "
                             "(always on CUDA)")
    parser.add_argument("--json", type=Path, help="also write the figures and verdict here (atomically)")
    add_results_dir_option(parser)
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.epoch < 0 or args.ranks_per_machine < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --epoch >= 0, --ranks-per-machine >= 1")
    return args


# --- judging -----------------------------------------------------------------------------
def verdict(loader_ips: float, model_ips: float, wait_share: float) -> str:
    ratio = loader_ips / model_ips
    if ratio < 1 - NOISE or wait_share > NOISE:
        return "DATA-BOUND"
    return "BALANCED" if ratio <= 1 + NOISE else "MODEL-BOUND"


def loader_slows_step(figures: dict, on_cuda: bool) -> bool:
    """On a GPU, as training runs: the step hardly waits for data, yet beside the loader it runs more
    than NOISE slower than alone (module doc)."""
    free = figures.get("free_running")
    return bool(on_cuda and free and figures["wait_share"] <= NOISE
                and free["together_img_per_s"] < (1 - NOISE) * free["model_img_per_s"])


def explain(figures: dict, cores: int) -> str:
    ratio, wait = figures["loader_img_per_s"] / figures["model_img_per_s"], figures["wait_share"]
    text = {"DATA-BOUND": f"The loader delivers {ratio:.0%} of what the model can take." if ratio < 1 - NOISE else
            f"The loader alone keeps up ({ratio:.2f}x the model), but together the step waited {wait:.0%} of "
            f"the time for data.",
            "BALANCED": f"Loader and model are within noise ({NOISE:.0%}) of each other (the loader delivers "
                        f"{ratio:.0%} of what the model takes): speeding up one alone gains little.",
            "MODEL-BOUND": f"The loader delivers {ratio:.1f}x what the model can take: the train step is the "
                           f"bottleneck."}[figures["verdict"]]
    slower = min(figures["loader_img_per_s"], figures["model_img_per_s"])
    if figures["together_img_per_s"] > (1 + NOISE) * slower:
        text += (f" Unsteady figures: together ran {figures['together_img_per_s'] / slower - 1:.0%} faster than the "
                 f"slower of the two alone, which a steady machine does not do: most likely other jobs came or went "
                 f"between the measurements; rerun with more --steps on a quiet machine.")
    if figures["cpu_contention"]:
        text += (f" CPU contention: with no accelerator, loader workers and the model share the {cores} cores, so "
                 f"together runs at {figures['together_img_per_s'] / slower:.0%} of the slower of the two alone.")
    if figures.get("loader_slows_step"):
        free = figures["free_running"]
        share = free["together_img_per_s"] / free["model_img_per_s"]
        text += (f" Yet as training runs, together reaches only {share:.0%} of the model alone while waiting for "
                 f"data {figures['wait_share']:.0%} of the time: the loader slows the step itself, with its own GPU "
                 f"work (decode, resize) or its threads beside the one that launches the step.")
    return text


def backend_from_results(side: int, current: str) -> str | None:
    """The best train-loader figure measured on this kind of machine at the nearest resolution, if not ours."""
    path = results_path(signature())
    if not path.exists():
        return f"another backend: run benchmarks/loaders.py --save to compare backends here (no {path.name} yet)"
    rows = [row for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            for row in [json.loads(line)] if row.get("benchmark") == "loaders" and row.get("split") == "train"
            and row.get("backend") != "synthetic" and {"resolution", "img_per_s"} <= row.keys()]
    if not rows:
        return f"another backend: {path.name} has no loader figures; run benchmarks/loaders.py --save"
    nearest = min({row["resolution"] for row in rows}, key=lambda res: abs(res - side))
    best = max((row for row in rows if row["resolution"] == nearest), key=lambda row: row["img_per_s"])
    if best["backend"].split("-")[0] == current:   # "dali-wds" is backend dali
        return None
    return (f"data.backend={best['backend'].split('-')[0]}: {best['backend']} is the fastest measured on this "
            f"machine at {nearest} px, {best['img_per_s']:,.0f} img/s with {best.get('workers', '?')} workers "
            f"({path.name}, {best.get('dataset', 'its dataset')})")


def suggestions(figures: dict, config, spec, cores: int, ranks: int, on_cuda: bool) -> list[str]:
    tips, per_rank = [], max(1, cores // ranks)
    if figures.get("loader_slows_step") and spec.backend == "dali":
        if spec.hw_decoder_load < 1:
            tips.append(f"data.hw_decoder_load=1 (now {spec.hw_decoder_load:g}): every JPEG to the GPU's hardware "
                        f"decoder, which leaves the SMs to the step (nvJPEG's CUDA decode does not)")
        if config.step_stream == "default":
            tips.append("step_stream=high_priority: the step's kernels go first and the loader's fill its gaps "
                        "(not yet measured on a GPU here; tools/compare_settings.py settles it in alternating rounds)")
        tips.append(f"a loader that decodes on the CPU (data.backend=webdataset or ffcv) leaves the GPU to the step, "
                    f"if this machine's cores decode more than the model's {figures['model_img_per_s']:,.0f} img/s "
                    f"(benchmarks/loaders.py --backends decode_bound,webdataset,ffcv --device cuda --save)")
    # FFCV sets torch's thread count to its own workers, so only other backends can be told apart
    if figures["cpu_contention"] and spec.backend != "ffcv" and figures["torch_threads"] + spec.num_workers > per_rank:
        tips.append(f"OMP_NUM_THREADS={max(1, per_rank - spec.num_workers)} (the model runs {figures['torch_threads']} "
                    f"threads beside {spec.num_workers} loader worker(s) on {per_rank} cores): on oversubscribed "
                    f"cores torch's threads wait for each other; torchrun sets 1 per rank unless told otherwise")
    if figures["verdict"] != "MODEL-BOUND":
        workers = max(1, spec.num_workers)
        if workers < per_rank:
            tips.append(f"data.num_workers={per_rank} (now {spec.num_workers}; {spec.num_workers} x {ranks} rank(s) "
                        f"on {cores} cores): about {figures['loader_img_per_s'] * per_rank / workers:,.0f} img/s "
                        f"if decode scales with workers (estimate)"
                        + ("" if on_cuda else "; here they also take cores from the model"))
        else:
            tips.append(f"workers already fill this rank's share of the cores ({spec.num_workers} x {ranks} rank(s) "
                        f"on {cores}): more workers will not help here; more CPU cores per accelerator will")
        tip = backend_from_results(figures["resolution"][0], spec.backend)
        if tip:
            tips.append(tip)
        if on_cuda and spec.backend != "dali":
            tips.append(f"data.backend=dali: nvJPEG 'mixed' decode on the GPU takes JPEG decode off the {cores} "
                        f"CPU cores (reads the webdataset or folder copy; measure it: benchmarks/loaders.py --save)")
        if spec.randaugment:
            depth, severity = spec.randaugment
            tips.append(f"fewer augmentations: RandAugment runs {depth} operation(s) per sample (severity "
                        f"{severity}) in the loader's workers; depth {depth - 1} or off cuts that work")
        if spec.colout:
            tips.append(f"ColOut {spec.colout} runs per sample in the loader's workers (a copy of every image); "
                        f"off, or mode=batch, takes that copy out of the workers")
    if figures["verdict"] != "DATA-BOUND":
        lower = figures.get("lower_resolution")
        if lower:
            kind = "measured" if lower["measured"] else "estimate, (side/new side)^2"
            ramp = ("progressive_resizing is on: a lower initial_scale" if "progressive_resizing" in config.algorithms
                    else "progressive_resizing trains most epochs below full size")
            tips.append(f"lower resolution: the model alone does {lower['img_per_s']:,.0f} img/s at {lower['side']} px "
                        f"({kind}, {lower['img_per_s'] / figures['model_img_per_s']:.2f}x); {ramp}")
        if not on_cuda and figures["torch_threads"] < per_rank:
            how = (f"data.num_workers={per_rank} (FFCV sets torch's thread count to its workers)"
                   if spec.backend == "ffcv" else f"OMP_NUM_THREADS={per_rank}")
            tips.append(f"the model runs {figures['torch_threads']} torch thread(s) on this rank's {per_rank} cores; "
                        f"{how} gives it {per_rank}")
        if not config.channels_last:
            tips.append("channels_last=true (off now): NHWC convolutions, most of the gain on GPUs under AMP")
        tip = precision_tip(config.precision, figures["model_img_per_s"], figures.get("other_precision"), on_cuda)
        if tip:
            tips.append(tip)
        if not config.compile:
            tips.append("compile=true (off now): torch.compile fuses the model's elementwise work (not measured here)")
        tips.append(f"data.batch_size={2 * config.data.batch_size} (now {config.data.batch_size}), if memory allows: "
                    f"the LR follows linearly (optim.lr_reference_batch)")
    return tips


def precision_tip(current: str, model_ips: float, other: dict | None, on_cuda: bool) -> str | None:
    """Switch precision when the other one's model-alone figure is more than NOISE faster. Unmeasured
    (compile on), only the GPU's case is sure enough to name: CPUs of one name differ (module doc)."""
    if other is None:
        return ("precision=bf16 (fp32 now): autocast runs the convolutions on tensor cores (not measured here)"
                if on_cuda and current == "fp32" else None)
    if other["img_per_s"] <= (1 + NOISE) * model_ips:
        return None
    return (f"precision={other['precision']} ({current} now): the model alone does {other['img_per_s']:,.0f} img/s "
            f"in {other['precision']} (measured, {other['img_per_s'] / model_ips:.2f}x); check the accuracy with "
            f"tools/tradeoff.py")


def other_precision(trainer: Trainer, args, device: torch.device) -> dict | None:
    """The model alone in the other of fp32 and bf16, measured briefly (a tenth of --steps: bf16 can be
    13-16x slower on a CPU); None for fp16 (it brings its GradScaler), under compile (a new autocast
    state would recompile the model) and on a GPU without bf16."""
    other = {"fp32": "bf16", "bf16": "fp32"}.get(trainer.config.precision)
    no_bf16 = device.type == "cuda" and not torch.cuda.is_bf16_supported()
    if other is None or trainer.config.compile or no_bf16:
        return None
    state, saved = trainer.state, trainer.autocast
    trainer.autocast = state.autocast = autocast_for(device, other)
    try:
        quick = measure(synthetic_twin(state.train_loader), args.epoch, min(args.warmup, 3),
                        max(5, args.steps // 10), device, trainer.train_step)
    finally:
        trainer.autocast = state.autocast = saved
    return {"precision": other, "img_per_s": round(quick["img_per_s"], 1)}


def lower_resolution(trainer: Trainer, args, figures: dict, device: torch.device) -> dict | None:
    """The model alone at LOWER_SCALE of the side: measured briefly, or estimated when compile would recompile."""
    side = trainer.state.train_loader.side          # before ColOut, which the synthetic twin applies again
    new_side = max(8, round(side * LOWER_SCALE / 4) * 4)
    if new_side >= side:
        return None
    if trainer.config.compile:
        return {"side": new_side, "img_per_s": figures["model_img_per_s"] * (side / new_side) ** 2, "measured": False}
    loader = synthetic_twin(trainer.state.train_loader, resolution=new_side)
    quick = measure(loader, args.epoch, min(args.warmup, 5), max(5, args.steps // 4), device, trainer.train_step)
    return {"side": new_side, "img_per_s": quick["img_per_s"], "measured": True}


# --- the run -----------------------------------------------------------------------------
def diagnose(args, config) -> dict:
    world = init_world(config.device)
    cores, ranks = os.cpu_count() or 1, args.ranks_per_machine
    if world.device.type == "cpu" and ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cores // ranks))   # this rank's share, as in a multi-rank run
    trainer = measured_run(config, world)
    config = trainer.config              # as the run settled it (precision: auto's choice, stretched schedules)
    state, device = trainer.state, world.device
    loader, train_step = state.train_loader, trainer.train_step
    spec = loader.spec

    alone = measure(loader, args.epoch, args.warmup, args.steps, device)
    model = measure(synthetic_twin(loader), args.epoch, args.warmup, args.steps, device, train_step)
    together = measure(loader, args.epoch, args.warmup, args.steps, device, train_step)
    figures = {"view": "one process: one rank's view", "device": str(device), "cpu_cores": cores,
               "torch_threads": torch.get_num_threads(),   # read now: FFCV sets it when its loader starts
               "ranks_per_machine": ranks, "steps": args.steps, "warmup": args.warmup, "epoch": args.epoch,
               "algorithms": list(config.algorithms), "algorithms_applied": True, "backend": spec.backend,
               "data_from": data_from(spec.path),
               "num_workers": spec.num_workers, "batch_size": spec.batch_size, "side": loader.side,
               "resolution": list(loader.resolution), "hw_decoder_load": spec.hw_decoder_load,
               "model": config.model.name, "precision": config.precision, "channels_last": config.channels_last,
               "compile": config.compile, "step_stream": config.step_stream,
               "loader_img_per_s": round(alone["img_per_s"], 1),
               "model_img_per_s": round(model["img_per_s"], 1), "together_img_per_s": round(together["img_per_s"], 1),
               "wait_share": round(together["wait_share"], 4), "batches_per_epoch": len(loader)}
    if device.type == "cuda" or args.free_running:
        figures["free_running"] = {
            "model_img_per_s": round(measure(synthetic_twin(loader), args.epoch, args.warmup, args.steps, device,
                                             train_step, sync_each_step=False)["img_per_s"], 1),
            "together_img_per_s": round(measure(loader, args.epoch, args.warmup, args.steps, device, train_step,
                                                sync_each_step=False)["img_per_s"], 1)}
    figures["verdict"] = verdict(figures["loader_img_per_s"], figures["model_img_per_s"], figures["wait_share"])
    figures["cpu_contention"] = device.type == "cpu" and figures["together_img_per_s"] < (1 - NOISE) * min(
        figures["loader_img_per_s"], figures["model_img_per_s"])
    figures["loader_slows_step"] = loader_slows_step(figures, device.type == "cuda")
    figures["verdict_text"] = explain(figures, cores)
    if figures["verdict"] != "DATA-BOUND":
        figures["lower_resolution"] = lower_resolution(trainer, args, figures, device)
        figures["other_precision"] = other_precision(trainer, args, device)
    figures["suggestions"] = suggestions(figures, config, spec, cores, ranks, device.type == "cuda")
    return figures


def report(figures: dict) -> str:
    height, width = figures["resolution"]
    pixels = f"{height} px" if height == width else f"{height}x{width} px"
    workers = f"{figures['num_workers']} worker{'s' * (figures['num_workers'] != 1)}"
    layout = "channels_last" if figures["channels_last"] else "contiguous"
    applied = ", ".join(figures["algorithms"]) or "none in the recipe"
    lines = [f"{figures['view']} on {figures['device']} ({figures['cpu_cores']} cores, {figures['torch_threads']} "
             f"torch thread(s), {figures['ranks_per_machine']} rank(s) per machine); epoch {figures['epoch']}, "
             f"{figures['steps']} timed steps after {figures['warmup']} warm-up step(s) per figure",
             f"algorithms applied as in training: {applied}",
             f"loader alone   {figures['loader_img_per_s']:>9,.0f} img/s   ({figures['backend']}, {workers}, {pixels}, "
             f"batch {figures['batch_size']})",
             f"model alone    {figures['model_img_per_s']:>9,.0f} img/s   ({figures['model']}, {figures['precision']}, "
             f"{layout}{', compiled' if figures['compile'] else ''}; synthetic batches)",
             f"together       {figures['together_img_per_s']:>9,.0f} img/s   waiting for data "
             f"{figures['wait_share']:.0%} of the time",
             f"verdict: {figures['verdict']}. {figures['verdict_text']}"]
    if figures["warmup"] + figures["steps"] > figures["batches_per_epoch"]:
        lines.insert(-1, f"note: {figures['warmup']} warm-up + {figures['steps']} timed steps span more than one "
                         f"pass over this data ({figures['batches_per_epoch']} batches): the figures include the "
                         f"loader's restart, which training pays once an epoch; for the steady rate keep "
                         f"--warmup + --steps within {figures['batches_per_epoch']}, or use a larger set")
    if free := figures.get("free_running"):
        lines.insert(-1, f"as training runs (no sync per step): model alone {free['model_img_per_s']:,.0f} img/s, "
                         f"together {free['together_img_per_s']:,.0f} "
                         f"({free['together_img_per_s'] / free['model_img_per_s']:.0%} of the model alone)")
    if figures["suggestions"]:
        lines.append(f"try, on this machine ({figures['cpu_cores']} cores):")
        lines += [f"  - {tip}" for tip in figures["suggestions"]]
    return "\n".join(lines)


def e2e_rows(figures: dict) -> list[dict]:
    """The together run as a share of the model alone: as training runs where measured so, else synced."""
    timed = figures.get("free_running", figures)
    loader = {"img_per_s": figures["loader_img_per_s"],
              **{key: figures[key] for key in ("backend", "num_workers", "hw_decoder_load", "data_from")}}
    return [{"tool": "diagnose", "as_training": "free_running" in figures,
             **e2e_row(figures, loader, timed["model_img_per_s"], timed["together_img_per_s"])}]


def main(argv=None) -> int:
    args = parse_args(argv)

    def measure_run(run_dir: str) -> dict:
        return diagnose(args, load_measuring_config(args.config, args.overrides, run_dir))
    return run_one_rank("diagnose.py", args, measure_run, report,
                        " (--ranks-per-machine says how many ranks share the machine)", e2e_rows)


if __name__ == "__main__":
    sys.exit(main())
