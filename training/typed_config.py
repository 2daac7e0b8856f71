"""Typed configs: a nested mapping read from YAML, plus dotted command-line overrides, turned into a
tree of dataclasses and checked against their type hints. Every mistake is a one-line ConfigError
that names the full dotted key. Nothing here knows the schema (training/config.py); it works on any
dataclass tree whose fields use the types `_convert` handles.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import reprlib
import types
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

import yaml

from algorithms.durations import Duration

NULL_WORDS = {"null", "none"}
BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class ConfigError(ValueError):
    """A mistake in a config file or an override, in one line for the user."""


class _WrongType(ConfigError):
    """The value at `key` itself has the wrong type (not something nested inside it), so that a
    Union can go on to its next member."""

    def __init__(self, key: str, expected: str, value: Any):
        shown = "null" if value is None else f"{reprlib.repr(value)} ({type(value).__name__})"
        super().__init__(f"{f'config key {key!r}' if key else 'config'}: expected {expected}, got {shown}")
        self.key = key


def from_mapping(cls: type, data: Mapping, where: str = "") -> Any:
    """An instance of dataclass `cls` built from `data`; `where` is the dotted path of `data`."""
    if not isinstance(data, Mapping):
        raise _WrongType(where, _describe(cls), data)
    fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(str(key), list(fields), where))
    for name, field in fields.items():
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if required and name not in data:
            raise ConfigError(f"missing config key {_join(where, name)!r}")
    hints = get_type_hints(cls)
    values = {name: _convert(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**values)
    except ValueError as error:  # __post_init__ checks that involve several fields
        raise ConfigError(f"{where}: {error}" if where else str(error)) from None


def apply_overrides(data: Mapping, overrides: list[str]) -> dict:
    """A copy of `data` with each `dotted.key=value` set; values are read as YAML."""
    merged = copy.deepcopy(dict(data))
    for override in overrides:
        dotted, equals, text = override.partition("=")
        keys = dotted.strip().split(".")
        if not equals or not all(keys):
            raise ConfigError(f"bad override {override!r}: write dotted.key=value, e.g. optim.lr=0.1")
        *parents, leaf = keys
        node = merged
        for key in parents:
            # A scalar in the way is replaced: `resolution.form=ffcv` turns `resolution: 160` into a mapping.
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = _parse_override_value(text)
    return merged


def to_plain(obj: Any) -> Any:
    """Dataclasses as dicts, tuples as lists, Durations as text: what yaml.safe_dump writes and
    from_mapping reads back to an equal tree."""
    if isinstance(obj, Duration):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {field.name: to_plain(getattr(obj, field.name)) for field in dataclasses.fields(obj) if field.init}
    if isinstance(obj, Mapping):
        return {key: to_plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(value) for value in obj]
    return obj


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file; an empty file is an empty mapping (all defaults)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        place = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{place}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys, got {type(data).__name__}")
    return data


def load_recipe(path: str | Path) -> dict:
    """The mapping in a recipe file with its `base:` chain resolved: `base: NAME` (a file beside
    it, `.yaml` optional, or a path relative to it) is loaded first and this file's keys are laid
    over it (mappings merged key by key, anything else, lists included, replaced whole). A
    missing base or a cycle is a ConfigError naming the files."""
    layers: list[tuple[Path, dict]] = []
    path: Path | None = Path(path)
    while path is not None:
        if any(path.resolve() == seen for seen, _ in layers):
            raise ConfigError("recipe bases form a cycle: " + " -> ".join(str(p) for p in [*(s for s, _ in layers), path]))
        data = load_yaml(path)
        layers.append((path.resolve(), data))
        path = _base_of(path, data.pop("base", None))
    merged: dict = {}
    for _, data in reversed(layers):                # the first base first, the named file last
        merged = _merge(merged, data)
    return merged


def _base_of(path: Path, base: Any) -> Path | None:
    if base is None:
        return None
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: 'base' must name a recipe file, got {reprlib.repr(base)}")
    for candidate in (path.parent / base, path.parent / f"{base}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{path}: base recipe {base!r} not found (no file {path.parent / base}[.yaml])")


def _merge(base: Mapping, over: Mapping) -> dict:
    """`over` laid on `base`: keys in both that hold mappings are merged, in base's order."""
    merged = copy.deepcopy(dict(base))
    for key, value in over.items():
        both_mappings = isinstance(merged.get(key), Mapping) and isinstance(value, Mapping)
        merged[key] = _merge(merged[key], value) if both_mappings else copy.deepcopy(value)
    return merged


