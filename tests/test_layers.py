"""The folder layout is the architecture, and dependencies point one way: tools and benchmarks
-> training -> algorithms -> pipeline. Two checks per layer, on every module of it:

1. imports: a module that imports a layer above its own fails, lazy imports inside functions
   included;
2. names: a module that names a folder or script of a layer above its own in its code fails,
   e.g. `Path(...) / "benchmarks" / "results"` or "training/main.py" in pipeline/, "tools/..."
   in training/. Such a string is a dependency the imports do not show: the lower layer then
   knows where the higher one keeps its files and breaks when they move. The folder comes from
   the caller instead (`backend: auto`'s figures: `data.measured_results`, which the recipes set).

The rule for names, and why:
- It reads the string constants of the code (f-strings' literal parts included): what the
  code opens, runs or prints.
- Docstrings and comments may name higher layers: they tell a reader where a module's input
  usually comes from or who calls it, and nothing runs on them.
- A message may name a higher layer's script as the command a user types, with the program
  that runs it: "run python tools/convert_wds.py again", "bash tools/bootstrap.sh",
  "torchrun ... training/main.py". That is advice to a person, complete enough to paste. The
  bare path ("run tools/convert_wds.py again") fails like any other: written that way, a
  string cannot be told from a path the code uses.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["pipeline", "algorithms", "training"]            # lowest first
ABOVE_ALL = ["tools", "benchmarks"]
# What may come right before a higher layer's script in a message: the program a user runs it with
COMMAND = re.compile(r"(?:\b(?:python3?|bash|sh)|\btorchrun(?: -\S+)*) $")


def layers_above(layer: str) -> list[str]:
    return LAYERS[LAYERS.index(layer) + 1:] + ABOVE_ALL


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def code_strings(source: str, filename: str = "<module>") -> list[str]:
    """The string constants of a module's code: every one but its docstrings."""
    tree = ast.parse(source, filename)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add(id(first.value))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def higher_names(source: str, higher: list[str], filename: str = "<module>") -> list[str]:
    """The strings of `source`'s code that name a folder or script of a layer in `higher`."""
    folders = "|".join(map(re.escape, higher))
    path = re.compile(rf"(?<![\w./-])(?:{folders})/[\w./-]*")
    found = []
    for text in code_strings(source, filename):
        if text.strip().strip("/") in higher:                              # a path component: "benchmarks"
            found.append(text)
        found += [match.group() for match in path.finditer(text) if not COMMAND.search(text[:match.start()])]
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer):
    above = set(layers_above(layer))
    offenders = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & above)
                 for path in sorted((ROOT / layer).rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_names_a_folder_or_script_of_a_layer_above_its_own(layer):
    offenders = {str(path.relative_to(ROOT)): higher_names(path.read_text(), layers_above(layer), str(path))
                 for path in sorted((ROOT / layer).rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}


def test_the_names_check_fails_on_a_module_that_names_a_higher_folder():
    module = '''
"""Reads benchmarks/results (a docstring may say so)."""
from pathlib import Path
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"   # a comment may: tools/x.py
FIGURES = "benchmarks/results"
ENTRY = "training/main.py"
RECIPE = "algorithms/recipes/fashion_baseline.yaml"


def check(path):
    """Says what to run: tools/convert_wds.py."""
    if not path:
        raise ValueError(f"{path}: missing; run tools/convert_wds.py again")
    raise ValueError(f"{path}: missing; run python tools/convert_wds.py SRC {path}, or bash tools/bootstrap.sh")
'''
    assert sorted(higher_names(module, layers_above("pipeline"))) == [
        "algorithms/recipes/fashion_baseline.yaml", "benchmarks", "benchmarks/results", "tools/convert_wds.py",
        "training/main.py"]
    # training sits above algorithms: it may name a recipe, not a tool or a benchmark
    assert sorted(higher_names(module, layers_above("training"))) == [
        "benchmarks", "benchmarks/results", "tools/convert_wds.py"]
    # the same module with commands a user types, and the folder left to the caller, passes
    fixed = module.replace('"benchmarks" / "results"', "results").replace("run tools/", "run python tools/")
    fixed = "\n".join(line for line in fixed.splitlines() if not line.startswith(("FIGURES", "ENTRY", "RECIPE")))
    assert higher_names(fixed, layers_above("pipeline")) == []
    assert higher_names('COMMAND = "torchrun --nproc_per_node=2 training/main.py --config R.yaml"', ["training"]) == []
