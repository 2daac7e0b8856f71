"""Checked FFCV data: the converter records a CRC-32 per sample of each .beton; data.verify=full
checks a local .beton once at open, so a flipped byte in an image or a label is a damaged sample
(skipped and counted, the other batches those of the undamaged file; or one line under
on_corrupt=raise), and damage to the file's layout is one line; tools/verify_dataset.py names the
damaged samples."""
from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

import verify_dataset
from conftest import flip
from pipeline import LoaderSpec, build_loader
from pipeline.errors import CorruptSample, DatasetError
from pipeline.formats.beton_checksums import BetonLayoutError, MappedFile, read_layout, sample_checksums
from pipeline.formats.manifest import MANIFEST_VERSION

DAMAGED = 5


@pytest.fixture
def beton_copy(converted_sets, tmp_path):
    copy = tmp_path / "fashion_ffcv"
    shutil.copytree(converted_sets["fashion"]["ffcv"], copy)
    return copy


def image_byte(beton, sample: int) -> int:
    """An offset in the middle of `sample`'s image bytes."""
    with MappedFile(beton) as buffer:
        layout = read_layout(buffer)
    slot = int(layout.first_allocation[sample])
    return int(layout.allocations["ptr"][slot] + layout.allocations["size"][slot] // 2)


def label_byte(beton, sample: int) -> int:
    """The offset of `sample`'s label's low byte (FFCV's IntField, an int64 in its metadata row)."""
    from ffcv.reader import Reader
    with MappedFile(beton) as buffer:
        layout = read_layout(buffer)
    label_field = Reader(str(beton)).metadata.dtype.names[1]
    return layout.metadata_at + sample * layout.row_bytes + Reader(str(beton)).metadata.dtype.fields[label_field][1]


def spec(path, tmp_path, **options) -> LoaderSpec:
    return LoaderSpec("ffcv", path=str(path), split="train", batch_size=8, resolution=32, num_workers=1,
                      drop_last=False, cache_dir=str(tmp_path / "cache"), **options)


def read_epoch(loader) -> list[tuple[torch.Tensor, int]]:
    return [(image, int(label)) for images, labels in loader for image, label in zip(images, labels)]


def test_the_converter_records_each_samples_checksum(converted_sets):
    path = converted_sets["fashion"]["ffcv"]
    manifest = json.loads((path / "manifest.json").read_text())
    record = manifest["splits"]["train"]
    assert manifest["manifest_version"] == MANIFEST_VERSION and record["sample_checksum"]
    recorded = np.fromfile(path / record["checksums"], "<u4")
    with MappedFile(path / "train.beton") as buffer:
        layout = read_layout(buffer)
        assert layout.layout_crc32 == record["layout_crc32"]
        assert np.array_equal(sample_checksums(buffer, layout), recorded) and len(recorded) == record["count"]


@pytest.mark.parametrize("where", ["image", "label"])
def test_verify_full_skips_a_damaged_sample_and_keeps_the_others_batches(beton_copy, tmp_path, where, caplog):
    beton = beton_copy / "train.beton"
    clean = read_epoch(build_loader(spec(beton_copy, tmp_path, verify="full")))
    flip(beton, image_byte(beton, DAMAGED) if where == "image" else label_byte(beton, DAMAGED), 0x01)
    with caplog.at_level(logging.WARNING):
        loader = build_loader(spec(beton_copy, tmp_path, verify="full"))
    assert f"{beton}: 1 samples fail their checksums ({DAMAGED})" in caplog.text
    damaged = read_epoch(loader)
    assert loader.corrupt_in_epoch == 1 and len(damaged) == len(clean) - 1
    order = loader._ids.tolist()
    kept = [pair for pair, sample in zip(clean, order) if sample != DAMAGED]
    assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(kept, damaged))
    with pytest.raises(CorruptSample) as raised:
        build_loader(spec(beton_copy, tmp_path, verify="full", on_corrupt="raise"))
    [line] = str(raised.value).splitlines()
    assert line.startswith(f"{beton}: sample {DAMAGED}: its bytes fail the checksum recorded at conversion")
    unchecked = build_loader(spec(beton_copy, tmp_path))          # verify on: a local .beton is read as it is
    assert len(read_epoch(unchecked)) == len(clean) and unchecked.corrupt_in_epoch == 0


