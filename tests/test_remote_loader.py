"""The webdataset backend reading a converted dataset from a URL, against real servers (nginx
over HTTP, moto's S3 server): the batches bit for bit those of the same shards on local disk
(engine and Pillow paths, resume included), the node's cache shared, bounded and reused, and the
bytes fetched close to the bytes of the samples read."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
from urllib.parse import unquote

import numpy as np
import pytest
import torch

from pipeline import LoaderSpec, build_loader
from pipeline.remote.block_cache import BLOCK_SUFFIX
from pipeline.datasets import read_converted
from pipeline.errors import DatasetError, RemoteDataError
from pipeline.remote.block_plan import block_visits, cut_blocks, sample_spans


@pytest.fixture(scope="module")
def photos_server(converted_sets, tmp_path_factory):
    """nginx serving the converted sets' folder; the photos conversion is at URL/photos_wds."""
    from benchmarks.loopback_servers import Nginx
    server = Nginx(converted_sets["photos"]["webdataset"].parent, tmp_path_factory.mktemp("nginx-photos"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def photos_in_s3(moto_s3, converted_sets):
    """The photos conversion uploaded to moto's S3 server as s3://datasets/photos_wds."""
    import boto3
    folder = converted_sets["photos"]["webdataset"]
    client = boto3.client("s3", endpoint_url=moto_s3.url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="datasets")
    for path in folder.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "datasets", f"photos_wds/{path.relative_to(folder)}")
    return "s3://datasets/photos_wds"


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    for name, value in (("AWS_ENDPOINT_URL", moto_s3.url), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)


def spec(path, split="train", **options) -> LoaderSpec:
    settings = dict(backend="webdataset", path=str(path), split=split, batch_size=16, resolution=64,
                    val_resolution=64, num_workers=2, seed=3)
    return LoaderSpec(**{**settings, **options})


def batches(loader, epoch=0, start=None):
    if start is None:
        loader.set_epoch(epoch)
    else:
        loader.load_state_dict({"epoch": epoch, "position": start})
    return [(images.clone(), labels.clone()) for images, labels in loader]


def assert_same(expected, actual):
    assert len(expected) == len(actual) > 0
    for (x1, y1), (x2, y2) in zip(expected, actual):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("options", [dict(split="train"), dict(split="val"),
                                     dict(split="train", native_decode=False),
                                     dict(split="val", native_decode=False, cache_limit=1),
                                     dict(split="train", rank=1, world_size=2, colout=(0.1, 0.1))],
                         ids=["train-engine", "val-engine", "train-pillow", "pillow-nothing-kept", "rank1of2-colout"])
def test_http_batches_equal_local_disk(converted_sets, photos_server, tmp_path, options):
    """Pillow's path decodes in forked workers, which get the samples' bytes from the main
    process: with nothing kept in the cache, a worker that fetched would hang."""
    local = converted_sets["photos"]["webdataset"]
    expected = batches(build_loader(spec(local, **{k: v for k, v in options.items() if k != "cache_limit"})), epoch=1)
    remote = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=tmp_path, **options))
    assert_same(expected, batches(remote, epoch=1))


def test_s3_batches_equal_local_disk_and_resume(converted_sets, photos_in_s3, s3_env, tmp_path):
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    remote = build_loader(spec(photos_in_s3, cache_dir=tmp_path / "cache"))
    assert_same(batches(local), batches(remote))
    # resumed at batch 2 of epoch 1 by a fresh loader with an empty cache
    resumed = build_loader(spec(photos_in_s3, cache_dir=tmp_path / "other-cache"))
    assert_same(batches(local, epoch=1, start=2), batches(resumed, epoch=1, start=2))


def test_s3_ranges_streamed_are_read_by_presigned_urls(converted_sets, photos_in_s3, s3_env, tmp_path):
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    remote = build_loader(spec(photos_in_s3, cache_dir=tmp_path / "cache", cache_limit=1))
    assert remote.stored.in_memory
    assert_same(batches(local), batches(remote))
    shared = remote.stored.sources.fetch_process.shared
    assert shared.direct_requests == shared.requests_made > 0


def test_s3_keys_from_a_credential_process_reach_the_fetch_process(converted_sets, photos_in_s3, moto_s3,
                                                                   moto_reader, monkeypatch, tmp_path):
    """A split streamed through memory from S3 with the keys of the AWS profile's
    credential_process: the fetch process signs with them too (moto checks every request)."""
    from conftest import checking_credentials, credential_process, without_aws_variables
    without_aws_variables(monkeypatch, tmp_path)
    command, ran = credential_process(tmp_path, moto_reader, 3600)
    (tmp_path / ".aws" / "config").write_text(f"[default]\ncredential_process = {command}\nregion = us-east-1\n"
                                              f"endpoint_url = {moto_s3.url}\n")
    expected = batches(build_loader(spec(converted_sets["photos"]["webdataset"])))
    with checking_credentials(moto_s3):
        remote = build_loader(spec(photos_in_s3, cache_dir=tmp_path / "cache", cache_limit=1))
        assert remote.stored.in_memory
        assert_same(expected, batches(remote))
        # the fetch process got the split's bytes itself: a request it made unsigned would be refused
        from pipeline.remote.block_fetcher import BYTES
        shared = remote.stored.sources.fetch_process.shared
        assert int(shared.header[BYTES]) >= remote.stored.split_bytes // 2
        # moto's checks take no presigned URL (they want an Authorization header): each direct read
        # was refused, obstore read the range again, and after a few the fetch process read through obstore alone
        assert shared.direct_requests == 0
    assert len(ran.read_text().splitlines()) == 1       # the keys it gave travel with the store's options


