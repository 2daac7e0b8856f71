"""The four data backends against the loader contract: interface, one semantics (same pixels
across backends), schedules and ColOut in the loader, determinism, exact mid-epoch resume,
distributed sharding under real torchrun, and the errors a user meets."""
import gc
import json
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, as_converted_before_index_packs, two_ranks
from pipeline import LoaderSpec, batches_per_epoch, build_loader
from pipeline.loader.prefetch import BufferRing, prefetched

# (backend, the form of the data it reads); DALI reads both raw folders and shards.
CASES = [("folder", "folder"), ("webdataset", "webdataset"), ("ffcv", "ffcv"), ("dali", "folder"), ("dali", "webdataset")]
IDS = [f"{backend}-{form}" for backend, form in CASES]
UNIT = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))   # "normalized" pixels stay in 0..255


def loader_for(converted_sets, backend, form, dataset="photos", **spec):
    spec.setdefault("batch_size", 16)
    spec.setdefault("num_workers", 2)
    return build_loader(LoaderSpec(backend, path=str(converted_sets[dataset][form]), **spec))


def epoch(loader):
    return [(images.clone(), labels.clone()) for images, labels in loader]


@pytest.mark.parametrize("backend,form", CASES, ids=IDS)
def test_interface_schedule_and_colout(converted_sets, backend, form):
    schedule = {"form": "ffcv", "min_res": 64, "max_res": 96, "start_ramp": 0, "end_ramp": 1}
    loader = loader_for(converted_sets, backend, form, resolution=schedule, colout=(0.25, 0.5), dtype=torch.bfloat16)
    assert loader.num_classes == 23 and len(loader) == 92 // 16     # 4 photos x 23 classes, last partial dropped
    assert loader.resolution == (48, 32)
    batches = epoch(loader)
    assert len(batches) == len(loader)
    images, labels = batches[0]
    assert images.shape == (16, 3, 48, 32) and images.dtype == torch.bfloat16
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64 and labels.shape == (16,) and 0 <= labels.min() <= labels.max() < 23
    loader.set_epoch(1)
    assert loader.resolution == (72, 48) and next(iter(loader))[0].shape == (16, 3, 72, 48)

    gc.collect()
    gc.disable()                     # what follows must not depend on the garbage collector
    try:
        val = loader_for(converted_sets, backend, form, split="val", val_resolution=80, **UNIT)
        counted = [labels for _, labels in epoch(val)]
        assert len(counted) == len(val) == 6 and sum(map(len, counted)) == 92     # all 92, the last batch partial
        assert val.resolution == (80, 80)
        # Freed as soon as it is dropped, workers stopped: a reference cycle left it to the garbage
        # collector, and the folder backend's workers then took torch's 5 s join timeout each to end.
        dropped = weakref.ref(val)
        del val
        assert dropped() is None, "a dropped loader is kept alive by a reference cycle"
    finally:
        gc.enable()


def test_backends_give_the_same_pixels_without_augmentation(converted_sets):
    """Val crops of the same stored samples agree across backends, in 0..255 units: mean
    |difference| <= 2.5 and no image worse than 8. What differs: FFCV stores JPEGs re-encoded
    at quality 90 and resizes with OpenCV INTER_AREA (measured 1.2 mean at 224 px, 1.7 at
    48 px, worst image 4.3); DALI's antialiased linear resize is not PIL's bilinear (0.1-0.2);
    at 48 px the webdataset backend decodes at 1/2 or 1/4 DCT scale (worst image 6.7: DCT
    scaling keeps fine texture that the triangle filter of a full decode averages away). The
    48 px pass also checks that every backend honours `val_crop_ratio`."""
    for side, crop_ratio in ((160, 224 / 256), (48, 0.6)):
        reference = None
        for backend, form in CASES:
            images, labels = epoch(loader_for(converted_sets, backend, form, split="val", batch_size=64,
                                              val_resolution=side, val_crop_ratio=crop_ratio, **UNIT))[0]
            if reference is None:
                reference = images.float(), labels
                whole = epoch(loader_for(converted_sets, backend, form, split="val", batch_size=64,
                                         val_resolution=side, val_crop_ratio=1.0, **UNIT))[0][0]
                assert (whole.float() - reference[0]).abs().mean() > 10, "val_crop_ratio changed nothing"
                continue
            assert torch.equal(labels, reference[1]), backend
            difference = (images.float() - reference[0]).abs()
            assert difference.mean() <= 2.5, (backend, form, side, float(difference.mean()))
            assert difference.flatten(1).mean(1).max() <= 8, (backend, form, side)


