"""``update_origin_differs`` / ``delete_origin_differs``: the row an UPDATE or DELETE is about to change was last
written by another origin than this subscription's (a local session, or another subscription), as PostgreSQL 18's
``apply_handle_update_internal`` / ``apply_handle_delete_internal`` find with ``GetTupleTransactionInfo``.

PostgreSQL can only tell when ``track_commit_timestamp`` is on (the commit timestamp data holds the origin), and
so can we: the target session reads the setting once when it connects (:func:`read_setup`) and, only when it is
on, queues before each UPDATE/DELETE one more pipelined statement, prepared once per relation and row shape, that
reads the row's ``pg_xact_commit_timestamp_origin(xmin)`` and returns the row only when its origin differs from
ours. Nothing waits for it: its result is read with the others, and a row it returns is reported (logged at LOG,
counted) through :attr:`applier.apply.pipeline.Pipeline.on_conflict`. The change is then applied, as PostgreSQL
applies it. A bulk UPDATE/DELETE (applier.apply.bulk_exec) is preceded by one such statement for its whole stretch
(:meth:`OriginProbe.bulk_sql`), which reports each key's first change. With the setting off, an UPDATE or DELETE
costs one attribute test more, nothing else.

A row our own open transaction wrote has no commit timestamp yet (PostgreSQL's ``TransactionIdGetCommitTsData``
finds none), so a row changed twice in one transaction, or in a group commit, is not reported twice: as in
PostgreSQL, where such a row carries our origin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from applier.apply import conflicts
from applier.apply.context import ErrorContext
from applier.apply.relmap import RelMapEntry
from applier.apply.target_trust import only, tbl
from applier.messages import KIND_BINARY, TupleData

if TYPE_CHECKING:
    from applier.apply.target_dml import DmlStatements


def read_setup(conn: psycopg.Connection[Any], origin: str) -> int | None:
    """Our replication origin's id when ``track_commit_timestamp`` is on in the target, else None (no checks)."""
    row = conn.execute(
        "SELECT pg_catalog.current_setting('track_commit_timestamp')::bool,"
        " (SELECT roident FROM pg_catalog.pg_replication_origin WHERE roname = %s)",
        (origin,),
    ).fetchone()
    if row is None or not row[0]:
        return None
    return int(row[1] or 0)


