"""The precision a run trains in, and `precision: auto`, which picks it for this machine.

On a GPU the answer is known: bf16 where the GPU has it (Ampere on), else fp16 with its
GradScaler. On a CPU it is not, and a CPU's name or flags do not say it: the same bf16 train
step is 1.5x faster than fp32 on an AMD EPYC with avx512_bf16, slower on a Xeon that also
lists avx512_bf16, and 13-16x slower on an AVX2 EPYC (docs/troubleshooting.md). So on a CPU
`auto` times the model's train step in both, briefly, on every rank at once (the cores are
shared as in training), and takes bf16 only when rank 0 saw it more than NOISE faster.

The probe trains a copy of the model on random images under a forked RNG, so the run itself
is the same as one started with the precision it picked; a resumed run takes the precision
its checkpoint was trained in and does not measure again.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

NOISE = 0.10                # a faster precision must beat the other by more than this
WARMUP_STEPS = 1            # the first step of a shape builds oneDNN's primitives
TIMED_STEPS = 3
SLOW_STOP = 2.0             # stop timing a precision once it has taken this many times fp32's time


def autocast_for(device: torch.device, precision: str):
    """A factory of autocast contexts for `precision` on `device`; fp32 gives disabled ones."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def gpu_precision() -> dict:
    """precision=auto on CUDA, where no measurement is needed."""
    if torch.cuda.is_bf16_supported():
        return {"precision": "bf16", "why": "this GPU has bf16"}
    return {"precision": "fp16", "why": "this GPU lacks bf16; fp16 with a GradScaler"}


def measure_train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], precision: str,
                       time_limit_s: float = float("inf")) -> float:
    """img/s of forward, loss and backward of `model` (changed: use a copy) on `batch` in `precision`:
    WARMUP_STEPS, then TIMED_STEPS or fewer once `time_limit_s` has passed (at least one)."""
    images, targets = batch
    autocast = autocast_for(images.device, precision)
    elapsed, timed = 0.0, 0
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        with autocast():
            loss = F.cross_entropy(model(images).float(), targets)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step >= WARMUP_STEPS:
            elapsed, timed = elapsed + time.perf_counter() - start, timed + 1
            if elapsed > time_limit_s:
                break
    return timed * images.shape[0] / elapsed


def probe_cpu_precision(model: torch.nn.Module, batch_size: int, size: tuple[int, int], num_classes: int,
                        channels_last: bool) -> dict:
    """fp32 and bf16 train-step img/s of a copy of `model` on random (height, width) = `size` images,
    and the faster of the two (bf16 only when more than NOISE faster):
    {"precision", "fp32_img_per_s", "bf16_img_per_s"}."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, *size, generator=generator)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    batch = images, torch.randint(num_classes, (batch_size,), generator=generator)
    with torch.random.fork_rng(devices=[]):          # stochastic depth and the like draw from it
        twin = copy.deepcopy(model).train()
        fp32 = measure_train_step(twin, batch, "fp32")
        fp32_seconds = TIMED_STEPS * batch_size / fp32
        bf16 = measure_train_step(twin, batch, "bf16", time_limit_s=SLOW_STOP * fp32_seconds)
    return {"precision": "bf16" if bf16 > (1 + NOISE) * fp32 else "fp32",
            "fp32_img_per_s": round(fp32, 1), "bf16_img_per_s": round(bf16, 1)}


def describe(choice: dict) -> str:
    """One line for the run's log: what `auto` picked and why."""
    if "fp32_img_per_s" not in choice:
        return f"precision auto: {choice['precision']} ({choice['why']})"
    ratio = choice["bf16_img_per_s"] / choice["fp32_img_per_s"]
    return (f"precision auto: {choice['precision']} (the model's train step here: {choice['fp32_img_per_s']:,.0f} "
            f"img/s in fp32, {choice['bf16_img_per_s']:,.0f} in bf16, {ratio:.2f}x; bf16 when over "
            f"{1 + NOISE:.2f}x)")
