"""Data as users hold it (pipeline/convert/sources/): the same images as an ImageNet-layout folder,
as ImageNet's official tars with a devkit whose IDs are not the sorted-WNID order, in Kaggle's
layout, as Hugging Face parquet, as another tool's WebDataset tars and as lists, each written from
real JPEGs (benchmarks/source_forms.py). Each form gives every image the folder form's label,
matched image by image, through both converters; nothing is extracted anywhere; the tar and
parquet forms convert from an S3 bucket and a web server; bad input is one line naming the file and
the member or row."""
from __future__ import annotations

import collections
import hashlib
import io
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.source_forms import write_devkit, write_forms, wnids
from conftest import read_manifest, run_tool_here

CLASSES = ["ant", "bee", "crème"]         # sorted
PER_CLASS = {"train": 4, "val": 2}
FIRST_LINE = {"imagefolder": "ImageNet-layout folder", "imagenet": "ImageNet's official files", "kaggle": "Kaggle's",
              "parquet": "Hugging Face image-classification parquet", "webdataset": "WebDataset tars",
              "list": "lists of images"}


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = (np.linspace(0, 200, 64)[None, :, None] + rng.integers(0, 55, (48, 64, 3))).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """{form: SRC} for the folder form ('imagefolder') and every other form, of the same 18 images."""
    root = tmp_path_factory.mktemp("forms")
    folder, seed = root / "imagefolder", 0
    for split, count in PER_CLASS.items():
        for name in CLASSES:
            for _ in range(count):
                path = folder / split / name / f"{seed:03d}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(jpeg(seed))
                seed += 1
    return {"imagefolder": folder, **write_forms(folder, root)}


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def wds_labels(out: Path) -> dict[str, tuple[str, int]]:
    """{sha1 of a stored JPEG: (split, label)} of a webdataset conversion, read with tarfile."""
    found = {}
    for split in ("train", "val"):
        for shard in sorted((out / split).glob("*.tar")):
            with tarfile.open(shard) as tar:
                members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
            for name, data in members.items():
                if name.endswith(".jpg"):
                    found[hashlib.sha1(data).hexdigest()] = (split, int(members[name[:-4] + ".cls"]))
    return found


def ffcv_labels(out: Path) -> dict[str, tuple[str, int]]:
    """{sha1 of a stored image: (split, label)} of an FFCV conversion, from FFCV's own reader."""
    import pipeline.formats.ffcv_import  # noqa: F401
    from ffcv.reader import Reader
    found = {}
    for split in ("train", "val"):
        reader = Reader(str(out / f"{split}.beton"))
        data = np.memmap(out / f"{split}.beton", np.uint8, "r")
        for row, allocation in enumerate(reader.alloc_table):
            index = int(allocation["sample_id"])
            image = bytes(data[allocation["ptr"]:allocation["ptr"] + allocation["size"]])
            found[hashlib.sha1(image).hexdigest()] = (split, int(reader.metadata["f1"][index]))
    return found


@pytest.mark.parametrize("script,read_labels", [("convert_wds.py", wds_labels), ("convert_ffcv.py", ffcv_labels)])
def test_every_form_gives_each_image_the_folder_forms_label(script, read_labels, forms, tmp_path, capsys, monkeypatch):
    spare_tmp = tmp_path / "tmp"
    spare_tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(spare_tmp))
    before = {form: tree(src) for form, src in forms.items()}
    labels = {}
    for form, src in forms.items():
        result = run_tool_here(capsys, script, src, tmp_path / form, "--num-workers", 1, check=True)
        first = result.stderr.splitlines()[0]
        assert first.startswith(f"{src}: ") and FIRST_LINE[form] in first, first
        manifest = read_manifest(tmp_path / form)
        assert manifest["source_form"] == form and manifest["counts"] == {"train": 12, "val": 6}
        labels[form] = read_labels(tmp_path / form)
    for form in forms:
        assert labels[form] == labels["imagefolder"], form
    assert collections.Counter(labels["imagefolder"].values()) == collections.Counter(
        {(split, label): count for split, count in PER_CLASS.items() for label in range(3)})
    # The classes are the sorted WNIDs where the form has WNIDs, and their names the devkit's words
    imagenet = read_manifest(tmp_path / "imagenet")
    assert imagenet["classes"] == sorted(wnids(CLASSES).values()) and imagenet["class_names"] == CLASSES
    assert read_manifest(tmp_path / "parquet")["class_names"] == CLASSES
    # Read in place: every source as it was, and nothing written beside it or in the temp folder
    assert {form: tree(src) for form, src in forms.items()} == before
    assert not any(spare_tmp.iterdir())