class OriginProbe:
    """The origin-differs check of one target session (see the module docstring); ``roident``: our origin's id."""

    def __init__(self, dml: DmlStatements, roident: int) -> None:
        self.dml = dml
        self.roident = roident

    def before(self, entry: RelMapEntry, op: str, search: TupleData, new: TupleData | None, shape: bytes,
               ctx: ErrorContext | None) -> None:  # fmt: skip
        """Queue the check of the row that the UPDATE (``op`` "U", with its ``new`` tuple) or DELETE ("D") about
        to be queued will find with ``search``; its result reports the conflict, if any."""
        dml = self.dml
        key = ("origin", shape)
        name = entry.statements.get(key)
        if name is None:
            name = dml._statement(entry, key, lambda: self._probe_sql(entry, shape), ctx)  # noqa: SLF001
        params, kinds = dml._search_values(entry, search, shape)  # noqa: SLF001
        formats = (
            [1 if k == KIND_BINARY else 0 for k in kinds] if dml.binary and KIND_BINARY in kinds else None
        )
        kind = "update_origin_differs" if op == "U" else "delete_origin_differs"
        pipeline = dml.pipeline

        def found(res: Any) -> None:
            if res is not None and res.ntuples and pipeline.on_conflict is not None:
                row = self._local_row(res)
                detail = conflicts.change_detail(kind, entry, row, search, new)
                pipeline.on_conflict(kind, ctx, [detail], (entry, search, new, row))

        pipeline.send_prepared(name, params, formats, ctx, found)

    def _probe_sql(self, entry: RelMapEntry, shape: bytes) -> tuple[sql.Composable, Sequence[int]]:
        """The row (its xmin and its columns' text) that ``shape``'s search finds, with its commit origin and
        time, when those are known and the origin is not ours."""
        cond, types = self.dml._search_condition(entry, shape, 1)  # noqa: SLF001
        cols = sql.SQL(", ").join(
            sql.SQL("{}::pg_catalog.text").format(sql.Identifier(c.name)) for c in entry.local.columns
        )
        q = sql.SQL(
            'SELECT c.roident, o.roname, c."timestamp"::pg_catalog.text, q.* FROM'
            ' (SELECT xmin AS "applier xmin", {cols} FROM {only}{tbl} WHERE {cond} LIMIT 1) q'
            ' CROSS JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(q."applier xmin") c'
            " LEFT JOIN pg_catalog.pg_replication_origin o ON o.roident = c.roident"
            ' WHERE c."timestamp" IS NOT NULL AND c.roident <> {ours}'
        ).format(cols=cols, only=only(entry), tbl=tbl(entry.local), cond=cond, ours=sql.Literal(self.roident))
        return q, types

    def bulk_sql(self, entry: RelMapEntry, unnest: sql.Composable, ord_name: str) -> sql.Composable:
        """The check of a bulk UPDATE/DELETE's rows (keys as arrays, one per key column): for each key whose row
        was last written by another origin, the position of its first change in the stretch (a later change of
        the same key meets a row this transaction wrote), the origin, commit time, xmin and columns' text."""
        keys = [sql.Identifier(entry.names[i]) for i in entry.key_positions or ()]
        ordc = sql.Identifier(ord_name)
        texts = sql.SQL(", ").join(
            sql.SQL("t.{}::pg_catalog.text").format(sql.Identifier(c.name)) for c in entry.local.columns
        )
        return sql.SQL(
            "WITH s AS (SELECT * FROM {unnest} WITH ORDINALITY AS s({keys}, {ordc})),"
            ' f AS (SELECT DISTINCT ON ({skeys}) s.{ordc} AS "applier ord", t.xmin AS "applier xmin", {texts}'
            " FROM s JOIN {only}{tbl} AS t ON {match} ORDER BY {skeys}, s.{ordc})"
            ' SELECT f."applier ord", c.roident, o.roname, c."timestamp"::pg_catalog.text, f.* FROM f'
            ' CROSS JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(f."applier xmin") c'
            " LEFT JOIN pg_catalog.pg_replication_origin o ON o.roident = c.roident"
            ' WHERE c."timestamp" IS NOT NULL AND c.roident <> {ours}'
        ).format(
            unnest=unnest, keys=sql.SQL(", ").join(keys), ordc=ordc, texts=texts, only=only(entry),
            tbl=tbl(entry.local), ours=sql.Literal(self.roident),
            skeys=sql.SQL(", ").join(sql.SQL("s.{}").format(k) for k in keys),
            match=sql.SQL(" AND ").join(sql.SQL("t.{} = s.{}").format(k, k) for k in keys),
        )  # fmt: skip

    @classmethod
    def bulk_found(cls, on_found: Callable[[int, conflicts.LocalRow], None]) -> Callable[[Any], None]:
        """The result callback of :meth:`bulk_sql`: ``on_found(position, local row)`` for each row it returned."""

        def done(res: Any) -> None:
            for r in range(res.ntuples if res is not None else 0):
                texts = [
                    None if v is None else bytes(v).decode()
                    for v in (res.get_value(r, i) for i in range(res.nfields))
                ]
                # position, roident, roname, time, then f.*: position again, xmin, the columns
                on_found(int(texts[0] or 0), cls._row(texts[1], texts[2], texts[3], texts[5], texts[6:]))

        return done

    @staticmethod
    def _row(roident: str | None, roname: str | None, committed: str | None, xmin: str | None,
             values: list[str | None]) -> conflicts.LocalRow:  # fmt: skip
        return conflicts.LocalRow(
            xmin=int(xmin or 0),
            origin_id=int(roident or 0),
            origin_name=roname,
            committed=committed,
            values=values,
        )

    @staticmethod
    def _local_row(res: Any) -> conflicts.LocalRow:
        """The row the check returned: its origin, commit time, xmin and columns' text."""
        texts = [
            None if v is None else bytes(v).decode()
            for v in (res.get_value(0, i) for i in range(res.nfields))
        ]
        return OriginProbe._row(texts[0], texts[1], texts[2], texts[3], texts[4:])
