"""What the training loop's machinery costs: our loop with zero algorithms against a bare loop.

    python benchmarks/loop_overhead.py [--steps 40] [--repeats 5] [--batch-size 128] [--resolution 28]

Both loops drive the same model, optimizer, LR schedule and synthetic loader (so the data
costs nothing), one process, in alternating rounds; the figure is each loop's median
img/s over the rounds, and their ratio. The bare loop is what a user would write by hand:
zero_grad, forward under autocast, loss, backward, step, schedule step. Ours adds the 11
per-step event calls, the counters, the metrics lines and the loss bookkeeping. Also
printed: the cost of one `Engine.fire` with no algorithms, timed alone. Our loop runs twice
a round, with the step-phase clock (training/step_phases.py, 14 laps a step) off and on, to
show what leaving it on costs; one lap is timed alone too. With --save, one JSON line per run goes
to this machine's file in benchmarks/results/.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
from algorithms.base import Event
from benchmarks.hardware import add_results_options, append_results, results_folder, signature
from training.config import load_config
from training.distributed import World
from training.engine import Engine
from training.trainer import Trainer


def bare_epoch(state, autocast) -> None:
    for images, targets in state.train_loader:
        state.optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = state.loss_fn(state.model(images), targets)
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()


def timed(run, images: int) -> float:
    started = time.perf_counter()
    run()
    return images / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--resolution", type=int, default=28)
    parser.add_argument("--precision", default="fp32")
    add_results_options(parser)
    args = parser.parse_args()

    run_dir = tempfile.mkdtemp(prefix="loop-overhead-")
    config = load_config(str(ROOT / "algorithms/recipes/fashion_baseline.yaml"), [
        "data.backend=synthetic", "data.num_classes=10", f"data.batch_size={args.batch_size}",
        f"data.synthetic_size={args.steps * args.batch_size}", f"data.resolution={args.resolution}",
        f"precision={args.precision}", "max_duration=1000000ba", "log.progress=false", "log.tensorboard=false",
        f"run_dir={run_dir}", "resume=never"])
    trainer = Trainer(config, World(0, 0, 1, torch.device("cpu")), algorithms=[])
    state, images = trainer.state, args.steps * args.batch_size

    def ours(phases_on: bool):
        trainer.phases.enabled = phases_on
        state.train_loader.set_epoch(state.epoch)
        trainer._train_epoch(save_every=0)
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0

    def bare():
        state.train_loader.set_epoch(state.epoch)
        bare_epoch(state, trainer.autocast)

    bare(), ours(False), ours(True)                           # warm-up
    rates = {"bare": [], "ours": [], "ours_phases": []}
    for _ in range(args.repeats):
        rates["bare"].append(timed(bare, images))
        rates["ours"].append(timed(lambda: ours(False), images))
        rates["ours_phases"].append(timed(lambda: ours(True), images))
    engine, calls = Engine([]), 100_000
    started = time.perf_counter()
    for _ in range(calls):
        engine.fire(Event.BEFORE_FORWARD, state)
    fire_ns = (time.perf_counter() - started) / calls * 1e9
    started = time.perf_counter()
    for _ in range(calls):
        trainer.phases.lap("other")
    lap_ns = (time.perf_counter() - started) / calls * 1e9

    medians = {name: statistics.median(values) for name, values in rates.items()}
    record = {"benchmark": "loop_overhead", "model": "small_resnet", "batch_size": args.batch_size,
              "resolution": args.resolution, "precision": args.precision, "steps": args.steps,
              "repeats": args.repeats, "bare_img_per_s": round(medians["bare"], 1),
              "ours_img_per_s": round(medians["ours"], 1), "ratio": round(medians["ours"] / medians["bare"], 4),
              "ours_phases_img_per_s": round(medians["ours_phases"], 1),
              "phases_ratio": round(medians["ours_phases"] / medians["ours"], 4),
              "empty_fire_ns": round(fire_ns, 1), "phase_lap_ns": round(lap_ns, 1)}
    print(f"bare loop {medians['bare']:,.0f} img/s, ours with no algorithms {medians['ours']:,.0f} img/s "
          f"(ratio {record['ratio']:.3f}), with the step-phase clock {medians['ours_phases']:,.0f} img/s "
          f"(ratio to ours {record['phases_ratio']:.3f}); rounds: "
          + ", ".join(f"{name} {[round(r) for r in values]}" for name, values in rates.items())
          + f"; one empty Engine.fire: {fire_ns:.0f} ns, one phase lap: {lap_ns:.0f} ns")
    append_results([record], signature(), results_folder(args))


if __name__ == "__main__":
    main()