@pytest.mark.parametrize("cache_limit", [None, 1], ids=["disk-cache", "streamed"])
def test_gs_batches_equal_local_disk(converted_sets, tmp_path, monkeypatch, cache_limit):
    """gs:// through the GCS client, sent to the loopback nginx by a service-account file that
    names it as the endpoint (as GCS emulators are reached), in the fetch process too."""
    from benchmarks.remote_sources import RemoteSource
    local = converted_sets["photos"]["webdataset"]
    with RemoteSource("gs-nginx", local.parent) as source:
        for name, value in source.environment.items():
            monkeypatch.setenv(name, value)
        options = {} if cache_limit is None else {"cache_limit": cache_limit}
        remote = build_loader(spec(source.url_for(local), cache_dir=tmp_path, **options))
        assert remote.stored.in_memory == (cache_limit is not None)
        assert_same(batches(build_loader(spec(local))), batches(remote))
        if remote.stored.in_memory:     # an account without a key signs no URL: obstore read every range
            shared = remote.stored.sources.fetch_process.shared
            assert shared.direct_requests == 0 < shared.requests_made
        [nginx] = source._servers
        assert "GET /bench/photos_wds/train/shard-000000.tar " in unquote(nginx.access_log.read_text())


@pytest.mark.parametrize("cache_limit", [None, 1], ids=["disk-cache", "streamed"])
def test_http_user_and_password_in_the_url_are_sent_to_the_server(converted_sets, tmp_path, cache_limit):
    """https://user:password@host/... as curl takes it (obstore alone sends no credentials a URL
    carries): nginx with basic auth, in the fetch process too; the password is never shown."""
    from benchmarks.loopback_servers import Nginx
    local = converted_sets["photos"]["webdataset"]
    server = Nginx(local.parent, tmp_path / "nginx", basic_auth=("reader", "p@ss w/rd%"))
    try:
        port = server.url.rsplit(":", 1)[1]
        options = {} if cache_limit is None else {"cache_limit": cache_limit}
        remote = build_loader(spec(f"http://reader:p%40ss%20w%2Frd%25@127.0.0.1:{port}/photos_wds",
                                   cache_dir=tmp_path / "cache", **options))
        assert remote.stored.in_memory == (cache_limit is not None)
        assert_same(batches(build_loader(spec(local))), batches(remote))
        if remote.stored.in_memory:     # read directly with the password as a header, as obstore sends it
            shared = remote.stored.sources.fetch_process.shared
            assert shared.direct_requests == shared.requests_made > 0
        refused = {}
        for url in (f"http://reader:not-the-password@127.0.0.1:{port}/photos_wds", f"{server.url}/photos_wds"):
            with pytest.raises(RemoteDataError) as caught:
                build_loader(spec(url, cache_dir=tmp_path))
            refused[url.count("@")] = str(caught.value)
    finally:
        server.stop()
    assert refused[1].startswith(f"http://***@127.0.0.1:{port}/photos_wds/manifest.json: the server refused the user")
    assert "not-the-password" not in refused[1]
    assert refused[0].endswith("asks for a user and password (401): give them in the URL, http://USER:PASSWORD@host/...")


def test_cache_is_reused_and_bounded(converted_sets, photos_server, tmp_path):
    url = f"{photos_server.url}/photos_wds"
    loader = build_loader(spec(url, cache_dir=tmp_path))
    store = loader.stored.source.store
    batches(loader, epoch=0)
    first_epoch = store.requests
    assert first_epoch > 0
    batches(loader, epoch=1)
    assert store.requests == first_epoch       # everything came from the cache

    # A cache that holds either split but not both: reading val evicts train's oldest blocks
    train_bytes = int((loader.stored.block_end - loader.stored.block_start).sum())
    limit = train_bytes + (1 << 20)
    train = build_loader(spec(url, cache_dir=tmp_path / "small", cache_limit=limit))
    val = build_loader(spec(url, split="val", cache_dir=tmp_path / "small", cache_limit=limit))
    assert not train.stored.in_memory and not val.stored.in_memory
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    local_val = build_loader(spec(converted_sets["photos"]["webdataset"], split="val"))
    assert_same(batches(local), batches(train))
    assert_same(batches(local_val), batches(val))
    held = sum(p.stat().st_size for p in (tmp_path / "small").rglob(f"*{BLOCK_SUFFIX}"))
    assert held <= limit + (1 << 20)     # at most a block past it, the one just fetched
    assert val.stored.source.cache.fetches > 0 and held < train_bytes + val.stored.source.cache.fetched_bytes