def test_webdataset_labels_given_as_class_names_in_json_are_the_sorted_names_places(forms, tmp_path, capsys):
    from benchmarks.source_forms import folder_images, write_webdataset
    splits = {split: folder_images(forms["imagefolder"], split) for split in ("train", "val")}
    write_webdataset(splits, CLASSES, tmp_path / "json", per_shard=5, label_key="class")
    run_tool_here(capsys, "convert_wds.py", forms["imagefolder"], tmp_path / "folder", check=True)
    run_tool_here(capsys, "convert_wds.py", tmp_path / "json", tmp_path / "out", "--label-key", "class", check=True)
    assert wds_labels(tmp_path / "out") == wds_labels(tmp_path / "folder")
    assert read_manifest(tmp_path / "out")["classes"] == CLASSES
    assert read_manifest(tmp_path / "out")["source_options"] == {"label_key": "class"}
    missing = run_tool_here(capsys, "convert_wds.py", tmp_path / "json", tmp_path / "no-key", "--splits", "val")
    assert missing.returncode == 2 and "no image files in val" in missing.stderr
    assert "no label (.cls, or .json with --label-key)" in missing.stderr


def test_the_devkits_ids_are_not_the_sorted_order_so_the_labels_above_check_the_mapping(forms):
    from scipy.io import loadmat
    with tarfile.open(forms["imagenet"] / "ILSVRC2012_devkit_t12.tar.gz") as kit:
        meta = kit.extractfile("ILSVRC2012_devkit_t12/data/meta.mat").read()
    synsets = loadmat(io.BytesIO(meta), squeeze_me=True)["synsets"]
    leaves = sorted((int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets if int(s["num_children"]) == 0)
    assert [wnid for _, wnid in leaves] != sorted(wnid for _, wnid in leaves)


def test_the_first_line_names_the_form_and_what_is_not_labelled_is_said(forms, tmp_path, capsys):
    result = run_tool_here(capsys, "convert_wds.py", forms["kaggle"], tmp_path / "out", check=True)
    lines = result.stderr.splitlines()
    assert "Kaggle" in lines[0] and "test: 3 images without labels" in lines[1], lines[:3]
    result = run_tool_here(capsys, "convert_wds.py", forms["parquet"], tmp_path / "pq", check=True)
    assert "parquet" in result.stderr.splitlines()[0] and "test files, labelled -1" in result.stderr


def test_a_source_of_no_form_or_of_two_is_one_line_saying_what_was_found(forms, tmp_path, capsys):
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"{i}.jpg").write_bytes(jpeg(i))
    result = run_tool_here(capsys, "convert_wds.py", flat, tmp_path / "out")
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and line.startswith(f"error: {flat}: no known source form")
    assert "3 image files" in line and "closest: imagefolder" in line and "list" in line

    both = tmp_path / "both"
    shutil.copytree(forms["imagefolder"], both)
    (both / "train.csv").write_text("path,label\ntrain/ant/000.jpg,ant\n")
    result = run_tool_here(capsys, "convert_wds.py", both, tmp_path / "out")
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and "more than one source form" in line and "--source-format" in line
    assert "imagefolder: " in line and "list: train.csv" in line
    forced = run_tool_here(capsys, "convert_wds.py", both, tmp_path / "out", "--source-format", "list",
                           "--splits", "train", check=True)
    assert read_manifest(tmp_path / "out")["counts"] == {"train": 1} and "lists of images" in forced.stderr