def test_ffcv_draws_the_train_crops_and_flips_the_folder_backend_draws(converted_sets):
    """One semantics with augmentation on: FFCV's compiled decoder takes each sample's crop and
    flip from the numbers pipeline.transforms.crops draws for every backend, so its train batches differ
    from folder's only as its val crops do (re-encoded JPEGs, another resize): mean |difference|
    1.3 at 64 px, worst image 3.5; numba's own np.random gave other crops (mean 28.5, worst 80)."""
    batches = {}
    for backend in ("folder", "ffcv"):
        loader = loader_for(converted_sets, backend, backend, batch_size=64, resolution=64, seed=5, **UNIT)
        loader.set_epoch(1)
        batches[backend] = epoch(loader)[0]
    (images, labels), (want_images, want_labels) = batches["ffcv"], batches["folder"]
    assert torch.equal(labels, want_labels)
    difference = (images.float() - want_images.float()).abs()
    assert difference.mean() <= 2.5 and difference.flatten(1).mean(1).max() <= 8, float(difference.mean())


def test_an_ffcv_epoch_left_mid_way_stops_its_thread(converted_sets):
    """FFCV's epoch thread, left running past an abandoned epoch, aborted 3 of 12 processes at exit
    (exit 134: a daemon thread in torch's C++ while the interpreter finalized); dropping the epoch's
    iterator now ends the thread at once."""
    before = set(threading.enumerate())
    loader = loader_for(converted_sets, "ffcv", "ffcv", batch_size=8)
    next(iter(loader))                      # the epoch's iterator is dropped here, 10 of 11 batches left
    assert [type(thread).__name__ for thread in set(threading.enumerate()) - before] == []


@pytest.mark.parametrize("backend,form", CASES, ids=IDS)
def test_same_seed_same_epoch_and_exact_resume(converted_sets, backend, form):
    spec = dict(resolution=48, seed=3)
    first = loader_for(converted_sets, backend, form, **spec)
    first.set_epoch(1)
    expected = epoch(first)
    again = loader_for(converted_sets, backend, form, **spec)
    again.set_epoch(1)
    iterator = iter(again)
    for (images, labels), (want_images, want_labels) in zip([next(iterator) for _ in range(2)], expected):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    state = again.state_dict()
    assert state["position"] == 2 and state["epoch"] == 1

    first.set_epoch(2)
    epoch_two = epoch(first)
    assert not torch.equal(epoch_two[0][0], expected[0][0])
    if backend == "dali":                   # its run for epoch 2 was started ahead, as epoch 1 ended
        fresh = loader_for(converted_sets, backend, form, **spec)
        fresh.set_epoch(2)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(epoch(fresh), epoch_two, strict=True))
    first.load_state_dict(state)            # as a restarted run would, from epoch 2 back to epoch 1
    rest = epoch(first)
    assert len(rest) == len(expected) - 2
    for (images, labels), (want_images, want_labels) in zip(rest, expected[2:]):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_webdataset_batches_do_not_depend_on_thread_or_worker_count(converted_sets):
    """The epoch plan comes from the shards' indexes alone: the engine's thread count and, on the
    RandAugment path, the number of worker processes change nothing."""
    for spec in (dict(colout=(0.2, 0.2)), dict(randaugment=(1, 5))):
        batches = []
        for workers in (1, 3):
            loader = loader_for(converted_sets, "webdataset", "webdataset", resolution=40, seed=4, num_workers=workers,
                                **spec)
            loader.set_epoch(1)
            batches.append(epoch(loader))
        assert len(batches[0]) == len(batches[1]) == 5
        for (images, labels), (again, again_labels) in zip(*batches):
            assert torch.equal(labels, again_labels) and torch.equal(images, again), spec


@pytest.mark.parametrize("backend,form,spec", [("folder", "folder", dict(split="val", val_resolution=32)),
                                               ("webdataset", "webdataset", dict(resolution=32, randaugment=(1, 5)))])
