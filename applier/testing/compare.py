"""Compare table contents between servers: the equality check of tests, the demo and `verify`'s simplest form."""

from __future__ import annotations

from typing import Any

from psycopg import sql

from applier.testing.cluster import Database


def table_rows(db: Database, table: str, columns: list[str] | None = None) -> list[tuple[Any, ...]]:
    """All rows of ``schema.table`` (or ``table``) as text tuples, in a total order independent of physical order."""
    ident = _ident(table)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in columns) if columns else None
    with db.connect() as conn:
        if cols is None:
            names = [
                r[0]
                for r in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
                    " AND NOT attisdropped ORDER BY attnum",
                    (ident.as_string(conn),),
                ).fetchall()
            ]
            cols = sql.SQL(", ").join(sql.Identifier(c) for c in names)
        # the alias must not be a column name of the table, or `alias::text` would pick that column
        query = sql.SQL("SELECT applier_row_::text FROM (SELECT {cols} FROM {tbl}) applier_row_ ORDER BY 1")
        query = query.format(cols=cols, tbl=ident)
        return [r[0] for r in conn.execute(query).fetchall()]


def table_digest(db: Database, table: str, columns: list[str] | None = None) -> tuple[int, str]:
    """(row count, md5 over the ordered text of every row): byte-exact equality without shipping rows around."""
    import hashlib

    rows = table_rows(db, table, columns)
    h = hashlib.md5(usedforsecurity=False)
    for r in rows:
        h.update(r.encode())
        h.update(b"\n")
    return len(rows), h.hexdigest()


def tables_differ(a: Database, b: Database, table: str, columns: list[str] | None = None) -> str | None:
    """None when equal, else a short description of the first differences (for assertion messages)."""
    ra, rb = table_rows(a, table, columns), table_rows(b, table, columns)
    if ra == rb:
        return None
    sa, sb = set(ra), set(rb)
    only_a, only_b = sorted(sa - sb)[:5], sorted(sb - sa)[:5]
    return f"{table}: {len(ra)} vs {len(rb)} rows; only on {a.name}: {only_a}; only on {b.name}: {only_b}"


def assert_tables_equal(a: Database, b: Database, *tables: str, columns: list[str] | None = None) -> None:
    problems = [d for t in tables if (d := tables_differ(a, b, t, columns))]
    assert not problems, "\n".join(problems)


def _ident(table: str) -> sql.Identifier:
    return sql.Identifier(*table.split(".", 1))
