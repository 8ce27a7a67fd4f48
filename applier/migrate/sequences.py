"""The cutover's sequences, in a few round trips whatever their number (issue 28): every sequence of the migrated
schemas is set on the target from the source (``setval(last_value, is_called)``), and each one a column owns must
next give a value past that column's largest on the target.

One statement reads all of them on the source, one sets them all on the target, one reads the owning columns'
largest values: at the issue's size (201 sequences) the one-by-one version took four round trips per sequence
under the fence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate.state import MigrationError

__all__ = ["set_from_source"]

_OWNED_SEQUENCES = """
SELECT format('%I.%I', sn.nspname, s.relname), format('%I.%I', tn.nspname, t.relname), a.attname
FROM pg_depend d
JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' JOIN pg_namespace sn ON sn.oid = s.relnamespace
JOIN pg_class t ON t.oid = d.refobjid JOIN pg_namespace tn ON tn.oid = t.relnamespace
JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
"""


def _read(src: psycopg.Connection[Any], seqs: Sequence[str]) -> list[tuple[str, int, bool, int]]:
    """Each sequence's ``last_value``, ``is_called`` and increment on the source, in one statement."""
    parts = [
        sql.SQL(
            "SELECT {}::text, last_value, is_called, (SELECT seqincrement FROM pg_sequence WHERE seqrelid = "
            "{}::regclass) FROM {}"
        ).format(sql.Literal(seq), sql.Literal(seq), sql.SQL(seq))
        for seq in seqs
    ]
    return [tuple(r) for r in src.execute(sql.SQL(" UNION ALL ").join(parts))]  # type: ignore[misc]


def _check_ahead(
    target: psycopg.Connection[Any], owned: dict[str, tuple[str, str]], following: dict[str, tuple[int, int]]
) -> None:
    """Refuse the cutover if a sequence's next value is already in the column that owns it (a table not migrated
    is not checked): the first insert on the new server would fail."""
    mine = [seq for seq in following if seq in owned]
    tables = [owned[seq][0] for seq in mine]
    present = {
        r[0]
        for r in target.execute(
            "SELECT t FROM unnest(%s::text[]) t WHERE to_regclass(t) IS NOT NULL", (tables,)
        )
    }
    parts = [
        sql.SQL("SELECT {}::text, {}").format(
            sql.Literal(seq),
            sql.SQL("max({})::numeric" if following[seq][1] > 0 else "min({})::numeric").format(
                sql.Identifier(owned[seq][1])
            ),
        )
        + sql.SQL(" FROM {}").format(sql.SQL(owned[seq][0]))
        for seq in mine
        if owned[seq][0] in present
    ]
    if not parts:
        return
    for seq, top in target.execute(sql.SQL(" UNION ALL ").join(parts)).fetchall():
        nxt, inc = following[seq]
        if top is not None and (nxt <= int(top) if inc > 0 else nxt >= int(top)):
            table, column = owned[seq]
            raise MigrationError(
                f"sequence {seq} would next give {nxt}, but {table}.{column} already holds {top}"
            )


def set_from_source(
    target: psycopg.Connection[Any], src: psycopg.Connection[Any], seqs: Sequence[str]
) -> None:
    """Set every sequence of ``seqs`` (quoted, qualified names on the source) the target has, in one target
    transaction, and check the owned ones against their columns."""
    if not seqs:
        return
    values = _read(src, seqs)
    owned = {r[0]: (r[1], r[2]) for r in src.execute(_OWNED_SEQUENCES)}
    with target.transaction():
        present = {
            r[0]
            for r in target.execute(
                "SELECT s FROM unnest(%s::text[]) s WHERE to_regclass(s) IS NOT NULL",
                ([v[0] for v in values],),
            )
        }
        rows = [v for v in values if v[0] in present]  # the others: sequences of tables not migrated
        target.execute(
            "SELECT setval(s::regclass, v, c) FROM unnest(%s::text[], %s::int8[], %s::bool[]) AS u(s, v, c)",
            ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]),
        )
        following = {seq: (last + inc if called else last, inc) for seq, last, called, inc in rows}
        _check_ahead(target, owned, following)