def test_workers_stop_at_once_when_the_garbage_collector_frees_a_loader(converted_sets, backend, form, spec):
    """A loader in a reference cycle (a trainer's, a traceback's) is freed by the collector, which
    used to leave its workers without their stop message: torch then sat out its 5 s join timeout
    for each of them (10 s here, against 0.1 s when they get the message) and signalled them,
    which a trainer's workers ignore (prepare_worker). A worker that got the message ends its
    loop and exits with status 0, and torch has joined it by the time the collector is done. The
    webdataset backend has workers only for RandAugment."""
    loader = loader_for(converted_sets, backend, form, **spec)
    epoch(loader)
    workers = list(loader.dataloader._iterator._workers)
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)    # persistent
    loader.cycle = loader
    del loader
    gc.collect()
    assert [worker.exitcode for worker in workers] == [0, 0], "the workers did not get their stop message"


@pytest.mark.parametrize("backend,form,spec", [("folder", "folder", {}),
                                               ("webdataset", "webdataset", dict(randaugment=(1, 5)))])
def test_an_uncaught_exception_mid_epoch_ends_the_process_at_once(converted_sets, backend, form, spec):
    """A bug or an out-of-memory error in a training step leaves the loader alive in the
    traceback through interpreter exit, where multiprocessing joins its daemon children after a
    SIGTERM that our workers ignore (they leave stopping to their rank, once a trainer asks them
    to: as here): the process used to hang there for good, its traceback printed, instead of
    exiting."""
    path = converted_sets["photos"][form]
    code = textwrap.dedent(f"""
        import signal
        from pipeline import LoaderSpec, build_loader
        from pipeline.loader.workers import leave_to_main_process
        leave_to_main_process((signal.SIGTERM, signal.SIGUSR1))       # as a trainer's stop requests do
        loader = build_loader(LoaderSpec({backend!r}, path={str(path)!r}, batch_size=8, num_workers=2, **{spec!r}))
        batches = iter(loader)
        next(batches)
        raise ZeroDivisionError("a fault in the step")
    """)
    # A process that lingers after its traceback is stopped by the timeout: TimeoutExpired fails the test.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 1 and "ZeroDivisionError: a fault in the step" in result.stderr, result.stderr


STUCK_FORK = """
import hashlib, os, sys, time
from pathlib import Path
import torch
from pipeline import LoaderSpec, build_loader
from pipeline.loader import workers as loader_workers
loader_workers.START_PATIENCE_S = 3
marker = Path(sys.argv[2])
if sys.argv[3] == "stuck":
    def stuck_once():
        # The first child forked waits forever before it runs any Python, as one that met an
        # interpreter lock held at the fork does (CPython gh-112275)
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            while True:
                time.sleep(60)
    os.register_at_fork(after_in_child=stuck_once)
torch.manual_seed(0)
loader = build_loader(LoaderSpec("folder", path=sys.argv[1], batch_size=8, num_workers=2, resolution=32))
digest = hashlib.sha256()
for images, labels in loader:
    digest.update(images.numpy().tobytes() + labels.numpy().tobytes())
print(digest.hexdigest(), torch.rand(1).item())
if marker.exists():
    try:
        os.kill(int(marker.read_text()), 0)
        print("the stuck worker is still there")
    except ProcessLookupError:
        pass
"""


def test_a_worker_that_never_starts_is_started_again_and_the_run_is_unchanged(converted_sets, tmp_path):
    script, data = tmp_path / "stuck_fork.py", converted_sets["fashion"]["folder"]
    script.write_text(STUCK_FORK)
    runs = {how: subprocess.run([sys.executable, str(script), str(data), str(tmp_path / f"{how}.pid"), how],
                                capture_output=True, text=True, timeout=60, cwd=ROOT) for how in ("stuck", "plain")}
    for how, run in runs.items():
        assert run.returncode == 0, (how, run.stderr[-3000:])
    said = runs["stuck"].stderr.strip().splitlines()
    assert len(said) == 1 and "did not start within 3 s" in said[0] and "starting the workers again" in said[0], said
    assert (tmp_path / "stuck.pid").exists() and not runs["plain"].stderr.strip()
    assert runs["stuck"].stdout == runs["plain"].stdout and len(runs["plain"].stdout.split()) == 2


