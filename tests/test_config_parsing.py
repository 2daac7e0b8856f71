"""Typed configs (training/typed_config.py) on a small schema of their own, and Durations."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import pytest
import yaml

from algorithms.durations import Duration
from conftest import ROOT
from training.typed_config import ConfigError, apply_overrides, from_mapping, load_recipe, load_yaml, to_plain


@dataclass
class Optim:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    warmup: Duration = Duration(0, "ep")

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Data:
    path: str = "/data"
    resolution: Union[int, dict[str, Any]] = 160
    milestones: tuple[int, ...] = ()
    colout: Optional[tuple[float, float]] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Example:
    name: str                                  # required
    seed: int | None = None
    max_duration: Duration = Duration(90, "ep")
    tags: list[str] = field(default_factory=list)
    notes: Any = None
    optim: Optim = field(default_factory=Optim)
    data: Data = field(default_factory=Data)


def error_of(overrides: list[str], data: dict | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        from_mapping(Example, apply_overrides(data or {"name": "x"}, overrides))
    return str(caught.value)


def test_missing_keys_take_the_defaults_and_required_keys_are_required():
    assert from_mapping(Example, {"name": "x"}) == Example(name="x")
    assert from_mapping(Example, {"name": "x", "optim": {"lr": 1}}).optim == Optim(lr=1.0)
    with pytest.raises(ConfigError, match="^missing config key 'name'$"):
        from_mapping(Example, {})


def test_round_trip_through_yaml():
    config = Example(name="run", seed=3, max_duration=Duration(1000, "ba"), tags=["a", "b"], notes={"k": [1]},
                     optim=Optim(name="adamw", lr=0.5, nesterov=True, betas=(0.8, 0.9), warmup=Duration(0.25, "dur")),
                     data=Data(resolution={"form": "ffcv", "min_res": 160}, milestones=(30, 60), colout=(0.1, 0.2),
                               extra={"nested": {"x": 1}}))
    plain = to_plain(config)
    assert plain["max_duration"] == "1000ba" and plain["optim"]["warmup"] == "0.25dur"
    assert plain["optim"]["betas"] == [0.8, 0.9] and plain["data"]["milestones"] == [30, 60]
    assert from_mapping(Example, yaml.safe_load(yaml.safe_dump(plain))) == config


def test_overrides_of_each_type():
    base = {"name": "x", "data": {"resolution": 160}}
    overrides = ["seed=7", "max_duration=1000ba", "tags=[a, b]", "notes=hello world", "optim.name=adamw",
                 "optim.lr=1e-3", "optim.nesterov=yes", "optim.betas=0.8,0.99", "optim.warmup=0.1dur",
                 "data.path=/imagenet", "data.resolution.form=ffcv", "data.milestones=[30, 60]",
                 "data.colout=[0.25, 0.5]", "data.extra={a: 1, b: [2]}"]
    config = from_mapping(Example, apply_overrides(base, overrides))
    assert base == {"name": "x", "data": {"resolution": 160}}  # the input is left alone
    assert config == Example(name="x", seed=7, max_duration=Duration(1000, "ba"), tags=["a", "b"], notes="hello world",
                             optim=Optim(name="adamw", lr=0.001, nesterov=True, betas=(0.8, 0.99),
                                         warmup=Duration(0.1, "dur")),
                             data=Data(path="/imagenet", resolution={"form": "ffcv"}, milestones=(30, 60),
                                       colout=(0.25, 0.5), extra={"a": 1, "b": [2]}))
    later_wins = from_mapping(Example, apply_overrides(base, ["seed=1", "seed=null", "data.colout=none"]))
    assert later_wins.seed is None and later_wins.data.colout is None
    assert from_mapping(Example, apply_overrides(base, ["data.resolution=224"])).data.resolution == 224


def test_an_override_without_equals_is_named():
    with pytest.raises(ConfigError, match="bad override 'optim.lr'"):
        apply_overrides({}, ["optim.lr"])
    with pytest.raises(ConfigError, match="bad override 'optim..lr=1'"):
        apply_overrides({}, ["optim..lr=1"])


def test_unknown_keys_name_the_full_key_and_suggest_the_close_one():
    assert error_of(["sead=1"]) == ("unknown config key 'sead'; did you mean 'seed'? "
                                    "valid top-level keys: name, seed, max_duration, tags, notes, optim, data")
    assert error_of(["optim.nesterof=true"]) == ("unknown config key 'optim.nesterof'; did you mean 'optim.nesterov'? "
                                                 "valid keys in optim: name, lr, nesterov, betas, warmup")
    assert error_of(["optim.zzz=1"]) == ("unknown config key 'optim.zzz'; "
                                         "valid keys in optim: name, lr, nesterov, betas, warmup")
    # free-form mappings take any key
    assert from_mapping(Example, {"name": "x", "data": {"extra": {"zzz": 1}}}).data.extra == {"zzz": 1}


@pytest.mark.parametrize("override, message", [
    ("optim.lr=fast", "config key 'optim.lr': expected a float, got 'fast' (str)"),
    ("optim.lr=true", "config key 'optim.lr': expected a float, got True (bool)"),
    ("seed=1.5", "config key 'seed': expected an integer or null, got 1.5 (float)"),
    ("name=null", "config key 'name': expected a string, got null"),
    ("name=2024", "config key 'name': expected a string, got 2024 (int)"),
    ("optim.betas=[1, 2, 3]", "config key 'optim.betas': expected a list of 2 values, got [1, 2, 3] (list)"),
    ("optim.betas=0.5,x", "config key 'optim.betas[1]': expected a float, got 'x' (str)"),
    # inside a Union, an error within the member that fits is reported as such
    ("data.colout=[0.1, x]", "config key 'data.colout[1]': expected a float, got 'x' (str)"),
    ("data.milestones=[1, 2.5]", "config key 'data.milestones[1]': expected an integer, got 2.5 (float)"),
    ("data.resolution=big", "config key 'data.resolution': expected an integer or a mapping, got 'big' (str)"),
    ("data.extra=[1]", "config key 'data.extra': expected a mapping, got [1] (list)"),
    ("optim=3", "config key 'optim': expected a mapping (the Optim section), got 3 (int)"),
    ("max_duration=90", "config key 'max_duration': expected a duration (e.g. 90ep, 1000ba, 0.5dur), got 90 (int)"),
    ("optim.warmup=2x", "config key 'optim.warmup': bad duration '2x': write a number followed by ep"),
    ("optim.name=adam", "config key 'optim.name': expected one of 'sgd', 'adamw', got 'adam' (str)"),
])
def test_bad_values_name_the_key_and_the_expected_type(override, message):
    assert error_of([override]).startswith(message)


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("tRuE", True), ("YES", True), ("yes", True), ("1", True),
    ("false", False), ("No", False), ("nO", False), ("0", False)])
def test_bools_from_override_strings(text, expected):
    assert from_mapping(Example, apply_overrides({"name": "x"}, [f"optim.nesterov={text}"])).optim.nesterov is expected


@pytest.mark.parametrize("value", ["maybe", 2, 1.0, None])
def test_bools_reject_anything_else(value):
    with pytest.raises(ConfigError, match="config key 'optim.nesterov': expected a boolean"):
        from_mapping(Example, {"name": "x", "optim": {"nesterov": value}})


def test_post_init_errors_become_config_errors_with_the_section_path():
    assert error_of(["optim.lr=-1"]) == "optim: lr must be > 0, got -1.0"


def test_duration_parse_str_and_batches():
    assert Duration.parse("90ep") == Duration(90, "ep") and str(Duration.parse("90ep")) == "90ep"
    assert str(Duration.parse("0.5ep")) == "0.5ep" and str(Duration.parse("1000ba")) == "1000ba"
    assert str(Duration.parse(" 0.25dur ")) == "0.25dur" and Duration.parse(Duration(1, "dur")) == Duration(1, "dur")
    assert Duration.parse("90ep").to_batches(100) == 9000 and Duration.parse("0.5ep").to_batches(7) == 4
    assert Duration.parse("1000ba").to_batches(7) == 1000
    assert Duration.parse("0.5dur").to_batches(7, total_batches=1001) == 500
    with pytest.raises(ValueError, match="max_duration cannot be given in dur"):
        Duration.parse("0.5dur").to_batches(7)


@pytest.mark.parametrize("text, message", [
    ("9x", "bad duration '9x': write a number followed by ep (epochs), ba (batches) or dur (fraction of max_duration)"),
    ("ep", "bad duration 'ep': write"), ("", "bad duration '': write"), (90, "bad duration 90: write"),
    ("-1ep", "bad duration '-1ep': must be"), ("1.5ba", "bad duration '1.5ba': a count of batches must be a whole"),
    ("1.5dur", "bad duration '1.5dur': a fraction of max_duration must be between 0 and 1")])
def test_bad_durations(text, message):
    with pytest.raises(ValueError) as caught:
        Duration.parse(text)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_load_yaml_reads_a_mapping_and_names_the_file_otherwise(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("name: x\noptim:\n  lr: 0.5\n")
    assert load_yaml(good) == {"name": "x", "optim": {"lr": 0.5}}
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\noptim: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml, line \d+, column \d+: YAML syntax error: "):
        load_yaml(broken)
    listed = tmp_path / "listed.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"listed\.yaml: the top level must be a mapping of config keys, got list"):
        load_yaml(listed)
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml: No such file"):
        load_yaml(tmp_path / "missing.yaml")


def test_a_recipe_lays_its_keys_over_its_base_chain(tmp_path):
    (tmp_path / "root.yaml").write_text("seed: 1\noptim: {name: sgd, lr: 0.1, betas: [0.8, 0.9]}\n"
                                        "data: {path: /a, scale: [0.1, 1.0]}\nalgorithms: {a: {x: 1}, b: {}}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "middle.yaml").write_text("base: ../root.yaml\noptim: {lr: 0.2}\n")
    (tmp_path / "sub" / "leaf.yaml").write_text("base: middle\noptim: {betas: [0.5, 0.6]}\ndata: {scale: [1.0]}\n"
                                                "algorithms: {a: {y: 2}, c: {}}\n")
    assert load_recipe(tmp_path / "sub" / "leaf.yaml") == {
        "seed": 1, "optim": {"name": "sgd", "lr": 0.2, "betas": [0.5, 0.6]},     # nested keys merged
        "data": {"path": "/a", "scale": [1.0]},                                    # a list replaced whole
        "algorithms": {"a": {"x": 1, "y": 2}, "b": {}, "c": {}}}
    assert list(load_recipe(tmp_path / "sub" / "leaf.yaml")["algorithms"]) == ["a", "b", "c"]  # the base's order
    assert load_recipe(tmp_path / "root.yaml") == load_yaml(tmp_path / "root.yaml")  # no base: the file as it is


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "base: nowhere\n"}, r"a\.yaml: base recipe 'nowhere' not found \(no file .*nowhere\[\.yaml\]\)"),
    ({"a.yaml": "base: b\n", "b.yaml": "base: a.yaml\nseed: 1\n"}, r"recipe bases form a cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"),
    ({"a.yaml": "base: a\n"}, r"recipe bases form a cycle"),
    ({"a.yaml": "base: [b]\n"}, r"a\.yaml: 'base' must name a recipe file"),
])
def test_a_bad_base_is_one_line_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_recipe(tmp_path / "a.yaml")
    assert "\n" not in str(caught.value)


def test_what_a_run_writes_of_its_config_carries_no_credentials():
    """config.yaml and every checkpoint hold `shareable(config)`; the tools' records, `shareable_overrides`."""
    from training.config import load_config, shareable, shareable_overrides
    url = "https://alice:PASSWORD@example.com/data?X-Amz-Signature=SIG&part=1"
    config = load_config(str(ROOT / "algorithms" / "recipes" / "fashion_baseline.yaml"),
                         [f"data.path={url}", "data.backend=webdataset"])
    plain = shareable(config)
    assert plain["data"]["path"] == "https://***@example.com/data?X-Amz-Signature=***&part=1"
    assert "PASSWORD" not in repr(plain) and "SIG" not in repr(plain)
    assert config.data.path == url                    # the run itself still reads with them
    assert shareable_overrides([f"data.path={url}", "seed=3", "compile"]) == [
        f"data.path={plain['data']['path']}", "seed=3", "compile"]
