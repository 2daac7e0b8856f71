"""Tests for tools/make_sample_data.py: layout, counts, image sizes, labels, determinism,
idempotence and resume, train/val disjointness of photo tiles, and the apt-get fallback.

The Debian packages are read where installed, else from `data/sample/.debian` when `make demo`
left them there, else downloaded once into pytest's cache folder (.pytest_cache/d/debian-packages,
about 170 MB unpacked) and reused by later runs (conftest's `debian_cache`)."""
import csv
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
import debian_packages
import generated_set
import make_sample_data as msd

LIMIT = 2


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory, debian_cache):
    out = tmp_path_factory.mktemp("fashion_a")
    summary = msd.make_fashion(out, limit=LIMIT, progress=False, cache_dir=debian_cache)
    assert summary["written"] == 2 * LIMIT * len(msd.FASHION_CLASSES)
    return out / "fashion"


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory, debian_cache):
    out = tmp_path_factory.mktemp("photos_a")
    summary = msd.make_photos(out, limit=LIMIT, seed=3, progress=False, cache_dir=debian_cache)
    assert summary["written"] == 2 * LIMIT * len(msd.PHOTO_SOURCES)
    return out / "photos"


def files_of(set_dir: Path) -> dict:
    """{relative path: bytes} of every file under set_dir."""
    return {str(p.relative_to(set_dir)): p.read_bytes()
            for p in sorted(set_dir.rglob("*")) if p.is_file()}


def mtimes_of(set_dir: Path) -> dict:
    return {str(p.relative_to(set_dir)): p.stat().st_mtime_ns
            for p in sorted(set_dir.rglob("*")) if p.is_file()}


def read_manifest(set_dir: Path) -> list:
    with open(set_dir / "tiles.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["box"] = tuple(int(row[k]) for k in ("x0", "y0", "x1", "y1"))
    return rows


def package_file(source: str, debian_cache: Path) -> Path:
    """The photo a manifest's 'package:/path' names, installed or in the cache."""
    package, path = source.split(":", 1)
    installed = Path(path)
    return installed if installed.exists() else debian_cache / package / path.lstrip("/")


# --- layout, counts, contents ----------------------------------------------------------------
def test_fashion_layout_counts_and_images(fashion_dir):
    for split in msd.SPLITS:
        class_dirs = sorted(p.name for p in (fashion_dir / split).iterdir())
        assert class_dirs == sorted(msd.FASHION_CLASSES)
        for class_name in class_dirs:
            files = sorted((fashion_dir / split / class_name).iterdir())
            assert len(files) == LIMIT
            for f in files:
                assert re.fullmatch(r"\d{8}\.JPEG", f.name), f.name
                with Image.open(f) as im:
                    assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (28, 28))


def test_fashion_files_hold_the_labelled_source_images(fashion_dir, debian_cache):
    """Each file is the source image of its index, in the folder of its label: the first
    LIMIT images of each class in source order."""
    root = debian_packages.package_root(msd.FASHION_PACKAGE, [msd.FASHION_DIR], debian_cache)
    for split, (image_file, label_file) in msd.FASHION_FILES.items():
        images = msd.read_idx(root / msd.FASHION_DIR / image_file)
        labels = msd.read_idx(root / msd.FASHION_DIR / label_file)
        assert len(images) == {"train": 60_000, "val": 10_000}[split]
        for label, class_name in enumerate(msd.FASHION_CLASSES):
            expected = np.flatnonzero(labels == label)[:LIMIT]
            files = sorted((fashion_dir / split / class_name).iterdir())
            assert [int(f.stem) for f in files] == expected.tolist()
            for f, index in zip(files, expected):
                with Image.open(f) as im:
                    decoded = np.asarray(im.convert("L"), dtype=np.int16)
                error = np.abs(decoded - images[index]).mean()
                other = np.abs(decoded - images[(index + 1) % len(images)]).mean()
                assert error < 3 and error < other, (f, error, other)