def test_an_epoch_read_again_fetches_only_the_blocks_gone_from_disk(photos_server, tmp_path):
    """The read-ahead asks the cache which blocks it holds with a listing per folder
    (BlockCache.present) and fetches only the others: a block still on disk is not written again."""
    loader = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=tmp_path, fetch_size="64KiB"))
    cache = loader.stored.source.cache
    batches(loader, epoch=0)
    files = sorted(tmp_path.rglob(f"*{BLOCK_SUFFIX}"))
    names = [str(f.relative_to(tmp_path))[:-len(BLOCK_SUFFIX)] for f in files]
    assert len(files) > 10 and cache.present(names) == set(names)
    gone, kept = files[::3], [f for i, f in enumerate(files) if i % 3]
    for path in gone:
        path.unlink()
    assert cache.present([*names, "no/such/block"]) == {n for i, n in enumerate(names) if i % 3}
    inodes = {path: path.stat().st_ino for path in kept}
    batches(loader, epoch=1)
    assert {path: path.stat().st_ino for path in kept} == inodes     # a fetch writes a new file
    assert any(path.exists() for path in gone)


def test_a_split_larger_than_the_cache_streams_through_memory(converted_sets, photos_server, tmp_path):
    """Its blocks are fetched by a process of their own into shared memory, never written to disk,
    each let go once the plan is past it, and the batches are still those of local disk."""
    url = f"{photos_server.url}/photos_wds"
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    split_bytes = int(np.subtract(*sample_spans(local.stored.members)[::-1]).sum())
    remote = build_loader(spec(url, cache_dir=tmp_path, cache_limit=split_bytes // 2, fetch_size="64KiB"))
    store = remote.stored.source.store
    assert remote.stored.in_memory
    requests = [0]
    for epoch in (0, 1):
        assert_same(batches(local, epoch), batches(remote, epoch))
        shared = remote.stored.sources.fetch_process.shared
        requests.append(store.requests)
        # What is held once the fetcher has caught up with the end of the epoch: the next epoch's
        # first blocks, fetched while this one ended, as many as the read-ahead's bytes allow, and
        # those that both the last batches of this epoch and the first of the next read
        next_plan = [remote.stored.block_of[ids].tolist() for ids in remote.stored.epoch_batches(remote.spec, epoch + 1)]
        held = wait_for(lambda: shared.held_blocks() if next_plan[0][0] in shared.held_blocks()
                        and shared.held_blocks() <= set(sum(next_plan, [])) else None)
        window = remote.stored.sources.fetch_process.visit_gap
        this_plan = [remote.stored.block_of[ids].tolist() for ids in remote._plan]
        both = set(sum(this_plan[-window:], [])) & set(sum(next_plan[:window], []))
        block_sizes = remote.stored.block_end - remote.stored.block_start
        assert held and shared.bytes_held <= remote.stored.ahead_bytes + block_sizes[list(both)].sum()
    assert requests[-1] > len(remote.stored.block_start)      # blocks let go were fetched again
    # the read-ahead's window and the blocks of the batches being made, within the slots
    assert 0 < shared.peak_bytes <= remote.stored.ahead_bytes + 2 * 16 * remote.stored.block_bytes < split_bytes
    assert shared.peak_bytes <= shared.slots * shared.slot_bytes
    assert not list(tmp_path.rglob(f"*{BLOCK_SUFFIX}"))
    assert shared.direct_requests == shared.requests_made > 0      # each range read into its slot directly
    # resumed mid-epoch, and a sample read alone (Pillow's fallback, DALI's source)
    assert_same(batches(local, epoch=1, start=3), batches(remote, epoch=1, start=3))
    assert remote.stored.read(5) == local.stored.read(5)
    fetcher = shared.process
    remote.stored.close()
    assert fetcher.poll() == 0          # told to stop, it ended


def test_blocks_the_fetch_process_cannot_give_are_fetched_here(converted_sets, photos_server, tmp_path):
    """Should the fetch process die, or not get a block, the loader fetches the blocks itself:
    the batches are the same and nothing is left waiting."""
    url = f"{photos_server.url}/photos_wds"
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    remote = build_loader(spec(url, cache_dir=tmp_path, cache_limit=1, fetch_size="64KiB"))
    assert_same(batches(local, 0)[:2], batches(remote, 0)[:2])
    shared = remote.stored.sources.fetch_process.shared
    shared.process.kill()
    shared.process.wait()
    before = remote.stored.source.store.requests
    assert_same(batches(local, 1), batches(remote, 1))
    assert remote.stored.source.store.requests > before       # fetched here
    assert not shared.alive


@pytest.mark.parametrize("failing", ["FetchProcess", "SharedBlocks"])
def test_a_fetch_process_that_does_not_start_leaves_the_blocks_to_threads_here(converted_sets, photos_server,
                                                                              tmp_path, monkeypatch, caplog, failing):
    """Where the fetch process cannot start (when the split is opened) or be set up (at the first
    plan), the split streams through memory all the same, fetched by threads here, with one line
    saying so, and the batches are those of local disk."""
    from pipeline.remote import block_sources, dataset

    def no_process(*args, **options):
        raise OSError("no process for the test")
    monkeypatch.setattr(block_sources, failing, no_process)
    if failing == "FetchProcess":       # nor as soon as the manifest shows that the split streams
        monkeypatch.setattr(dataset, failing, no_process)
    local = build_loader(spec(converted_sets["photos"]["webdataset"]))
    remote = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=tmp_path, cache_limit=1,
                               fetch_size="64KiB"))
    with caplog.at_level("WARNING", logger="pipeline.remote.block_sources"):
        for epoch in (0, 1):
            assert_same(batches(local, epoch), batches(remote, epoch))
    assert remote.stored.in_memory and remote.stored.sources.serving is remote.stored.sources.memory
    assert remote.stored.sources.fetch_process is None
    said = [record.getMessage() for record in caplog.records if "did not start" in record.getMessage()]
    assert len(said) == 1 and "no process for the test" in said[0], said
    assert not list(tmp_path.rglob(f"*{BLOCK_SUFFIX}"))