def rewritten_tar(path: Path, change) -> None:
    """The tar at `path` written again with change(name, data) for each member: new data, or
    None to leave it out; change(None, None) may return more (name, data) to add at the end."""
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [*members, *(change(None, None) or [])]:
            data = change(name, data) if name in dict(members) else data
            if data is not None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def official(forms, tmp_path) -> Path:
    return Path(shutil.copytree(forms["imagenet"], tmp_path / "imagenet"))


def one_error(result) -> str:
    """The run's error line; it exited 2 and wrote nothing."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    return errors[0]


def test_a_class_tar_truncated_or_not_a_tar_is_skipped_with_why_or_stops_a_strict_run(forms, tmp_path, capsys):
    src = official(forms, tmp_path)
    ant, bee = (f"{wnids(CLASSES)[name]}.tar" for name in ("ant", "bee"))
    rewritten_tar(src / "ILSVRC2012_img_train.tar",
                  lambda name, data: data[:1024] if name == ant else b"no tar here " * 100
                  if name == bee else data)
    out = tmp_path / "out"
    result = run_tool_here(capsys, "convert_wds.py", src, out, "--num-workers", 1, check=True)
    manifest = read_manifest(out)
    reasons = {skip["path"]: skip["reason"] for skip in manifest["skipped"]}
    train = f"{src / 'ILSVRC2012_img_train.tar'}"
    assert "truncated" in reasons[f"{train}:{ant}"] and "rest of it is skipped" in reasons[f"{train}:{ant}"]
    assert "not a tar" in reasons[f"{train}:{bee}"]
    assert manifest["counts"]["train"] == 4 and f"skipped {train}:{bee}: " in result.stderr

    strict = run_tool_here(capsys, "convert_wds.py", src, tmp_path / "strict", "--strict")
    line = one_error(strict)
    assert f"{train}:{ant}" in line and "--strict" in line
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize("case", ["val image without a line", "more lines than images", "unreadable meta.mat",
                                  "an id of no leaf"])
def test_a_devkit_that_does_not_match_the_val_tar_is_one_line_and_nothing_is_written(case, forms, tmp_path, capsys):
    src = official(forms, tmp_path)
    kit, val = src / "ILSVRC2012_devkit_t12.tar.gz", src / "ILSVRC2012_img_val.tar"
    val_wnids = [wnids(CLASSES)[name] for name in CLASSES for _ in range(PER_CLASS["val"])]
    if case == "val image without a line":
        rewritten_tar(val, lambda name, data: [("ILSVRC2012_val_00000007.JPEG", jpeg(99))] if name is None else data)
        expected = f"{val}:ILSVRC2012_val_00000007.JPEG: has no line in the devkit's ground truth (6 lines)"
    elif case == "more lines than images":
        write_devkit(kit, val_wnids + val_wnids[:1], CLASSES)
        expected = "data/ILSVRC2012_validation_ground_truth.txt: 7 lines for 6 images in"
    elif case == "unreadable meta.mat":
        rewritten_tar_gz(kit, lambda name, data: b"MATLAB 5.0 but not really" if name.endswith("meta.mat") else data)
        expected = f"{kit}:data/meta.mat: unreadable"
    else:
        rewritten_tar_gz(kit, lambda name, data: b"1\n99\n" + data.split(b"\n", 2)[2]
                         if name.endswith("ground_truth.txt") else data)
        expected = "ground_truth.txt: line 2: '99' is no ILSVRC2012_ID of a leaf synset"
    line = one_error(run_tool_here(capsys, "convert_wds.py", src, tmp_path / "out"))
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def rewritten_tar_gz(path: Path, change) -> None:
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            data = change(name, data)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_links_and_paths_that_climb_out_are_refused_and_nothing_is_extracted(forms, tmp_path, capsys):
    src = official(forms, tmp_path)
    ant = f"{wnids(CLASSES)['ant']}.tar"

    def with_bad_members(name, data):
        if name != ant:
            return data
        inner = tmp_path / "inner.tar"
        inner.write_bytes(data)
        with tarfile.open(inner, "a") as tar:
            link = tarfile.TarInfo("n01000000_98.JPEG")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(link)
            escape = tarfile.TarInfo("../../n01000000_99.JPEG")
            escape.size = len(jpeg(98))
            tar.addfile(escape, io.BytesIO(jpeg(98)))
        return inner.read_bytes()
    rewritten_tar(src / "ILSVRC2012_img_train.tar", with_bad_members)
    before = tree(tmp_path)
    run_tool_here(capsys, "convert_wds.py", src, tmp_path / "out", "--num-workers", 1, check=True)
    manifest = read_manifest(tmp_path / "out")
    reasons = {skip["path"].rsplit(":", 1)[-1]: skip["reason"] for skip in manifest["skipped"]}
    assert reasons["n01000000_98.JPEG"].startswith("refused: a link")
    assert reasons["../../n01000000_99.JPEG"] == "refused: its path leads out of the tar"
    assert manifest["counts"]["train"] == 12
    assert {name for name in tree(tmp_path) if name not in before and not name.startswith("out")} == set()


def test_bad_rows_of_a_list_or_a_parquet_of_another_schema_are_one_line_naming_file_and_row(forms, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    lists = Path(shutil.copytree(forms["list"], tmp_path / "list"))
    (lists / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    val = (lists / "val.csv").read_text().splitlines()
    path = val[2].rsplit(",", 1)[0]
    for row, expected in ((path + ",3", "val.csv: line 3: label 3 is out of range"),
                          (path + ",wasp", "val.csv: line 3: class 'wasp' is not in the class list")):
        (lists / "val.csv").write_text("\n".join([*val[:2], row, *val[3:]]) + "\n")
        line = one_error(run_tool_here(capsys, "convert_wds.py", lists, tmp_path / "out"))
        assert f"{lists}/{expected}" in line, line

    other = tmp_path / "other" / "data"
    other.mkdir(parents=True)
    pq.write_table(pa.table({"img": [b"x"], "target": [1]}), other / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"img": [b"x"], "target": [1]}), other / "validation-00000-of-00001.parquet")
    line = one_error(run_tool_here(capsys, "convert_ffcv.py", other.parent, tmp_path / "out"))
    assert f"{other}/train-00000-of-00001.parquet: columns ['img', 'target']" in line, line
    assert not (tmp_path / "out").exists()


def test_a_kaggle_val_image_the_solution_does_not_label_is_one_line(forms, tmp_path, capsys):
    src = Path(shutil.copytree(forms["kaggle"], tmp_path / "kaggle"))
    extra = src / "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000099.JPEG"
    extra.write_bytes(jpeg(1))
    line = one_error(run_tool_here(capsys, "convert_ffcv.py", src, tmp_path / "out"))
    assert f"{src / 'LOC_val_solution.csv'}: no row for ILSVRC2012_val_00000099 ({extra})" in line, line


def shard_bytes(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "manifest.json"}


@pytest.mark.timeout(120)
def test_the_tar_and_parquet_forms_convert_from_a_bucket_and_a_web_server_as_from_disk(forms, bucket, tmp_path,
                                                                                        capsys):
    from benchmarks.loopback_servers import Nginx
    client, name = bucket
    for form in ("imagenet", "parquet"):
        for path in forms[form].rglob("*"):
            if path.is_file():
                client.upload_file(str(path), name, f"{form}/{path.relative_to(forms[form])}")
    server = Nginx(forms["imagenet"].parent, tmp_path / "nginx")
    try:
        for form, url in (("imagenet", f"s3://{name}/imagenet"), ("parquet", f"s3://{name}/parquet"),
                          ("imagenet", f"{server.url}/imagenet")):
            local, remote = tmp_path / f"{form}-local", tmp_path / f"{form}-{url.split(':')[0]}"
            run_tool_here(capsys, "convert_wds.py", forms[form], local, "--num-workers", 2, check=True)
            result = run_tool_here(capsys, "convert_wds.py", url, remote, "--num-workers", 2, check=True)
            assert result.stderr.startswith(f"{url}: {FIRST_LINE[form]}"), result.stderr[:300]
            assert shard_bytes(remote) == shard_bytes(local), url
            assert read_manifest(remote)["source"] == url and read_manifest(remote)["source_form"] == form
        # FFCV's writer processes read through the process that holds the store's client
        run_tool_here(capsys, "convert_ffcv.py", f"s3://{name}/parquet", tmp_path / "ffcv", "--num-workers", 2,
                      check=True)
        run_tool_here(capsys, "convert_ffcv.py", forms["parquet"], tmp_path / "ffcv-local", "--num-workers", 1,
                      check=True)
        assert ffcv_labels(tmp_path / "ffcv") == ffcv_labels(tmp_path / "ffcv-local")
    finally:
        server.stop()


def test_a_shard_converted_from_the_official_tars_is_repaired_from_them_byte_for_byte(forms, tmp_path, capsys):
    from conftest import flip
    out = tmp_path / "out"
    run_tool_here(capsys, "convert_wds.py", forms["imagenet"], out, "--num-workers", 1, check=True)
    shard = out / "train" / "shard-000000.tar"
    sound = shard.read_bytes()
    flip(shard, len(sound) // 2)
    result = run_tool_here(capsys, "verify_dataset.py", out, "--repair", forms["imagenet"], "--num-workers", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shard.read_bytes() == sound


def test_tar_members_lie_where_their_headers_say_nested_long_names_included(tmp_path):
    from pipeline.formats.tar_members import TarDamaged, tar_members
    long_name = "a" * 120 + ".JPEG"
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in (("x.JPEG", b"first"), (long_name, b"second member")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    outer = tmp_path / "outer.tar"
    with tarfile.open(outer, "w") as tar:
        info = tarfile.TarInfo("inner.tar")
        info.size = len(inner.getvalue())
        tar.addfile(info, io.BytesIO(inner.getvalue()))
    data = outer.read_bytes()

    def read_at(offset, size):
        return data[offset:offset + size]
    [holder] = tar_members(read_at, 0, len(data), "outer.tar")
    members = list(tar_members(read_at, holder.data_at, holder.size, "inner.tar"))
    assert [(m.name, data[m.data_at:m.data_at + m.size]) for m in members] == \
        [("x.JPEG", b"first"), (long_name, b"second member")]
    with pytest.raises(TarDamaged, match="truncated"):
        list(tar_members(read_at, holder.data_at, members[1].data_at - holder.data_at + 4, "inner.tar"))


def test_samples_put_in_any_order_come_back_in_the_write_order_with_bounded_buckets(tmp_path, monkeypatch):
    from pipeline.convert import reorder
    monkeypatch.setattr(reorder, "BUCKET_BYTES", 100)
    places = np.random.default_rng(0).permutation(57)
    buffer = reorder.Reorder(tmp_path / "buckets", 57, mean_bytes=10)
    for place in places.tolist():
        buffer.put(place, 100 + place, f"sample {place}".encode(), place % 2)
    assert buffer.buckets == 6 and len(list((tmp_path / "buckets").glob("bucket-??????"))) == 6
    assert list(buffer.taken()) == [(place, 100 + place, place % 2, f"sample {place}".encode()) for place in range(57)]
    assert not any((tmp_path / "buckets").iterdir())


def test_kaggles_cls_loc_folder_given_as_src_is_not_taken_for_a_folder_with_an_empty_val(forms, tmp_path, capsys):
    cls_loc = forms["kaggle"] / "ILSVRC/Data/CLS-LOC"
    line = one_error(run_tool_here(capsys, "convert_wds.py", cls_loc, tmp_path / "out"))
    assert f"{cls_loc / 'val'}: 6 files and no class folders" in line and "LOC_val_solution.csv" in line


def test_one_parquet_file_a_split_as_to_parquet_writes_it_converts_as_the_hubs_layout(forms, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    single = tmp_path / "single"
    single.mkdir()
    for split in ("train", "validation"):
        parts = sorted((forms["parquet"] / "data").glob(f"{split}-*.parquet"))
        pq.write_table(pa.concat_tables([pq.read_table(part) for part in parts]), single / f"{split}.parquet")
    run_tool_here(capsys, "convert_wds.py", forms["parquet"], tmp_path / "hub", check=True)
    run_tool_here(capsys, "convert_wds.py", single, tmp_path / "out", check=True)
    assert read_manifest(tmp_path / "out")["counts"] == {"train": 12, "val": 6}
    assert wds_labels(tmp_path / "out") == wds_labels(tmp_path / "hub")
