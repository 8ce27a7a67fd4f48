"""The shape of the code, checked so that it stays readable (issue 18): no function in ``applier``, ``tablesync``
or ``state`` longer than :data:`MAX_FUNCTION_LINES` lines or with ``if``/``for``/``while``/``try``/``with`` nested
deeper than :data:`MAX_DEPTH`, and no class (the transaction/dispatch core,
:class:`applier.apply.handlers.Applier`, first) longer than :data:`MAX_CLASS_LINES` lines. A function or class that
grows past a limit is a sign that a strategy or a step wants its own function or module; see docs/architecture.md
for where each belongs.

The check covered ``applier/apply`` and ``tablesync/live.py`` first; it covers every package since the CLI's parser,
the migration, the runner and the initial copy were split into named steps. A function let off goes in
:data:`EXEMPT` with the reason, a class in :data:`EXEMPT_CLASSES` (issue 27 capped every class, not only the core).

The tests have a shape too (issue 38): no file under ``tests/`` imports a test module (``from test_migrate_start
import start``, ``from tests.unit.test_migrate_units import table``); what two test modules share lives in
``tests/support`` (fixtures offered by a ``conftest.py``). A file let off goes in :data:`EXEMPT_TEST_IMPORTS`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "applier" / "apply"
#: the packages checked, every module of each
PACKAGES = ("applier", "tablesync", "state")
CHECKED = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
MAX_FUNCTION_LINES = 60
MAX_DEPTH = 3
MAX_CLASS_LINES = 400
#: functions let off these limits ("path name"), each with the reason
EXEMPT: dict[str, str] = {
    "applier/decoder.py _read_tuple": "the codec's hottest loop, one turn per column of every row: its fourth level "
    "is a text/binary column's length check, and flattening it reorders the per-column tests (or adds a call per "
    "column); not without a benchmark on a quiet machine (tests/unit/test_decoder_fastpath.py, bench/)",
}
#: classes let off :data:`MAX_CLASS_LINES` ("path name"), each with the reason; remove one once it fits
EXEMPT_CLASSES: dict[str, str] = {
    "applier/apply/target.py Target": "432 lines: the apply's session on the target; its catalog, DML and COPY "
    "parts have modules of their own already; the preload of local tables (with its side connection and stamps) is "
    "the next part to move out",
}
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
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS) and f"{where} {node.name}" not in EXEMPT:
                found.append((f"{where}:{node.lineno} {node.name}", node))
    return found


FUNCTIONS = _functions()


def test_there_is_something_to_check():
    assert len(FUNCTIONS) > 1000
    for module in ("applier/apply/handlers.py", "applier/cli.py", "applier/migrate/", "tablesync/initial.py",
                   "tablesync/live.py", "state/"):  # fmt: skip
        assert any(w.startswith(module) for w, _ in FUNCTIONS), module


def test_every_exemption_names_a_function_that_exists():
    """An exemption outlives its function only by mistake: a renamed or split function must leave the list."""
    names = set()
    for path in CHECKED:
        where = path.relative_to(ROOT).as_posix()
        names |= {
            f"{where} {n.name}" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, _FUNCTIONS)
        }
    assert set(EXEMPT) <= names, set(EXEMPT) - names


@pytest.mark.parametrize("where,node", FUNCTIONS, ids=[w for w, _ in FUNCTIONS])
def test_function_shape(where: str, node: ast.FunctionDef | ast.AsyncFunctionDef):
    length = (node.end_lineno or node.lineno) - node.lineno + 1
    assert length <= MAX_FUNCTION_LINES, f"{where} is {length} lines (at most {MAX_FUNCTION_LINES})"
    depth = _depth(node)
    assert depth <= MAX_DEPTH, f"{where} nests {depth} deep (at most {MAX_DEPTH})"


def _classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for path in CHECKED:
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and f"{where} {node.name}" not in EXEMPT_CLASSES:
                found.append((f"{where}:{node.lineno} {node.name}", node))
    return found


CLASSES = _classes()


def test_the_core_class_is_small():
    """The transaction/dispatch core is never let off: the strategies live beside it, not in it."""
    assert not any(k.startswith("applier/apply/handlers.py ") for k in EXEMPT_CLASSES)
    tree = ast.parse((APPLY / "handlers.py").read_text())
    (core,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Applier"]
    length = (core.end_lineno or core.lineno) - core.lineno + 1
    assert length <= MAX_CLASS_LINES, f"Applier is {length} lines (at most {MAX_CLASS_LINES})"


def test_every_class_exemption_names_a_class_that_exists():
    names = set()
    for path in CHECKED:
        where = path.relative_to(ROOT).as_posix()
        names |= {
            f"{where} {n.name}" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
        }
    assert set(EXEMPT_CLASSES) <= names, set(EXEMPT_CLASSES) - names


@pytest.mark.parametrize("where,node", CLASSES, ids=[w for w, _ in CLASSES])
def test_class_size(where: str, node: ast.ClassDef):
    length = (node.end_lineno or node.lineno) - node.lineno + 1
    assert length <= MAX_CLASS_LINES, f"{where} is {length} lines (at most {MAX_CLASS_LINES})"


def test_the_depth_measure():
    code = "def f():\n    if a:\n        for b in c:\n            pass\n    elif d:\n        pass\n"
    (f,) = ast.parse(code).body
    assert _depth(f) == 2


#: a migration's phase compared with, or set from, a bare string (applier.migrate.state.Phase is the one spelling)
_PHASE_LITERAL = re.compile(
    r"""phase["']?\]?\s*(?:[=!]=|in\b|not in\b)\s*\(?\s*["'](?:schema|copy|following|cutover|done|failed)["']"""
    r"""|set_phase\([^)\n]*["'](?:schema|copy|following|cutover|done|failed)["']"""
)


