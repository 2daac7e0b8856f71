"""Each global step of an epoch is made of the same samples at every world size, on every backend:
the loaders' half of resuming a run on another number of processes. Checked on a set whose every
sample is its own class, so a batch's labels are its sample ids."""
from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest

from conftest import convert_here, made_once
from pipeline import build_loader
from pipeline.spec import LoaderSpec

GLOBAL_BATCH = 12


@pytest.fixture(scope="session")
def own_class_sets(sample_sets, tmp_path_factory) -> dict:
    """The fashion sample (120 train, 120 val images) with every image its own class, as a folder
    and converted: {"folder"|"ffcv"|"webdataset": path}. Shards of about 20 samples, so an epoch's
    stream crosses several."""
    def make(out):
        for split in ("train", "val"):
            images = sorted((sample_sets / "fashion" / split).glob("*/*.JPEG"))
            for index, image in enumerate(images):
                (out / "folder" / split / f"s{index:03d}").mkdir(parents=True)
                shutil.copy(image, out / "folder" / split / f"s{index:03d}" / image.name)
        convert_here("convert_ffcv.py", out / "folder", out / "ffcv")
        convert_here("convert_wds.py", out / "folder", out / "webdataset", "--shard-size-mb", "0.02")
    out = made_once(tmp_path_factory, "own_class", make)
    return {kind: out / kind for kind in ("folder", "ffcv", "webdataset")}


def global_steps(backend: str, path, world_size: int, epoch: int = 1, **options) -> list[list]:
    """Per global step of the epoch, the sorted labels of its samples over all ranks."""
    per_rank = []
    for rank in range(world_size):
        spec = LoaderSpec(backend=backend, path=str(path) if path else None, batch_size=GLOBAL_BATCH // world_size,
                          rank=rank, world_size=world_size, resolution=16, num_workers=1, seed=5, **options)
        loader = build_loader(spec)
        loader.set_epoch(epoch)
        per_rank.append([labels.tolist() for _, labels in loader])
    assert len({len(batches) for batches in per_rank}) == 1, "ranks gave different numbers of steps"
    return [sorted(sum((batches[step] for batches in per_rank), [])) for step in range(len(per_rank[0]))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["webdataset", "folder", "ffcv", "dali"])
def test_each_global_step_holds_the_same_samples_at_every_world_size(backend, own_class_sets):
    path = own_class_sets["webdataset" if backend == "dali" else backend]   # dali: the shard source
    steps = global_steps(backend, path, 1)
    assert len(steps) == 120 // GLOBAL_BATCH
    seen = sum(steps, [])
    assert len(set(seen)) == len(seen) == 120                  # each sample once in the epoch
    # ffcv deals the permutation folder does (pipeline/loader/sharding.py), and each of its loaders takes a second to build
    for world_size in (3,) if backend == "ffcv" else (2, 3, 4):
        assert global_steps(backend, path, world_size) == steps, f"world size {world_size}"
    assert global_steps(backend, path, 1, epoch=2) != steps      # and another order the next epoch


def test_the_pillow_path_of_webdataset_follows_the_same_steps(own_class_sets):
    path = own_class_sets["webdataset"]
    assert global_steps("webdataset", path, 3, native_decode=False) == global_steps("webdataset", path, 2)


def test_synthetic_global_batches_do_not_depend_on_the_world_size():
    def step_samples(world_size):
        samples = []
        for rank in range(world_size):
            loader = build_loader(LoaderSpec(backend="synthetic", batch_size=GLOBAL_BATCH // world_size, rank=rank,
                                             world_size=world_size, resolution=8, num_classes=50, synthetic_size=48))
            images, labels = next(iter(loader))
            samples += [(int(label), round(float(image.sum()), 3)) for image, label in zip(images, labels)]
        return Counter(samples)
    assert step_samples(1) == step_samples(2) == step_samples(4)
    assert len(step_samples(1)) == GLOBAL_BATCH


@pytest.mark.parametrize("before, after", [(2, 3), (4, 1)])
def test_resumed_at_another_world_size_a_rank_takes_the_samples_not_yet_seen(before, after, own_class_sets):
    """A loader state saved on one world size, loaded on another: the steps that follow are the
    uninterrupted epoch's, and over both parts each sample comes once."""
    path = own_class_sets["webdataset"]
    whole = global_steps("webdataset", path, 1)
    stopped = build_loader(LoaderSpec(backend="webdataset", path=str(path), batch_size=GLOBAL_BATCH // before,
                                      world_size=before, rank=0, resolution=16, num_workers=1, seed=5))
    stopped.set_epoch(1)
    batches = iter(stopped)
    for _ in range(4):
        next(batches)
    state = stopped.state_dict()
    rest = []
    for rank in range(after):
        loader = build_loader(LoaderSpec(backend="webdataset", path=str(path), batch_size=GLOBAL_BATCH // after,
                                         world_size=after, rank=rank, resolution=16, num_workers=1, seed=5))
        loader.load_state_dict(state)
        rest.append([labels.tolist() for _, labels in loader])
    resumed = [sorted(sum((batches[step] for batches in rest), [])) for step in range(len(rest[0]))]
    assert resumed == whole[4:]
    assert sorted(sum(whole[:4] + resumed, [])) == list(range(120))


def test_a_rank_reads_one_contiguous_part_of_the_stream(own_class_sets):
    """A rank of the webdataset backend reads its batch-size lanes, neighbours in the epoch's shard
    stream: one contiguous part of it, so reading stays sequential (and, from a URL, a rank fetches
    no other rank's blocks but at its part's two ends)."""
    from pipeline.datasets import read_converted
    from pipeline.shards.index import StoredShards
    stored = StoredShards(read_converted(own_class_sets["webdataset"], "train", "webdataset").shards)
    spec = LoaderSpec(backend="webdataset", path=str(own_class_sets["webdataset"]), batch_size=3, rank=1, world_size=4,
                      resolution=16, seed=5)
    plan = np.stack(stored.epoch_batches(spec, 1))               # (steps, this rank's lanes)
    stream = stored._stream(0, len(stored), 1, spec.seed, shuffle=True)
    position = np.argsort(stream)                                # stored id -> place in the epoch's stream
    assert sorted(position[plan.reshape(-1)]) == list(range(30, 60))        # rank 1 of 4, 30 samples each
    assert all(np.ptp(position[lane]) == 9 for lane in plan.T)              # each lane: 10 in a row