def test_shard_stream_pieces_cover_every_sample_once_per_epoch():
    from pipeline.shards.index import stream_pieces
    counts = [5, 3, 7]
    for epoch in range(4):
        for shuffle in (True, False):
            ranges = [(0, 6), (6, 9), (9, 15)]    # as three ranks would cut the epoch's stream
            pieces = [p for lo, hi in ranges for p in stream_pieces(counts, lo, hi, epoch, seed=1, shuffle=shuffle)]
            samples = [(shard, i) for shard, begin, end in pieces for i in range(begin, end)]
            assert sorted(samples) == [(s, i) for s, n in enumerate(counts) for i in range(n)]
            assert all(0 <= begin < end <= counts[shard] for shard, begin, end in pieces)
            if not shuffle:
                assert samples == sorted(samples)


def test_the_train_shuffle_keeps_the_order_webdataset_gave():
    """The shard stream's window shuffle is ours (pipeline/shards/buffer_shuffle.py); it gives the order the
    webdataset package's `shuffle` stage gave with a full initial buffer, so every epoch's batches
    are the ones runs saw before: against a recorded order, and against the package's function."""
    from pipeline.shards.buffer_shuffle import buffer_shuffle
    assert list(buffer_shuffle(range(12), 4, seed=7)) == [2, 1, 5, 0, 6, 7, 3, 8, 4, 10, 9, 11]
    assert list(buffer_shuffle(range(12), 1000, seed=7)) == [5, 2, 6, 0, 1, 9, 4, 8, 10, 3, 11, 7]
    filters = pytest.importorskip("webdataset.filters")
    for count, size, seed in [(0, 3, 1), (1, 1, 2), (999, 1000, 3), (2500, 1000, 2 ** 62 + 5), (3001, 7, 4)]:
        theirs = filters._shuffle(iter(range(count)), bufsize=size, initial=size, rng=random.Random(seed))
        assert list(buffer_shuffle(range(count), size, seed)) == list(theirs), (count, size, seed)


def test_batches_made_ahead_are_handed_on_in_order_and_none_begun_is_left():
    """The engine's prefetch thread starts each batch but the first before it finishes the one
    before: batches still come out in order, an error starting one comes after the batch before
    it, and a consumer that stops early leaves no started batch unfinished (its memory is the
    engine's)."""
    ring = BufferRing(2, (1,), torch.uint8, pinned=False)
    events = []

    def start(key, buffer):
        if key == 3:
            raise ValueError("batch 3 cannot start")
        events.append(("start", key))
        return lambda: events.append(("finish", key)) or key

    got = []
    with pytest.raises(ValueError, match="batch 3 cannot start"):
        for key in prefetched(start, range(6), ring, depth=2):
            got.append(key)
    assert got == [0, 1, 2]
    assert events.index(("finish", 0)) < events.index(("start", 1))      # the first is not held back
    assert events.index(("start", 2)) < events.index(("finish", 1))
    events.clear()
    batches = prefetched(start, range(6), ring, depth=2)
    assert next(batches) == 0 and next(batches) == 1
    batches.close()
    begun = {key for what, key in events if what == "start"}
    assert len(begun) > 1 and begun == {key for what, key in events if what == "finish"}


def test_the_lanes_are_shuffled_at_once_as_one_at_a_time():
    """`shuffle_lanes` (C, every lane of an epoch in one call) gives each lane the order
    `buffer_shuffle` gives it with its seed: CPython's own draws, at every length and window."""
    from pipeline.shards.buffer_shuffle import buffer_shuffle, shuffle_lanes
    rng = np.random.default_rng(5)
    for length, window in [(0, 3), (1, 1), (12, 4), (999, 1000), (2500, 1000), (3001, 7), (600, 1), (700, 3)]:
        seeds = [0, 7, 2 ** 62 + 5, *map(int, rng.integers(0, 2 ** 63, 3))]
        lanes = rng.integers(0, 10 ** 12, (len(seeds), length))
        shuffled = shuffle_lanes(lanes, window, seeds)
        for lane, seed, ours in zip(lanes, seeds, shuffled):
            assert ours.tolist() == list(buffer_shuffle(lane.tolist(), window, seed)), (length, window, seed)
    with pytest.raises(ValueError, match="one seed per lane"):
        shuffle_lanes(np.zeros((2, 5), np.int64), 3, [1])


