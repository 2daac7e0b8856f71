"""LoaderSpec: everything a loader backend needs to know, validated once, in one dataclass."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pipeline.transforms.colout import kept_size
from pipeline.transforms.crops import CENTER_CROP_RATIO
from pipeline.transforms.randaugment import check_randaugment
from pipeline.schedules import Schedule, resolution_schedule

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BACKENDS = ("ffcv", "dali", "webdataset", "folder", "synthetic", "auto")   # auto: pipeline/backends/auto.py
SPLITS = ("train", "val")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(value) -> int:
    """Bytes from an int or a size such as '20GiB', '500MB', '1.5g'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2) is not None and match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 20GiB, 500MB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


@dataclass
class LoaderSpec:
    backend: str
    path: Optional[str] = None          # converter output (ffcv, webdataset), ImageNet root (folder), either (dali)
    split: str = "train"
    batch_size: int = 256               # per rank
    resolution: Any = 224               # train: an int, a schedule, or a schedule mapping (pipeline.schedules)
    val_resolution: int = 224
    val_crop_ratio: float = CENTER_CROP_RATIO          # val: the centered square's share of the shorter side
    scale: tuple[float, float] = (0.08, 1.0)          # RandomResizedCrop area share
    ratio: tuple[float, float] = (3 / 4, 4 / 3)       # RandomResizedCrop aspect ratio
    colout: Optional[tuple[float, float]] = None      # (p_row, p_col) dropped in the loader
    randaugment: Optional[tuple[int, int]] = None     # (depth, severity) in the loader; not in ffcv
    num_workers: int = 2                # worker processes; the webdataset engine's threads
    native_decode: bool = True          # webdataset: the native engine (False: Pillow in worker processes)
    hw_decoder_load: float = 0.65       # dali on CUDA: the share of JPEGs sent to the hardware decoder (A100, H100)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0
    rank: Optional[int] = None          # default: torch.distributed's, when initialised, else 0
    world_size: Optional[int] = None    # likewise, else 1
    local_rank: int = 0                 # the rank on its node: the first says what befalls the node's cache
    drop_last: Optional[bool] = None    # default: True for train, False for val
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    on_corrupt: str = "skip"            # a sample that fails to decode: "skip" (counted) or "raise"
    # True: each webdataset sample checked against its recorded checksum as it is read; "full": also a
    # local .beton's samples, once at open; False: nothing checked
    verify: Any = True
    num_classes: Optional[int] = None   # synthetic only; the others read it from the data
    synthetic_size: int = 10_000        # synthetic only: samples per epoch over all ranks
    measured_results: Optional[str] = None   # auto: the folder of per-machine loader figures; None: probe
    cache_dir: Optional[str] = None     # a dataset at a URL: the node's local cache (default ~/.cache/fastpipe/datasets)
    cache_limit: Any = None             # its size, bytes or "20GiB" (default 16GiB); past it, least recently used goes
    fetch_size: Any = None              # the most bytes one range request fetches (default 1MiB)
    fetch_timeout: Optional[float] = None   # seconds before a request that gets no answer is tried again (default 30)
    schedule: Schedule = field(init=False, repr=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown loader backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.backend != "synthetic" and not self.path:
            raise ValueError(f"backend {self.backend!r} needs a path")
        for size in (self.cache_limit, self.fetch_size):
            if size is not None:
                parse_size(size)            # a ValueError that names the bad size
        if self.fetch_timeout is not None and not self.fetch_timeout > 0:
            raise ValueError(f"fetch_timeout must be a positive number of seconds, got {self.fetch_timeout!r}")
        if self.batch_size < 1 or self.num_workers < 0:
            raise ValueError(f"need batch_size >= 1 and num_workers >= 0, got {self.batch_size}, {self.num_workers}")
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"bad crop scale {self.scale} or ratio {self.ratio}")
        if not 0 < self.val_crop_ratio <= 1:
            raise ValueError(f"val_crop_ratio must be in (0, 1], got {self.val_crop_ratio}")
        if self.colout is not None:
            kept_size(8, 8, *self.colout)  # validates the shares
        if self.randaugment is not None:
            check_randaugment(*self.randaugment)
            if self.backend == "ffcv":
                raise ValueError("randaugment cannot run in the ffcv backend: FFCV's pipeline is compiled numba "
                                 "code with no RandAugment operations; use the webdataset or dali backend")
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {self.hw_decoder_load}")
        if not (isinstance(self.verify, bool) or self.verify == "full"):
            raise ValueError(f"verify must be True, False or 'full', got {self.verify!r}")
        if self.on_corrupt not in ("skip", "raise"):
            raise ValueError(f"on_corrupt must be 'skip' or 'raise', got {self.on_corrupt!r}")
        self.schedule = resolution_schedule(self.resolution)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.rank is None:
            self.rank = torch.distributed.get_rank() if distributed else 0
        if self.world_size is None:
            self.world_size = torch.distributed.get_world_size() if distributed else 1
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        if self.drop_last is None:
            self.drop_last = self.split == "train"

    @property
    def remote_options(self) -> dict:
        """What reading a dataset at a URL takes from the spec (`pipeline.datasets.read_converted`)."""
        return dict(cache_dir=self.cache_dir, cache_limit=self.cache_limit, fetch_timeout=self.fetch_timeout,
                    local_rank=self.local_rank)

    @property
    def train(self) -> bool:
        return self.split == "train"

    def resolution_at(self, epoch: int) -> int:
        """The side of the square images this split yields in this epoch."""
        return self.schedule(epoch) if self.train else self.val_resolution
