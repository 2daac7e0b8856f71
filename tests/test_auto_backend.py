"""`backend: auto` (pipeline/backends/auto.py): it reads only the backends that can read the data,
takes this machine's benchmark figures when it has them for every candidate, probes otherwise,
and under torchrun every rank takes rank 0's answer. The figures' folder comes with the spec
(`measured_results`), and the recipes name the one the benchmarks write to."""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import two_ranks
from pipeline import LoaderSpec, build_loader
from benchmarks.hardware import RESULTS
from pipeline.backends.auto import candidates, choose_backend
from pipeline.machine import results_path, signature
from pipeline.formats.manifest import write_manifest
from training.config import load_config

ROOT = RESULTS.parents[1]


def write_figures(directory, figures: dict[str, float], split="train", resolution=64):
    path = results_path(signature(), directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"benchmark": "loaders", "backend": name, "split": split, "resolution": resolution, "img_per_s": rate}
            for name, rate in figures.items()]
    rows.append({"benchmark": "loaders", "backend": "webdataset", "split": split, "resolution": 512, "img_per_s": 1e9})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_candidates_follow_the_data_and_randaugment(converted_sets):
    photos = converted_sets["photos"]
    assert set(candidates(LoaderSpec("auto", path=str(photos["webdataset"])))) == {"webdataset", "dali"}
    assert set(candidates(LoaderSpec("auto", path=str(photos["folder"])))) == {"folder", "dali"}
    assert set(candidates(LoaderSpec("auto", path=str(photos["ffcv"])))) == {"ffcv"}
    assert candidates(LoaderSpec("auto", path=str(photos["ffcv"]), randaugment=(1, 5))) == {}


def test_this_machines_figures_decide_when_they_cover_every_candidate(converted_sets, tmp_path):
    spec = LoaderSpec("auto", path=str(converted_sets["photos"]["webdataset"]), resolution=64)
    write_figures(tmp_path, {"webdataset": 900.0, "dali-wds": 1200.0})
    backend, why = choose_backend(spec, tmp_path)
    # The 1e9 row is at resolution 512: the figure nearest 64 counts, not the largest
    assert backend == "dali" and "dali-wds 1,200 img/s at 64" in why and results_path(signature(), tmp_path).name in why
    write_figures(tmp_path, {"webdataset": 1500.0, "dali-wds": 1200.0})
    assert choose_backend(spec, tmp_path)[0] == "webdataset"
    # the folder as a run gives it: in the spec, from the recipe's data.measured_results
    assert choose_backend(LoaderSpec("auto", path=spec.path, resolution=64, measured_results=str(tmp_path)))[0] \
        == "webdataset"
    only_ffcv, why = choose_backend(LoaderSpec("auto", path=str(converted_sets["photos"]["ffcv"])), tmp_path)
    assert only_ffcv == "ffcv" and "only installed backend" in why


def test_without_figures_a_probe_decides_and_the_loader_works(converted_sets, tmp_path):
    write_figures(tmp_path, {"webdataset": 900.0})                # dali-wds missing: not enough to decide
    spec = LoaderSpec("auto", path=str(converted_sets["photos"]["webdataset"]), split="val", val_resolution=48,
                      batch_size=8, num_workers=1)
    backend, why = choose_backend(spec, tmp_path)
    assert backend in ("webdataset", "dali") and "probe" in why and "img/s" in why
    loader = build_loader(spec)
    images, labels = next(iter(loader))
    assert loader.spec.backend in ("webdataset", "dali") and images.shape == (8, 3, 48, 48)


def test_the_recipes_point_auto_at_the_benchmarks_figures():
    """As users run it (`torchrun training/main.py --config RECIPE data.backend=auto`, from the
    repository's root): every recipe's loader spec names the folder the benchmarks write to."""
    for recipe in sorted((ROOT / "algorithms" / "recipes").glob("*.yaml")):
        spec = load_config(str(recipe), ["data.backend=auto"]).data.loader_spec("train", rank=0, world_size=1)
        assert (ROOT / spec.measured_results).resolve() == RESULTS.resolve(), recipe.name


def test_no_reader_is_a_one_line_error(tmp_path):
    write_manifest(tmp_path, {"format": "tfrecord"})
    with pytest.raises(ValueError, match="no installed backend reads this tfrecord data"):
        choose_backend(LoaderSpec("auto", path=str(tmp_path)), tmp_path)


RANKS = textwrap.dedent("""
    import json, sys, torch.distributed as dist
    from pipeline import LoaderSpec
    from pipeline.backends.auto import choose_backend
    dist.init_process_group("gloo")
    path, results, out = sys.argv[1:]
    spec = LoaderSpec("auto", path=path, split="val", val_resolution=32, batch_size=8, num_workers=1)
    answer = choose_backend(spec, results)
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(answer, f)
    dist.destroy_process_group()
""")


def test_every_rank_takes_rank_zeros_answer(converted_sets, tmp_path):
    answers = two_ranks(RANKS, tmp_path, converted_sets["photos"]["webdataset"], tmp_path / "no-results", timeout=300)
    assert answers[0] == answers[1] and "probe" in answers[0][1]