def test_the_fetch_process_starts_as_soon_as_the_manifest_shows_that_the_split_streams(photos_server, tmp_path,
                                                                                       monkeypatch):
    """Its interpreter loads while the indexes are fetched: the loader then sets up that process and
    starts no other. One that no loader takes is stopped once dropped; a split kept on disk starts
    none."""
    from pipeline.remote import block_sources, dataset
    from pipeline.remote.shared_blocks import FetchProcess
    started = []

    class Counted(FetchProcess):
        def __init__(self):
            super().__init__()
            started.append(self)
    monkeypatch.setattr(dataset, "FetchProcess", Counted)
    monkeypatch.setattr(block_sources, "FetchProcess", Counted)
    url = f"{photos_server.url}/photos_wds"
    data = read_converted(url, "train", "webdataset", cache_dir=str(tmp_path), cache_limit=1)
    assert started and data.remote.fetch_process is started[0]
    fetcher = started[0].process
    del data
    started.clear()
    assert fetcher.wait(timeout=30) == 0 and fetcher.poll() == 0
    assert read_converted(url, "train", "webdataset", cache_dir=str(tmp_path)).remote.fetch_process is None
    assert not started
    remote = build_loader(spec(url, cache_dir=tmp_path, cache_limit=1, fetch_size="64KiB"))
    next(iter(remote))
    assert len(started) == 1 and remote.stored.sources.fetch_process.shared.fetch_process is started[0]
    remote.stored.close()


def test_a_block_larger_than_the_fetch_process_slots_is_fetched_ahead_here(photos_server, tmp_path):
    """A sample larger than the fetch size is a block of its own, larger than the fetch process's
    slots: threads here fetch it ahead into memory, and the batch reading it finds it there."""
    remote = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=tmp_path, cache_limit=1, fetch_size="64KiB"))
    stored = remote.stored
    oversized = set(np.flatnonzero(stored.block_end - stored.block_start > stored.block_bytes).tolist())
    plan = stored.epoch_batches(remote.spec, 0)
    first_use = {}
    for index, ids in enumerate(plan):
        for block in stored.block_of[ids].tolist():
            first_use.setdefault(block, index)
    # within the first window of both the fetch process (batches to 3) and the threads (to 4)
    soon = {block for block in oversized if first_use[block] <= 3}
    assert soon, "the test set needs a sample larger than 64 KiB in its first batches"
    stored.read_ahead(plan, 0)
    shared = stored.sources.fetch_process.shared
    assert shared is not None and not shared.planned[list(soon)].any()
    memory = stored.sources.memory._blocks
    wait_for(lambda: all(block in memory and memory[block].filled for block in soon))
    batch = plan[max(first_use[block] for block in soon)]
    # and the fetch process's blocks of that batch: one it has not begun within its patience (a
    # starved process on a loaded machine) would be fetched here, as it should, and counted below
    theirs = [block for block in set(stored.block_of[batch].tolist()) - soon if shared.planned[block]]
    wait_for(lambda: (shared.state[theirs] >= 0).all())
    requests = stored.source.store.requests       # fetches here; the fetch process's are added as batches are handed out
    with stored.located(batch):
        pass
    assert stored.source.store.requests == requests


def wait_for(condition, limit_s: float = 30.0):
    """condition()'s first true value, asked again until it comes (an event another process makes)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"not true within {limit_s} s: {condition}")


def _one_epoch(url: str, cache_dir: str, out) -> None:
    loader = build_loader(spec(url, cache_dir=cache_dir))
    batches(loader)
    out.put(loader.stored.source.cache.fetches)


def test_the_fetch_process_raises_its_requests_to_cover_the_round_trip(tmp_path):
    """Blocks read as fast as they come from a server 50 ms away: 16 requests at once hold the
    reader back, so the fetch process allows more (up to the most given), and the bytes are right."""
    from benchmarks.loopback_servers import ECHO_MODULE, Nginx
    from pipeline.storage.object_store import open_store
    from pipeline.remote.block_plan import Visits
    from pipeline.remote.block_fetcher import FetcherSettings
    from pipeline.remote.shared_blocks import SharedBlocks
    if not ECHO_MODULE.exists():
        pytest.skip("nginx's echo module is not installed (libnginx-mod-http-echo)")
    block, blocks = 64 << 10, 640
    data = np.random.default_rng(0).integers(0, 256, block * blocks, dtype=np.uint8).tobytes()
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "big.bin").write_bytes(data)
    server = Nginx(tmp_path / "served", tmp_path / "nginx", delay_ms=50)
    store = open_store(server.url)
    starts = np.arange(blocks, dtype=np.int64) * block
    shared = SharedBlocks(FetcherSettings(store.url, store.options, ["big.bin"], np.zeros(blocks, np.int32), starts,
                                          starts + block, block, 256, 16, 48))
    try:
        order = np.arange(blocks, dtype=np.int64)
        shared.plan(Visits(order, order + 1, order + 1, starts, starts + block), 128, 0)    # block i read by batch i + 1
        for i in range(blocks):
            [address] = shared.addresses(order[i:i + 1], starts[i:i + 1], starts[i:i + 1] + block)
            assert address, f"block {i} was not fetched"
            if i % 97 == 0:
                assert shared.view(i) == data[i * block:(i + 1) * block]
            shared.at(i + 1)
        assert 16 < shared.peak_in_flight <= 48
    finally:
        shared.close()
        server.stop()


def test_processes_share_one_cache_without_fetching_a_block_twice(photos_server, tmp_path):
    """Two processes (the ranks of a node) reading the same epoch at once fetch each block once."""
    url = f"{photos_server.url}/photos_wds"
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=_one_epoch, args=(url, str(tmp_path), out)) for _ in range(2)]
    for worker in workers:
        worker.start()
    fetches = [out.get(timeout=150) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    blocks = len(list(tmp_path.rglob(f"*{BLOCK_SUFFIX}")))
    assert sum(fetches) == blocks > 1
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_bytes_fetched_are_those_of_the_samples_read(converted_sets, photos_server, tmp_path):
    """An epoch of rank 0 of 2 fetches its own samples' records and little more: not the other
    rank's, nor whole shards."""
    url = f"{photos_server.url}/photos_wds"
    loader = build_loader(spec(url, cache_dir=tmp_path, rank=0, world_size=2, batch_size=8))
    batches(loader)
    ids = np.concatenate(loader._plan)
    starts, ends = sample_spans(loader.stored.members)
    read = int((ends[ids] - starts[ids]).sum())
    fetched = loader.stored.source.store.bytes_read
    shards_total = int(ends.max())     # the photos sample is one shard
    assert read <= fetched <= 1.05 * read + 2 * (1 << 20)   # a block at each end of the rank's range
    assert fetched < shards_total


