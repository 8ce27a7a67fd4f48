"""The shape of the apply package, checked so that it stays readable (issue 18): no function in ``applier/apply``
or in the live table sync (``tablesync/live.py``, which runs the apply loop in a sync-worker context) longer than :data:`MAX_FUNCTION_LINES` lines or with ``if``/``for``/``while``/``try``/``with`` nested deeper than
:data:`MAX_DEPTH`, and the transaction/dispatch core class (:class:`applier.apply.handlers.Applier`) no longer than
:data:`MAX_CORE_LINES` lines. A function that grows past a limit is a sign that a strategy or a step wants its own
function or module; see docs/architecture.md for where each belongs.

The rest of ``tablesync`` is not checked yet: ``copy.py``, ``initial.py`` and ``job.py`` have functions over the
limits (``InitialCopy.copy`` and ``InitialCopy.run``, each about 80 lines; a few nest 4 deep)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "applier" / "apply"
#: the files checked: the apply package, and the live table sync that drives the same loop and core
CHECKED = [*sorted(APPLY.glob("*.py")), ROOT / "tablesync" / "live.py"]
MAX_FUNCTION_LINES = 60
MAX_DEPTH = 3
MAX_CORE_LINES = 400
EXEMPT: set[str] = set()  # files let off these limits, each with the reason (none today)
_NESTING = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _depth(node: ast.AST) -> int:
    """How deeply ``if``/``for``/``while``/``try``/``with`` statements nest inside ``node`` (a nested function's
    body counts on its own, as its own function)."""
    deepest = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (*_FUNCTIONS, ast.ClassDef)):
            continue
        inner = _depth(child)
        # an ``elif`` is the orelse If of an If: the same level, as it reads
        is_elif = isinstance(node, ast.If) and isinstance(child, ast.If) and child in node.orelse
        if isinstance(child, _NESTING) and not is_elif:
            inner += 1
        deepest = max(deepest, inner)
    return deepest


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in CHECKED:
        if path.name in EXEMPT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT).as_posix() if path.parent != APPLY else path.name
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS):
                found.append((f"{where}:{node.lineno} {node.name}", node))
    return found


FUNCTIONS = _functions()


def test_there_is_something_to_check():
    assert len(FUNCTIONS) > 100
    assert any(w.startswith("tablesync/live.py:") for w, _ in FUNCTIONS)


@pytest.mark.parametrize("where,node", FUNCTIONS, ids=[w for w, _ in FUNCTIONS])
def test_function_shape(where: str, node: ast.FunctionDef | ast.AsyncFunctionDef):
    length = (node.end_lineno or node.lineno) - node.lineno + 1
    assert length <= MAX_FUNCTION_LINES, f"{where} is {length} lines (at most {MAX_FUNCTION_LINES})"
    depth = _depth(node)
    assert depth <= MAX_DEPTH, f"{where} nests {depth} deep (at most {MAX_DEPTH})"


def test_the_core_class_is_small():
    tree = ast.parse((APPLY / "handlers.py").read_text())
    (core,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Applier"]
    length = (core.end_lineno or core.lineno) - core.lineno + 1
    assert length <= MAX_CORE_LINES, f"Applier is {length} lines (at most {MAX_CORE_LINES})"


def test_the_depth_measure():
    code = "def f():\n    if a:\n        for b in c:\n            pass\n    elif d:\n        pass\n"
    (f,) = ast.parse(code).body
    assert _depth(f) == 2
