"""The catalog's SQL lives in one place (issue 18, step 3): no module of ``applier``, ``tablesync`` or ``state``
outside ``applier/catalog/`` names a table of the catalog in SQL text, nor builds statements from its SQLAlchemy
tables. A change to a catalog table or column (``applier.catalog.schema``, with a migration) then finds every
statement that touches it in that package: :class:`applier.catalog.store.Catalog` for what runs on a connection of
its own or a SQLAlchemy one, :mod:`applier.catalog.sql` for the text that a caller sends on its own session.

The check reads the source (``ast``), not the running code: every string and bytes constant that is not
documentation (a bare string statement, i.e. a docstring) and that names ``applier.<catalog table>`` next to SQL
words. Docstrings, comments and log messages may name the tables; SQL may not. Tests and benchmarks are not
checked: they read the catalog to check it.

The migration's own tables (``applier.migration``, ``applier.migration_step``: catalog version 6, plain DDL in
:data:`applier.catalog.schema.MIGRATION_TABLES`) have a home of their own: :mod:`applier.migrate.store`. No other
module names them in SQL text (issue 27, item 1).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from applier.catalog.schema import MIGRATION_TABLES as MIGRATION_DDL
from applier.catalog.schema import SCHEMA, metadata

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("applier", "tablesync", "state")
HOME = ROOT / "applier" / "catalog"

#: The catalog's tables, from its schema, so that a new table is covered without touching this test.
TABLES = sorted(t.name for t in metadata.tables.values() if t.schema == SCHEMA)

_NAMES = re.compile(rf"\b{re.escape(SCHEMA)}\.({'|'.join(TABLES)})\b", re.IGNORECASE)

#: The migration's tables, from their DDL, and the only modules that may send SQL on them.
MIGRATION_TABLES = sorted(re.findall(rf"CREATE TABLE IF NOT EXISTS {SCHEMA}\.(\w+)", " ".join(MIGRATION_DDL)))
_MIGRATION_NAMES = re.compile(rf"\b{re.escape(SCHEMA)}\.({'|'.join(MIGRATION_TABLES)})\b", re.IGNORECASE)
MIGRATION_HOME = (ROOT / "applier" / "migrate" / "store.py", ROOT / "applier" / "catalog" / "schema.py")
# SQL words: these in any case; the ones that are English words too only in capitals, as our SQL writes them
_SQL = re.compile(
    r"\b(?i:select|insert|update|delete|join|where|truncate|returning|to_regclass|regclass)\b"
    r"|\b(FROM|INTO|TABLE|SET|USING|COPY|LOCK|ALTER|VALUES)\b"
)


def _documentation(tree: ast.AST) -> set[int]:
    """The ids of the constants that are bare string statements: docstrings, never sent to a server."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _sql_constants(tree: ast.AST, names: re.Pattern[str], filename: str) -> list[str]:
    """The string and bytes constants of ``tree`` that are not documentation and name one of ``names`` next to SQL
    words, one line each (``file:line: what``)."""
    docs = _documentation(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes) and id(node) not in docs:
            text = node.value if isinstance(node.value, str) else node.value.decode("utf-8", "replace")
            tables = names.findall(text)
            if tables and _SQL.search(text):
                found.append(
                    f"{filename}:{node.lineno}: SQL on {', '.join(sorted(set(tables)))}: {text[:80]!r}"
                )
    return found


