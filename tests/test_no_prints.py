"""Library code prints nothing: its messages go through `logging`, and the command lines decide how
they are shown. pipeline/progress.py alone writes, since drawing progress on a given stream is its job."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRITES_BY_DESIGN = {ROOT / "pipeline" / "progress.py"}


def print_calls(source: str, filename: str = "<module>") -> list[int]:
    """The lines of `source` that call the builtin print."""
    return [node.lineno for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]


def test_no_module_of_pipeline_calls_print():
    found = {str(path.relative_to(ROOT)): lines for path in sorted((ROOT / "pipeline").rglob("*.py"))
             if path not in WRITES_BY_DESIGN and (lines := print_calls(path.read_text(), str(path)))}
    assert not found, f"print() in library code (log through logging.getLogger(__name__) instead): {found}"


def test_the_check_finds_a_print_and_only_a_call_of_print():
    assert print_calls("import sys\nprint('x', file=sys.stderr)\n") == [2]
    assert print_calls("log.info('print(x)')\nstream.print(1)\nprinted = print\n") == []
