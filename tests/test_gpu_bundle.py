"""tools/gpu_bundle.py and gpu_bundle_install.py: chunks made here install on a node, and a missing or
damaged chunk is caught.

The packing half downloads DALI and builds FFCV (internet, minutes), so it is exercised by hand
(docs/benchmarks.md); these tests give it small real wheels, install them with the real pip into a
site folder, and import them from a fresh interpreter through the env.sh it writes.
"""
from __future__ import annotations

import lzma
import secrets
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
import gpu_bundle
import gpu_bundle_install

CHUNK_BYTES = 4096          # several chunks per group, as DALI's 144 MiB makes at the default --chunk-mib


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple = ()) -> Path:
    """A minimal pure-Python wheel: the files, METADATA (with `requires` as Requires-Dist), WHEEL and RECORD."""
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    info = {f"{dist}.dist-info/METADATA": metadata,
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                       "Tag: py3-none-any\n"}
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:     # deflated, as pip's wheels are
        for member, text in {**files, **info}.items():
            archive.writestr(member, text)
        archive.writestr(f"{dist}.dist-info/RECORD", "".join(f"{m},,\n" for m in [*files, *info]) +
                         f"{dist}.dist-info/RECORD,,\n")
    return path


def make_bundle(tmp_path: Path, photo: bool = True) -> Path:
    """Two groups as `pack` lays them out: base with a wheel, a JPEG kit, a photograph and a wheel
    of a distribution this Python already has (pytest); dali with an `nvidia.*` namespace wheel."""
    base, dali = tmp_path / "src" / "base", tmp_path / "src" / "dali"
    for folder in (base, dali):
        folder.mkdir(parents=True)
    # random hex: xz halves it, no more, so each group still needs several chunks
    make_wheel(base, "probe-base", "1.0", {
        "probe_base/__init__.py": f"VALUE = 'base'\n# {secrets.token_hex(5000)}\n"})
    make_wheel(base, "pytest", "0.0.1", {"pytest_shadow_probe/__init__.py": ""})
    (base / "jpeg-kit" / "usr" / "include").mkdir(parents=True)
    (base / "jpeg-kit" / "usr" / "include" / "jpeglib.h").write_text("/* kit */\n")
    if photo:
        path = base / "photos" / "mate-backgrounds" / "usr" / "share" / "Aqua.jpg"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"\xff\xd8 not decoded here \xff\xd9")
    make_wheel(dali, "probe-dali", "2.0", {
        "nvidia/__init__.py": "raise ImportError('hides the node')\n",
        "nvidia/probe_dali/__init__.py": f"VALUE = 'dali'\n# {secrets.token_hex(7000)}\n"})
    out = tmp_path / "bundle"
    gpu_bundle.write_bundle(out, {"base": (base, ["probe_base"]), "dali": (dali, ["nvidia.probe_dali"])},
                            CHUNK_BYTES, python="3.x", cuda="13")
    return out


@pytest.fixture()
def bundle(tmp_path) -> Path:
    return make_bundle(tmp_path)


def install(bundle: Path, site: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bundle.py"), "install", str(bundle),
                           "--site", str(site), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)


def imported(site: Path, code: str) -> str:
    """stdout of `code` in a fresh interpreter after `source site/env.sh`."""
    result = subprocess.run(["bash", "-c", f"source {site}/env.sh && {sys.executable} -c \"{code}\""],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.timeout(180)
def test_the_chunks_install_into_a_site_that_env_sh_makes_importable(bundle, tmp_path):
    manifest = gpu_bundle_install.read_manifest(bundle)
    assert [len(g["chunks"]) > 1 for g in manifest["groups"].values()] == [True, True], manifest
    # the transfers carry every chunk once, in order, base first, none over its limit; dali's first
    # chunk fills what base's last transfer had left
    chunks = [c for g in manifest["groups"].values() for c in g["chunks"]]
    assert [name for transfer in manifest["transfers"] for name in transfer] == [c["name"] for c in chunks]
    size = {c["name"]: c["size"] for c in chunks}
    assert all(sum(size[n] for n in transfer) <= CHUNK_BYTES for transfer in manifest["transfers"])
    assert manifest["transfers"][len(manifest["groups"]["base"]["chunks"]) - 1][-1] == "dali.tar.xz.00"
    assert sum(size[n] for n in manifest["transfers"][0]) == CHUNK_BYTES
    assert (bundle / "base.tar.xz.00").read_bytes()[:6] == b"\xfd7zXZ\x00"
    site, root = tmp_path / "site", tmp_path / "repo"
    result = install(bundle, site, root)
    assert result.returncode == 0, result.stderr
    assert "import probe_base: ok" in result.stderr and "import nvidia.probe_dali: ok" in result.stderr
    assert imported(site, "import probe_base, nvidia.probe_dali; print(probe_base.VALUE, nvidia.probe_dali.VALUE)") \
        == "base dali"
    # the node's own pytest is not shadowed, and no namespace __init__ hides the node's nvidia.*
    assert not list((site / "base").glob("pytest-0.0.1*")) and (site / "base" / "probe_base").is_dir()
    assert not (site / "dali" / "nvidia" / "__init__.py").exists()
    assert (root / "data" / "sample" / ".debian" / "mate-backgrounds" / "usr" / "share" / "Aqua.jpg").is_file()
    env_sh = (site / "env.sh").read_text()
    assert f"CPATH=\"{site}/base/jpeg-kit/usr/include" in env_sh and str(root) in env_sh, env_sh

    again = install(bundle, site, root)             # after the next transfer: nothing new to do
    assert again.returncode == 0 and "base: already installed" in again.stderr, again.stderr

    # with env.sh sourced, site's own copies are on the path: they do not count as the node's
    probe = ("from pathlib import Path; import gpu_bundle_install; "
             f"print(*(gpu_bundle_install.node_has(Path(n), Path('{site}')) for n in "
             "('probe_base-1.0-py3-none-any.whl', 'pytest-0.0.1-py3-none-any.whl')))")
    result = subprocess.run(["bash", "-c", f"source {site}/env.sh && PYTHONPATH=tools:$PYTHONPATH {sys.executable} -c \"{probe}\""],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.stdout.split() == ["False", "True"], result.stderr[-2000:]


@pytest.mark.timeout(180)
def test_a_missing_chunk_leaves_its_group_out_and_a_damaged_one_is_named(bundle, tmp_path):
    site, root = tmp_path / "site", tmp_path / "repo"
    last = bundle / gpu_bundle_install.read_manifest(bundle)["groups"]["dali"]["chunks"][-1]["name"]
    kept = last.read_bytes()
    last.unlink()                                   # its transfer has not come yet
    result = install(bundle, site, root)
    assert result.returncode == 0, result.stderr
    assert f"missing {last.name}" in result.stderr and not (site / "dali").exists()
    assert imported(site, "import probe_base; print(probe_base.VALUE)") == "base"

    last.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))     # one bit flipped in transit
    result = install(bundle, site, root)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and str(last) in errors[0], result.stderr
    assert not (site / "dali").exists()
    assert imported(site, "import probe_base; print(probe_base.VALUE)") == "base"    # what was there stays