def _convert(hint: Any, value: Any, key: str) -> Any:
    """`value` checked against (and converted to) the type `hint`, for the config key `key`."""
    origin, args = get_origin(hint) or hint, get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or isinstance(value, str) and value.lower() in NULL_WORDS):
            return None
        for member in (arg for arg in args if arg is not type(None)):
            try:
                return _convert(member, value, key)
            except _WrongType as error:
                if error.key != key:  # the member fits, but something inside the value is wrong
                    raise
        raise _WrongType(key, _describe(hint), value)
    if origin is Literal:
        if any(value == allowed and type(value) is type(allowed) for allowed in args):
            return value
    elif hint is Duration:
        if isinstance(value, (str, Duration)):
            try:
                return Duration.parse(value)
            except ValueError as error:
                raise ConfigError(f"config key {key!r}: {error}") from None
    elif dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else from_mapping(hint, value, key)
    elif hint is bool:
        # Override values arrive read as YAML: `=yes` is already a bool, `=1` an int, `=tRuE` a str.
        if isinstance(value, (int, str)) and str(value).lower() in BOOL_WORDS:  # bools are ints too
            return BOOL_WORDS[str(value).lower()]
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # PyYAML reads 1e-3 as a str
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, str):  # an override such as `0.25,0.5` or `[0.25, 0.5]`
            inner = value.strip().strip("[]").strip()
            value = [_parse_override_value(part) for part in inner.split(",")] if inner else []
        if isinstance(value, (list, tuple)):
            fixed_length = origin is tuple and args and args[-1] is not Ellipsis
            if fixed_length and len(value) != len(args):
                raise _WrongType(key, _describe(hint), value)
            item_hints = args if fixed_length else [args[0] if args else Any] * len(value)
            return origin(_convert(item_hint, item, f"{key}[{i}]")
                          for i, (item_hint, item) in enumerate(zip(item_hints, value)))
    elif origin is dict:
        if isinstance(value, Mapping):
            key_hint, value_hint = args or (Any, Any)
            return {_convert(key_hint, item_key, f"{key}.{item_key}"): _convert(value_hint, item, f"{key}.{item_key}")
                    for item_key, item in value.items()}
    else:
        raise TypeError(f"config key {key!r}: typed_config cannot check fields of type {hint!r}")
    raise _WrongType(key, _describe(hint), value)


def _describe(hint: Any) -> str:
    """The type `hint` in words, for error messages."""
    origin, args = get_origin(hint) or hint, get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} values"
    if dataclasses.is_dataclass(hint) and hint is not Duration:
        return f"a mapping (the {hint.__name__} section)"
    words = {type(None): "null", bool: "a boolean (true or false)", int: "an integer", float: "a float",
             str: "a string", Duration: "a duration (e.g. 90ep, 1000ba, 0.5dur)", list: "a list", tuple: "a list",
             dict: "a mapping"}
    return words.get(origin, repr(hint))


def _parse_override_value(text: str) -> Any:
    """`text` read as YAML (numbers, booleans, null, lists, mappings), else the text itself."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, str) else value


def _unknown_key_message(key: str, valid: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    suggestion = f"; did you mean {_join(where, close[0])!r}?" if close else ";"
    section = f"valid keys in {where}" if where else "valid top-level keys"
    return f"unknown config key {_join(where, key)!r}{suggestion} {section}: {', '.join(valid)}"


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
