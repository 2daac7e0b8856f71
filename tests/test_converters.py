"""The FFCV and WebDataset converters: bad input, atomic output, idempotence, the manifest and its
version (pipeline/formats/manifest.py), and reading back what they wrote with the real readers (ffcv's
Reader/Loader, webdataset, DALI on CPU)."""
from __future__ import annotations

import collections
import re
import hashlib
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import (TOOLS, as_converted_before_checksums, as_converted_before_index_packs, read_manifest, run_tool,
                      run_tool_here, run_tool_without)
from pipeline import LoaderSpec, build_loader
from pipeline.convert.errors import ConversionFault
from pipeline.convert.parallel import map_samples
from pipeline.formats import manifest as pipeline_manifest
from pipeline.errors import DatasetError
from pipeline.formats.converted import Shard, member_table
from pipeline.formats.manifest import MANIFEST_VERSION, ManifestError

CONVERTERS = ["convert_ffcv.py", "convert_wds.py"]
CLASSES = ["apple", "crème_brûlée", "empty"]  # sorted; 'empty' has no train images


def gradient(width: int, height: int) -> np.ndarray:
    """A smooth RGB image: compresses well even at 8000x6000, unlike noise."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    return np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1).astype(np.uint8)


def jpeg(image: Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **kwargs)
    return buffer.getvalue()


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def rotated_jpeg() -> bytes:
    """Stored 90x60, left half red and right half blue, EXIF orientation 6 (turn 90 degrees
    clockwise to display): shown as 60x90 with red on top."""
    pixels = np.zeros((60, 90, 3), np.uint8)
    pixels[:, :45] = (255, 0, 0)
    pixels[:, 45:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    return jpeg(Image.fromarray(pixels), exif=exif)


@pytest.fixture(scope="module")
def bad_source(tmp_path_factory) -> tuple[Path, dict, set]:
    """A folder with every kind of awkward input; returns (root, expected {split: Counter of
    (label, width, height)}, expected skipped paths)."""
    root = tmp_path_factory.mktemp("bad") / "src"
    good = Image.fromarray(gradient(320, 240))
    files = {
        "train/apple/good.JPEG": jpeg(good),
        "train/apple/cmyk.JPEG": jpeg(good.convert("CMYK")),
        "train/apple/gray.JPEG": jpeg(good.convert("L")),
        "train/apple/png_named.JPEG": png(good),
        "train/apple/palette.png": png(good.convert("P")),
        "train/apple/rgba.png": png(good.convert("RGBA")),
        "train/apple/rotated.JPEG": rotated_jpeg(),
        "train/apple/large.JPEG": jpeg(Image.fromarray(gradient(8000, 6000))),
        "train/apple/truncated.JPEG": jpeg(good)[:3000],
        "train/apple/zero.JPEG": b"",
        "train/apple/text.JPEG": b"this is not an image\n",
        "train/apple/README.md": b"# notes beside the images\n",
        "train/crème_brûlée/日本語の写真.JPEG": jpeg(good),
        "val/apple/v1.JPEG": jpeg(good),
        "val/crème_brûlée/v2.JPEG": jpeg(good),
        "val/empty/v3.JPEG": jpeg(good),
    }
    for relpath, data in files.items():
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / relpath).write_bytes(data)
    (root / "train/empty").mkdir()
    expected = {
        "train": collections.Counter([(0, 320, 240)] * 6 + [(0, 60, 90), (0, 512, 384), (1, 320, 240)]),
        "val": collections.Counter([(0, 320, 240), (1, 320, 240), (2, 320, 240)]),
    }
    skipped = {str(root / f"train/apple/{name}") for name in ("truncated.JPEG", "zero.JPEG", "text.JPEG", "README.md")}
    return root, expected, skipped


@pytest.fixture(scope="module")
def converted(bad_source, tmp_path_factory) -> dict:
    """Both converters run once on the bad source: {script: (result, out)}."""
    root, _, _ = bad_source
    outputs = {}
    for script in CONVERTERS:
        out = tmp_path_factory.mktemp(script.split(".")[0])
        outputs[script] = (run_tool(script, root, out, "--num-workers", 2, "--max-resolution", 512), out)
    return outputs


def ffcv_shapes(beton: Path) -> collections.Counter:
    import pipeline.formats.ffcv_import  # noqa: F401
    from ffcv.reader import Reader
    metadata = Reader(str(beton)).metadata
    return collections.Counter(zip(metadata["f1"].tolist(), metadata["f0"]["width"].tolist(),
                                   metadata["f0"]["height"].tolist()))


def wds_samples(split_dir: Path) -> list[dict]:
    """Every sample of a split through the webdataset package, images decoded as PIL."""
    import webdataset as wds
    urls = [str(p) for p in sorted(split_dir.glob("shard-*.tar"))]
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil", only=["jpg", "cls"])
    return list(dataset)


@pytest.mark.parametrize("script", CONVERTERS)
def test_bad_input_is_converted_or_skipped_with_reasons(script, bad_source, converted):
    root, expected, expected_skips = bad_source
    result, out = converted[script]
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest["classes"] == CLASSES
    assert manifest["counts"] == {split: sum(c.values()) for split, c in expected.items()}
    assert {s["path"] for s in manifest["skipped"]} == expected_skips
    reasons = {Path(s["path"]).name: s["reason"] for s in manifest["skipped"]}
    assert "truncated" in reasons["truncated.JPEG"]
    assert "empty" in reasons["zero.JPEG"]
    assert "extension" in reasons["README.md"]
    for path in expected_skips:
        assert f"skipped {path}: " in result.stderr
    # Not a terminal: progress as lines (FFCV's own writer bar included), no carriage-return redraws.
    assert "\r" not in result.stderr and re.search(r"^[^\n]+: \d+/\d+ img \(100%\)", result.stderr, re.M)
    assert manifest["splits"]["train"]["empty_classes"] == ["empty"]
    assert manifest["params"]["max_resolution"] == 512 and manifest["source"] == str(root.resolve())
    assert {"numpy", "python"} <= set(manifest["versions"])


def test_ffcv_output_has_the_expected_images_and_labels(bad_source, converted):
    _, expected, _ = bad_source
    _, out = converted["convert_ffcv.py"]
    for split in expected:
        assert ffcv_shapes(out / f"{split}.beton") == expected[split]


def test_wds_output_has_the_expected_images_and_labels(bad_source, converted):
    _, expected, _ = bad_source
    _, out = converted["convert_wds.py"]
    for split in expected:
        samples = wds_samples(out / split)
        assert all(s["jpg"].mode == "RGB" for s in samples)
        assert all(int.from_bytes(s["lbl"], "little") == s["cls"] for s in samples)
        assert collections.Counter((s["cls"], *s["jpg"].size) for s in samples) == expected[split]
    rotated = [s["jpg"] for s in wds_samples(out / "train") if s["jpg"].size == (60, 90)]
    top, bottom = np.asarray(rotated[0])[5, 30], np.asarray(rotated[0])[-5, 30]
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0], "EXIF rotation not applied"


def test_wds_stores_the_source_pixels_with_a_restart_marker_per_mcu(bad_source, converted, tmp_path):
    """Every JPEG gets the markers (lossless: a JPEG kept as it is decodes to the source's
    pixels); --no-restart-markers stores the source's own bytes."""
    root, _, _ = bad_source
    _, out = converted["convert_wds.py"]
    manifest = read_manifest(out)
    assert all(record["restart_markers"] == record["count"] for record in manifest["splits"].values())
    source = (root / "val/apple/v1.JPEG").read_bytes()
    stored = [s["__key__"] for s in wds_samples(out / "val")]
    import webdataset as wds
    raw = next(iter(wds.WebDataset(str(out / "val/shard-000000.tar"), shardshuffle=False, empty_check=False)))
    assert raw["__key__"] == stored[0] and raw["jpg"] != source and raw["jpg"].count(b"\xff\xd0")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(raw["jpg"]))), np.asarray(Image.open(io.BytesIO(source))))

    plain = tmp_path / "plain"
    run_tool("convert_wds.py", root, plain, "--splits", "val", "--no-restart-markers", check=True)
    assert read_manifest(plain)["splits"]["val"]["restart_markers"] == 0
    raw = next(iter(wds.WebDataset(str(plain / "val/shard-000000.tar"), shardshuffle=False, empty_check=False)))
    assert raw["jpg"] == source