def test_wheels_are_stored_whole_and_either_xz_gives_what_tarfile_reads(tmp_path):
    wheel = make_wheel(tmp_path, "probe-stored", "1.0", {"probe_stored/__init__.py": "VALUE = 1\n" * 500})
    with zipfile.ZipFile(wheel) as before:
        files = {info.filename: before.read(info) for info in before.infolist()}
        assert {info.compress_type for info in before.infolist()} == {zipfile.ZIP_DEFLATED}
    gpu_bundle.store_wheel(wheel)
    with zipfile.ZipFile(wheel) as after:
        assert {info.compress_type for info in after.infolist()} == {zipfile.ZIP_STORED}
        assert {info.filename: after.read(info) for info in after.infolist()} == files
    tar_path = tmp_path / "group.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(wheel, arcname=wheel.name)
    for index, program in enumerate((shutil.which("xz"), None)):    # the xz program where it is, then lzma
        target = tmp_path / f"group-{index}.tar.xz"
        gpu_bundle.compress_xz(tar_path, target, program=program)
        assert lzma.decompress(target.read_bytes()) == tar_path.read_bytes()
        with tarfile.open(target) as tar:
            assert tar.getnames() == [wheel.name]


def test_a_manifest_of_an_older_format_asks_to_pack_again(tmp_path):
    (tmp_path / "MANIFEST.json").write_text('{"format": 2, "groups": {}}')
    result = install(tmp_path, tmp_path / "site", tmp_path)
    assert result.returncode == 2 and "not a gpu_bundle manifest of format 3; pack it again" in result.stderr


def test_a_folder_without_the_manifest_is_one_line_naming_it(tmp_path):
    (tmp_path / "base.tar.xz.00").write_bytes(b"chunk")
    result = install(tmp_path, tmp_path / "site", tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == \
        f"error: no MANIFEST.json in {tmp_path}: copy it with the chunks", result.stderr


@pytest.mark.timeout(180)
def test_pack_completes_a_group_with_what_its_wheels_require_on_the_node(tmp_path, monkeypatch):
    """`complete` with the real pip, against a local folder of wheels instead of the index."""
    links, dest = tmp_path / "links", tmp_path / "dest"
    links.mkdir(), dest.mkdir()
    make_wheel(dest, "app", "1.0", {"app/__init__.py": ""}, requires=(
        "dep-a>=1", "torch", "nvidia-libnvcomp-cu13==5.3", "dep-windows; sys_platform == 'win32'",
        "dep-old-python; python_version < '3.11'", "dep-extra; extra == 'dev'",
        "dep-new-python; python_version >= '3.12'"))
    make_wheel(links, "dep-a", "1.2", {"dep_a/__init__.py": ""}, requires=("dep_b",))
    for name in ("dep-b", "dep-c", "dep-windows", "dep-old-python", "dep-extra", "dep-new-python"):
        make_wheel(links, name, "1.0", {f"{name.replace('-', '_')}/__init__.py": ""})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    gpu_bundle.complete(dest, "3.12")
    assert sorted(gpu_bundle_install.distribution(w) for w in dest.glob("*.whl")) == [
        "app", "dep-a", "dep-b", "dep-new-python"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_wheel(elsewhere, "app", "1.0", {"app/__init__.py": ""}, requires=("dep-a", "dep-c"))
    gpu_bundle.complete(elsewhere, "3.11", {"dep-a", "dep-b"})   # another group holds them
    assert sorted(gpu_bundle_install.distribution(w) for w in elsewhere.glob("*.whl")) == ["app", "dep-c"]
