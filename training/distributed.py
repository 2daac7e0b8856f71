"""The process group: who this process is (from torchrun's environment), which device and
backend it uses (NCCL on CUDA, gloo on CPU), and the few collectives the loop needs.
Plain `python training/main.py` is a world of one and creates no process group."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.typed_config import ConfigError


# What this rank is doing, named in the one line a failed or timed-out collective gets
# (training/main.py): which wait it was.
activity = "start-up (loaders, model, DDP's first broadcast)"


def doing(what: str) -> None:
    global activity
    activity = what


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(device: str = "auto") -> World:
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available here; use device=cpu or auto")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    world = World(rank, local_rank, size, torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"))
    if size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        store = _store_of_this_attempt(size, timeout)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout,
                                **({"store": store, "rank": rank, "world_size": size} if store else {}),
                                **({"device_id": world.device} if use_cuda else {}))
    return world


def _store_of_this_attempt(size: int, timeout: datetime.timedelta):
    """torchrun keeps one key-value store for all restarts of a worker group (the agent's,
    TORCHELASTIC_USE_AGENT_STORE=True). A restarted group would read there the addresses the
    dead group's ranks published and dial dead ports: gloo's connect fails, or waits out the
    whole timeout (seen: a restarted pair silent for 13 minutes). A prefix per restart gives
    each attempt clean keys. None elsewhere: torch's env:// rendezvous as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fastpipe/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_main(value, world: World):
    """Rank 0's `value` (any picklable object) on every rank."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_main(value, world: World) -> list:
    """Every rank's `value` as a list on rank 0 (in rank order); an empty list elsewhere."""
    if not world.distributed:
        return [value]
    gathered = [None] * world.size if world.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered or []
