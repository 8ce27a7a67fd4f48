"""``insert_exists``, ``update_exists`` and ``multiple_unique_conflicts``: a remote INSERT or UPDATE that meets
existing rows on the target's unique indexes. PostgreSQL 18 checks every immediate unique index of the table
(``InitConflictIndexes``, in index OID order) and raises one ERROR naming each conflicting row; the apply stops until
the local rows go, and every attempt counts.

Our statements are pipelined and the target raises a plain unique violation (23505) for the first index it meets, so
the report is made once the attempt has failed and been rolled back (:meth:`applier.apply.retries.SessionRetries`),
on a connection of its own, from what the error carries (:attr:`~applier.apply.context.ApplyError.unique`): the
table and the index, and, for a change sent as a statement of its own, the remote row
(:attr:`~applier.apply.context.ApplyError.remote`). With the remote row, every unique index is searched for rows it
meets (more than one index: ``multiple_unique_conflicts``), an UPDATE's own row aside; without it (the row went
in a COPY or a bulk statement), the index the target named is searched for the key its DETAIL gives. Each local row
is described as PostgreSQL describes it: its transaction, origin and commit time (when ``track_commit_timestamp``
knows them), key and values (:mod:`applier.apply.conflicts`). Costs nothing until such an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.apply import conflicts
from applier.apply.conflicts import identity_description, remote_texts
from applier.apply.context import ApplyError

_SERVER_KEY = re.compile(r"Key \((.*)\)=\((.*)\) already exists\.", re.S)

_INDEXES = (
    "SELECT c.relname, pg_catalog.pg_get_expr(i.indpred, i.indrelid),"
    " ARRAY(SELECT pg_catalog.pg_get_indexdef(i.indexrelid, k, true)"
    "       FROM pg_catalog.generate_series(1, i.indnkeyatts) k ORDER BY k)"
    " FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid"
    " WHERE i.indrelid = %s AND i.indisunique AND i.indimmediate AND i.indisvalid ORDER BY i.indexrelid"
)
_COLUMNS = (
    "SELECT attname, pg_catalog.format_type(atttypid, atttypmod) FROM pg_catalog.pg_attribute"
    " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
)


def kind_of(exc: ApplyError) -> str:
    """The kind a unique violation is when nothing more can be learnt: by the change that met it."""
    return (
        "update_exists"
        if exc.context is not None and exc.context.message_type == "UPDATE"
        else "insert_exists"
    )


def report(conn: psycopg.Connection[Any], exc: ApplyError) -> tuple[str, list[str]]:
    """The conflict kind of the unique violation ``exc`` and its DETAIL parts, read from the target now (the
    attempt has been rolled back; the local rows it met are still there). Raises psycopg's errors."""
    assert exc.unique is not None
    schema, table, index, server_detail = exc.unique
    qualified = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    oid = conn.execute("SELECT %s::regclass::oid", (qualified.as_string(conn),)).fetchone()
    assert oid is not None
    indexes = conn.execute(_INDEXES, (oid[0],)).fetchall()
    columns = conn.execute(_COLUMNS, (oid[0],)).fetchall()
    timed = bool(
        conn.execute("SELECT pg_catalog.current_setting('track_commit_timestamp')::bool").fetchone()[0]
    )  # type: ignore[index]
    search = _Search(conn, qualified, columns, timed)
    kind = kind_of(exc)
    if exc.remote is not None:
        entry, old, new = exc.remote
        values = dict(zip((c.name for c in entry.local.columns), remote_texts(entry, new), strict=True))
        remote = [values.get(name) for name, _ in columns]
        exclude = None
        if kind == "update_exists" and entry.key_positions is not None:
            exclude = {
                entry.names[i]: remote_texts(entry, old)[_local(entry, i)] for i in entry.key_positions
            }
        rows = [
            r for name, pred, exprs in indexes if (r := search.by_row(name, pred, exprs, remote, exclude))
        ]
        identity = identity_description(entry, old) if kind == "update_exists" else None
        shown = search.remote_row(remote)
    else:
        rows, identity, shown = [], None, None
        for name, _pred, exprs in indexes:
            if name == index and (key := _server_key(server_detail, len(exprs))) is not None:
                rows = [r for r in [search.by_key(name, exprs, key)] if r]
    if len(rows) > 1:
        kind = "multiple_unique_conflicts"
    if not rows:
        return kind, [server_detail]
    text, full = identity or (None, False)
    return kind, [conflicts.detail(kind, r, shown, text, full) for r in rows]


def _local(entry: Any, remote_position: int) -> int:
    """The local column position of a remote column (remote_texts gives local order)."""
    name = entry.names[remote_position]
    return next(i for i, c in enumerate(entry.local.columns) if c.name == name)