def test_photos_layout_counts_and_sizes(photos_dir):
    names = sorted(name for name, _, _ in msd.PHOTO_SOURCES)
    rows = {row["file"]: row for row in read_manifest(photos_dir)}
    for split in msd.SPLITS:
        assert sorted(p.name for p in (photos_dir / split).iterdir()) == names
        for name in names:
            files = sorted((photos_dir / split / name).iterdir())
            assert [f.name for f in files] == [f"{name}_{i:04d}.JPEG" for i in range(LIMIT)]
            for f in files:
                row = rows.pop(f"{split}/{name}/{f.name}")
                with Image.open(f) as im:
                    assert (im.format, im.mode) == ("JPEG", "RGB")
                    assert im.size == (int(row["width"]), int(row["height"]))
                    assert all(msd.MIN_SIDE <= side <= msd.MAX_SIDE for side in im.size)
    assert not rows, "manifest lists files that are not there"


def test_photo_val_regions_are_disjoint_from_train(photos_dir):
    rows = read_manifest(photos_dir)
    for name, _, _ in msd.PHOTO_SOURCES:
        train = [r["box"] for r in rows if r["class"] == name and r["split"] == "train"]
        val = [r["box"] for r in rows if r["class"] == name and r["split"] == "val"]
        assert len(train) == len(val) == LIMIT
        for t in train:
            for v in val:
                assert not msd.boxes_overlap(t, v), (name, t, v)


def test_photo_tiles_show_their_manifest_region(photos_dir, debian_cache):
    """Re-cut one train and one val tile from the source photo: the manifest's box is where
    the pixels came from (so the disjointness test above is about the real pixels)."""
    rows = read_manifest(photos_dir)
    for row in (rows[0], next(r for r in rows if r["split"] == "val")):
        x0, y0, x1, y1 = row["box"]
        shift = 40 if x0 < 40 else -40  # a box next to the right one, for contrast
        size = (int(row["width"]), int(row["height"]))
        with Image.open(package_file(row["source"], debian_cache)) as photo:
            photo = photo.convert("RGB")
            expected = np.asarray(photo.crop(row["box"]).resize(size, Image.LANCZOS), np.int16)
            wrong = np.asarray(photo.crop((x0 + shift, y0, x1 + shift, y1)).resize(size),
                               np.int16)
        with Image.open(photos_dir / row["file"]) as im:
            tile = np.asarray(im.convert("RGB"), np.int16)
        error = np.abs(tile - expected).mean()
        assert error < 3 and error < np.abs(tile - wrong).mean(), (row["file"], error)


def test_tile_plan_distribution_and_regions():
    """The tile sampler alone, on many tiles: sizes, scales, qualities, regions, prefixes."""
    for photo_size in ((1280, 1024), (2560, 1600)):
        width, height = photo_size
        block = msd.val_block(width, height)
        plans = {split: msd.plan_tiles("Example", photo_size, split, 2000, seed=0)
                 for split in msd.SPLITS}
        for split, tiles in plans.items():
            boxes = np.array([box for box, _, _ in tiles])
            sizes = np.array([size for _, size, _ in tiles])
            qualities = np.array([q for _, _, q in tiles])
            assert sizes.min() >= msd.MIN_SIDE and sizes.max() <= msd.MAX_SIDE
            assert 380 <= sizes[:, 0].mean() <= 430 and 330 <= sizes[:, 1].mean() <= 370
            scales = (boxes[:, 2] - boxes[:, 0]) / sizes[:, 0]
            assert scales.min() >= 0.99 and scales.max() <= msd.MAX_SCALE + 0.01
            assert scales.max() > 1.5, "content scale should vary"
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all()
            assert (boxes[:, 3] <= height).all()
            assert set(qualities.tolist()) == set(range(85, 96))
            in_val = [msd.boxes_overlap(tuple(b), block) for b in boxes]
            assert all(in_val) if split == "val" else not any(in_val)
        # a --limit run cuts the same first tiles as the full run
        assert msd.plan_tiles("Example", photo_size, "val", 5, seed=0) == plans["val"][:5]
        assert msd.plan_tiles("Example", photo_size, "val", 5, seed=1) != plans["val"][:5]


def test_photo_sources_are_unique_safe_names():
    names = [name for name, _, _ in msd.PHOTO_SOURCES]
    assert len(set(names)) == len(names) >= 20
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", name) for name in names)
    total = {s: n * len(names) for s, n in msd.PHOTO_TILES_PER_CLASS.items()}
    assert total["train"] >= 2000 and total["val"] >= 500