def test_the_check_is_made_once_per_file(beton_copy, tmp_path):
    build_loader(spec(beton_copy, tmp_path, verify="full"))
    [result] = (tmp_path / "cache" / "verified").glob("*.json")
    assert json.loads(result.read_text())["damaged"] == []
    result.write_text(json.dumps({"damaged": [DAMAGED]}))     # a second open reads the result, not the file
    assert DAMAGED in build_loader(spec(beton_copy, tmp_path, verify="full")).damaged
    flip(beton_copy / "train.beton", image_byte(beton_copy / "train.beton", 2))      # a changed file is checked again
    assert build_loader(spec(beton_copy, tmp_path, verify="full")).damaged.tolist() == [2]


def test_damage_to_the_layout_is_one_line(beton_copy, tmp_path):
    beton = beton_copy / "train.beton"
    flip(beton, beton.stat().st_size - 3)            # inside the allocation table
    with pytest.raises(DatasetError) as raised:
        build_loader(spec(beton_copy, tmp_path, verify="full"))
    [line] = str(raised.value).splitlines()
    assert line.startswith(f"{beton}: its header or allocation table fails the checksum recorded at conversion")


@pytest.mark.parametrize("at,says", [(0, "format version 18, FFCV reads 2"), (21, "its allocation table at ")])
def test_a_header_that_does_not_parse_is_a_layout_error_and_the_file_closes(beton_copy, at, says):
    beton = beton_copy / "train.beton"
    flip(beton, at)          # the format version; the pointer to the allocation table
    with pytest.raises(BetonLayoutError, match=says), MappedFile(beton) as buffer:
        read_layout(buffer)


def test_a_beton_converted_before_checksums_is_checked_by_its_sha256(beton_copy, tmp_path, caplog):
    manifest = json.loads((beton_copy / "manifest.json").read_text())
    manifest["manifest_version"] = 2
    for record in manifest["splits"].values():
        (beton_copy / record.pop("checksums")).unlink()
        record["files"] = record["files"][:1]
        for key in ("checksums_bytes", "checksums_sha256", "layout_crc32", "sample_checksum"):
            del record[key]
    (beton_copy / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        build_loader(spec(beton_copy, tmp_path, verify="full"))
    assert "converted before per-sample checksums, so data.verify=full checks its sha256 instead" in caplog.text
    beton = beton_copy / "train.beton"
    flip(beton, image_byte(beton, DAMAGED))
    with pytest.raises(DatasetError, match="its sha256 differs from its manifest's"):
        build_loader(spec(beton_copy, tmp_path, verify="full"))


def test_verify_dataset_names_a_damaged_beton_sample(beton_copy, capsys):
    assert verify_dataset.main([str(beton_copy)]) == 0
    assert capsys.readouterr().out.startswith("clean: ")
    beton = beton_copy / "train.beton"
    flip(beton, label_byte(beton, DAMAGED), 0x01)
    assert verify_dataset.main([str(beton_copy)]) == 1
    out = capsys.readouterr().out
    assert f"{beton}: sample {DAMAGED}: its bytes fail the checksum recorded at conversion" in out
    assert out.count("fail the checksum") == 1


def test_verify_dataset_checks_a_beton_at_a_url_through_a_copy_on_disk(beton_copy, tmp_path, capsys, monkeypatch):
    from benchmarks.loopback_servers import Nginx
    monkeypatch.setattr(verify_dataset, "IN_MEMORY", 64 << 10)     # every .beton of the sample is larger
    monkeypatch.setattr(verify_dataset, "CHUNK", 1 << 20)
    beton = beton_copy / "train.beton"
    flip(beton, image_byte(beton, DAMAGED))
    server = Nginx(beton_copy.parent, tmp_path / "nginx")
    try:
        code = verify_dataset.main([f"{server.url}/{beton_copy.name}"])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert code == 1 and f"/{beton_copy.name}/train.beton: sample {DAMAGED}: its bytes fail the checksum" in out
    assert out.count("fail the checksum") == 1


def test_a_staged_copy_damaged_since_it_was_staged_is_staged_again(beton_copy, tmp_path, caplog):
    from benchmarks.loopback_servers import Nginx
    server = Nginx(beton_copy.parent, tmp_path / "nginx")
    try:
        url = f"{server.url}/{beton_copy.name}"
        staged = build_loader(spec(url, tmp_path, verify="full")).beton       # checked whole as it was staged
        sound = staged.read_bytes()
        flip(staged, image_byte(staged, DAMAGED))                              # the cache's disk, since
        with caplog.at_level(logging.WARNING):
            again = build_loader(spec(url, tmp_path, verify="full"))
    finally:
        server.stop()
    assert "is damaged (1 samples) since it was staged; staging it again" in caplog.text
    assert not len(again.damaged) and again.beton == staged and staged.read_bytes() == sound
