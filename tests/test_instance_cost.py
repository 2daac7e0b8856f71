"""tools/instance_cost.py: a recipe's hours and dollars per instance and loader, from the figures
in a results folder, a catalog and its overrides; the loader's scaling rows from a real run of
the loader benchmark at 1 and 2 vCPUs."""
from __future__ import annotations

import csv
import json

import pytest

import instance_cost
from benchmarks.instance_catalog import CATALOG, FIELDS, CatalogError, load_catalog
from benchmarks.measured_figures import LoaderRates, along_cores, gpu_model, result_rows
from conftest import ROOT, loaders_here

H100 = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_isa": "avx512", "cpu_cores": 16,
        "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 1}
XEON_VM = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_isa": "avx512", "cpu_cores": 4, "gpu_model": "",
           "gpu_count": 0}
TWO_SIDES = f"""base: {ROOT / 'algorithms' / 'recipes' / 'resnet50_baseline.yaml'}
max_duration: 4ep
eval_interval: 2ep
algorithms:
  progressive_resizing: {{mode: loader, initial_scale: 0.5, delay_fraction: 0.5, finetune_fraction: 0.5}}
"""
TEST_INSTANCE = {"name": "test.4gpu", "cloud": "aws", "region": "us-east-1", "gpu_model": "H100-80GB",
                 "gpu_count": "4", "gpu_memory_gib": "80", "vcpus": "12", "cpu": "Intel Xeon Platinum 8488C",
                 "cpu_isa": "avx512", "memory_gib": "512", "local_nvme_gb": "8000", "network_gbps": "100",
                 "on_demand_usd_per_h": "40", "spot_usd_per_h": "", "price_source": "a test",
                 "price_date": "2026-01-01", "spec_source": "a test"}