# --- determinism, idempotence, resume ---------------------------------------------------------
def test_same_arguments_give_identical_bytes(tmp_path, fashion_dir, photos_dir, debian_cache, capsys):
    fashion = msd.make_fashion(tmp_path, limit=LIMIT, progress=True, cache_dir=debian_cache)
    photos = msd.make_photos(tmp_path, limit=LIMIT, seed=3, progress=True,
                             cache_dir=debian_cache)
    assert fashion["written"] > 0 and photos["written"] > 0
    shown = capsys.readouterr().err                     # not a terminal: progress as lines, no redraws
    assert "\r" not in shown and f"fashion: {fashion['written']}/{fashion['written']} img (100%)" in shown
    assert files_of(tmp_path / "fashion") == files_of(fashion_dir)
    assert files_of(tmp_path / "photos") == files_of(photos_dir)


def test_another_seed_gives_other_photo_tiles(tmp_path, photos_dir, debian_cache):
    sources = msd.PHOTO_SOURCES[:2]
    msd.make_photos(tmp_path, limit=1, seed=4, progress=False, cache_dir=debian_cache,
                    sources=sources)
    for name, _, _ in sources:
        rel = f"train/{name}/{name}_0000.JPEG"
        assert (tmp_path / "photos" / rel).read_bytes() != (photos_dir / rel).read_bytes()


def test_second_run_writes_nothing(fashion_dir, photos_dir, debian_cache):
    before = {d: mtimes_of(d) for d in (fashion_dir, photos_dir)}
    assert msd.make_fashion(fashion_dir.parent, limit=LIMIT, progress=False,
                            cache_dir=debian_cache)["written"] == 0
    assert msd.make_photos(photos_dir.parent, limit=LIMIT, seed=3, progress=False,
                           cache_dir=debian_cache)["written"] == 0
    assert {d: mtimes_of(d) for d in (fashion_dir, photos_dir)} == before


def test_interrupted_run_resumes(tmp_path, fashion_dir, debian_cache):
    """A run killed midway (no done marker, files missing, a temp file left) finishes with
    exactly the files an uninterrupted run writes, rewriting only the missing ones."""
    msd.make_fashion(tmp_path, limit=LIMIT, progress=False, cache_dir=debian_cache)
    set_dir = tmp_path / "fashion"
    (set_dir / generated_set.DONE_FILE).unlink()
    victims = sorted(set_dir.rglob("*.JPEG"))[::7]
    for v in victims:
        v.unlink()
    (victims[0].parent / f".{victims[0].name}.123.tmp").write_bytes(b"partial")
    kept = {p: p.stat().st_mtime_ns for p in set_dir.rglob("*.JPEG")}
    summary = msd.make_fashion(tmp_path, limit=LIMIT, progress=False, cache_dir=debian_cache)
    assert summary["written"] == len(victims)
    assert files_of(set_dir) == files_of(fashion_dir)
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())


def test_smaller_limit_keeps_a_prefix(tmp_path, photos_dir, debian_cache):
    sources = msd.PHOTO_SOURCES[-2:]
    for limit in (2, 1):
        summary = msd.make_photos(tmp_path, limit=limit, seed=3, progress=False,
                                  cache_dir=debian_cache, sources=sources)
        assert summary["train"] == summary["val"] == limit * len(sources)
    for rel, data in files_of(tmp_path / "photos").items():
        if rel.endswith(".JPEG"):
            assert data == (photos_dir / rel).read_bytes()
            assert rel.endswith("_0000.JPEG")


# --- command line and failures -----------------------------------------------------------------
def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "make_sample_data.py"), *args],
                          capture_output=True, text=True, cwd=cwd)


def test_cli_writes_summary_and_reruns(tmp_path, debian_cache):
    (tmp_path / ".debian").symlink_to(debian_cache, target_is_directory=True)
    result = run_cli("fashion", "--out", str(tmp_path), "--limit", "1")
    assert result.returncode == 0, result.stderr
    summary = [ln for ln in result.stderr.splitlines() if ln.startswith(str(tmp_path))]
    assert len(summary) == 1
    assert re.search(r": 10 classes, train 10, val 10, [\d.]+ MB on disk", summary[0])
    again = run_cli("fashion", "--out", str(tmp_path), "--limit", "1")
    assert again.returncode == 0 and "(0 files written)" in again.stderr