def migration_sql_in(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` names one of the migration's tables in SQL text, one line each."""
    return _sql_constants(ast.parse(source, filename), _MIGRATION_NAMES, filename)


def catalog_sql_in(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` names a catalog table in SQL text or imports the catalog's SQLAlchemy tables, one line
    each (``file:line: what``)."""
    tree = ast.parse(source, filename)
    found = _sql_constants(tree, _NAMES, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "applier.catalog.schema":
            used = sorted({a.name for a in node.names} & set(TABLES))
            if used:
                found.append(f"{filename}:{node.lineno}: imports the catalog table(s) {', '.join(used)}")
    return found


def _modules() -> list[Path]:
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in paths if HOME not in p.parents]


def test_no_catalog_sql_outside_the_catalog_package():
    modules = _modules()
    assert len(modules) > 50  # the walk found the code
    found = [f for p in modules for f in catalog_sql_in(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, (
        "catalog SQL outside applier/catalog/ (move it to a Catalog method in applier/catalog/store.py, or to "
        "applier/catalog/sql.py when the caller must send it on its own session):\n" + "\n".join(found)
    )


def test_the_catalog_package_is_where_its_sql_is():
    """The check is not vacuous: it finds the catalog's own statements."""
    found = [f for p in sorted(HOME.glob("*.py")) for f in catalog_sql_in(p.read_text(), p.name)]
    assert any(f.startswith("sql.py:") for f in found)
    assert any(f.startswith("store.py:") for f in found)
    # every table of the schema is one the check recognises (a table added later is covered without an edit)
    source = 'Q = "DELETE FROM applier.{} WHERE subid = %s"\n'
    missed = [t for t in TABLES if not catalog_sql_in(source.format(t))]
    assert not missed, missed


@pytest.mark.parametrize(
    "code",
    [
        'X = "SELECT subid FROM applier.subscription WHERE subname = %s"\n',
        'c.execute("update applier.subscription set subenabled = false")\n',
        'Q = (b"UPDATE applier.subscription_rel SET srsubstate = $1"\n     b" WHERE subid = $2")\n',
        'rows = t.execute(" FROM applier.prepared_xact p WHERE p.subid = %s", (1,))\n',
        "from applier.catalog.schema import SCHEMA, subscription_rel\n",
    ],
)
def test_the_check_finds_catalog_sql(code: str):
    assert catalog_sql_in(code)


@pytest.mark.parametrize(
    "code",
    [
        '"""Stored in ``applier.subscription.subconninfo``; SELECT it from applier.subscription."""\n',
        'def f():\n    """Reads applier.subscription_rel: SELECT ... FROM it."""\n',
        'log.warning("cannot add applier.apply_lag: %s", exc)\n',
        'X = "SELECT subname FROM applier.subscriptions_view"\n',  # not a catalog table
        "from applier.subscriptions import status\n",
        "from applier.catalog.schema import SCHEMA, metadata\n",
    ],
)
def test_the_check_lets_documentation_pass(code: str):
    assert not catalog_sql_in(code)


def test_no_migration_sql_outside_its_store():
    modules = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p not in MIGRATION_HOME]
    assert len(modules) > 50
    found = [f for p in modules for f in migration_sql_in(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, (
        "SQL on the migration's tables outside applier/migrate/store.py (add a function there):\n"
        + "\n".join(found)
    )


def test_the_migration_store_is_where_its_sql_is():
    """The check is not vacuous: it finds the store's statements, on both tables."""
    assert MIGRATION_TABLES == ["migration", "migration_step"]
    found = migration_sql_in(MIGRATION_HOME[0].read_text(), "store.py")
    assert {t for t in MIGRATION_TABLES if any(f"SQL on {t}:" in f for f in found)} == set(MIGRATION_TABLES)


@pytest.mark.parametrize(
    "code",
    [
        "X = \"UPDATE applier.migration SET phase = 'failed' WHERE name = %s\"\n",
        'c.execute("SELECT statements FROM applier.migration_step WHERE kind = %s", (k,))\n',
        'Q = (" count(*) FILTER (WHERE done) FROM applier.migration_step"\n     " WHERE name = %s")\n',
    ],
)
def test_the_check_finds_migration_sql(code: str):
    assert migration_sql_in(code)


@pytest.mark.parametrize(
    "code",
    [
        '"""State in ``applier.migration``; SELECT it FROM applier.migration_step."""\n',
        'say("migration steps: see applier.migration_step")\n',
        'X = "SELECT name FROM applier.migrations_view"\n',
    ],
)
def test_the_migration_check_lets_documentation_pass(code: str):
    assert not migration_sql_in(code)