def test_no_migration_phase_is_a_bare_string():
    """Issue 38: the phases are :class:`applier.migrate.state.Phase`; a string compared in one place and spelled
    differently in another is how the old code drifted (13 places)."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{n}"
        for path in CHECKED
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _PHASE_LITERAL.search(line)
    ]
    assert found == []
    assert _PHASE_LITERAL.search('if m.phase == "done":') and _PHASE_LITERAL.search(
        "phase in ('done', 'failed')"
    )


TESTS = ROOT / "tests"
#: files under tests/ let off the rule that no test module imports another ("path": the reason); remove one once
#: its imports come from tests/support
EXEMPT_TEST_IMPORTS: dict[str, str] = {}


def _test_module_imports(code: str) -> list[str]:
    """The imports in ``code`` of a test module (a dotted name with a ``test_*`` part): ``import test_x``, ``from
    test_x import y``, ``from tests.unit.test_x import y``, ``from tests.unit import test_x``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{node.module or ''}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(part.startswith("test_") for name in names for part in name.split(".")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_module_imports_another():
    """A helper, constant or fixture two test modules share lives in ``tests/support`` (a fixture offered by the
    folder's ``conftest.py``): importing a test module can load it a second time under another name
    (``tests.unit.test_x`` beside pytest's ``test_x``), works only where pytest put its folder on ``sys.path``, and
    makes one test module's helpers an interface that nobody reviews as one."""
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100 and TESTS / "integration" / "test_migrate_start.py" in files
    offending = [
        f"{where}:{line}"
        for path in files
        if (where := path.relative_to(ROOT).as_posix()) not in EXEMPT_TEST_IMPORTS
        for line in _test_module_imports(path.read_text())
    ]
    assert not offending, "import these from tests/support instead:\n" + "\n".join(offending)


def test_every_test_import_exemption_is_still_needed():
    """An exemption outlives its imports only by mistake: a file whose imports moved to tests/support leaves the
    list."""
    for where in EXEMPT_TEST_IMPORTS:
        path = ROOT / where
        assert path.exists(), where
        assert _test_module_imports(path.read_text()), (
            f"{where} imports no test module now: remove its exemption"
        )


def test_the_test_import_measure():
    code = (
        "import os\nimport test_a\nfrom test_b import c\nfrom tests.unit.test_d import e\n"
        "from tests.unit import test_f\nfrom tests.support.cli import ok\nfrom applier.testing import x\n"
        "def g():\n    from test_h import i\n"
    )
    assert [line.split(":")[0] for line in _test_module_imports(code)] == ["2", "3", "4", "5", "9"]


def test_the_migrations_knobs_are_read_in_one_module():
    """Issue 38: options are parsed once at the edge; the environment's tuning knobs are read only in
    ``applier/migrate/knobs.py`` (handing the whole environment on to ``pg_dump`` is not reading a knob)."""
    read = re.compile(r"os\.environ(?:\.get\(|\[)|os\.getenv\(")
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{n}"
        for path in sorted((ROOT / "applier" / "migrate").glob("*.py"))
        if path.name != "knobs.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if read.search(line)
    ]
    assert found == []