def answered_sizes(server, after: int) -> list[int]:
    """The body sizes of the server's answers, in the order it finished them, from answer `after` on."""
    return [int(line.split('"')[2].split()[1]) for line in server.access_log.read_text().splitlines()[after:]]


@pytest.mark.parametrize("cache_limit", [None, 1], ids=["kept", "streamed"])
def test_an_epochs_first_batch_is_fetched_as_its_samples_before_any_block(converted_sets, photos_server, tmp_path,
                                                                           cache_limit):
    """Where its blocks are not held, an epoch's first batch reads its samples' own ranges, all
    answered before the read-ahead asks for a block, and equals local disk's; an epoch whose blocks
    the cache holds fetches nothing."""
    expected = batches(build_loader(spec(converted_sets["photos"]["webdataset"])))
    loader = build_loader(spec(f"{photos_server.url}/photos_wds", cache_dir=tmp_path, cache_limit=cache_limit))
    built = photos_server.requests()
    assert_same(expected, batches(loader))
    starts, ends = sample_spans(loader.stored.members)
    first, read = loader._plan[0], np.concatenate(loader._plan)
    answered = answered_sizes(photos_server, built)
    assert sorted(answered[:len(first)]) == sorted((ends - starts)[first].tolist())
    assert sum(answered[len(first):]) >= (ends - starts)[read].sum()        # then the blocks, the first batch's too
    held = photos_server.requests()
    assert_same(batches(build_loader(spec(converted_sets["photos"]["webdataset"])), epoch=1), batches(loader, epoch=1))
    assert cache_limit is not None or photos_server.requests() == held      # kept: every block on disk