def test_an_index_is_read_at_once_or_line_by_line_alike(converted_sets, tmp_path):
    """The converters' indexes (every line the same members in the same order) are parsed at once;
    any other (members in another order on some line, one more member) line by line, to the same
    table; a bad number still names its line."""
    from pipeline.errors import DatasetError
    from pipeline.formats.converted import Shard, member_table
    from pipeline.formats.wds_shards import index_columns
    index = next((Path(converted_sets["photos"]["webdataset"]) / "train").glob("*.idx"))
    lines = index.read_text().splitlines()
    assert index_columns(index.read_text()) is not None
    count = len(lines) - 1
    table = member_table(Shard(tar=index.with_suffix(".tar"), index=index, count=count, first_sample=0))
    assert table.shape == (count, 3) and (table[:, 1] > 0).all() and (np.diff(table[:, 0]) > 0).all()

    def reordered(line):
        members = line.split()
        return " ".join(members[4:] + members[:4])
    for name, changed in [("reordered", [lines[0], lines[1], reordered(lines[2]), *lines[3:]]),
                          ("one more", [lines[0], lines[1] + " txt 1 1 x.txt", *lines[2:]])]:
        other = tmp_path / f"{name}.idx"
        other.write_text("\n".join(changed) + "\n")
        assert index_columns(other.read_text()) is None, name
        assert np.array_equal(member_table(Shard(tar=index, index=other, count=count, first_sample=0)), table), name
    bad = tmp_path / "bad.idx"
    bad.write_text("\n".join([*lines[:3], lines[3].replace(lines[3].split()[1], "12x", 1), *lines[4:]]) + "\n")
    with pytest.raises(DatasetError, match=r"bad.idx: unreadable index \(line 4: ValueError"):
        member_table(Shard(tar=index, index=bad, count=count, first_sample=0))


@pytest.mark.parametrize("backend,form", CASES, ids=IDS)
def test_batches_per_epoch_are_known_before_a_loader_is_built(converted_sets, backend, form):
    for split in ("train", "val"):
        for rank, world_size in ((0, 1), (1, 2)):
            spec = LoaderSpec(backend, path=str(converted_sets["photos"][form]), split=split, batch_size=16,
                              num_workers=1, rank=rank, world_size=world_size)
            assert batches_per_epoch(spec) == len(build_loader(spec)), (split, rank, world_size)
    assert batches_per_epoch(LoaderSpec("synthetic", batch_size=8, synthetic_size=100)) == 12


def test_a_loader_is_whole_once_built(converted_sets):
    """What a spec decides is decided when the loader is built: the webdataset backend's decoding
    path (the engine, or DataLoader workers for RandAugment) and FFCV's loader with its val crop.
    Building FFCV's loader leaves torch's thread count alone (FFCV sets it at each epoch's start)."""
    engine = loader_for(converted_sets, "webdataset", "webdataset", resolution=32)
    workers = loader_for(converted_sets, "webdataset", "webdataset", resolution=32, randaugment=(1, 5))
    assert engine.uses_engine and engine.engine is not None and engine.dataloader is None
    assert not workers.uses_engine and workers.engine is None and workers.dataloader is not None
    threads = torch.get_num_threads()
    # FFCV sets numba's and torch's thread count to num_workers, which numba caps at the core count
    ffcv = loader_for(converted_sets, "ffcv", "ffcv", split="val", val_resolution=32, val_crop_ratio=0.6,
                      num_workers=2 if threads == 1 else 1)
    assert torch.get_num_threads() == threads
    assert ffcv.ffcv.batch_size == 16 and ffcv.decoder.ratio == 0.6
    # more workers than numba has threads: capped, with a warning, not numba's bare ValueError
    import numba
    crowded = loader_for(converted_sets, "ffcv", "ffcv", split="val", val_resolution=32, num_workers=64)
    assert crowded.ffcv.num_workers == numba.config.NUMBA_NUM_THREADS < 64


