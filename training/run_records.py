"""What a run keeps in its run directory and how it goes on from it: checkpoints (every rank's RNG
states gathered, rank 0 writing, the others told whether it could), the stop at an agreed step, the
config and summary, and resume from the newest sound checkpoint on any number of processes. Part of
the Trainer (training/trainer.py), whose state, engine, log and checkpoint store it reads.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from training import distributed as dist
from training import checkpoints
from training.config import ConfigError, shareable
from training.rng import rng_state
from training.run_log import cannot_write
from training.stop_requests import Preempted, RunFault

log = logging.getLogger("training")


class RunRecords:
    """Checkpoints, resume, the run directory and the summary of a Trainer."""

    def save_checkpoint(self) -> Path | None:
        """All ranks call this: their RNG states are gathered; rank 0 writes the file and tells
        the others whether it could (RunFault on every rank if not). Rank 0 gets the path."""
        state, path, problem = self.state, None, None
        dist.doing(f"the checkpoint of step {state.step}")
        rng_states = dist.gather_to_main(rng_state(), self.world)
        if self.world.is_main:
            checkpoint = checkpoints.snapshot(state, self.engine, self.config, rng_states,
                                              {"wall_seconds": self._wall_seconds(),
                                               "step_phases": self.phases.state_dict()}, self.data_order)
            try:
                path = self.store.save(checkpoint, state.epoch, state.step)
            except OSError as error:
                error.filename = None                 # name the checkpoint, not its temporary file
                problem = (f"{cannot_write(error, self.store.path(state.epoch, state.step))}; "
                           f"the checkpoints before it are intact")
        problem = dist.broadcast_from_main(problem, self.world)   # the barrier: no rank runs ahead of the file
        if problem:
            raise RunFault(problem if self.world.is_main else "")
        return path

    def _stop_now(self) -> None:
        """Every rank, after the step at which they agreed to stop: a fault ends the run there; a
        signal gets a checkpoint of exactly this step first (no evaluation: the grace time
        before SIGKILL is short; a resumed run evaluates first if this step was due one)."""
        self.stops.drain()
        if self.stop.fault:
            raise RunFault(self.log.fault or "")
        path = self.save_checkpoint()
        self.log.print(f"stopped by {self.stop.signal.name} after step {self.state.step}: checkpoint {path} "
                       f"written; resume=auto continues the run")
        raise Preempted(self.stop.exit_code)

    def _prepare_run_dir(self) -> None:
        """Rank 0 checks that the run directory can be written, drops the metrics lines a resumed
        run writes again and saves the config; a place that cannot be written is a ConfigError
        on every rank (rank 0 says why)."""
        problem = None
        if self.world.is_main:
            try:
                self.log.check_writable()
                self.log.rewind(self.state.step)
                self.log.write_config(shareable(self.config))
            except OSError as error:
                problem = f"run_dir {self.config.run_dir}: {cannot_write(error, self.config.run_dir)}"
        problem = dist.broadcast_from_main(problem, self.world)
        if problem:
            raise ConfigError(problem)

    def _resume(self) -> None:
        resume = self.config.resume
        if resume == "never":
            if self.store.checkpoints():
                raise ConfigError(f"run_dir {self.config.run_dir} already has checkpoints; resume=auto continues "
                                  f"that run, or pick another run_dir")
            return
        found, self._resume_from = self._resume_from, None    # not kept in memory after this
        if found is None:
            return
        path, checkpoint = found
        state = self.state
        earlier, changed, order_changes = checkpoints.restore(checkpoint, path, state, self.engine, self.config,
                                                              self.world.rank, self.data_order)
        self._wall_before = earlier["wall_seconds"]
        if "step_phases" in earlier:
            self.phases.load_state_dict(earlier["step_phases"])
        saved_world = checkpoint["world_size"]
        self.log.print(f"resumed from {path}: step {state.step} of {state.total_steps}, epoch "
                       f"{state.step / state.steps_per_epoch:.4g} of {state.total_steps / state.steps_per_epoch:.4g}"
                       + (f", on {_processes(self.world.size)} where it had {saved_world}: {self.config.data.batch_size} "
                          f"samples each of the global batch of {self.config.data.global_batch_size}"
                          if saved_world != self.world.size else "")
                       + (f" (config keys changed since: {', '.join(changed)})" if changed else ""))
        if order_changes:
            if self.world.is_main:
                log.warning("resumed with %s (resume_allow_changes=true): epoch %d goes on from step %d of %d with "
                            "samples drawn afresh, not exactly those it had left", "; ".join(order_changes),
                            state.epoch + 1, state.batch_in_epoch, state.steps_per_epoch)
            self._resume_changes = {"epoch": state.epoch, "step": state.step, "resume_changes": order_changes}

    def _wall_seconds(self) -> float:
        return self._wall_before + time.perf_counter() - self._started_at

    def _summary(self) -> dict:
        state = self.state
        summary = {"best_val_top1": state.best_val_top1, "last_val_top1": state.metrics.get("val_top1"),
                   "last_val_top5": state.metrics.get("val_top5"), "wall_s": round(self._wall_seconds(), 2),
                   "train_img_per_s": round(state.samples_seen / max(state.train_seconds, 1e-9), 1),
                   "epochs": round(state.step / state.steps_per_epoch, 3), "steps": state.step,
                   "world_size": self.world.size, "device": str(self.world.device), "precision": self.config.precision,
                   **({"precision_auto": self._precision_choice} if self._precision_choice else {}),
                   "step_phases": self.phases.shares(),
                   # damaged samples skipped since this start of the run (train, val), over all ranks
                   "damaged_samples_skipped": dict(zip(("train", "val"), self._damaged_skipped))}
        if self.log.fault:
            raise RunFault(self.log.fault)
        try:
            self.log.write_summary(summary)
        except OSError as error:
            raise RunFault(cannot_write(error, self.config.run_dir)) from None
        self.log.print(f"done: top-1 {summary['last_val_top1']:.2f}% (best {summary['best_val_top1']:.2f}%), "
                       f"{summary['epochs']:g} epochs in {summary['wall_s']:.1f} s, "
                       f"{summary['train_img_per_s']:,.0f} train img/s, run dir {self.config.run_dir}")
        return summary


def _processes(count: int) -> str:
    return f"{count} process" + ("es" if count != 1 else "")