@pytest.mark.parametrize("script", CONVERTERS)
def test_strict_fails_when_anything_was_skipped(script, bad_source, tmp_path, capsys):
    root, _, _ = bad_source
    result = run_tool_here(capsys, script, root, tmp_path / "out", "--strict", "--splits", "train")
    assert result.returncode == 1
    assert read_manifest(tmp_path / "out")["counts"] == {"train": 9}
    clean = run_tool_here(capsys, script, root, tmp_path / "clean", "--strict", "--splits", "val")
    assert clean.returncode == 0, clean.stderr


def command_in_process(script: str, caplog, *args) -> tuple[int, list[str]]:
    """The converter's command line called in this process, for what is refused before any image
    is read: its exit code and the lines it logged (main_guard shows them on stderr, one a line)."""
    command = importlib.import_module(f"pipeline.convert.{script.removeprefix('convert_').removesuffix('.py')}").command
    caplog.clear()
    with pytest.raises(SystemExit) as exited:
        command([str(arg) for arg in args])
    return exited.value.code, [line for record in caplog.records for line in record.getMessage().splitlines()]


@pytest.mark.parametrize("script", CONVERTERS)
def test_missing_or_empty_source_is_a_one_line_error(script, tmp_path, caplog):
    caplog.set_level("INFO")
    for src in (tmp_path / "missing", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        code, lines = command_in_process(script, caplog, src, tmp_path / "out")
        assert code == 2
        assert len(lines) == 1 and str(src) in lines[0] and lines[0].startswith("error: "), lines
    (tmp_path / "layout/train/cat").mkdir(parents=True)
    code, lines = command_in_process(script, caplog, tmp_path / "layout", tmp_path / "out")
    # The first line names the form found, the last says what it lacks
    assert code == 2 and len(lines) == 2 and "ImageNet-layout folder" in lines[0], lines
    assert lines[1].startswith("error: ") and "val" in lines[1], lines


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def kill_when_writing(script: str, src: Path, out: Path, temporary_glob: str) -> None:
    """Start a conversion and SIGKILL it once its temporary output holds samples. Not as soon as
    the FFCV .beton appears: FFCV creates a SharedMemory just after, and a kill before Python's
    resource tracker has it registered left the segment in /dev/shm for good."""
    process = subprocess.Popen([sys.executable, str(TOOLS / script), str(src), str(out), "--force",
                                "--num-workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120

    def written() -> int:
        return sum(p.stat().st_size for t in out.glob(temporary_glob) for p in (t, *t.rglob("*")) if p.is_file())
    while not written() > 1 << 20:
        assert process.poll() is None, "the conversion ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()


def noisy_folder(root: Path, counts: dict[str, int], classes: int, shape: tuple[int, int], seed: int) -> Path:
    """An ImageNet-layout folder of random-noise JPEGs (slow to encode, big for their size)."""
    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        for i in range(n):
            path = root / split / f"c{i % classes}" / f"{i}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg(Image.fromarray(rng.integers(0, 255, (*shape, 3), dtype=np.uint8))))
    return root


@pytest.fixture(scope="module")
def many_images(tmp_path_factory) -> Path:
    return noisy_folder(tmp_path_factory.mktemp("many") / "src", {"train": 300, "val": 10}, 3, (300, 400), seed=0)


LEFT_BY_A_KILL = (".converting", ".scan-")        # the next run in OUT clears them (test_convert_resume.py)


@pytest.mark.parametrize("script,temporary", [("convert_ffcv.py", ".train.beton.tmp-*"),
                                               ("convert_wds.py", ".converting")])
def test_an_interrupted_run_loses_nothing_and_looks_incomplete(script, temporary, many_images, tmp_path, capsys):
    out = tmp_path / "out"
    kill_when_writing(script, many_images, out, temporary)
    assert not (out / "manifest.json").exists()
    assert not (out / "train.beton").exists() and not (out / "train").exists()

    run_tool_here(capsys, script, many_images, out, "--shard-size-mb", 1, check=True) if script == "convert_wds.py" \
        else run_tool_here(capsys, script, many_images, out, check=True)
    before = {k: v for k, v in tree_digest(out).items() if not k.startswith(LEFT_BY_A_KILL) and ".tmp-" not in k}
    kill_when_writing(script, many_images, out, temporary)
    after = {k: v for k, v in tree_digest(out).items() if not k.startswith(LEFT_BY_A_KILL) and ".tmp-" not in k}
    assert after == before


def test_up_to_date_outputs_are_not_written_again(bad_source, tmp_path, capsys):
    root, _, _ = bad_source
    out = tmp_path / "out"
    run_tool_here(capsys, "convert_wds.py", root, out, check=True)
    first = tree_digest(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.tar")}
    again = run_tool_here(capsys, "convert_wds.py", root, out, check=True)
    assert "train is up to date" in again.stderr and "val is up to date" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.tar")} == mtimes

    # A conversion from before index packs gets them, its shards untouched
    splits = read_manifest(out)["splits"]
    as_converted_before_index_packs(out)
    again = run_tool_here(capsys, "convert_wds.py", root, out, check=True)
    assert "train is up to date" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.tar")} == mtimes
    assert tree_digest(out).keys() == first.keys() and read_manifest(out)["splits"] == splits
    assert all(tree_digest(out)[name] == digest for name, digest in first.items() if name != "manifest.json")

    # Converting one split keeps the other in the manifest; a changed source is converted again.
    os.utime(root / "val/apple/v1.JPEG", ns=(1, 1))
    partial = run_tool_here(capsys, "convert_wds.py", root, out, "--splits", "val", check=True)
    assert "val is up to date" not in partial.stderr
    assert read_manifest(out)["counts"] == {"train": 9, "val": 3}
    assert tree_digest(out)["train/shard-000000.tar"] == first["train/shard-000000.tar"]


def test_the_webdataset_converter_needs_no_torch(bad_source, tmp_path):
    """Nor does it import torch, which would add 2-3 s to each start: a machine that only
    prepares data needs none."""
    root, _, _ = bad_source
    result = run_tool_without(("torch",), "convert_wds.py", root, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "out")["counts"] == {"train": 9, "val": 3}


def test_the_manifest_carries_the_version_its_reader_checks(converted):
    for _, out in converted.values():
        assert read_manifest(out)["manifest_version"] == MANIFEST_VERSION
        assert pipeline_manifest.read_manifest(out) == read_manifest(out)


BROKEN_MANIFESTS = {
    "newer": json.dumps({"format": "webdataset", "manifest_version": MANIFEST_VERSION + 1, "classes": [], "splits": {}}),
    "not JSON": "{" + "x" * 100_000,                       # a parser's complaint quoting all of it would not fit
    "a list": "[1, 2]",
    "no version": json.dumps({"format": "webdataset", "classes": [], "splits": {}}),
}


@pytest.mark.parametrize("kind", BROKEN_MANIFESTS)
def test_a_newer_or_broken_manifest_is_a_one_line_error_naming_it(kind, tmp_path):
    """The reader (pipeline/formats/manifest.py), a loader and the converter each meet the same manifest:
    the first two refuse it in one short line naming the file, the converter converts anew."""
    (tmp_path / "manifest.json").write_text(BROKEN_MANIFESTS[kind])
    with pytest.raises(ManifestError) as caught:
        pipeline_manifest.read_manifest(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "manifest.json") in message and "\n" not in message and len(message) <= 400, message
    assert ("newer than this code reads" in message) == (kind == "newer"), message
    assert ("older converter" in message) == (kind == "no version"), message
    with pytest.raises(DatasetError) as caught:
        build_loader(LoaderSpec("webdataset", path=str(tmp_path)))
    loader_message = str(caught.value)
    assert loader_message.startswith(message) and "python tools/convert_wds.py" in loader_message
    assert "\n" not in loader_message and len(loader_message) <= 500, loader_message


def test_a_converter_converts_anew_over_a_manifest_it_cannot_read(bad_source, tmp_path, capsys):
    root, _, _ = bad_source
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(BROKEN_MANIFESTS["newer"])
    result = run_tool_here(capsys, "convert_wds.py", root, out, check=True)
    assert "newer than this code reads" in result.stderr and "converting everything" in result.stderr
    assert read_manifest(out)["manifest_version"] == MANIFEST_VERSION and read_manifest(out)["counts"]["train"] == 9

def test_converting_again_over_an_older_versions_output_adds_what_this_version_writes(bad_source, tmp_path):
    """A dataset converted before per-sample checksums: "convert it again" writes them, rather than
    finding its splits up to date."""
    from pipeline.convert.wds import main
    root, _, _ = bad_source
    out = tmp_path / "out"
    assert main([str(root), str(out), "--num-workers", "1"]) == 0
    as_converted_before_checksums(out)
    assert main([str(root), str(out), "--num-workers", "1"]) == 0
    again = read_manifest(out)
    assert again["manifest_version"] == MANIFEST_VERSION
    assert all("checksums" in shard and (out / split / shard["checksums"]).is_file()
               for split, record in again["splits"].items() for shard in record["shards"])


def test_wds_shards_are_deterministic_size_capped_and_indexed_as_dali_does_without_dali(many_images, tmp_path, capsys):
    from wds2idx import IndexCreator
    args = (many_images, "--shard-size-mb", 1, "--splits", "train")
    run_tool_here(capsys, "convert_wds.py", *args[:1], tmp_path / "a", *args[1:], check=True)
    # as on a GPU node where DALI is not installed yet
    without_dali = run_tool_without(("nvidia.dali", "wds2idx"), "convert_wds.py", *args[:1], tmp_path / "b", *args[1:])
    assert without_dali.returncode == 0, without_dali.stderr[-3000:]
    digests = {name: tree_digest(tmp_path / name / "train") for name in ("a", "b")}
    assert digests["a"] == digests["b"]
    shards = read_manifest(tmp_path / "a")["splits"]["train"]["shards"]
    assert len(shards) > 1 and sum(s["count"] for s in shards) == 300
    assert all((tmp_path / "a/train" / s["tar"]).stat().st_size <= 2**20 for s in shards)
    # The split's index pack: every shard's index, then its checksums, in the manifest's order, then
    # the member table a loader would parse from the indexes
    record = read_manifest(tmp_path / "a")["splits"]["train"]
    pack = (tmp_path / "a/train/shard-indexes.pack").read_bytes()
    files = b"".join((tmp_path / "a/train" / shard[kind]).read_bytes() for shard in shards for kind in ("index", "checksums"))
    assert record["index_pack"] == {"file": "shard-indexes.pack", "bytes": len(pack),
                                    "sha256": hashlib.sha256(pack).hexdigest(), "members_at": len(files),
                                    "members_sha256": hashlib.sha256(pack[len(files):]).hexdigest()}
    assert pack[:len(files)] == files and "train/shard-indexes.pack" in record["files"]
    parsed = [member_table(Shard(tmp_path / "a/train" / s["tar"], tmp_path / "a/train" / s["index"], s["count"], 0))
              for s in shards]
    assert np.array_equal(np.frombuffer(pack[len(files):], "<i8").reshape(-1, 3), np.concatenate(parsed))
    for shard in shards:
        with IndexCreator(str(tmp_path / "a/train" / shard["tar"]), str(tmp_path / "dali.idx"), verbose=False) as ic:
            ic.create_index()
        assert (tmp_path / "a/train" / shard["index"]).read_text() == (tmp_path / "dali.idx").read_text(), shard


def test_a_beton_is_the_same_bytes_whatever_the_number_of_writer_processes(sample_sets, tmp_path, capsys):
    """FFCV's writer places pages as its processes ask for them; the converter then lays the file
    out as one process would."""
    for name, workers in (("one", 1), ("two", 2), ("again", 2)):
        run_tool_here(capsys, "convert_ffcv.py", sample_sets / "photos", tmp_path / name, "--splits", "val",
                      "--num-workers", workers, check=True)
    digests = [tree_digest(tmp_path / name) for name in ("one", "two", "again")]
    for digest in digests:
        digest.pop("manifest.json")
    assert digests[0] == digests[1] == digests[2] and "val.beton" in digests[0]


def dali_labels(split_dir: Path, manifest: dict, split: str) -> list[int]:
    """Labels read by DALI's readers.webdataset (CPU pipeline) through the .idx files."""
    from nvidia.dali import fn, pipeline_def, types
    members = manifest["splits"][split]["members"]
    tars = [str(split_dir / s["tar"]) for s in manifest["splits"][split]["shards"]]

    @pipeline_def(batch_size=8, num_threads=1, device_id=None)
    def labels_pipeline():
        jpegs, labels = fn.readers.webdataset(paths=tars, index_paths=[t[:-4] + ".idx" for t in tars],
                                              ext=[members["image"], members["label_int32"]],
                                              dtypes=[types.UINT8, types.INT32], name="reader")
        return fn.decoders.image(jpegs, device="cpu"), labels

    pipe = labels_pipeline()
    pipe.build()
    count = manifest["counts"][split]
    labels = []
    while len(labels) < count:
        _, batch = pipe.run()
        labels += [int(np.asarray(batch[i])[0]) for i in range(len(batch))]
    assert pipe.epoch_size("reader") == count
    return labels[:count]


def test_sample_sets_read_back_with_ffcv_webdataset_and_dali(sample_sets, converted_sets):
    import pipeline.formats.ffcv_import  # noqa: F401
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption

    for name in ("fashion", "photos"):
        src = sample_sets / name
        ffcv_out, wds_out = converted_sets[name]["ffcv"], converted_sets[name]["webdataset"]
        for out in (ffcv_out, wds_out):
            manifest = read_manifest(out)
            assert manifest["classes"] == sorted(p.name for p in (src / "train").iterdir())
            assert manifest["skipped"] == []
        for split in ("train", "val"):
            sources = sorted((src / split).glob("*/*.JPEG"))
            true_labels = collections.Counter(manifest["classes"].index(p.parent.name) for p in sources)
            assert read_manifest(ffcv_out)["counts"][split] == read_manifest(wds_out)["counts"][split] == len(sources)

            image_pipeline = [SimpleRGBImageDecoder()] if name == "fashion" else None
            loader = Loader(str(ffcv_out / f"{split}.beton"), batch_size=16, num_workers=1,
                            order=OrderOption.SEQUENTIAL, drop_last=False,  # FFCV drops it by default
                            pipelines={"image": image_pipeline, "label": [IntDecoder()]})
            ffcv_labels, ffcv_images = [], []
            for batch in loader:
                ffcv_labels += batch[-1].ravel().tolist()
                if name == "fashion":
                    ffcv_images.append(batch[0].copy())  # the Loader reuses its buffers
            assert collections.Counter(ffcv_labels) == true_labels

            samples = wds_samples(wds_out / split)
            assert collections.Counter(s["cls"] for s in samples) == true_labels
            assert collections.Counter(dali_labels(wds_out / split, read_manifest(wds_out), split)) == true_labels

            if name == "fashion":
                # FFCV stores in source order: its pixels are the source's, re-encoded at quality 90.
                stored = np.concatenate(ffcv_images).astype(np.float32)
                original = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sources]).astype(np.float32)
                assert stored.shape == original.shape
                assert np.abs(stored - original).mean() < 4.0
                # Untouched JPEGs go into the shards with the source's pixels (restart markers added losslessly).
                source_pixels = {np.asarray(Image.open(p)).tobytes() for p in sources}
                import webdataset as wds
                raw = wds.WebDataset([str(p) for p in sorted((wds_out / split).glob("*.tar"))], shardshuffle=False)
                assert {np.asarray(Image.open(io.BytesIO(s["jpg"]))).tobytes() for s in raw} == source_pixels


def crash_on_37(data: bytes) -> int:
    if int(data) == 37:
        os.kill(os.getpid(), signal.SIGSEGV)    # what a fault in native code does to a worker
    return 2 * int(data)


def numbered_files(root: Path, count: int):
    """A folder source of `count` files holding their own numbers, with its train split scanned."""
    from pipeline.convert.sources import SourceOptions, open_source
    for number in range(count):
        (root / "train" / "c").mkdir(parents=True, exist_ok=True)
        (root / "train" / "c" / f"{number:03d}.jpg").write_bytes(str(number).encode())
    source = open_source(str(root), SourceOptions(form="imagefolder"))
    source.use_classes(source.classes(["train"]))
    return source


def test_a_worker_that_dies_is_a_one_line_fault_not_a_hang(tmp_path):
    # multiprocessing.Pool would start a new worker and wait for the lost items forever.
    fine = numbered_files(tmp_path / "fine", 36)
    assert [result for _, result in map_samples(fine, "train", crash_on_37, 2, "fine")] == [2 * i for i in range(36)]
    dies = numbered_files(tmp_path / "dies", 100)
    started = time.monotonic()
    with pytest.raises(ConversionFault, match=r"^train: encoding: a worker process died .*--num-workers 1"):
        list(map_samples(dies, "train", crash_on_37, 2, "train: encoding"))
    assert time.monotonic() - started < 30


def test_a_conversion_called_where_stderr_is_no_file_runs_its_workers(many_images, tmp_path, capsys):
    """From Python with sys.stderr captured, as in a notebook (here pytest's capsys): its forked
    workers start, where enabling their crash tracebacks on sys.stderr would have killed each one."""
    from pipeline.convert.wds import main
    assert not _has_fileno(sys.stderr)
    assert main([str(many_images), str(tmp_path / "out"), "--splits", "train", "--num-workers", "2"]) == 0
    assert read_manifest(tmp_path / "out")["counts"] == {"train": 300}


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