def test_cli_refuses_foreign_folder_in_one_line(tmp_path):
    (tmp_path / "fashion" / "train").mkdir(parents=True)
    result = run_cli("fashion", "--out", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "did not write" in result.stderr
    assert run_cli("nonsense", "--out", str(tmp_path)).returncode == 2


@pytest.mark.parametrize("is_root", [False, True])
def test_failed_download_says_what_to_run(tmp_path, monkeypatch, is_root):
    """apt-get download failing: as root, apt-get update once and retry; then a one-line
    error naming the command to run."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    log = tmp_path / "apt.log"
    (fake_bin / "apt-get").write_text(
        f'#!/bin/sh\necho "$1" >> {log}\n'
        'echo "E: Unable to locate package $2" >&2\n[ "$1" = update ] || exit 100\n')
    (fake_bin / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 0 if is_root else 1000)
    with pytest.raises(debian_packages.DebianPackageError) as err:
        debian_packages.fetch_package("mate-backgrounds", tmp_path / "cache")
    message = str(err.value)
    sudo = "" if is_root else "sudo "
    assert "\n" not in message and "Unable to locate package" in message
    assert message.endswith(f"run: {sudo}apt-get update && {sudo}apt-get install -y "
                            f"mate-backgrounds")
    calls = log.read_text().split()
    assert calls == (["download", "update", "download"] if is_root else ["download"])


def test_photos_large_cuts_the_same_tiles_and_workers_change_no_byte(tmp_path, photos_dir, debian_cache):
    """photos-large draws from the same per-class streams as photos, so its first tiles are
    photos' tiles; made by 3 worker processes they are the bytes one process wrote."""
    summary = msd.make_photos_large(tmp_path, limit=LIMIT, seed=3, progress=False, cache_dir=debian_cache, jobs=3)
    assert Path(summary["path"]).name == "photos-large" and summary["written"] > 0
    large, photos = files_of(tmp_path / "photos-large"), files_of(photos_dir)
    jpegs = [rel for rel in photos if rel.endswith(".JPEG")]
    assert jpegs and all(large[rel] == photos[rel] for rel in jpegs)
    assert set(large) == set(photos)


def test_photos_heavy_is_photos_tiles_with_grain_at_quality_97(tmp_path, photos_dir, debian_cache):
    """The same tiles (boxes and sizes) as photos, at quality 97 with a seeded grain: far more bytes
    per tile, the same ones on a second run."""
    summary = msd.make_photos_heavy(tmp_path, limit=LIMIT, seed=3, progress=False, cache_dir=debian_cache)
    heavy_dir = Path(summary["path"])
    heavy, photos = files_of(heavy_dir), files_of(photos_dir)
    jpegs = sorted(rel for rel in photos if rel.endswith(".JPEG"))
    assert jpegs == sorted(rel for rel in heavy if rel.endswith(".JPEG"))
    for rel in jpegs:
        with Image.open(io.BytesIO(heavy[rel])) as image, Image.open(io.BytesIO(photos[rel])) as photo:
            assert image.size == photo.size
    mean_bytes = lambda files: np.mean([len(files[rel]) for rel in jpegs])
    assert mean_bytes(heavy) > 2.5 * mean_bytes(photos)
    rows = lambda folder: [row[:-1] for row in csv.reader(io.StringIO((folder / "tiles.csv").read_text()))]
    assert rows(heavy_dir) == rows(photos_dir)            # the same boxes and sizes: all but the quality
    assert {row[-1] for row in csv.reader(io.StringIO((heavy_dir / "tiles.csv").read_text()))} == {"quality", "97"}
    again = msd.make_photos_heavy(tmp_path / "again", limit=LIMIT, seed=3, progress=False, cache_dir=debian_cache)
    assert files_of(Path(again["path"])) == heavy


@pytest.mark.timeout(60)
def test_a_render_worker_that_dies_is_one_line_not_a_hang(tmp_path):
    plan = {f"train/c/{i}.bin": i for i in range(64)}

    def render(job):
        if job == 40:
            os.kill(os.getpid(), signal.SIGKILL)       # what the out-of-memory killer does
        return b"x"
    with pytest.raises(generated_set.GeneratedSetError, match=r"^probe: a worker process died .* --jobs 1"):
        generated_set.write_missing(tmp_path, plan, render, "probe", progress=False, jobs=2)
    assert generated_set.write_missing(tmp_path, plan, lambda job: b"y", "probe", progress=False, jobs=2) > 0
