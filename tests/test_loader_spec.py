"""LoaderSpec validation and defaults, the factory's errors, and the synthetic backend."""
import subprocess
import sys
import textwrap

import pytest
import torch

from pipeline import LoaderSpec, build_loader


def test_spec_rejects_bad_values_with_the_key_named():
    for kwargs, message in [({"backend": "fcv"}, "unknown loader backend 'fcv'"),
                            ({"backend": "ffcv"}, "needs a path"),
                            ({"backend": "synthetic", "split": "test"}, "split"),
                            ({"backend": "synthetic", "colout": (1.0, 0.1)}, "colout"),
                            ({"backend": "synthetic", "on_corrupt": "ignore"}, "on_corrupt"),
                            ({"backend": "synthetic", "rank": 2, "world_size": 2}, "rank"),
                            ({"backend": "synthetic", "resolution": {"form": "ffcv", "min": 1}}, "unknown keys")]:
        with pytest.raises(ValueError, match=message):
            LoaderSpec(**kwargs)


def test_spec_defaults():
    train, val = LoaderSpec("synthetic"), LoaderSpec("synthetic", split="val")
    assert (train.rank, train.world_size, train.drop_last, val.drop_last) == (0, 1, True, False)


def test_synthetic_loader_follows_schedule_colout_and_resumes():
    spec = LoaderSpec("synthetic", batch_size=8, synthetic_size=100, dtype=torch.bfloat16, colout=(0.25, 0.5),
                      resolution={"form": "ffcv", "min_res": 64, "max_res": 128, "start_ramp": 0, "end_ramp": 2})
    loader = build_loader(spec)
    assert len(loader) == 12  # 100 // 8, the last partial batch dropped in training
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 48, 32) and images.dtype == torch.bfloat16
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64 and labels.shape == (8,)
    loader.set_epoch(2)
    assert loader.resolution == (96, 64) and next(iter(loader))[0].shape[2:] == (96, 64)

    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    resumed = build_loader(spec)
    resumed.load_state_dict(loader.state_dict())
    assert sum(1 for _ in resumed) == 12 - 5
    assert len(build_loader(LoaderSpec("synthetic", split="val", batch_size=8, synthetic_size=100))) == 13


def test_rank_and_world_size_come_from_torchrun(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, torch.distributed as dist
        from pipeline import LoaderSpec, build_loader
        dist.init_process_group("gloo")
        spec = LoaderSpec("synthetic", batch_size=10, synthetic_size=100)
        assert (spec.rank, spec.world_size) == (int(os.environ["RANK"]), 2), (spec.rank, spec.world_size)
        assert len(build_loader(spec)) == 5
        dist.destroy_process_group()
    """))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--standalone", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_epoch_length_of_a_converted_format_on_an_unconverted_folder_names_the_converter(tmp_path):
    """An epoch's length is read before any loader is built; for ffcv and webdataset it comes from
    the converter's manifest, so a plain image folder gets the converter's command, not a scan."""
    from pipeline import batches_per_epoch
    from pipeline.errors import DatasetError
    from pipeline.formats.converted import CONVERTERS
    (tmp_path / "train" / "apple").mkdir(parents=True)
    for backend, converter in CONVERTERS.items():
        with pytest.raises(DatasetError, match=r"manifest\.json: missing") as caught:
            batches_per_epoch(LoaderSpec(backend, path=str(tmp_path)))
        assert converter in str(caught.value)
