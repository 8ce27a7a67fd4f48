"""``--conflict-log table|all``: each conflict the apply meets as a row of ``applier.conflict_log`` (the columns of
the conflict log table of PostgreSQL's development branch, plus ``subid`` and ``logged_at``), written in the local
transaction of the change it is about, so that a rolled-back attempt leaves no row.

Conflicts are found in the results of pipelined statements, which may be read after the COMMIT has been queued;
so with a table to write, the target reads every result of the transaction before its COMMIT or PREPARE (one
round trip per local transaction, only for such subscriptions) and queues one INSERT of the rows gathered, just
before the origin's progress and the COMMIT (:meth:`applier.apply.target.Target.commit`). A conflict that stops
the apply (the ``*_exists`` kinds) is in a transaction that is rolled back: it leaves no row, as said.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from applier.apply.conflicts import LocalRow
from applier.apply.context import ErrorContext
from applier.apply.relmap import RelMapEntry
from applier.catalog.sql import INSERT_CONFLICT_LOG
from applier.lsn import format_lsn
from applier.messages import KIND_BINARY, KIND_UNCHANGED_TOAST, TupleData


def tuple_json(entry: RelMapEntry, t: TupleData | None, positions: Any = None) -> dict[str, Any] | None:
    """A remote tuple as ``{column: text}`` (NULL as null; unchanged TOAST and binary values left out), of the
    columns at ``positions`` (default: all sent)."""
    if t is None:
        return None
    out: dict[str, Any] = {}
    for i in range(len(entry.names)) if positions is None else positions:
        kind, value = t.kinds[i], t.values[i]
        if kind in (KIND_UNCHANGED_TOAST, KIND_BINARY):
            continue
        out[entry.names[i]] = None if value is None else value.decode()
    return out


def local_json(entry: RelMapEntry, row: LocalRow) -> dict[str, Any]:
    """One local row a conflict met: its transaction, origin, commit time, unique key and values."""
    names = [c.name for c in entry.local.columns]
    return {
        "xid": row.xmin,
        "origin": row.origin_name,  # null: a local transaction, an origin dropped since, or not known
        "commit_ts": row.committed,
        "key": row.key,
        "tuple": dict(zip(names, row.values, strict=False)) if row.values is not None else None,
    }


class ConflictTable:
    """The conflict rows of the open local transaction of one apply session (see the module docstring)."""

    def __init__(self, subid: int) -> None:
        self.subid = subid
        self.rows: list[dict[str, Any]] = []

    def add(self, kind: str, ctx: ErrorContext | None, record: Any) -> None:
        """A conflict met: ``record`` is (entry, search tuple, new tuple, local row), the tuples and row when known."""
        entry, search, new, local = record
        key = entry.key_positions
        self.rows.append({
            "subid": self.subid, "relid": entry.local.oid, "schemaname": entry.local.schema,
            "relname": entry.local.name, "conflict_type": kind,
            "remote_xid": ctx.xid if ctx is not None else None,
            "remote_commit_lsn": format_lsn(ctx.finish_lsn) if ctx is not None and ctx.finish_lsn else None,
            "remote_origin": None,
            "replica_identity": tuple_json(entry, search, key),
            "remote_tuple": tuple_json(entry, new),
            "local_conflicts": [local_json(entry, local)] if local is not None else None,
        })  # fmt: skip

    def flush(self, pipeline: Any, ts: int, ctx: ErrorContext | None) -> None:
        """Queue the INSERT of the rows gathered (every result of the transaction has been read: the caller
        drained the pipeline), with the remote commit time ``ts``; forget them."""
        if self.rows:
            rows, self.rows = self.rows, []
            pipeline.send_query(INSERT_CONFLICT_LOG, [json.dumps(rows).encode(), str(ts).encode()], ctx)

    def reset(self) -> None:
        """The local transaction was abandoned: its rows go with it."""
        self.rows.clear()


def attach(stats: Any, target: Any, subid: int, mode: str, counted: Callable[[str], None]) -> None:
    """Set an apply session up for the subscription's ``--conflict-log`` ``mode``: ``log`` (lines only),
    ``table`` (rows only) or ``all`` (both). ``stats``: the core's ApplyStats, whose conflicts ``counted`` hears
    of (the worker's metrics); ``target``: its Target."""
    stats.on_conflict = counted
    stats.log_lines = mode != "table"
    if mode in ("table", "all"):
        table = ConflictTable(subid)
        stats.on_record = table.add
        target.conflict_table = table
