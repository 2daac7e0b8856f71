"""The offline set-up's answers to a bad request, which must be one line each, tools/ffcv_wheel.sh's
too. (The whole path,
`make wheelhouse` then `WHEELHOUSE=DIR tools/bootstrap.sh` from a fresh clone with no index,
downloads about 0.9 GB and builds FFCV and Pillow-SIMD: it is run by hand, README says with
what result; so is tools/ffcv_wheel.sh's build, docs/setup.md says with what result.)"""
import shutil
import subprocess

from conftest import ROOT


def run(command, **env):
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", **env})


def test_wheelhouse_rejects_an_unknown_torch_build_and_a_file_as_folder(tmp_path):
    result = run(["bash", str(ROOT / "tools" / "wheelhouse.sh"), str(tmp_path / "wh"), "rocm"])
    assert result.returncode == 2 and result.stderr.strip() == (
        "[wheelhouse] error: TORCH=rocm: use cpu or a CUDA build of torch such as cu126, cu128, cu130")
    (tmp_path / "file").write_text("")
    result = run(["bash", str(ROOT / "tools" / "wheelhouse.sh"), str(tmp_path / "file")])
    assert result.returncode == 2 and "exists and is not a folder" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "wh").exists()


def test_offline_bootstrap_names_a_missing_wheelhouse(tmp_path):
    """In a copy of the set-up files (a fresh .venv there, nothing installed into it)."""
    for name in ("tools/bootstrap.sh", "tools/setup_specs.sh", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    result = run(["bash", str(tmp_path / "tools" / "bootstrap.sh")], WHEELHOUSE=str(tmp_path / "nowhere"))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[bootstrap] error: WHEELHOUSE={tmp_path / 'nowhere'}: no such folder (make it with: make wheelhouse WHEELHOUSE=DIR)")


def test_ffcv_wheel_names_a_missing_interpreter_library_or_folder_before_writing(tmp_path):
    script, out = str(ROOT / "tools" / "ffcv_wheel.sh"), tmp_path / "wheels"
    cases = [([], {}, "[ffcv-wheel] error: usage: bash tools/ffcv_wheel.sh OUT_DIR [PYTHON]"),
             ([str(out), "python9.9"], {}, "[ffcv-wheel] error: no interpreter python9.9"),
             ([str(out)], {"PKG_CONFIG_LIBDIR": str(tmp_path / "none")},
              "[ffcv-wheel] error: pkg-config finds no libturbojpeg: install libturbojpeg0-dev libopencv-dev "
              "pkg-config libjpeg-dev zlib1g-dev")]
    for args, env, message in cases:
        result = run(["bash", script, *args], **env)
        assert result.returncode == 2 and result.stderr.strip() == message, result.stderr
    assert not out.exists()
    (tmp_path / "file").write_text("")
    result = run(["bash", script, str(tmp_path / "file" / "wheels")])
    assert result.returncode == 2 and result.stderr.strip() == \
        f"[ffcv-wheel] error: cannot make the folder {tmp_path / 'file' / 'wheels'}"
