"""The catalog writes of the apply session, queued on its pipeline: table states with origin progress
(``mark_ready``), and the ``applier.prepared_xact`` records of prepared transactions (behaviour 65), one at a time
or several in one statement (:mod:`applier.apply.prepared_records` decides which).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from psycopg import sql

from applier.apply.context import ErrorContext
from applier.catalog import sql as catalog_sql
from applier.lsn import format_lsn, now_pg_timestamp, parse_lsn
from state.tables import SyncState

if TYPE_CHECKING:  # (the session creates its CatalogWrites; typing only)
    from applier.apply.target import Target

#: A GID that is a valid SQL string literal once put in single quotes (see gid_literal).
_PLAIN_GID = re.compile(r"[A-Za-z0-9_]+")


def gid_literal(gid: str, conn: Any) -> bytes:
    """``gid`` as an SQL string literal; ours (``pg_gid_<subid>_<xid>``) need no escaping, so the general
    quoting (which asks the connection for its encoding and string settings) is only for anything else."""
    if _PLAIN_GID.fullmatch(gid):
        return b"'" + gid.encode() + b"'"
    return sql.Literal(gid).as_bytes(conn)


class CatalogWrites:
    """The catalog statements of one target session (``session``: its transactions and pipeline)."""

    def __init__(self, session: Target) -> None:
        self.session = session
        self.pipeline = session.pipeline
        self._record_prepared_ready = False
        self._record_many_ready = False
        self._reconcile_ready = False

    def mark_ready(
        self,
        subid: int,
        tables: Sequence[tuple[int, SyncState, int | None]],
        origin_lsn: int,
        origin: str | None = None,
    ) -> None:
        """Set table states and advance the session's origin to ``origin_lsn`` in one local transaction, and wait
        for it. Only between remote transactions (nothing else may be open). ``origin`` names the session's origin
        in an error's context: a live sync's catch-up applies through its own, not the subscription's."""
        ctx = ErrorContext(origin or f"applier_{subid}", "COMMIT")
        self.session.begin(ctx)
        for relid, state, lsn in tables:
            self.pipeline.send_query(
                catalog_sql.SET_TABLE_STATE,
                [
                    state.encode(),
                    None if lsn is None else format_lsn(lsn).encode(),
                    str(subid).encode(),
                    str(relid).encode(),
                ],
                ctx,
            )
        self.session.origin_setup(origin_lsn, now_pg_timestamp(), ctx)
        self.pipeline.send_prepared(
            b"applier_commit", (), None, ctx, self.session.confirming(origin_lsn, None)
        )
        self.session.in_transaction = False
        self.pipeline.drain()

    def record_prepared(
        self,
        gid: str,
        subid: int,
        xid: int,
        prepare_lsn: int,
        end_lsn: int,
        prepare_time: int,
        ctx: ErrorContext | None,
    ) -> None:
        """Queue the ``applier.prepared_xact`` record of a transaction about to be prepared (behaviour 65), as a
        statement prepared once per session (no parse and plan per transaction): in a transaction of its own, or
        in the open local transaction, whose commit the caller then sends (a group commit's)."""
        self.session.end_copy()
        if not self._record_prepared_ready:
            self.pipeline.send_prepare(
                b"applier_record_prepared",
                catalog_sql.RECORD_PREPARED,
                [],
                ctx,
            )
            self._record_prepared_ready = True
        self._recording(
            ctx,
            b"applier_record_prepared",
            [
                gid.encode(),
                str(subid).encode(),
                str(xid).encode(),
                format_lsn(prepare_lsn).encode(),
                format_lsn(end_lsn).encode(),
                str(prepare_time).encode(),
            ],
        )

    def record_prepared_many(
        self, records: Sequence[tuple[str, int, int, int, int]], subid: int, ctx: ErrorContext | None
    ) -> None:
        """Queue the records of several transactions, ``(gid, remote xid, prepare LSN, prepare end LSN, prepare
        time)`` each (distinct GIDs), as :meth:`record_prepared` does one: one statement, one transaction."""
        if not all(_PLAIN_GID.fullmatch(r[0]) for r in records):  # pragma: no cover - gid_for makes them so
            raise ValueError("record_prepared_many takes plain GIDs only")
        self.session.end_copy()
        if not self._record_many_ready:
            self.pipeline.send_prepare(
                b"applier_record_prepared_many",
                catalog_sql.RECORD_PREPARED_MANY,
                [],
                ctx,
            )
            self._record_many_ready = True

        def array(values: Any) -> bytes:
            # GIDs (pg_gid_<subid>_<xid>), LSNs and integers need no quoting inside an array literal
            return b"{" + b",".join(values) + b"}"

        self._recording(
            ctx,
            b"applier_record_prepared_many",
            [
                array(r[0].encode() for r in records),
                str(subid).encode(),
                array(str(r[1]).encode() for r in records),
                array(format_lsn(r[2]).encode() for r in records),
                array(format_lsn(r[3]).encode() for r in records),
                array(str(r[4]).encode() for r in records),
            ],
        )

    def reconcile_prepared(self, subid: int) -> None:
        """Queue the removal of the records of finished prepared transactions, in a local transaction of its own,
        without waiting for it. Only between remote transactions, with no local transaction open.

        On the apply session rather than the catalog's, because pipeline order is what makes it safe without a
        drain: the catalog's session would first have to wait until every queued PREPARE had run (a record whose
        PREPARE is still queued looks finished), and that drain stopped the loop from sending anything new, the
        lag spike of issue 19. Asynchronous commit (the apply session's setting) is enough: a removal lost in a
        crash is redone at the next start (``ApplyWorker`` reconciles before applying)."""
        ctx = ErrorContext(f"applier_{subid}", "COMMIT")
        self.session.end_copy()
        if not self._reconcile_ready:
            self.pipeline.send_prepare(b"applier_reconcile_prepared", catalog_sql.RECONCILE_PREPARED, [], ctx)
            self._reconcile_ready = True
        self.session.prepare_fixed(ctx)
        p = self.pipeline
        p.send_prepared(b"applier_begin", (), None, ctx)
        p.send_prepared(b"applier_reconcile_prepared", (str(subid).encode(),), None, ctx)
        p.send_prepared(b"applier_commit", (), None, ctx)

    def _recording(self, ctx: ErrorContext | None, statement: bytes, params: list[bytes | None]) -> None:
        """Run a record statement in the open local transaction, or in one of its own."""
        own = not self.session.in_transaction  # else it rides in the open (group commit's) transaction
        p = self.pipeline
        if own:
            self.session.prepare_fixed(ctx)
            p.send_prepared(b"applier_begin", (), None, ctx)
        p.send_prepared(statement, params, None, ctx)
        if own:
            p.send_prepared(b"applier_commit", (), None, ctx)

    def prepared_transactions(self, subid: int) -> dict[str, tuple[int, int]]:
        """Our recorded prepared transactions that exist on the target: gid -> (prepare_end_lsn, prepare_time)."""
        rows = self.session.query(catalog_sql.PREPARED_TRANSACTIONS, (subid,))
        return {gid: (parse_lsn(lsn), int(ts)) for gid, lsn, ts in rows}