RANKS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from pipeline import LoaderSpec, build_loader
    dist.init_process_group("gloo")
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    seen = {}
    for name, (backend, path) in cases.items():
        for split in ("train", "val"):
            # scale and ratio 1: the train crop is the centered square, so a sample's pixel sum
            # (which a flip keeps) tells which sample it is.
            spec = LoaderSpec(backend, path=path, split=split, batch_size=16, num_workers=1, resolution=32,
                              val_resolution=32, scale=(1, 1), ratio=(1, 1), seed=5)
            loader = build_loader(spec)
            loader.set_epoch(1)
            sums = [[round(float(s), 1), int(l)] for images, labels in loader
                    for s, l in zip(images.double().sum((1, 2, 3)), labels)]
            seen[f"{name}/{split}"] = {"samples": sums, "len": len(loader)}
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
""")


def test_ranks_read_disjoint_parts_and_val_counts_every_sample_once(converted_sets, tmp_path):
    cases = {f"{backend}-{form}": (backend, str(converted_sets["photos"][form])) for backend, form in CASES}
    ranks = two_ranks(RANKS_SCRIPT, tmp_path, json.dumps(cases))
    for name in cases:
        train = [ranks[r][f"{name}/train"] for r in range(2)]
        assert train[0]["len"] == train[1]["len"] == 46 // 16, name     # 92 samples: 46 a rank, full batches
        keys = [tuple(s) for rank in train for s in rank["samples"]]
        assert len(keys) == 2 * 2 * 16 and len(set(keys)) == len(keys), f"{name}: a train sample read twice"

        val = [tuple(s) for r in range(2) for s in ranks[r][f"{name}/val"]["samples"]]
        alone = loader_for(converted_sets, name.split("-")[0], name.split("-")[1], split="val", batch_size=16,
                           val_resolution=32)
        single = [tuple((round(float(s), 1), int(l))) for images, labels in alone
                  for s, l in zip(images.double().sum((1, 2, 3)), labels)]
        assert sorted(val) == sorted(single) and len(single) == 92, f"{name}: val not read exactly once"


def one_line_error(kind, message, call):
    with pytest.raises(kind) as caught:
        call()
    text = str(caught.value)
    assert "\n" not in text and message in text, text
    return text


def test_bad_paths_and_damaged_files_are_one_line_errors(converted_sets, tmp_path):
    from pipeline.errors import DatasetError
    photos = converted_sets["photos"]

    def build(backend, path, split="val"):
        return lambda: build_loader(LoaderSpec(backend, path=str(path), split=split, num_workers=0))

    for backend in ("ffcv", "webdataset", "folder", "dali"):
        one_line_error(DatasetError, "no such directory", build(backend, tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    one_line_error(DatasetError, "manifest.json: missing", build("ffcv", tmp_path / "empty"))
    one_line_error(DatasetError, "holds a webdataset conversion, not ffcv", build("ffcv", photos["webdataset"]))
    one_line_error(DatasetError, "is a converted dataset, not an ImageNet-layout folder", build("folder", photos["ffcv"]))
    flat, loose = tmp_path / "flat", tmp_path / "loose"
    for folder in (flat, loose / "val", loose / "pics" / "more"):
        folder.mkdir(parents=True)
    for number in range(3):
        shutil.copy(next((photos["folder"] / "val").glob("*/*.JPEG")), flat / f"{number}.jpg")
    shutil.copy(flat / "0.jpg", loose / "val" / "0.jpg")
    shutil.copy(flat / "0.jpg", loose / "pics" / "more" / "0.jpg")
    one_line_error(DatasetError, "found 3 image files and 0 folders; python tools/convert_wds.py", build("folder", flat))
    one_line_error(DatasetError, "found 0 image files and 2 folders: pics/ (1 image), val/ (1 image)",
                   build("folder", loose, split="train"))
    one_line_error(DatasetError, "no class folders under val (val/: found 1 image file and 0 folders)",
                   build("folder", loose))

    not_beton = tmp_path / "not_beton"
    shutil.copytree(photos["ffcv"], not_beton)
    size = (not_beton / "val.beton").stat().st_size
    (not_beton / "val.beton").write_bytes(b"\x00" * size)
    one_line_error(DatasetError, "val.beton: not a readable FFCV .beton", build("ffcv", not_beton))

    truncated = tmp_path / "truncated"
    shutil.copytree(photos["webdataset"], truncated)
    tar = truncated / "val" / "shard-000000.tar"
    tar.write_bytes(tar.read_bytes()[:100_000])
    for backend in ("webdataset", "dali"):
        one_line_error(DatasetError, "shard-000000.tar: 100000 bytes, its index needs", build(backend, truncated))


def test_folder_takes_local_paths_only_and_a_scrambled_index_is_one_short_line(converted_sets, tmp_path):
    from pipeline.errors import DatasetError
    text = one_line_error(DatasetError, "the folder backend reads local paths only", lambda: build_loader(
        LoaderSpec("folder", path="s3://bucket/photos?X-Amz-Signature=abc123", split="val", num_workers=0)))
    assert "convert_wds.py" in text and "webdataset" in text and "abc123" not in text

    scrambled = tmp_path / "scrambled"
    shutil.copytree(converted_sets["photos"]["webdataset"], scrambled)
    as_converted_before_index_packs(scrambled)         # else the loader reads its index pack's table
    index = scrambled / "val" / "shard-000000.idx"
    index.write_bytes(b"v1.0 0 1\n" + bytes(range(33, 127)) * 2300)   # one 216 KB line of junk
    for backend in ("webdataset",):
        text = one_line_error(DatasetError, "shard-000000.idx: unreadable index", lambda: build_loader(
            LoaderSpec(backend, path=str(scrambled), split="val", num_workers=0)))
        assert len(text) < 400, len(text)


def test_a_missing_package_names_it():
    code = ("import sys; sys.modules['ffcv'] = None\n"
            "from pipeline import LoaderSpec, build_loader\n"
            f"build_loader(LoaderSpec('ffcv', path={str(ROOT)!r}))")   # a directory: the path is checked first
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "ImportError: loader backend 'ffcv' needs the package 'ffcv'" in result.stderr.splitlines()[-1]


def corrupt_one_sample(converted_sets, tmp_path):
    """A copy of the photos val split, raw and as shards, where one JPEG has lost its second half."""
    folder, shards = tmp_path / "folder", tmp_path / "shards"
    shutil.copytree(converted_sets["photos"]["folder"], folder)
    shutil.copytree(converted_sets["photos"]["webdataset"], shards)
    victim = sorted((folder / "val").glob("*/*.JPEG"))[5]
    victim.write_bytes(victim.read_bytes()[:len(victim.read_bytes()) // 2])
    # In the shard: blank the second half of sample 5's JPEG in place, so offsets stay valid.
    index = (shards / "val" / "shard-000000.idx").read_text().splitlines()
    _, offset, size, _ = index[1 + 5].split()[:4]
    tar = bytearray((shards / "val" / "shard-000000.tar").read_bytes())
    start = int(offset) + int(size) // 2
    tar[start:int(offset) + int(size)] = bytes(int(size) - int(size) // 2)
    (shards / "val" / "shard-000000.tar").write_bytes(bytes(tar))
    return folder, shards, victim


def test_corrupt_samples_are_skipped_and_counted_or_raised(converted_sets, tmp_path, caplog):
    from benchmarks.loopback_servers import Nginx
    folder, shards, victim = corrupt_one_sample(converted_sets, tmp_path)
    server = Nginx(tmp_path, tmp_path / "nginx")          # the shards also read from a URL
    cases = [("folder", folder, victim.name), ("webdataset", shards, "shard-000000.tar:000000005"),
             ("webdataset", f"{server.url}/shards", "/shards/val/shard-000000.tar:000000005")]
    try:
        for backend, path, name in cases:
            options = dict(split="val", batch_size=16, num_workers=1, cache_dir=str(tmp_path / "cache"))
            loader = build_loader(LoaderSpec(backend, path=str(path), **options))
            with caplog.at_level("WARNING", logger="pipeline"):
                seen = sum(len(labels) for _, labels in loader)
            assert (seen, loader.corrupt_in_epoch) == (91, 1), path
            assert "skipped 1 damaged samples" in caplog.text
            strict = build_loader(LoaderSpec(backend, path=str(path), on_corrupt="raise", **options))
            from pipeline.errors import CorruptSample
            one_line_error(CorruptSample, name, lambda: [None for _ in strict])
    finally:
        server.stop()
    dali = build_loader(LoaderSpec("dali", path=str(folder), split="val", batch_size=16, num_workers=1))
    from pipeline.errors import DatasetError
    text = one_line_error(DatasetError, "DALI failed while reading the val split", lambda: [None for _ in dali])
    assert str(victim) in text
