"""tools/verify_dataset.py --repair SRC: only the damaged WebDataset shards are converted again,
byte for byte what the first conversion wrote (a source file it skipped skipped again), in place or
in a bucket, the manifest last; a source folder that changed since is refused in one line with
nothing written; an FFCV split's .beton is written again with a new record."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

import verify_dataset
from conftest import flip, run_tool, versions
from pipeline import LoaderSpec, build_loader

SHARD_MB = "0.1"        # the fashion sample's 120 train images in about five shards


@pytest.fixture
def source(sample_sets, tmp_path):
    """The fashion sample with one file the converters skip."""
    copy = tmp_path / "src"
    shutil.copytree(sample_sets / "fashion", copy)
    (copy / "train" / "Bag" / "0-broken.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    return copy


def converted(source, out) -> None:
    """Convert `source` to webdataset shards in `out`, a folder or a bucket."""
    run_tool("convert_wds.py", source, out, "--shard-size-mb", SHARD_MB, "--num-workers", "1", check=True)


def files_of(root) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def check(capsys, *args) -> tuple[int, str, str]:
    code = verify_dataset.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_only_the_damaged_shards_are_converted_again_byte_for_byte(source, tmp_path, capsys):
    out = tmp_path / "wds"
    converted(source, out)
    pristine = files_of(out)
    shards = sorted((out / "train").glob("*.tar"))
    assert len(shards) >= 4 and "0-broken.jpg" in (out / "manifest.json").read_text()
    flip(shards[1], shards[1].stat().st_size // 3)                 # a sample's bytes, or a header
    flip(out / "train" / "shard-000002.idx", 40)
    untouched = {path: path.stat().st_mtime_ns for path in (out / "train").iterdir()
                 if not path.name.startswith(("shard-000001", "shard-000002"))}
    code, text, _ = check(capsys, out, "--repair", source, "--num-workers", "1")
    assert code == 0, text
    assert "repaired from" in text and "train/shard-000001.tar" in text and "train/shard-000002.idx" in text
    assert text.strip().splitlines()[-1].startswith("clean: ")
    assert files_of(out) == pristine
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in untouched.items())


def test_a_damaged_index_pack_is_read_around_found_and_written_again(source, tmp_path, capsys, caplog):
    """Bit rot in the pack's member table: a loader parses the shards' indexes instead, saying so
    in one line; the check names the pack; --repair writes it again from the shards' files."""
    from pipeline.datasets import read_converted
    out = tmp_path / "wds"
    converted(source, out)
    sound = read_converted(out, "train", "webdataset")
    pack = out / "train" / "shard-indexes.pack"
    flip(pack, pack.stat().st_size - 20)            # in the member table, its last part
    with caplog.at_level("WARNING", logger="pipeline.formats.converted"):
        damaged = read_converted(out, "train", "webdataset")
    [line] = [record.getMessage() for record in caplog.records]
    assert str(pack) in line and "fails its sha256" in line, line
    assert all(np.array_equal(a.members, b.members) for a, b in zip(damaged.shards, sound.shards))
    code, text, _ = check(capsys, out)
    assert code == 1 and f"{out}/train/shard-indexes.pack: its sha256 differs" in text, text
    code, text, _ = check(capsys, out, "--repair", source, "--num-workers", "1")
    assert code == 0 and "train/shard-indexes.pack" in text and text.strip().splitlines()[-1].startswith("clean: ")
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.formats.converted"):
        read_converted(out, "train", "webdataset")
    assert not caplog.records


def test_a_shard_rebuilt_to_other_bytes_gets_its_index_pack_written_again(source, tmp_path, capsys):
    """Where the libraries that encoded a shard changed since, its rebuilt files differ from the
    first conversion's and its record is written anew, and the split's index pack with it, from the
    rebuilt files."""
    out = tmp_path / "wds"
    converted(source, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][1]["sha256"] = "0" * 64        # as other libraries wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, text, _ = check(capsys, out, "--repair", source, "--num-workers", "1")
    assert code == 0 and "train/shard-000001.tar" in text and "train/shard-indexes.pack" in text, text
    record = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    assert record["shards"][1]["sha256"] != "0" * 64
    pack = (out / "train" / record["index_pack"]["file"]).read_bytes()
    assert record["index_pack"]["sha256"] == hashlib.sha256(pack).hexdigest()
    assert check(capsys, out)[0] == 0


