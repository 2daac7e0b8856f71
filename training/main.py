"""The entry point: `torchrun --nproc_per_node=N training/main.py --config RECIPE.yaml [key=value ...]`.

Also runs as plain `python training/main.py ...` (one process). Exit codes: 0 done; 2 a bad
config, dataset or run directory (one line on stderr, from rank 0); 1 a fault met on the way
(a full disk, a dead loader worker: one line from the rank that met it); 128 + the signal when
SIGTERM or SIGUSR1 stopped the run after a checkpoint (`resume=auto` continues it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from pipeline.loader.base import LoaderWorkerDied
from pipeline.errors import CorruptSample, DatasetError, RemoteDataError
from training.config import ConfigError, load_config
from training import distributed
from training.distributed import close_world
from training.run import USAGE_ERROR, build_run
from training.stop_requests import Preempted, RunFault

FAULT = 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. algorithms/recipes/fashion_baseline.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=0.2")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    # Every rank logs its warnings (a loader's are its own): under torchrun each line says whose it is
    whose = f"rank {rank} " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(levelname)s {whose}%(name)s: %(message)s")
    trainer = None
    try:
        config = load_config(args.config, args.overrides)
        trainer = build_run(config)
        trainer.fit()
    # Data in object storage that stopped answering mid-run (after obstore's retries): this rank
    # alone, so the other ranks' collectives fail too; a bad URL or credentials are met building the run.
    except RemoteDataError as error:
        if trainer is not None:
            exit_now(f"error: rank {rank}: {error}; the checkpoints are intact: run again with resume=auto "
                     f"once it answers")
        return finish(f"error: {error}", USAGE_ERROR, printed=rank == 0)
    # A damaged sample under on_corrupt=raise, met mid-run by the rank that reads it alone.
    except CorruptSample as error:
        if trainer is not None:
            exit_now(f"error: rank {rank}: {error}; the checkpoints are intact")
        return finish(f"error: {error}", USAGE_ERROR, printed=rank == 0)
    # Every rank meets these at the same point, so the process group can be closed together.
    except (ConfigError, DatasetError) as error:
        return finish(f"error: {error}", USAGE_ERROR, printed=rank == 0)
    except RunFault as error:
        return finish(f"error: {error}" if str(error) else "", FAULT)
    except Preempted as stop:
        return finish("", stop.exit_code)
    # This rank alone: closing the process group would wait on ranks still inside a collective
    # (a hang); exiting at once closes its sockets, and their collectives fail straight away.
    except LoaderWorkerDied as error:
        exit_now(f"error: rank {rank}: {error}")
    except RuntimeError as error:
        if LoaderWorkerDied.says_so(error):         # torch's SIGCHLD handler raises wherever the loop is
            exit_now(f"error: rank {rank}: {LoaderWorkerDied(config.data.backend, str(error))}")
        if not lost_a_peer(error):
            raise
        exit_now(f"error: rank {rank}: a collective failed in {distributed.activity} "
                 f"({str(error).splitlines()[0][:200]}): another rank stopped first or is stuck (its own error, if "
                 f"it left one, says why)")
    return finish("", 0)


def lost_a_peer(error: RuntimeError) -> bool:
    """A collective that failed because another rank is gone or silent (gloo raises a plain
    RuntimeError from its transport, NCCL a DistBackendError)."""
    return isinstance(error, dist.DistBackendError) or "gloo/transport" in str(error)


def finish(message: str, code: int, printed: bool = True) -> int:
    """Close the process group; the one-line `message` on stderr (where `printed`: rank 0 alone
    speaks for an error every rank met) and in torchrun's error file; `code`."""
    close_world()
    if message:
        tell_torchrun(message)
        if printed:
            print(message, file=sys.stderr)
    return code


def tell_torchrun(message: str) -> None:
    """Write the one-line error where torchrun reads a failed rank's error (TORCHELASTIC_ERROR_FILE,
    set for each rank it starts), so that its failure summary, the last lines a user sees, ends
    with this line instead of `error_file: <N/A>`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as file:
                json.dump({"message": message, "timestamp": int(time.time())}, file)
        except OSError:
            pass


def exit_now(message: str) -> None:
    """The one-line message, then exit at once. torch's DataLoader SIGCHLD handler raises wherever
    this process is when a worker dies, between print's pieces too, and a traceback would follow
    the line: here the handler goes first and the line is one write."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(2, f"{message}\n".encode())
        tell_torchrun(message)
        os._exit(FAULT)


def exit_after_success() -> None:
    """End a finished run without interpreter teardown. There, torch's gloo threads intermittently
    abort a finished rank (SIGABRT, `terminate called without an active exception`, after rank 0's
    `done` line: twice in the test suite's tiny runs), which torchrun reports as a failed run.
    Everything is written, fsynced and closed by now, and the process group destroyed; DataLoader
    workers die with this process (pipeline/loader/workers.py). No gc.collect() first: it ran
    numba's dispatcher finalizers, which print a harmless KeyError."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    code = record(main)()       # an unexpected exception's traceback goes to torchrun's error file, and its summary
    if code == 0:
        exit_after_success()
    sys.exit(code)
