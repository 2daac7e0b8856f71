"""The folder layout is the architecture, and imports point one way: tools and benchmarks ->
training -> algorithms -> pipeline. A module that imports a layer above its own fails here,
lazy imports inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["pipeline", "algorithms", "training"]            # lowest first
ABOVE_ALL = ["tools", "benchmarks"]


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:] + ABOVE_ALL)
    offenders = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & above)
                 for path in sorted((ROOT / layer).rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}