def test_an_epoch_read_ahead_starts_with_the_first_batches_blocks_then_widens():
    """Before the first batch is handed out, only the blocks of the first MIN_WINDOW batches are
    fetched (on few cores, fetching the whole window beside them slows their decode); the reach
    doubles with each batch handed out, up to the window."""
    from pipeline.remote.block_plan import MIN_WINDOW, BlockPlan
    from pipeline.remote.read_ahead import ReadAhead, ReadsAhead
    samples, size = 4096, 100
    members = np.stack([np.arange(samples) * size, np.full(samples, size - 10), np.arange(samples) * size + 90], 1)
    blocks = BlockPlan(members, [samples], np.zeros(samples, np.int32), block_bytes=size, ahead_bytes=10 ** 9,
                       reads_ahead=1)
    plan = [np.arange(b * 16, (b + 1) * 16) for b in range(samples // 16)]      # every sample a block
    fetched, arrived = [], threading.Condition()

    class Recorded(ReadsAhead):
        def prefetch(self, block):
            with arrived:
                fetched.append(block)
                arrived.notify_all()

    def fetched_up_to(batches):
        with arrived:
            assert arrived.wait_for(lambda: len(fetched) >= 16 * batches, timeout=30)
        time.sleep(0.2)         # time for anything further to be asked for
        return max(fetched) // 16 + 1
    reader = ReadAhead(blocks, plan, 0, None, Recorded())
    assert fetched_up_to(MIN_WINDOW + 1) == MIN_WINDOW + 1      # the consumer's batch 0, and 4 ahead
    for handed_out, reach in ((1, 2 * MIN_WINDOW), (2, 4 * MIN_WINDOW), (3, 8 * MIN_WINDOW)):
        reader.advance(handed_out)
        assert fetched_up_to(handed_out + reach + 1) == handed_out + reach + 1
    reader.advance(8)
    assert fetched_up_to(len(plan)) == len(plan) and reader.window >= len(plan)
    reader.stop()


def test_blocks_are_cut_at_sample_boundaries():
    starts = np.array([0, 100, 600, 700, 2000])
    ends = np.array([90, 500, 690, 1900, 2100])
    assert cut_blocks(starts, ends, block_bytes=1000).tolist() == [0, 0, 0, 1, 2]
    assert cut_blocks(starts, ends, block_bytes=10).tolist() == [0, 1, 2, 3, 4]   # a big sample is a block alone


def test_a_block_read_again_after_a_long_gap_is_a_visit_of_its_own():
    """Read at an epoch's start and again at its end (where two lanes of the plan meet), a block
    is two visits, each of the bytes its batches read; reads closer than the gap are one."""
    members = np.array([[i * 100, 90, i * 100 + 90] for i in range(8)])      # (image at, size, label at)
    block_of = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    batches = [np.array([0, 1]), np.array([2]), np.array([], np.int64), np.array([6])] + \
        [np.array([], np.int64)] * 3 + [np.array([7])] + [np.array([], np.int64)] * 12 + [np.array([5, 4])]
    visits = block_visits(block_of, members, batches, offset=100, gap=5)
    assert [tuple(map(int, visit)) for visit in zip(*visits)] == [
        (0, 100, 101, 0, 294), (1, 103, 107, 600, 794), (0, 120, 120, 400, 594)]
    whole = block_visits(block_of, members, batches, offset=100, gap=20)
    assert whole.blocks.tolist() == [0, 1] and whole.end[0] == 594


def test_reads_either_side_of_the_next_epoch_are_one_visit_only_when_read_at_once():
    """A short epoch's blocks, read again as the next epoch starts, are let go in between unless
    the loader may read both at once (within the batches it reads ahead)."""
    members = np.array([[i * 100, 90, i * 100 + 90] for i in range(2)])
    block_of = np.zeros(2, np.int64)
    batches = [np.array([0])] + [np.array([], np.int64)] * 4 + [np.array([1])]     # the next epoch from batch 3
    assert block_visits(block_of, members, batches, 0, gap=20).blocks.tolist() == [0]
    assert block_visits(block_of, members, batches, 0, gap=20, next_epoch=3, reads_ahead=5).blocks.tolist() == [0]
    parted = block_visits(block_of, members, batches, 0, gap=20, next_epoch=3, reads_ahead=2)
    assert parted.first.tolist() == [0, 5] and parted.start.tolist() == [0, 100]


def one_object_in_blocks(tmp_path, block: int, blocks: int):
    """(its bytes, the nginx serving it, the fetch process's settings for it): one object of
    `blocks` random blocks of `block` bytes, 64 slots of a block, 16 requests in flight."""
    from benchmarks.loopback_servers import Nginx
    from pipeline.remote.block_fetcher import FetcherSettings
    from pipeline.storage.object_store import open_store
    data = np.random.default_rng(blocks).integers(0, 256, block * blocks, dtype=np.uint8).tobytes()
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "blocks.bin").write_bytes(data)
    server = Nginx(tmp_path / "served", tmp_path / "nginx")
    store = open_store(server.url)
    starts = np.arange(blocks, dtype=np.int64) * block
    return data, server, FetcherSettings(store.url, store.options, ["blocks.bin"], np.zeros(blocks, np.int32), starts,
                                         starts + block, block, 64, 16, 16)


def test_the_fetch_process_fetches_each_visit_and_lets_the_block_go_between(tmp_path):
    """A block visited twice is fetched twice, each time only the bytes of its visit, put where
    they lie in the block; it is not held between the visits, and a visit that comes within the
    window while the one before is still read waits for it to end. A batch of the later visit
    waits while the block still holds the earlier one's bytes."""
    from pipeline.remote.block_plan import Visits
    from pipeline.remote.shared_blocks import SharedBlocks
    block, blocks = 64 << 10, 40
    data, server, settings = one_object_in_blocks(tmp_path, block, blocks)
    starts = settings.block_start
    shared = SharedBlocks(settings)
    # (block, first batch, last batch, first byte, end byte): block 0's first quarter read by batch 0,
    # its second half by batch 30; block 1's halves by batches 1-10 and 12; block i by batch i
    planned = sorted([(0, 0, 0, 0, block // 4), (0, 30, 30, block // 2, block), (1, 1, 10, block, block * 3 // 2),
                      (1, 12, 12, block * 3 // 2, 2 * block)] +
                     [(i, i, i, i * block, (i + 1) * block) for i in range(2, blocks)], key=lambda visit: visit[1])
    visits = Visits(*map(np.array, zip(*planned)))
    try:
        shared.plan(visits, 4, -1)
        for batch in range(blocks):
            for b, first, last, lo, hi in planned:
                if first <= batch <= last:
                    [address] = shared.addresses(np.array([b]), np.array([lo]), np.array([hi]))
                    assert address, f"block {b} was not fetched for batch {batch}"
                    assert shared.view(b)[lo - b * block:hi - b * block] == data[lo:hi], (b, batch)
            if batch == 20:
                assert 0 not in shared.held_blocks()
            if batch == 10:     # the fetcher late to see the loader pass block 1's first visit (a busy node)
                os.kill(shared.process.pid, signal.SIGSTOP)
                threading.Timer(0.5, os.kill, (shared.process.pid, signal.SIGCONT)).start()
            shared.at(batch)
        requests, fetched = shared.counted()
        assert requests == blocks + 2
        assert fetched == int((visits.end - visits.start).sum()) == (blocks - 1) * block + block // 4 + block // 2
    finally:
        shared.close()
        server.stop()


def test_the_set_up_and_plans_do_not_wait_for_the_fetch_process_to_read_them(tmp_path):
    """A set-up message larger than a socket holds (here 2 MB: a block table at ImageNet's size,
    or a CA bundle) and a plan are handed over at once, though the fetch process is stopped before
    reading a byte: the loader goes on with its first batch while the process loads. Resumed,
    it reads them in order and fetches the plan."""
    from pipeline.remote.block_plan import Visits
    from pipeline.remote.shared_blocks import FetchProcess, SharedBlocks
    block, blocks, planned = 64, 100_000, 40
    data, server, settings = one_object_in_blocks(tmp_path, block, blocks)
    starts = settings.block_start
    process = FetchProcess()
    os.kill(process.process.pid, signal.SIGSTOP)
    made = {}

    def set_up_and_plan():
        made["shared"] = SharedBlocks(settings, process)
        made["shared"].plan(Visits(*(np.arange(planned),) * 3, starts[:planned], starts[:planned] + block), 8, -1)
    handing_over = threading.Thread(target=set_up_and_plan, daemon=True)
    handing_over.start()
    handing_over.join(timeout=30)
    waited = handing_over.is_alive()
    os.kill(process.process.pid, signal.SIGCONT)
    handing_over.join()
    shared = made["shared"]
    try:
        assert not waited, "the set-up waited for the fetch process to read it"
        for b in range(planned):
            [address] = shared.addresses(np.array([b]), starts[b:b + 1], starts[b:b + 1] + block)
            assert address and shared.view(b) == data[b * block:(b + 1) * block], b
            shared.at(b)
    finally:
        shared.close()
        server.stop()
    assert process.process.poll() == 0          # told to stop after what was sent before, it ended


def test_a_prefix_without_manifest_and_a_bad_server_are_one_line_errors(converted_sets, tmp_path):
    from benchmarks.loopback_servers import Nginx
    served = tmp_path / "served"
    shutil.copytree(converted_sets["photos"]["webdataset"], served / "half")
    (served / "half" / "manifest.json").unlink()          # as an interrupted upload leaves it
    shutil.copytree(converted_sets["photos"]["webdataset"], served / "scrambled")
    (served / "scrambled" / "manifest.json").write_text("{" + "x" * 100_000)
    server = Nginx(served, tmp_path / "nginx")
    try:
        with pytest.raises(DatasetError) as caught:
            build_loader(spec(f"{server.url}/scrambled", cache_dir=tmp_path / "c"))
        message = str(caught.value)
        assert f"{server.url}/scrambled/manifest.json: not valid JSON" in message and len(message) < 400
        with pytest.raises(DatasetError) as caught:
            build_loader(spec(f"http://user:hunter2@127.0.0.1:{server.port}/half", cache_dir=tmp_path / "c"))
        message = str(caught.value)
        assert "manifest.json" in message and "not a finished conversion" in message
        assert "hunter2" not in message and "\n" not in message
    finally:
        server.stop()
    with pytest.raises(RemoteDataError) as caught:       # nothing listens there any more
        read_converted(f"http://127.0.0.1:{server.port}/half", "train", "webdataset", cache_dir=tmp_path / "c")
    assert "connection refused" in str(caught.value) and "\n" not in str(caught.value)


def test_ffcv_from_a_url_reads_a_staged_copy_checked_against_the_manifest(converted_sets, tmp_path):
    """FFCV memory-maps its file: from a URL it reads a copy staged once into the cache, and
    its batches are those of the local file."""
    from benchmarks.loopback_servers import Nginx
    local = converted_sets["fashion"]["ffcv"]
    served = tmp_path / "served" / "fashion_ffcv"
    shutil.copytree(local, served)
    server = Nginx(served.parent, tmp_path / "nginx")
    try:
        options = dict(backend="ffcv", split="val", num_workers=1)
        expected = batches(build_loader(spec(local, **options)))
        remote = build_loader(spec(f"{server.url}/fashion_ffcv", cache_dir=tmp_path / "cache", **options))
        assert_same(expected, batches(remote))
        staged = list((tmp_path / "cache").rglob("val.beton"))
        assert len(staged) == 1 and staged[0].read_bytes() == (local / "val.beton").read_bytes()
        requests = server.requests()
        build_loader(spec(f"{server.url}/fashion_ffcv", cache_dir=tmp_path / "cache", **options))
        assert server.requests() - requests == 1          # the manifest, not the file again
        beton = served / "val.beton"
        data = bytearray(beton.read_bytes())
        data[len(data) // 2] ^= 0xFF                    # changed after it was converted
        beton.write_bytes(bytes(data))
        with pytest.raises(RemoteDataError) as caught:
            build_loader(spec(f"{server.url}/fashion_ffcv", cache_dir=tmp_path / "other", **options))
        assert "sha256" in str(caught.value) and "\n" not in str(caught.value)
    finally:
        server.stop()


def test_dali_from_a_url_reads_through_the_same_fetcher(converted_sets, photos_server, tmp_path):
    """DALI from a URL: an external source in the webdataset backend's order, giving DALI's local
    batches bit for bit, from the disk cache and streamed through the fetch process. Streamed,
    each epoch's run starts (and reads) while the last one's batches are still handed out, and
    small blocks make the fetch process's visits cross the epochs' boundary."""
    pytest.importorskip("nvidia.dali")
    url = f"{photos_server.url}/photos_wds"
    val = dict(backend="dali", split="val", num_workers=1)
    local = batches(build_loader(spec(converted_sets["photos"]["webdataset"], **val)))
    assert_same(local, batches(build_loader(spec(url, cache_dir=tmp_path, **val))))
    train = dict(backend="dali", num_workers=1, batch_size=4)
    local = build_loader(spec(converted_sets["photos"]["webdataset"], **train))
    streamed = build_loader(spec(url, cache_dir=tmp_path / "streamed", cache_limit=1, fetch_size="64KiB", **train))
    assert streamed.stored.in_memory
    for epoch in (0, 1):
        assert_same(batches(local, epoch), batches(streamed, epoch))
    assert streamed.stored.sources.fetch_process.shared.alive
    split_bytes = int(np.subtract(*sample_spans(streamed.stored.members)[::-1]).sum())
    fetched = streamed.stored.source.store.bytes_read
    assert fetched > 1.5 * split_bytes      # each epoch streamed again: nothing kept on disk
    assert not list((tmp_path / "streamed").rglob(f"*{BLOCK_SUFFIX}"))


def test_the_epoch_length_is_known_from_a_url_before_the_loader_is_built(photos_server):
    from pipeline import batches_per_epoch
    url = f"{photos_server.url}/photos_wds"
    for backend in ("webdataset", "dali"):
        assert batches_per_epoch(spec(url, backend=backend)) == len(build_loader(spec(url, backend="webdataset")))
    with pytest.raises(DatasetError) as caught:
        batches_per_epoch(spec(f"http://bob:hunter2@127.0.0.1:{photos_server.port}/photos_wds", backend="ffcv"))
    assert "hunter2" not in str(caught.value) and "***@" in str(caught.value)


@pytest.fixture(scope="module")
def many_shards(sample_sets, tmp_path_factory):
    """The fashion sample in shards of 8 samples: a split of many shards, each with its index and
    checksums, and the split's index pack."""
    from conftest import convert_here
    out = tmp_path_factory.mktemp("many-shards") / "fashion_wds"
    convert_here("convert_wds.py", sample_sets / "fashion", out, "--shard-samples", "8", "--num-workers", "1")
    return out


def assert_same_tables(remote, local) -> None:
    assert len(remote.shards) == len(local.shards) > 10
    for got, expected in zip(remote.shards, local.shards):
        assert np.array_equal(got.members, expected.members) and np.array_equal(got.checksums, expected.checksums)
        assert got.index.read_bytes() == expected.index.read_bytes()


def test_a_split_of_many_shards_fetches_its_indexes_as_its_index_pack(many_shards, tmp_path, monkeypatch):
    """Two requests rather than two a shard: the pack, and the one range that checks the server
    answers ranges (the manifest is the third); a later start reads the split's member table from
    the cache, without parsing an index."""
    from benchmarks.loopback_servers import Nginx
    from pipeline.formats import converted
    server = Nginx(many_shards.parent, tmp_path / "nginx")
    try:
        remote = read_converted(f"{server.url}/fashion_wds", "train", "webdataset", cache_dir=str(tmp_path / "cache"))
        monkeypatch.setattr(converted, "index_members", None)     # not parsed again: a call would raise
        again = read_converted(f"{server.url}/fashion_wds", "train", "webdataset", cache_dir=str(tmp_path / "cache"))
    finally:
        server.stop()
    assert remote.remote.store.requests == 3 and again.remote.store.requests == 2     # then all from the cache
    monkeypatch.undo()
    local = read_converted(many_shards, "train", "webdataset")
    assert_same_tables(remote, local)
    assert_same_tables(again, local)


@pytest.mark.parametrize("fault", ["a part differs", "missing"])
def test_an_index_pack_that_differs_or_is_missing_gives_way_to_the_shards_own_files(many_shards, tmp_path, caplog,
                                                                                    fault):
    """A pack older than a repair, or lost from the store: each index it cannot give as the
    manifest records it is fetched as its own file, with one line naming the pack."""
    from benchmarks.loopback_servers import Nginx
    copy = tmp_path / "served" / "fashion_wds"
    shutil.copytree(many_shards, copy)
    pack = copy / "train" / "shard-indexes.pack"
    if fault == "missing":
        pack.unlink()
    else:
        data = bytearray(pack.read_bytes())
        data[20] ^= 0x10        # in the first shard's index
        pack.write_bytes(bytes(data))
    server = Nginx(copy.parent, tmp_path / "nginx")
    try:
        with caplog.at_level("WARNING", logger="pipeline.remote.dataset"):
            remote = read_converted(f"{server.url}/fashion_wds", "train", "webdataset",
                                    cache_dir=str(tmp_path / "cache"))
    finally:
        server.stop()
    local = read_converted(many_shards, "train", "webdataset")
    assert_same_tables(remote, local)
    [line] = [record.getMessage() for record in caplog.records]
    assert "train/shard-indexes.pack" in line and "one by one" in line, line
    # The manifest and the range check; then the pack and the one part that differs, or, the pack
    # missing (its 404 not counted), each shard's two files
    fetched = 2 + (2 if fault == "a part differs" else 2 * len(local.shards))
    assert remote.remote.store.requests == fetched
