"""Which loader and step settings let training run fastest end to end: several of them, measured
in alternating rounds in one process, each as a share of the model alone.

    python tools/compare_settings.py --config RECIPE.yaml [key=value ...]
        --setting "data.hw_decoder_load=0.65" --setting "data.hw_decoder_load=1" [--setting ...]
        [--rounds 3] [--steps 100] [--warmup 10] [--epoch 0] [--json PATH] [--results-dir benchmarks/results]

Why rounds in one process: a GPU's speed drifts over minutes, and separate runs of
tools/diagnose.py on an H100 put one setting's model-alone figure 15% apart. Here the trainer
is built once (one torch.compile), each setting gets a loader of its own, and every round
measures the model alone and then each setting's loader feeding the real train step, the
settings' order rotating from round to round. A setting's figure in a round is its rate
together as a share of that round's model alone; the report gives each setting's median share,
its loader-alone rate (measured once, before the rounds), and in how many rounds the best one
beat each other one. --json is written after every round, so a run cut short (a job killed at
its time limit) leaves the rounds it finished, and its report says so. Every figure is as training
runs (no sync per step: the host fetches the next batch while the device computes), over
--steps steps after --warmup untimed ones; as in diagnose.py every pass re-runs epoch --epoch,
so a resolution schedule stays at that size.

A setting is a space-separated list of overrides of only these keys: data.backend, data.path,
data.num_workers, data.hw_decoder_load, data.cache_limit (the train loader) and step_stream
(training/step_stream.py). Everything else (model, batch, resolution, precision, compile,
algorithms) is the recipe's and the same for all; the model alone runs with the recipe's
step_stream. A bad setting is one line on stderr and exit 2, before anything is measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import string
import sys
from pathlib import Path

from measuring import (add_results_dir_option, data_from, e2e_row, load_measuring_config, measure, measured_run,
                       run_one_rank, synthetic_twin, write_figures)
from pipeline import build_loader
from training.config import ConfigError, shareable_overrides
from training.step_stream import StepStream

LOADER_KEYS = ("backend", "path", "num_workers", "hw_decoder_load", "cache_limit")   # data.<key>: loader spec fields
SETTING_KEYS = (*(f"data.{key}" for key in LOADER_KEYS), "step_stream")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. algorithms/recipes/resnet50_mild.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides for every setting")
    parser.add_argument("--setting", action="append", default=[], metavar='"key=value ..."',
                        help=f"one setting to compare (give two or more); keys from {', '.join(SETTING_KEYS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all settings (default 3)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each measurement (default 10)")
    parser.add_argument("--epoch", type=int, default=0, help="the epoch measured: its resolution (default 0)")
    parser.add_argument("--json", type=Path, help="also write every figure here (atomically)")
    add_results_dir_option(parser)
    args = parser.parse_intermixed_args(argv)
    if len(args.setting) < 2 or len(args.setting) > len(string.ascii_uppercase):
        parser.error(f"give 2 to {len(string.ascii_uppercase)} --setting options, got {len(args.setting)}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.epoch < 0:
        parser.error("need --rounds >= 1, --steps >= 1, --warmup >= 0, --epoch >= 0")
    return args


@dataclasses.dataclass
class Setting:
    name: str                  # A, B, ...: short labels for the report
    overrides: list[str]
    loader_changes: dict       # loader spec fields that differ from the recipe's
    step_stream: str


def read_settings(texts: list[str], recipe: str | None, overrides: list[str], run_dir: str) -> list[Setting]:
    """Each setting checked as training would check it, and for the keys it may change; a ConfigError
    names the first fault."""
    base = load_measuring_config(recipe, overrides, run_dir)
    settings = []
    for name, text in zip(string.ascii_uppercase, texts):
        changes = text.split()
        for change in changes:
            key = change.partition("=")[0].strip()
            if key not in SETTING_KEYS:
                raise ConfigError(f"setting {text!r}: {key!r} cannot change between settings (the trainer is built "
                                  f"once); a setting may change {', '.join(SETTING_KEYS)}")
        config = load_measuring_config(recipe, [*overrides, *changes], run_dir)
        loader_changes = {key: getattr(config.data, key) for key in LOADER_KEYS
                          if getattr(config.data, key) != getattr(base.data, key)}
        if "path" in loader_changes:
            loader_changes["path"] = loader_changes["path"] or None      # as DataConfig.loader_spec gives it
        settings.append(Setting(name, changes, loader_changes, config.step_stream))
    return settings


def compare(args, config, settings: list[Setting]) -> dict:
    trainer = measured_run(config)
    config = trainer.config              # as the run settled it (precision: auto's choice, stretched schedules)
    state, device = trainer.state, trainer.world.device
    recipe_loader, recipe_stream, train_step = state.train_loader, trainer.step_stream, trainer.train_step
    try:
        streams = {s.name: StepStream(device, s.step_stream) for s in settings}
        loaders = {s.name: build_loader(dataclasses.replace(recipe_loader.spec, **s.loader_changes))
                   if s.loader_changes else recipe_loader for s in settings}
    except ValueError as error:     # a spec or stream this device cannot take
        raise ConfigError(str(error)) from None

    def together(setting: Setting) -> dict:
        trainer.step_stream = streams[setting.name]
        try:
            return measure(loaders[setting.name], args.epoch, args.warmup, args.steps, device, train_step,
                           sync_each_step=False)
        finally:
            trainer.step_stream = recipe_stream

    loader_alone = {s.name: measure(loaders[s.name], args.epoch, args.warmup, args.steps, device)["img_per_s"]
                    for s in settings}
    about = {
        "device": str(device), "cpu_cores": len(os.sched_getaffinity(0)), "model": config.model.name,
        "precision": config.precision, "compile": config.compile, "channels_last": config.channels_last,
        "batch_size": recipe_loader.spec.batch_size, "side": recipe_loader.side, "epoch": args.epoch,
        "steps": args.steps, "warmup": args.warmup, "rounds_planned": args.rounds,
        "recipe_backend": recipe_loader.spec.backend, "recipe_num_workers": recipe_loader.spec.num_workers}
    model_loader, rounds = synthetic_twin(recipe_loader), []
    for number in range(args.rounds):
        order = settings[number % len(settings):] + settings[:number % len(settings)]
        model = measure(model_loader, args.epoch, args.warmup, args.steps, device, train_step, sync_each_step=False)
        figures = {s.name: together(s) for s in order}
        rounds.append({"order": [s.name for s in order], "model_img_per_s": round(model["img_per_s"], 1),
                       "together": {name: {"img_per_s": round(f["img_per_s"], 1),
                                           "wait_share": round(f["wait_share"], 4),
                                           "share_of_model": round(f["img_per_s"] / model["img_per_s"], 4)}
                                    for name, f in figures.items()}})
        result = summarise(rounds, settings, loader_alone) | about
        for entry in result["settings"]:          # what each setting's figures were measured with
            spec = loaders[entry["name"]].spec
            entry["loader"] = {key: getattr(spec, key) for key in LOADER_KEYS}
            entry["step_stream"] = streams[entry["name"]].choice
        if number + 1 < args.rounds:
            write_figures(args, result)            # the last round's, with the report, by run_one_rank
        print(f"round {number + 1}/{args.rounds}: model alone {model['img_per_s']:,.0f} img/s; "
              + ", ".join(f"{name} {f['img_per_s']:,.0f}" for name, f in figures.items()), flush=True)
    return result


def summarise(rounds: list[dict], settings: list[Setting], loader_alone: dict) -> dict:
    """Median share of model-bound per setting, the best by it, and its wins over each other setting, round by round."""
    shares = {s.name: [r["together"][s.name]["share_of_model"] for r in rounds] for s in settings}
    medians = {name: statistics.median(values) for name, values in shares.items()}
    best = max(medians, key=medians.get)
    return {"settings": [{"name": s.name, "overrides": shareable_overrides(s.overrides), "loader_img_per_s": round(loader_alone[s.name], 1),
                          "shares_of_model": shares[s.name], "median_share_of_model": round(medians[s.name], 4),
                          "median_img_per_s": round(statistics.median(r["together"][s.name]["img_per_s"]
                                                                      for r in rounds), 1)}
                         for s in settings],
            "rounds": rounds, "best": best,
            "best_wins": {name: sum(mine > theirs for mine, theirs in zip(shares[best], shares[name]))
                          for name in shares if name != best}}


def report(result: dict) -> str:
    rounds = result["rounds"]
    lines = [f"{result['model']} on {result['device']} ({result['cpu_cores']} cores), {result['precision']}"
             f"{', compiled' if result['compile'] else ''}, batch {result['batch_size']}, {result['side']} px "
             f"(epoch {result['epoch']}); {len(rounds)} round(s) of {result['steps']} timed steps after "
             f"{result['warmup']} warm-up ones per figure, as training runs (no sync per step)",
             "model alone per round: " + ", ".join(f"{r['model_img_per_s']:,.0f}" for r in rounds) + " img/s", "",
             f"{'':2} {'loader alone':>12}  {'together per round (img/s)':<28} {'median share':>12}  setting"]
    for s in result["settings"]:
        per_round = " ".join(f"{r['together'][s['name']]['img_per_s']:,.0f}" for r in rounds)
        lines.append(f"{s['name']:2} {s['loader_img_per_s']:>12,.0f}  {per_round:<28} "
                     f"{s['median_share_of_model']:>12.1%}  {' '.join(s['overrides'])}")
    wins = ", ".join(f"{wins} of {len(rounds)} over {name}" for name, wins in result["best_wins"].items())
    lines += ["", f"best: {result['best']} by median share of the model alone; it beat the others in: {wins}"]
    if len(rounds) < result.get("rounds_planned", len(rounds)):
        lines.append(f"cut short: {len(rounds)} of {result['rounds_planned']} rounds finished")
    if any(wins < len(rounds) for wins in result["best_wins"].values()):
        lines.append("not every round agrees: the gap is within this machine's noise; more --rounds or --steps "
                     "will tell")
    return "\n".join(lines)


def e2e_rows(result: dict) -> list[dict]:
    """Each setting's medians over the rounds (as training runs); its share, the median of its paired ones."""
    model = statistics.median(r["model_img_per_s"] for r in result["rounds"])
    return [{"tool": "compare_settings", "as_training": True, "rounds": len(result["rounds"]),
             **e2e_row({**result, "step_stream": s["step_stream"]},
                       {**s["loader"], "data_from": data_from(s["loader"]["path"]), "img_per_s": s["loader_img_per_s"]},
                       model, s["median_img_per_s"]),
             "share_of_model": s["median_share_of_model"]}
            for s in result["settings"]]


def main(argv=None) -> int:
    args = parse_args(argv)

    def measure_run(run_dir: str) -> dict:
        settings = read_settings(args.setting, args.config, args.overrides, run_dir)
        config = load_measuring_config(args.config, args.overrides, run_dir)
        return compare(args, config, settings)
    return run_one_rank("compare_settings.py", args, measure_run, report, e2e_rows_of=e2e_rows)


if __name__ == "__main__":
    sys.exit(main())