def _server_key(detail: str, n: int) -> list[str] | None:
    """The values of the server's ``Key (a, b)=(1, 2) already exists.``, when they split into ``n`` unambiguously."""
    m = _SERVER_KEY.fullmatch(detail.strip())
    if m is None:
        return None
    values = m.group(2).split(", ") if n > 1 else [m.group(2)]
    return values if len(values) == n else None


class _Search:
    """The queries that find a conflicting local row and describe it (one per index searched)."""

    def __init__(self, conn: psycopg.Connection[Any], table: sql.Composable, columns: Sequence[tuple[str, str]],
                 timed: bool) -> None:  # fmt: skip
        self.conn, self.table, self.columns, self.timed = conn, table, columns, timed

    def _remote_cte(
        self, name: str, values: Sequence[str | None], columns: Sequence[tuple[str, str]]
    ) -> sql.Composable:
        cols = sql.SQL(", ").join(
            sql.SQL("{}::" + typ + " AS {}").format(sql.Literal(v), sql.Identifier(col))
            for (col, typ), v in zip(columns, values, strict=True)
        )
        return sql.SQL("{} AS (SELECT {})").format(sql.Identifier(name), cols)

    def remote_row(self, remote: Sequence[str | None]) -> list[str | None]:
        """The remote row as the target's types print it (NULL where not sent)."""
        cols = sql.SQL(", ").join(
            sql.SQL("{}::pg_catalog.text").format(sql.Identifier(c)) for c, _ in self.columns
        )
        q = sql.SQL("WITH {} SELECT {} FROM r").format(self._remote_cte("r", remote, self.columns), cols)
        got = self.conn.execute(q).fetchone()
        return list(got) if got is not None else list(remote)

    def by_row(self, index: str, pred: str | None, exprs: Sequence[str], remote: Sequence[str | None],
               exclude: dict[str, str | None] | None) -> conflicts.LocalRow | None:  # fmt: skip
        """The local row that index ``index`` finds for the remote row (not the one an UPDATE changes)."""
        keys = sql.SQL(", ").join(sql.SQL(e) for e in exprs)
        ctes = [self._remote_cte("r", remote, self.columns)]
        cond = sql.SQL("({}) IN (SELECT {} FROM r)").format(keys, keys)
        if pred:
            cond = sql.SQL("{} AND ({})").format(cond, sql.SQL(pred))
        if exclude:
            types = dict(self.columns)
            ctes.append(self._remote_cte("w", list(exclude.values()), [(c, types[c]) for c in exclude]))
            mine = sql.SQL(", ").join(sql.Identifier(c) for c in exclude)
            cond = sql.SQL("{} AND ({}) NOT IN (SELECT {} FROM w)").format(cond, mine, mine)
        return self._find(index, exprs, sql.SQL("WITH {} ").format(sql.SQL(", ").join(ctes)), cond, ())

    def by_key(self, index: str, exprs: Sequence[str], key: Sequence[str]) -> conflicts.LocalRow | None:
        """The local row whose key in ``index`` is ``key`` (the server's text of each value)."""
        cond = sql.SQL("({}) = ({})").format(
            sql.SQL(", ").join(sql.SQL(e) for e in exprs), sql.SQL(", ").join(sql.Placeholder() * len(key))
        )
        return self._find(index, exprs, sql.SQL(""), cond, key)

    def _find(self, index: str, exprs: Sequence[str], with_: sql.Composable, cond: sql.Composable,
              params: Sequence[str]) -> conflicts.LocalRow | None:  # fmt: skip
        texts = [sql.SQL("({})::pg_catalog.text").format(sql.SQL(e)) for e in exprs] + [
            sql.SQL("{}::pg_catalog.text").format(sql.Identifier(c)) for c, _ in self.columns
        ]
        origin = (
            sql.SQL('c.roident, o.roname, c."timestamp"::pg_catalog.text')
            if self.timed
            else sql.SQL("NULL::oid, NULL::name, NULL::text")
        )
        joins = (
            sql.SQL(
                ' CROSS JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(q."applier xmin") c'
                " LEFT JOIN pg_catalog.pg_replication_origin o ON o.roident = c.roident"
            )
            if self.timed
            else sql.SQL("")
        )
        q = sql.SQL(
            '{with_}SELECT {origin}, q.* FROM (SELECT xmin AS "applier xmin", {texts} FROM {table}'
            " WHERE {cond} LIMIT 1) q{joins}"
        ).format(with_=with_, origin=origin, texts=sql.SQL(", ").join(texts), table=self.table, cond=cond,
                 joins=joins)  # fmt: skip
        got = self.conn.execute(q, params or None).fetchone()
        if got is None:
            return None
        n = len(exprs)
        return conflicts.LocalRow(
            xmin=int(str(got[3])), origin_id=got[0], origin_name=got[1], committed=got[2],
            values=list(got[4 + n :]), index=index, key=conflicts.index_description(exprs, got[4 : 4 + n]),
        )  # fmt: skip