def write_csv(path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def model_row(side, step, rate, precision="bf16"):
    return {"benchmark": "models", "model": "resnet50", "resolution": side, "precision": precision,
            "channels_last": True, "compile": False, "step": step, "device": "cuda", "img_per_s": rate,
            "hardware": H100}


def loader_row(split, side, cores, rate):
    return {"benchmark": "loaders", "backend": "webdataset", "split": split, "resolution": side, "cores": cores,
            "workers": cores, "device": "cpu", "img_per_s": rate, "hardware": XEON_VM, "unix_time": 1}


@pytest.fixture
def figures(tmp_path):
    """A results folder: an H100's model-bound rates at 112 and 224 px, a Xeon's loader at 2 and 4 vCPUs."""
    rows = [model_row(112, "train", 10_000), model_row(224, "train", 2_000), model_row(224, "eval", 7_000),
            model_row(224, "train", 2_500, "fp16"),
            loader_row("train", 112, 2, 4_000), loader_row("train", 112, 4, 8_000),
            loader_row("train", 224, 2, 3_000), loader_row("train", 224, 4, 5_000),
            loader_row("val", 224, 2, 1_000), loader_row("val", 224, 4, 3_000)]
    results = tmp_path / "results"
    results.mkdir()
    (results / "machines.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "two_sides.yaml").write_text(TWO_SIDES)
    return tmp_path


def run(capsys, *args) -> tuple[int, str, str]:
    code = instance_cost.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def cost_args(figures, *extra):
    return ["--config", figures / "two_sides.yaml", "--dataset", "12000,1200,100000", "--results-dir",
            figures / "results", "--catalog", write_csv(figures / "mine.csv", [TEST_INSTANCE]),
            "--instances", "test.*", "--backends", "webdataset", *extra]


def test_a_two_resolution_schedule_costs_the_sum_worked_by_hand(figures, capsys, tmp_path):
    code, out, err = run(capsys, *cost_args(figures, "--json", tmp_path / "cost.json", "--plot", tmp_path / "c.png"))
    assert code == 0, err
    projection = json.loads((tmp_path / "cost.json").read_text())
    [row] = projection["rows"]
    assert projection["schedule"]["sides"] == [112, 112, 224, 224] and projection["schedule"]["evaluations"] == 2
    # 3 vCPUs per GPU: the loader halfway between its 2- and 4-vCPU figures; each side's rate the lower one
    at_112, at_224, val = min(10_000, (4_000 + 8_000) / 2), min(2_000, (3_000 + 5_000) / 2), min(7_000, 2_000)
    train = 2 * 12_000 / (4 * at_112) + 2 * 12_000 / (4 * at_224)
    evaluation = 2 * 1_200 / (4 * val)
    assert row["hours"] == pytest.approx((train + evaluation) / 3600)
    assert row["on_demand_usd"] == pytest.approx(row["hours"] * 40) and row["spot_usd"] is None
    assert [(s["side"], s["binds"]) for s in row["sides"]] == [(112, "data"), (224, "GPU")]
    assert row["eval"]["binds"] == "data"
    assert row["gpu_source"] == "measured" and row["loader_source"] == "measured"
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "test.4gpu *" in out and "H100-80GB" in out


def test_the_json_has_the_fields_its_docstring_names(figures, capsys, tmp_path):
    code, _, err = run(capsys, *cost_args(figures, "--data-from", "local,s3", "--json", tmp_path / "cost.json"))
    assert code == 0, err
    projection = json.loads((tmp_path / "cost.json").read_text())
    assert {"recipe", "dataset", "scaling", "schedule", "catalog", "rows", "pareto", "left_out"} <= set(projection)
    documented = {"instance", "gpus", "vcpus_per_gpu", "backend", "data_from", "binds", "binds_share", "sides",
                  "minutes_per_epoch", "hours", "on_demand_usd", "spot_usd", "price", "gpu_source",
                  "loader_source", "sources"}
    for row in projection["rows"]:
        assert documented <= set(row)
    s3 = next(row for row in projection["rows"] if row["data_from"] == "s3")
    # 100 Gbit/s over 4 GPUs at 100,000 bytes per image: 31,250 img/s per GPU, above every other figure
    assert s3["sides"][0]["network_img_per_s"] == pytest.approx(100e9 / 8 / 4 / 100_000)
    import instance_cost
    assert all(f"`{field}`" in instance_cost.__doc__ for field in documented)       # where the docs send a reader


def test_overridden_prices_are_used(figures, capsys, tmp_path):
    prices = write_csv(tmp_path / "prices.csv", [{"name": "test.4gpu", "on_demand_usd_per_h": "10",
                                                  "spot_usd_per_h": "3.5"}])
    code, _, err = run(capsys, *cost_args(figures, "--catalog", prices, "--json", tmp_path / "cost.json"))
    assert code == 0, err
    [row] = json.loads((tmp_path / "cost.json").read_text())["rows"]
    assert row["on_demand_usd"] == pytest.approx(row["hours"] * 10)
    assert row["spot_usd"] == pytest.approx(row["hours"] * 3.5)
    shipped = load_catalog()["p4d.24xlarge"]
    mine = load_catalog([write_csv(tmp_path / "p4d.csv", [{"name": "p4d.24xlarge", "on_demand_usd_per_h": "20.5"}])])
    assert mine["p4d.24xlarge"].on_demand_usd_per_h == 20.5 and shipped.on_demand_usd_per_h != 20.5
    # the price says where it now comes from; the rest of the row is the catalog's
    assert mine["p4d.24xlarge"].price_source == str(tmp_path / "p4d.csv") and mine["p4d.24xlarge"].gpu_count == 8
    assert mine["p4d.24xlarge"].spot_usd_per_h == shipped.spot_usd_per_h


def test_an_instance_whose_gpu_has_no_figure_is_left_out_with_its_reason(figures, capsys):
    unknown = {**TEST_INSTANCE, "name": "test.z100", "gpu_model": "Z100"}
    args = cost_args(figures)
    args[args.index("--catalog") + 1] = write_csv(figures / "z.csv", [TEST_INSTANCE, unknown])
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "test.4gpu" in out
    left = out.split("left out", 1)[1]
    assert "no resnet50 train figure for Z100, measured or published; on one, run python benchmarks/models.py" in left
    assert "test.z100" not in out.split("left out", 1)[0]


def test_a_published_figure_follows_the_measured_gpus_curve(figures, capsys, tmp_path):
    """A GPU never measured: its published 224 px fp16 figure, carried to 112 px bf16 by the H100's rows."""
    published = write_csv(tmp_path / "published.csv", [{
        "gpu_model": "A100-80GB", "model": "resnet50", "resolution": "224", "precision": "fp16",
        "batch_per_gpu": "256", "gpus": "1", "img_per_s": "1250", "what": "a table", "source": "a page",
        "source_date": "2024-01-01"}])
    a100 = {**TEST_INSTANCE, "name": "test.a100", "gpu_model": "A100-80GB"}
    args = cost_args(figures, "--published", published, "--json", tmp_path / "cost.json")
    args[args.index("--catalog") + 1] = write_csv(figures / "a.csv", [a100])
    code, _, err = run(capsys, *args)
    assert code == 0, err
    [row] = json.loads((tmp_path / "cost.json").read_text())["rows"]
    assert row["gpu_source"] == "published"
    # half the H100's (fp16, 224 px) rate: half of its bf16 rates at each side
    assert row["sides"][0]["gpu_img_per_s"] == pytest.approx(10_000 * 1250 / 2500)
    assert row["sides"][1]["gpu_img_per_s"] == pytest.approx(2_000 * 1250 / 2500)


def e2e_row(share: float, hardware: dict = H100, loader: float = 20_000, data_from: str = "local") -> dict:
    return {"benchmark": "e2e", "backend": "dali", "model": "resnet50", "device": "cuda:0", "data_from": data_from,
            "loader_img_per_s": loader, "model_img_per_s": 10_000, "together_img_per_s": 10_000 * share,
            "share_of_model": share, "hardware": hardware}


def test_beside_dali_the_step_keeps_the_share_of_the_gpu_measured_end_to_end(figures, capsys, tmp_path):
    """DALI decodes on the GPU: its GPU bound is the model's rate times the median share measured end to
    end, of local runs whose loader outran the model, on this GPU model, else on those measured."""
    dali = [{**loader_row(split, side, cores, 50_000), "backend": "dali-wds", "device": "cuda"}
            for split, side in (("train", 112), ("train", 224), ("val", 224)) for cores in (2, 4)]
    a100 = {**H100, "gpu_model": "NVIDIA A100-SXM4-80GB"}
    not_the_steps = [e2e_row(0.1, data_from="url"), e2e_row(0.2, loader=5_000)]
    on_the_h100 = [e2e_row(0.8), e2e_row(0.9), e2e_row(0.7)]
    results = figures / "results" / "machines.jsonl"
    before = results.read_text()

    def project(e2e_rows: list[dict]) -> tuple[str, dict]:
        results.write_text(before + "".join(json.dumps(row) + "\n" for row in [*dali, *e2e_rows]))
        code, out, err = run(capsys, *cost_args(figures, "--backends", "webdataset,dali", "--json", tmp_path / "c.json"))
        assert code == 0, err
        return out, {row["backend"]: row for row in json.loads((tmp_path / "c.json").read_text())["rows"]}

    out, rows = project([*not_the_steps, *on_the_h100, e2e_row(0.95, a100)])
    assert rows["dali"]["step_share"] == pytest.approx(0.8) and rows["webdataset"]["step_share"] is None
    assert [s["gpu_img_per_s"] for s in rows["dali"]["sides"]] == pytest.approx([8_000, 1_600])
    assert [s["binds"] for s in rows["dali"]["sides"]] == ["GPU", "GPU"]
    assert rows["dali"]["eval"]["gpu_img_per_s"] == pytest.approx(7_000)     # no end-to-end eval figure
    train = 2 * 12_000 / (4 * 8_000) + 2 * 12_000 / (4 * 1_600)
    assert rows["dali"]["hours"] == pytest.approx((train + 2 * 1_200 / (4 * 7_000)) / 3600)
    assert [s["gpu_img_per_s"] for s in rows["webdataset"]["sides"]] == pytest.approx([10_000, 2_000])
    assert ("measured: resnet50 step beside dali on H100-80GB: 80% of the model alone, median of 3 end-to-end "
            "runs (70%-90%)") in rows["dali"]["sources"]

    out, rows = project([e2e_row(0.95, a100)])          # the only one measured so, and said
    assert rows["dali"]["step_share"] == pytest.approx(0.95)
    assert any("on A100-80GB" in s and "not measured so on H100-80GB" in s for s in rows["dali"]["sources"])

    out, rows = project(not_the_steps)
    assert set(rows) == {"webdataset"}
    assert ("no end-to-end dali figure on a GPU, and its decode takes from the step; on one, run python "
            "tools/diagnose.py --config RECIPE data.backend=dali --results-dir benchmarks/results") in out


@pytest.mark.parametrize("text,message", [
    ("name,gpu_count\ntest.4gpu,eight\n", "row 2: column 'gpu_count' is 'eight', not a number"),
    ("name,gpus\ntest.4gpu,8\n", "unknown column 'gpus'"),
    ("name,on_demand_usd_per_h\nnew.instance,3\n", "row 2: 'new.instance' is not in the catalog, so it needs every column"),
    ("name,on_demand_usd_per_h\ntest.4gpu,3,4\n", "row 2: 2 columns expected"),
])
def test_a_file_that_does_not_parse_is_one_line_naming_file_and_row(figures, capsys, tmp_path, text, message):
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    code, out, err = run(capsys, *cost_args(figures, "--catalog", bad))
    assert code == 2 and not out
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: {bad}") and message in line


def test_the_shipped_catalog_parses_and_dates_every_price(tmp_path):
    catalog = load_catalog()
    with open(CATALOG, newline="") as f:
        header = next(csv.reader(line for line in f if not line.startswith("#")))
    assert header == list(FIELDS)
    for name in ("p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "g5.xlarge", "g5.12xlarge", "g5.48xlarge",
                 "g6.xlarge", "g6.12xlarge", "g6.48xlarge", "g6e.xlarge", "g6e.12xlarge", "g6e.48xlarge",
                 "a2-highgpu-1g", "a2-highgpu-8g", "a3-highgpu-8g", "g2-standard-4",
                 "Standard_ND96asr_v4", "Standard_ND96isr_H100_v5"):
        instance = catalog[name]
        assert instance.price_source and len(instance.price_date) == 10 and instance.on_demand_usd_per_h > 0
    with pytest.raises(CatalogError, match="x.csv: no 'name' column"):
        load_catalog([write_csv(tmp_path / "x.csv", [{"on_demand_usd_per_h": 1}])])
    assert gpu_model("NVIDIA A100-SXM4-40GB") == "A100-40GB" and gpu_model("NVIDIA L4") == "L4"


def test_the_scaling_rows_come_from_the_loader_benchmark_at_1_and_2_cores(sample_sets, tmp_path, capsys, monkeypatch):
    result = loaders_here(capsys, monkeypatch, "--source", sample_sets / "photos", "--cache", tmp_path / "cache",
                          "--results-dir", tmp_path / "results", "--backends", "webdataset", "--splits", "train",
                          "--resolutions", "64", "--cores", "1,2", "--epochs", "1", "--batch-size", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = result_rows(tmp_path / "results")
    assert [(row["cores"], row["workers"]) for row in rows] == [(1, 1), (2, 2)]
    hardware = rows[0]["hardware"]
    figure = LoaderRates(rows).rate(hardware["cpu_model"], hardware["cpu_isa"], "webdataset", "train", 64, 1.5)
    assert figure.kind == "measured" and "interpolated from 1, 2 vCPUs" in figure.source
    assert figure.img_per_s == pytest.approx((rows[0]["img_per_s"] + rows[1]["img_per_s"]) / 2)
    assert along_cores({1: rows[0], 2: rows[1]}, 4) == pytest.approx(2 * rows[1]["img_per_s"])


def test_rows_measured_on_the_instance_itself_come_first(figures, capsys, tmp_path):
    """Benchmarks run on the instance with --instance-type NAME: their rows, not its CPU kind's or GPU model's."""
    there = {**XEON_VM, "cpu_model": "AMD EPYC 9R14", "cpu_isa": "avx512", "instance_type": "test.4gpu",
             "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 4}
    rows = [{**loader_row(split, side, 3, rate), "hardware": there}
            for split, side, rate in (("train", 112, 7_000), ("train", 224, 1_500), ("val", 224, 2_500))]
    rows.append({**model_row(112, "train", 9_000), "hardware": there})
    rows.append({**model_row(224, "train", 1_800), "hardware": there})
    with open(figures / "results" / "test.4gpu.jsonl", "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    code, _, err = run(capsys, *cost_args(figures, "--json", tmp_path / "cost.json"))
    assert code == 0, err
    [row] = json.loads((tmp_path / "cost.json").read_text())["rows"]
    assert [r for s in row["sides"] for r in (s["gpu_img_per_s"], s["data_img_per_s"])] == pytest.approx(
        [9_000, 7_000, 1_800, 1_500])
    assert row["eval"]["gpu_img_per_s"] == pytest.approx(7_000)     # no eval row of its own: the GPU model's
    assert any(source.startswith("measured: test.4gpu, at 3 vCPUs") for source in row["sources"])
