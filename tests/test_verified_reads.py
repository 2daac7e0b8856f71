"""Verified reads: each webdataset sample is checked against the CRC-32 its converter recorded
before it is decoded (in C by the decode engine, in Python for the Pillow workers and DALI's
source). A flipped byte in an image or a label, or a run of zeros in a JPEG body, is a damaged
sample under on_corrupt, named; data.verify=off reads unchecked; a dataset converted before
checksums reads unchecked, saying so once."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from conftest import as_converted_before_checksums, as_converted_before_index_packs
from pipeline import LoaderSpec, build_loader
from pipeline.errors import CorruptSample, DatasetError
from pipeline.formats.converted import read_local_converted
from pipeline.shards.index import StoredShards

PATHS = [("webdataset", {}), ("webdataset", {"native_decode": False})]


def damaged_copy(converted_sets, tmp_path, where: str, number: int = 9):
    """A copy of the fashion conversion with one train sample damaged; (path, its name, samples)."""
    copy = tmp_path / "fashion_wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], copy)
    stored = StoredShards(read_local_converted(copy, "train", "webdataset").shards)
    image_at, image_size, label_at = (int(v) for v in stored.members[number])
    tar = stored.shards[int(stored.shard_of[number])].tar
    data = bytearray(tar.read_bytes())
    if where == "image":
        data[image_at + image_size // 2] ^= 0x20
    elif where == "label":
        data[label_at] ^= 0x01          # still one of the classes: only the checksum tells
    else:
        data[image_at + image_size // 4:image_at + image_size // 4 + 64] = bytes(64)
    tar.write_bytes(bytes(data))
    return copy, str(stored.name(number)), len(stored)


def spec(path, backend, **options) -> LoaderSpec:
    return LoaderSpec(backend, path=str(path), split="train", batch_size=8, resolution=32, num_workers=1,
                      drop_last=False, **options)


def epoch(loader) -> int:
    return sum(len(labels) for _, labels in loader)


@pytest.mark.parametrize("where", ["image", "label", "zeros"])
@pytest.mark.parametrize("backend,options", PATHS, ids=["engine", "workers"])
def test_a_damaged_sample_fails_its_checksum_and_is_skipped_and_named(converted_sets, tmp_path, where, backend,
                                                                      options):
    path, name, samples = damaged_copy(converted_sets, tmp_path, where)
    loader = build_loader(spec(path, backend, **options))
    assert epoch(loader) == samples - 1 and loader.corrupt_in_epoch == 1
    with pytest.raises(CorruptSample) as raised:
        epoch(build_loader(spec(path, backend, on_corrupt="raise", **options)))
    [line] = str(raised.value).splitlines()
    assert line.startswith(f"{name}: its bytes fail the checksum recorded at conversion"), line
    unchecked = build_loader(spec(path, backend, verify=False, **options))
    assert epoch(unchecked) == samples and unchecked.corrupt_in_epoch == 0     # what verify=off gives back


def test_dali_stops_on_a_damaged_sample_naming_it(converted_sets, tmp_path):
    pytest.importorskip("nvidia.dali")
    path, name, _ = damaged_copy(converted_sets, tmp_path, "image")
    with pytest.raises((CorruptSample, DatasetError)) as raised:
        epoch(build_loader(spec(path, "dali")))
    assert f"{name}: its bytes fail the checksum recorded at conversion" in str(raised.value)


def test_a_dataset_converted_before_checksums_reads_unchecked_and_says_so_once(converted_sets, tmp_path, caplog):
    copy = tmp_path / "old_wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], copy)
    as_converted_before_checksums(copy)
    with caplog.at_level(logging.WARNING):
        first = build_loader(spec(copy, "webdataset"))
        build_loader(spec(copy, "webdataset"))
    assert first.stored.checksums is None and epoch(first) == len(first.stored)
    said = [r.getMessage() for r in caplog.records if "converted before per-sample checksums" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{copy}: converted before") and "convert_wds.py" in said[0]


def test_a_run_counts_and_names_what_it_skipped_or_stops_in_one_line(converted_sets, tmp_path, capsys):
    from runs import RECIPE, main_here, main_py, read_jsonl, tiny_run
    path, name, _ = damaged_copy(converted_sets, tmp_path, "image")
    skipping = main_here(capsys, "--config", RECIPE, *tiny_run(path, "webdataset", tmp_path / "run", "max_duration=1ep",
                                                     "log.interval=5"))
    assert skipping.returncode == 0, skipping.stderr[-3000:]
    assert f"skipped {name}: its bytes fail the checksum recorded at conversion" in skipping.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["damaged_samples_skipped"] == {"train": 1, "val": 0}
    counted = [line["damaged_samples_skipped"] for line in read_jsonl(tmp_path / "run" / "metrics.jsonl")
               if "damaged_samples_skipped" in line]
    assert counted and counted[-1] == 1
    # a process of its own: the rank that meets the damaged sample ends its process
    stopping = main_py("--config", RECIPE, *tiny_run(path, "webdataset", tmp_path / "strict", "max_duration=1ep",
                                                     "data.on_corrupt=raise"))
    [line] = stopping.stderr.strip().splitlines()[-1:]
    assert stopping.returncode == 1 and name in line and "fail the checksum" in line, stopping.stderr[-3000:]


@pytest.mark.parametrize("backend,options", PATHS, ids=["engine", "workers"])
def test_answers_damaged_in_transit_are_fetched_again_and_the_batches_are_local_disks(converted_sets, tmp_path,
                                                                                     backend, options, caplog):
    """nginx behind a proxy that flips one bit in each of its first answers' bodies: the samples they
    held fail their checksums, are fetched again, and every batch is the one local disk gives. As many
    answers are damaged as a sample may be fetched again, so even one sample whose every fetch met a
    damaged answer has a sound one left."""
    from benchmarks.latency_proxy import LatencyProxy
    from benchmarks.loopback_servers import Nginx
    from pipeline.remote.shards import HEALING_FETCHES
    local = converted_sets["photos"]["webdataset"]
    server = Nginx(local.parent, tmp_path / "nginx")
    common = dict(split="val", batch_size=16, resolution=48, val_resolution=48, num_workers=1, drop_last=False)
    try:
        with LatencyProxy("127.0.0.1", server.port, latency_ms=0, flip_first=HEALING_FETCHES) as proxy, \
                caplog.at_level(logging.WARNING):
            remote = build_loader(LoaderSpec(backend, path=f"{proxy.url}/{local.name}", cache_dir=str(tmp_path / "c"),
                                             fetch_size="64KiB", **common, **options))
            batches = [(images.clone(), labels.clone()) for images, labels in remote]
    finally:
        server.stop()
    healed = [r.getMessage() for r in caplog.records if "fetched again, sound" in r.getMessage()]
    assert proxy.flipped == HEALING_FETCHES and healed and remote.corrupt_in_epoch == 0
    expected = [(images, labels) for images, labels in build_loader(LoaderSpec(backend, path=str(local), **common,
                                                                                **options))]
    assert len(batches) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(batches, expected):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_an_index_whose_bytes_changed_on_the_server_is_one_line_naming_it(converted_sets, tmp_path):
    """Each index (and checksums file) from a URL is checked against the manifest's sha256 as it is
    fetched, asked for again where it differs, and named in one line where it stays different."""
    from benchmarks.loopback_servers import Nginx
    copy = tmp_path / "served" / "fashion_wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], copy)
    as_converted_before_index_packs(copy)      # else the index comes from the split's pack
    index = copy / "val" / "shard-000000.idx"
    text = index.read_text()
    index.write_text(text.replace(" 1024 ", " 1025 ", 1) if " 1024 " in text else text + " ")
    server = Nginx(copy.parent, tmp_path / "nginx")
    try:
        with pytest.raises(DatasetError) as raised:
            build_loader(LoaderSpec("webdataset", path=f"{server.url}/fashion_wds", split="val", batch_size=8,
                                    cache_dir=str(tmp_path / "cache")))
    finally:
        server.stop()
    [line] = str(raised.value).splitlines()
    assert line.endswith("/fashion_wds/val/shard-000000.idx: its sha256 differs from the manifest's, in 3 answers: "
                         "the stored file is damaged; run python tools/convert_wds.py again"), line


def test_training_through_answers_damaged_in_transit_has_the_losses_of_local_disk(converted_sets, tmp_path, capsys):
    """A run reading through the bit-flipping proxy heals every damaged answer by fetching it again:
    its losses, at every step, and its final weights are those of a run reading local disk."""
    from benchmarks.latency_proxy import LatencyProxy
    from benchmarks.loopback_servers import Nginx
    from runs import RECIPE, assert_ends_alike, main_here, read_jsonl, tiny_run
    local = converted_sets["fashion"]["webdataset"]
    # A fetch per sample and nothing kept: every sample crosses the proxy, in answers of their own.
    run = ["max_duration=1ep", "deterministic=true", "log.interval=1", "data.fetch_size=4KiB", "data.cache_limit=1"]
    reference = main_here(capsys, "--config", RECIPE, *tiny_run(local, "webdataset", tmp_path / "local", *run))
    assert reference.returncode == 0, reference.stderr[-3000:]
    server = Nginx(local.parent, tmp_path / "nginx")
    try:
        # A quarter into each answer: inside the image of the fashion sample's one-sample ranges
        with LatencyProxy("127.0.0.1", server.port, latency_ms=0, flip_first=8, flip_at=0.25) as proxy:
            remote = main_here(capsys, "--config", RECIPE, *tiny_run(f"{proxy.url}/{local.name}", "webdataset",
                                                                     tmp_path / "remote", *run,
                                                                     f"data.cache_dir={tmp_path / 'cache'}"))
    finally:
        server.stop()
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert proxy.flipped == 8 and (remote.stdout + remote.stderr).count("fetched again, sound") >= 6

    def losses(run_dir):
        return [(line["step"], line["train_loss"]) for line in read_jsonl(run_dir / "metrics.jsonl")
                if "train_loss" in line]
    assert len(losses(tmp_path / "local")) == 15 and losses(tmp_path / "remote") == losses(tmp_path / "local")
    assert_ends_alike(tmp_path / "local", tmp_path / "remote", 15)
