"""Labels are checked against the dataset's classes where they are read, on every backend: a label
past the last class (one flipped byte in a shard read unchecked, a manifest that lost classes) is
a damaged sample under the on_corrupt policy, named, never a target the loss meets. (With
data.verify on, a flipped byte fails its sample's checksum first: tests/test_verified_reads.py.)"""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline import LoaderSpec, build_loader
from pipeline.errors import CorruptSample, DatasetError
from pipeline.formats.converted import read_local_converted
from pipeline.shards.index import StoredShards

CLASSES = 10       # the fashion sample's


@pytest.fixture
def flipped_label(converted_sets, tmp_path):
    """A copy of the fashion webdataset conversion with the top byte of one train label flipped."""
    copy = tmp_path / "fashion_wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], copy)
    stored = StoredShards(read_local_converted(copy, "train", "webdataset").shards)
    victim = 5
    shard_index = int(stored.shard_of[victim])
    label_at = int(stored.members[victim][2])
    tar = stored.shards[shard_index].tar
    label = stored.read(victim)[1]
    data = bytearray(tar.read_bytes())
    data[label_at + 3] ^= 0x01                               # the label's high byte (little-endian int32)
    tar.write_bytes(bytes(data))
    return copy, f"{stored.name(victim)}: label {label + 2 ** 24} ", len(stored)


def spec(path, backend, **options) -> LoaderSpec:
    return LoaderSpec(backend, path=str(path), split="train", batch_size=8, resolution=32, num_workers=1,
                      drop_last=False, **{"verify": False, **options})


def epoch_labels(loader) -> list[int]:
    return [int(label) for _, labels in loader for label in labels]


@pytest.mark.parametrize("backend,options", [("webdataset", {}), ("webdataset", {"native_decode": False})],
                         ids=["engine", "workers"])
def test_a_flipped_label_byte_is_a_damaged_sample_skipped_and_named(flipped_label, backend, options, caplog):
    path, named, samples = flipped_label
    loader = build_loader(spec(path, backend, **options))
    labels = epoch_labels(loader)
    assert len(labels) == samples - 1 and all(0 <= label < CLASSES for label in labels)
    assert loader.corrupt_in_epoch == 1
    with pytest.raises(CorruptSample) as raised:
        epoch_labels(build_loader(spec(path, backend, on_corrupt="raise", **options)))
    [line] = str(raised.value).splitlines()
    assert line.startswith(f"{named}is not one of the {CLASSES} classes"), line


def test_dali_stops_on_a_flipped_label_naming_the_sample(flipped_label):
    pytest.importorskip("nvidia.dali")
    path, named, _ = flipped_label
    with pytest.raises((CorruptSample, DatasetError)) as raised:
        epoch_labels(build_loader(spec(path, "dali")))
    assert f"{named}is not one of the {CLASSES} classes" in str(raised.value)


def test_ffcv_labels_past_the_manifests_classes_are_skipped(converted_sets, tmp_path):
    """A manifest that lost classes: every label past them is a damaged sample, not a loss target."""
    copy = tmp_path / "fashion_ffcv"
    shutil.copytree(converted_sets["fashion"]["ffcv"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["classes"] = manifest["classes"][:5]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    everything = epoch_labels(build_loader(spec(converted_sets["fashion"]["ffcv"], "ffcv")))
    loader = build_loader(spec(copy, "ffcv"))
    kept = epoch_labels(loader)
    assert sorted(kept) == sorted(label for label in everything if label < 5)
    assert loader.corrupt_in_epoch == sum(label >= 5 for label in everything) > 0
    with pytest.raises(CorruptSample, match=r"train.beton: sample \d+: label [5-9] is not one of the 5 classes"):
        epoch_labels(build_loader(spec(copy, "ffcv", on_corrupt="raise")))
