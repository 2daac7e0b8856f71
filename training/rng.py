"""Every random number generator a run draws from, seeded per rank, and saved and restored
whole, so that a resumed run draws what the uninterrupted run would have."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int) -> None:
    """Different streams per rank (augmentation algorithms must not repeat across ranks);
    the model's initial weights come from `seed` alone and are made before this is called."""
    rank_seed = seed + 1_000_003 * rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)


def rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA) states as tensors and plain values (weights_only-safe)."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, python_state, gauss = random.getstate()
    state = {"python": [version, list(python_state), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
