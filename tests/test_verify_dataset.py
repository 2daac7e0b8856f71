"""tools/verify_dataset.py and the checksums the WebDataset converter records: a clean dataset is
clean, locally and over HTTP; a flipped byte in an image or a label, a run of zeros in a JPEG
body and a truncated tar are named, sample by sample; a dataset converted before checksums is
checked file by file and says its samples are unchecked."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import verify_dataset
from conftest import as_converted_before_checksums
from benchmarks.loopback_servers import Nginx
from pipeline.formats.wds_shards import sample_checksum
from pipeline.formats.manifest import MANIFEST_VERSION
from pipeline.formats.converted import read_local_converted
from pipeline.shards.index import StoredShards


@pytest.fixture
def dataset(converted_sets, tmp_path):
    copy = tmp_path / "fashion_wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], copy)
    return copy


def check(capsys, *args) -> tuple[int, str, str]:
    code = verify_dataset.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def sample_at(root, number: int):
    """(tar, the sample's name as the loaders print it, image offset, image size, label offset)."""
    stored = StoredShards(read_local_converted(root, "train", "webdataset").shards)
    image_at, image_size, label_at = (int(v) for v in stored.members[number])
    return stored.shards[int(stored.shard_of[number])].tar, str(stored.name(number)), image_at, image_size, label_at


def damage(tar, at: int, data: bytes) -> None:
    content = bytearray(tar.read_bytes())
    content[at:at + len(data)] = data
    tar.write_bytes(bytes(content))


def test_the_converter_records_each_samples_checksum(dataset):
    split = read_local_converted(dataset, "train", "webdataset")
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["manifest_version"] == MANIFEST_VERSION and manifest["splits"]["train"]["sample_checksum"]
    stored = StoredShards(split.shards)
    recorded = np.concatenate([np.fromfile(dataset / "train" / s.tar.with_suffix(".crc32").name, "<u4")
                               for s in split.shards])
    assert len(recorded) == len(stored)
    for number in (0, len(stored) - 1):
        image, label = stored.read(number)
        assert recorded[number] == sample_checksum(image, np.int32(label).astype("<i4").tobytes())


def test_a_clean_dataset_is_clean(dataset, capsys):
    code, out, _ = check(capsys, dataset)
    assert code == 0 and out.startswith("clean: ") and "0 damaged files, 0 damaged samples" in out


@pytest.mark.parametrize("where", ["image", "label", "zeros"])
def test_a_damaged_sample_is_named(dataset, capsys, where):
    tar, name, image_at, image_size, label_at = sample_at(dataset, 7)
    if where == "image":
        damage(tar, image_at + image_size // 2, bytes([tar.read_bytes()[image_at + image_size // 2] ^ 0x10]))
    elif where == "label":
        damage(tar, label_at, bytes([tar.read_bytes()[label_at] ^ 0x01]))
    else:                                    # a run of zeros in the JPEG body, which libjpeg would decode
        damage(tar, image_at + image_size // 4, bytes(min(512, image_size // 2)))
    code, out, _ = check(capsys, dataset)
    assert code == 1 and out.startswith("DAMAGED: ")
    assert f"{name}: its bytes fail the checksum recorded at conversion" in out
    assert out.count("fail the checksum") == 1
    assert f"{tar.parent.name}/{tar.name}: its sha256 differs from the manifest's" in out


def test_a_truncated_tar_names_the_file_and_the_samples_past_its_end(dataset, capsys):
    tar, name, image_at, _, _ = sample_at(dataset, 50)
    tar.write_bytes(tar.read_bytes()[:image_at])
    code, out, _ = check(capsys, dataset)
    assert code == 1 and "(truncated)" in out
    assert f"{name}: past the end of the tar (truncated)" in out


def test_a_dataset_converted_before_checksums_is_checked_file_by_file(dataset, capsys):
    as_converted_before_checksums(dataset)
    code, out, _ = check(capsys, dataset)
    assert code == 0 and "samples unchecked in train, val: converted before per-sample checksums" in out


def test_over_http_clean_then_damaged(dataset, capsys, tmp_path):
    server = Nginx(dataset.parent, tmp_path / "nginx")
    try:
        url = f"{server.url.replace('http://', 'http://alice:hunter2@')}/{dataset.name}"
        code, out, _ = check(capsys, url)
        assert code == 0 and out.startswith("clean: "), out
        tar, name, image_at, image_size, _ = sample_at(dataset, 3)
        damage(tar, image_at + image_size // 2, bytes([tar.read_bytes()[image_at + image_size // 2] ^ 0x04]))
        code, out, err = check(capsys, url)
    finally:
        server.stop()
    assert code == 1 and f"/{dataset.name}/train/{tar.name}:{name.rsplit(':', 1)[1]}: its bytes fail" in out
    assert "hunter2" not in out + err and "http://***@127.0.0.1" in out


def test_what_is_not_a_dataset_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = check(capsys, tmp_path / "nowhere")
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nowhere'}: no such directory"
    (tmp_path / "empty").mkdir()
    code, _, err = check(capsys, tmp_path / "empty")
    assert code == 2 and "no manifest.json; not a converted dataset" in err