def test_a_changed_source_is_refused_and_nothing_is_written(source, tmp_path, capsys):
    out = tmp_path / "wds"
    converted(source, out)
    shard = out / "train" / "shard-000001.tar"
    flip(shard, shard.stat().st_size // 3)
    damaged = files_of(out)
    next((source / "train" / "Coat").iterdir()).unlink()
    code, _, err = check(capsys, out, "--repair", source, "--num-workers", "1")
    [line] = [line for line in err.splitlines() if line.startswith("error:")]      # the rest is progress
    assert code == 2 and line.startswith(f"error: {source}: ") and "convert the whole dataset again" in line
    assert files_of(out) == damaged


def test_an_ffcv_split_is_written_again(converted_sets, sample_sets, tmp_path, capsys):
    out = tmp_path / "ffcv"
    shutil.copytree(converted_sets["fashion"]["ffcv"], out)
    flip(out / "val.beton", (out / "val.beton").stat().st_size // 2)
    code, text, _ = check(capsys, out, "--repair", sample_sets / "fashion", "--num-workers", "1")
    assert code == 0 and "repaired from" in text and "val.beton" in text, text
    record = json.loads((out / "manifest.json").read_text())["splits"]["val"]
    assert record["sha256"] and (out / "val.crc32").stat().st_size == 4 * record["count"]
    loader = build_loader(LoaderSpec("ffcv", path=str(out), split="val", batch_size=40, resolution=32,
                                     num_workers=1, verify="full", cache_dir=str(tmp_path / "cache")))
    assert sum(len(labels) for _, labels in loader) == record["count"] and not len(loader.damaged)


def test_a_damaged_shard_in_a_bucket_is_put_again(source, bucket, tmp_path, capsys):
    client, name = bucket
    converted(source, f"s3://{name}/wds")
    key = "wds/train/shard-000001.tar"
    original = client.get_object(Bucket=name, Key=key)
    sound = original["Body"].read()
    data = bytearray(sound)
    data[len(data) // 3] ^= 0x08
    client.put_object(Bucket=name, Key=key, Body=bytes(data), Metadata=original["Metadata"])   # bit rot, metadata intact
    code, text, _ = check(capsys, f"s3://{name}/wds", "--repair", source, "--num-workers", "1")
    assert code == 0 and "train/shard-000001.tar" in text, text
    assert client.get_object(Bucket=name, Key=key)["Body"].read() == sound
    puts, deletes = versions(client, name, "wds")
    assert puts["train/shard-000001.tar"] == 3 and puts["manifest.json"] == 1 and not deletes   # the manifest as it was


def test_a_damaged_index_pack_in_a_bucket_is_dropped(source, bucket, tmp_path, capsys):
    """Without the shards' files at hand to write it again, the repair drops the pack from the
    manifest: the split's loaders parse the shards' indexes until it is converted again."""
    client, name = bucket
    converted(source, f"s3://{name}/wds")
    key = "wds/train/shard-indexes.pack"
    original = client.get_object(Bucket=name, Key=key)
    data = bytearray(original["Body"].read())
    data[len(data) // 2] ^= 0x08
    client.put_object(Bucket=name, Key=key, Body=bytes(data), Metadata=original["Metadata"])
    code, text, _ = check(capsys, f"s3://{name}/wds", "--repair", source, "--num-workers", "1")
    assert code == 0 and text.strip().splitlines()[-1].startswith("clean: "), text
    record = json.loads(client.get_object(Bucket=name, Key="wds/manifest.json")["Body"].read())["splits"]["train"]
    assert "index_pack" not in record and "train/shard-indexes.pack" not in record["files"]


def test_a_dataset_over_http_cannot_be_repaired(converted_sets, sample_sets, tmp_path, capsys):
    from benchmarks.loopback_servers import Nginx
    out = tmp_path / "wds"
    shutil.copytree(converted_sets["fashion"]["webdataset"], out)
    flip(out / "train" / "shard-000000.idx", 40)
    server = Nginx(tmp_path, tmp_path / "nginx")
    try:
        code, _, err = check(capsys, f"{server.url}/wds", "--repair", sample_sets / "fashion")
    finally:
        server.stop()
    assert code == 2 and err.strip().splitlines()[-1].endswith("cannot be written; repair a copy on local disk or in s3:// or gs://")
