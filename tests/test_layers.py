"""The folder layout is the architecture, and dependencies point one way: tools and benchmarks
-> training -> algorithms -> pipeline, and inside pipeline/ from its top (the loader factory, the
backends) down to its bottom (the errors, the spec's parts). Two checks per layer, on every module of it:

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
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["pipeline", "algorithms", "training"]            # lowest first
ABOVE_ALL = ["tools", "benchmarks"]
# What may come right before a higher layer's script in a message: the program a user runs it with
COMMAND = re.compile(r"(?:\b(?:python3?|bash|sh)|\btorchrun(?: -\S+)*) $")


# pipeline/'s sub-packages and root modules, lowest first: each imports only those before it (and
# itself). The loader contract's parts sit at the bottom, the façade and the factory near the top.
PIPELINE_ORDER = ["errors", "progress", "machine", "schedules", "native", "storage", "transforms", "spec",
                  "formats", "decode", "loader", "shards", "remote", "datasets", "backends", "build", "convert",
                  "__init__"]
MODULE_NAME = re.compile(r"^pipeline(\.\w+)+$")


def parse(source: str, filename: str) -> ast.Module:
    """ast.parse, again after CPython 3.11's "AST constructor recursion depth mismatch": its depth count
    is shared by all threads, so a loader's thread compiling code (numba, FFCV) beside it can trip it."""
    for attempt in range(5):
        try:
            return ast.parse(source, filename)
        except SystemError:
            if attempt == 4:
                raise


def layers_above(layer: str) -> list[str]:
    return LAYERS[LAYERS.index(layer) + 1:] + ABOVE_ALL


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def code_strings(source: str, filename: str = "<module>") -> list[str]:
    """The string constants of a module's code: every one but its docstrings."""
    tree = parse(source, filename)
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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pipeline_imports(path: Path, modules: set[str]) -> set[str]:
    """The pipeline modules `path` imports, at its top or inside a function (a lazy import is an
    import all the same), and those its code names as a string, as `importlib.import_module` takes
    them. `from pipeline import NAME` of an export (not a module) is an import of pipeline/__init__."""
    found = set()
    tree = parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "pipeline"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "pipeline":
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("relative import")                       # the package uses absolute imports only
    found |= {text for text in code_strings(path.read_text(), str(path)) if MODULE_NAME.match(text)}
    return found


def pipeline_graph() -> dict[str, set[str]]:
    """pipeline module -> the pipeline modules it imports (a package stands for its __init__)."""
    paths = {module_name(path): path for path in (ROOT / "pipeline").rglob("*.py")}
    return {name: pipeline_imports(path, set(paths)) - {name} for name, path in paths.items()}


def unit(module: str) -> str:
    """The sub-package or root module of pipeline/ that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_pipeline_modules_import_no_cycle_lazy_imports_included():
    graph = pipeline_graph()
    unknown = {module: sorted(targets - set(graph)) for module, targets in graph.items() if targets - set(graph)}
    assert not unknown, f"imports of modules that do not exist (or relative imports): {unknown}"
    assert cycles(graph) == []


def test_pipeline_sub_packages_import_only_those_below_them():
    graph = pipeline_graph()
    assert {unit(module) for module in graph} == set(PIPELINE_ORDER)
    rank = {name: position for position, name in enumerate(PIPELINE_ORDER)}
    upward = defaultdict(list)
    for module, targets in graph.items():
        for target in targets & set(graph):
            if rank[unit(target)] > rank[unit(module)]:
                upward[module].append(target)
    assert not upward, f"imports of a higher part of pipeline/ ({' < '.join(PIPELINE_ORDER)}): {dict(upward)}"


def test_the_cycle_and_order_checks_fail_on_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert unit("pipeline.remote.shards") == "remote" and unit("pipeline.spec") == "spec" and unit("pipeline") == "__init__"
    assert PIPELINE_ORDER.index("storage") < PIPELINE_ORDER.index("formats") < PIPELINE_ORDER.index("remote")


SYS_PATH_EDIT = re.compile(r"\bsys\.path\.(?:insert|append|extend)\(|\bsys\.path\s*\+?=")


def sys_path_edits(source: str) -> list[int]:
    return [number for number, line in enumerate(source.splitlines(), 1) if SYS_PATH_EDIT.search(line)]


def test_no_module_edits_sys_path():
    """Imports resolve through the install (editable or wheel) or PYTHONPATH, never a path
    the module splices in: such a module works from one folder and breaks once installed."""
    sources = [path for folder in [*LAYERS, *ABOVE_ALL, "tests"] for path in (ROOT / folder).rglob("*.py")]
    edits = {str(path.relative_to(ROOT)): lines for path in sources
             if (lines := sys_path_edits(path.read_text()))}
    assert not edits
    assert sys_path_edits("import sys\nsys.path.insert(0, str(ROOT))\n") == [2]
