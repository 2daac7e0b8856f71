"""A recipe's wall time on N GPUs, projected from end-to-end img/s measured on one of them.

    python tools/project_time.py --config RECIPE.yaml [key=value ...] --measured DIAGNOSE.json ...
                                 [--gpus 8] [--scaling 1.0] [--eval-img-per-s N]
                                 [--train-images 1281167] [--val-images 50000] [--json PATH]

How the projection is made, and what it leaves out:
1. The recipe's train side per epoch comes from the run training builds (`training.run.build_run`), on
   the `synthetic` backend with the dataset's size split over the GPUs, so scale_schedule,
   progressive resizing and every other effect on the run act exactly as in training.
2. The per-GPU rate at a side is what `tools/diagnose.py --json` measured together, the real
   loader feeding the real train step on one GPU: as training runs (`free_running`, always
   there on CUDA), else with a sync per step (`together_img_per_s`). At least two sides must
   be measured (or only the sides the recipe trains at); between them the time per image is
   interpolated linearly in the pixel count (a CNN step's cost grows with it), and beyond
   them extended along the nearest two points' line.
3. Train time = sum over epochs of (epoch share x train images) / (GPUs x rate x scaling).
   `--scaling` is the share of linear speed-up kept across GPUs: 1.0 (the default) is ideal
   scaling, an upper bound on speed until NCCL across those GPUs has been measured.
4. Eval time = evaluations x val images / (GPUs x `--eval-img-per-s`), when given; else it
   is left out, and said so.
Start-up, torch.compile, checkpoints and the epochs' ends are not counted. The time is to
the end of the recipe, not to an accuracy: which accuracy the recipe reaches on ImageNet is a
separate claim, and needs runs of its own.
Published figures to set it beside, not re-measured here: MLPerf
Training v4.0's best 8xH100 ResNet-50, about 13.2 minutes to 75.9%; MosaicML's Mild recipe,
75.9% in 23.8 minutes on 8xA100; NVIDIA's test floor for DALI's RN50 pipeline on one Hopper
GPU, about 19,000 img/s with 70 CPU threads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.storage.atomic_files import write_bytes_atomic
from training.config import ConfigError, load_config
from training.projection import (IMAGENET_TRAIN, IMAGENET_VAL, recipe_identity, recipe_schedule,  # noqa: F401
                                 seconds_per_image, walk)
from training.run import USAGE_ERROR

PUBLISHED = ["MLPerf Training v4.0, best 8xH100 ResNet-50: about 13.2 min to 75.9%",
             "MosaicML Mild recipe, 8xA100: 75.9% in 23.8 min",
             "NVIDIA's DALI RN50 pipeline test floor, one Hopper GPU with 70 CPU threads: about 19,000 img/s"]
MEASURE_SIDES = "tools/diagnose.py --epoch"


def measured_rates(paths: list[Path], recipe: dict) -> dict[int, float]:
    """side -> together img/s, from diagnose JSONs of this recipe; a one-line ConfigError otherwise."""
    rates, where = {}, {}
    for path in paths:
        try:
            figures = json.loads(path.read_text())
            side = int(figures["side"])
            rate = float((figures.get("free_running") or figures)["together_img_per_s"])
            measured = {"model": figures["model"], "algorithms": figures["algorithms"],
                        "batch_size": figures["batch_size"]}
        except OSError as error:
            raise ConfigError(f"{path}: cannot read it ({error.strerror})") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
        except KeyError as error:
            raise ConfigError(f"{path}: no key {error.args[0]!r}; write it with tools/diagnose.py --json") from None
        for key, value in measured.items():
            if value != recipe[key]:
                raise ConfigError(f"{path}: measured with {key} {value}, the recipe has {recipe[key]}")
        if rate <= 0:
            raise ConfigError(f"{path}: together_img_per_s must be > 0, got {rate}")
        if side in rates:
            raise ConfigError(f"{path}: side {side} is measured in {where[side]} too; pass one of them")
        rates[side], where[side] = rate, path
    return rates


def project(schedule: dict, rates: dict[int, float], gpus: int, scaling: float,
            eval_img_per_s: float | None) -> dict:
    rows = walk(schedule, lambda side: {"img_per_s": 1 / seconds_per_image(side, rates, MEASURE_SIDES),
                                        "measured": side in rates}, gpus, scaling)
    train = sum(row["minutes"] for row in rows)
    evaluation = (schedule["evaluations"] * schedule["val_images"] / (gpus * eval_img_per_s) / 60
                  if eval_img_per_s else None)
    return {**schedule, "gpus": gpus, "scaling": scaling, "eval_img_per_s": eval_img_per_s,
            "rows": rows, "train_minutes": train,
            "eval_minutes": evaluation, "total_minutes": train + (evaluation or 0.0)}


def report(projection: dict) -> str:
    p = projection
    lines = [f"{p['model']} ({', '.join(p['algorithms']) or 'no algorithms'}), {p['epochs']:g} epochs of "
             f"{p['train_images']:,} images, on {p['gpus']} GPUs at scaling {p['scaling']:g}:",
             "  side  epochs  img/s per GPU      minutes"]
    lines += [f"  {r['side']:>4}  {r['epochs']:>6.2f}  {r['img_per_s']:>8,.0f} {'measured' if r['measured'] else 'interp.':<9}"
              f"{r['minutes']:>7.1f}" for r in p["rows"]]
    lines.append(f"train {p['train_minutes']:.1f} min; " + (
        f"eval {p['eval_minutes']:.1f} min ({p['evaluations']} evaluations of {p['val_images']:,} images at "
        f"{p['eval_img_per_s']:,.0f} img/s per GPU)" if p["eval_minutes"] is not None else
        "eval not counted (no --eval-img-per-s)") + f"; total {p['total_minutes']:.1f} min")
    lines.append("how: per-GPU end-to-end img/s measured on one GPU by tools/diagnose.py, interpolated linearly in "
                 "pixels between measured sides; x GPUs x scaling; start-up, compile and checkpoints not counted; "
                 "time to the recipe's end, not to an accuracy")
    lines.append("published, for comparison: " + "; ".join(PUBLISHED))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML (e.g. algorithms/recipes/resnet50_mild.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as training/main.py")
    parser.add_argument("--measured", type=Path, nargs="+", required=True, help="tools/diagnose.py --json outputs")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--scaling", type=float, default=1.0, help="share of linear speed-up kept (default 1.0)")
    parser.add_argument("--eval-img-per-s", type=float, help="per-GPU evaluation img/s, loader included")
    parser.add_argument("--train-images", type=int, default=IMAGENET_TRAIN)
    parser.add_argument("--val-images", type=int, default=IMAGENET_VAL)
    parser.add_argument("--json", type=Path, help="also write the projection here (atomically)")
    args = parser.parse_args(argv)
    if args.gpus < 1 or not 0 < args.scaling <= 1 or args.train_images < args.gpus or args.val_images < 1 \
            or (args.eval_img_per_s is not None and args.eval_img_per_s <= 0):
        parser.error("need --gpus >= 1, 0 < --scaling <= 1, --train-images >= --gpus, --val-images >= 1, "
                     "--eval-img-per-s > 0")
    try:
        rates = measured_rates(args.measured, recipe_identity(load_config(args.config, args.overrides)))
        schedule = recipe_schedule(args.config, args.overrides, args.gpus, args.train_images, args.val_images)
        projection = project(schedule, rates, args.gpus, args.scaling, args.eval_img_per_s)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(report(projection), flush=True)
    if args.json:
        write_bytes_atomic(args.json, (json.dumps(projection, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
