"""The cutover's sequences, in a few round trips whatever their number (issue 28): every sequence of the migrated
schemas is set on the target from the source (``setval(last_value, is_called)``), and each one a column owns must
next give a value past that column's largest on the target.

One statement reads all of them on the source, one sets them all on the target, one reads the owning columns'
largest values: at the issue's size (201 sequences) the one-by-one version took four round trips per sequence
under the fence. Which sequences there are and which columns own them is read before the fence
(:func:`list_source`); with a count before the fence (:mod:`applier.migrate.counts`) so are the owning columns'
extremes on the target (:func:`extremes`), and under the fence only the tables changed since are read again: a
table no transaction changed after the count's point C gets no row from the stream, so its extremes are final
(the same limit as the counts': nothing else may write to the new server before the cutover is done).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate.state import MigrationError

__all__ = ["Extremes", "Owned", "extremes", "list_source", "read_values", "set_on_target"]

_OWNED_SEQUENCES = """
SELECT format('%I.%I', sn.nspname, s.relname), format('%I.%I', tn.nspname, t.relname), a.attname
FROM pg_depend d
JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' JOIN pg_namespace sn ON sn.oid = s.relnamespace
JOIN pg_class t ON t.oid = d.refobjid JOIN pg_namespace tn ON tn.oid = t.relnamespace
JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
"""


@dataclass
class Owned:
    """The migrated schemas' sequences on the source (quoted, qualified names) and, for those a column owns, that
    table and column: read before the fence (the schema does not change during a migration)."""

    seqs: list[str]
    owned: dict[str, tuple[str, str]] = field(default_factory=dict)


def list_source(src: psycopg.Connection[Any], covers_schema: Any) -> Owned:
    """Every sequence of the schemas ``covers_schema`` accepts, and the columns that own them."""
    seqs = [
        r[0]
        for r in src.execute(
            "SELECT format('%I.%I', schemaname, sequencename), schemaname FROM pg_sequences ORDER BY 1"
        )
        if covers_schema(r[1])
    ]
    mine = set(seqs)
    return Owned(seqs, {r[0]: (r[1], r[2]) for r in src.execute(_OWNED_SEQUENCES) if r[0] in mine})


def read_values(src: psycopg.Connection[Any], seqs: Sequence[str]) -> list[tuple[str, int, bool, int]]:
    """Each sequence's ``last_value``, ``is_called`` and increment on the source (under the fence: no session may
    call ``nextval`` then). One statement reads those that were called (``pg_sequence_last_value``, as the
    ``pg_sequences`` view does: 201 in 0.02 s under the fence, where a ``UNION ALL`` over their relations took
    0.2 s); the rest (its answer is NULL: never called, or set with ``is_called`` false) are read from their
    relations."""
    if not seqs:
        return []
    rows = src.execute(
        "SELECT s, pg_sequence_last_value(s::regclass), p.seqincrement FROM unnest(%s::text[]) AS s"
        " JOIN pg_sequence p ON p.seqrelid = s::regclass",
        (list(seqs),),
    ).fetchall()
    values = [(str(s), int(v), True, int(inc)) for s, v, inc in rows if v is not None]
    uncalled = [str(s) for s, v, _ in rows if v is None]
    if uncalled:
        parts = [
            sql.SQL(
                "SELECT {}::text, last_value, is_called, (SELECT seqincrement FROM pg_sequence WHERE seqrelid = "
                "{}::regclass) FROM {}"
            ).format(sql.Literal(seq), sql.Literal(seq), sql.SQL(seq))
            for seq in uncalled
        ]
        values += [tuple(r) for r in src.execute(sql.SQL(" UNION ALL ").join(parts))]  # type: ignore[misc]
    return values


def _present(target: psycopg.Connection[Any], names: Sequence[str]) -> set[str]:
    """Those of ``names`` (quoted, qualified relation names) the target has."""
    rows = target.execute(
        "SELECT n FROM unnest(%s::text[]) n WHERE to_regclass(n) IS NOT NULL", (list(names),)
    )
    return {r[0] for r in rows}


#: a sequence's owning column on the target: its largest and smallest value (None: no row)
Extremes = dict[str, tuple[int | None, int | None]]


def extremes(
    target: psycopg.Connection[Any], owned: Owned, tables: Collection[str] | None = None
) -> Extremes:
    """The largest and smallest value of each owning column on the target (of ``tables`` only, if given), in one
    statement; tables the target does not have are left out."""
    mine = {seq: tc for seq, tc in owned.owned.items() if tables is None or tc[0] in tables}
    present = _present(target, sorted({tc[0] for tc in mine.values()}))
    parts = [
        sql.SQL("SELECT {}::text, max({c})::numeric, min({c})::numeric FROM {}").format(
            sql.Literal(seq), sql.SQL(table), c=sql.Identifier(column)
        )
        for seq, (table, column) in mine.items()
        if table in present
    ]
    if not parts:
        return {}
    rows = target.execute(sql.SQL(" UNION ALL ").join(parts)).fetchall()
    return {seq: (None if hi is None else int(hi), None if lo is None else int(lo)) for seq, hi, lo in rows}


def _check_ahead(owned: Owned, tops: Extremes, following: dict[str, tuple[int, int]]) -> None:
    """Refuse the cutover if a sequence's next value is already in the column that owns it (a table not migrated
    is not checked): the first insert on the new server would fail."""
    for seq, (nxt, inc) in following.items():
        if seq not in tops:
            continue
        hi, lo = tops[seq]
        top = hi if inc > 0 else lo
        if top is not None and (nxt <= top if inc > 0 else nxt >= top):
            table, column = owned.owned[seq]
            raise MigrationError(
                f"sequence {seq} would next give {nxt}, but {table}.{column} already holds {top}"
            )


def set_on_target(
    target: psycopg.Connection[Any],
    owned: Owned,
    values: Sequence[tuple[str, int, bool, int]],
    before: Extremes | None = None,
    changed: Collection[str] | None = None,
) -> None:
    """Set every sequence of ``values`` (:func:`read_values`) the target has, in one target transaction, and check
    the owned ones against their columns: the extremes read ``before`` the fence for tables not ``changed`` since
    (both None: every column read now)."""
    if not values:
        return
    with target.transaction():
        present = _present(target, [v[0] for v in values])
        rows = [v for v in values if v[0] in present]  # the others: sequences of tables not migrated
        target.execute(
            "SELECT setval(s::regclass, v, c) FROM unnest(%s::text[], %s::int8[], %s::bool[]) AS u(s, v, c)",
            ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]),
        )
        following = {seq: (last + inc if called else last, inc) for seq, last, called, inc in rows}
        if before is None or changed is None:
            tops = extremes(target, owned)
        else:
            tops = {seq: v for seq, v in before.items() if owned.owned[seq][0] not in changed}
            tops |= extremes(target, owned, set(changed))
        _check_ahead(owned, tops, following)
