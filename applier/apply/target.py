"""The target adapter: one psycopg connection to the target database, driven as a libpq pipeline.

The target is a network hop away, so a round trip per row would cap the apply rate at 1/RTT. Every row change is
therefore sent as an execution of a per-relation prepared statement in libpq *pipeline mode*, with the publisher's
values passed through untouched: text values as text parameters and binary values as binary parameters, each typed
with the OID of the *local* column so that the target runs the local type's input (or receive) function, as the
native worker does (behaviour 42). Results are read back in batches; the only round trips are one per transaction
commit and the rare synchronous queries (a relation's first use, feedback LSNs).

We use psycopg's libpq wrapper (``conn.pgconn``) directly rather than psycopg's cursor-level pipeline: the values
are already bytes in the server's text/binary formats, so there is nothing to adapt, and owning the result queue
lets every queued statement keep its own :class:`~applier.apply.context.ErrorContext` (which row of which relation
failed) and its own completion callback (which commit finished). psycopg puts connections in non-blocking mode; we
wait on the socket with ``select`` for both directions, so neither side can stall on a full buffer.

Runs of inserts into one table are sent as ``COPY ... FROM STDIN`` when they are long enough for that to pay (COPY
cannot run in pipeline mode, so the pipeline is drained and left first).

Session settings are the native worker's (behaviour 51) plus the value formats of behaviour 1, with an empty
``search_path``: every identifier is schema-qualified and composed with :mod:`psycopg.sql`, never string-formatted.
"""

from __future__ import annotations

import logging
import re
import select
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import pq, sql

from applier.apply.context import ApplyError, ErrorContext
from applier.apply.lag import LagWindow
from applier.apply.ports import copy_eligible
from applier.apply.relmap import LocalColumn, LocalTable, RelMapEntry
from applier.catalog import sql as catalog_sql
from applier.lsn import format_lsn, now_pg_timestamp, parse_lsn
from applier.messages import KIND_BINARY, KIND_UNCHANGED_TOAST, TupleData
from state.tables import SyncState

log = logging.getLogger(__name__)

_S = pq.ExecStatus
_OK = (_S.COMMAND_OK, _S.TUPLES_OK, _S.EMPTY_QUERY)

#: Session settings of the apply session (behaviours 1 and 51).
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (
    ("session_replication_role", "replica"),
    ("synchronous_commit", "off"),
    ("datestyle", "ISO"),
    ("intervalstyle", "postgres"),
    ("extra_float_digits", "3"),
    ("search_path", ""),
    ("client_encoding", "UTF8"),
)

#: How many statements may be queued without reading results before we wait for some.
MAX_IN_FLIGHT = 4000

_SYNC = object()
#: ``on_ok`` of an UPDATE/DELETE: a result of 0 rows goes to :attr:`Pipeline.on_missing_row` with its context
CHECK_ROWS: Any = object()

#: Whether whole transactions may be applied to table ``c`` a batch at a time (applier.apply.bulk): a plain table
#: with no trigger or rule that fires in the apply session (enabled REPLICA or ALWAYS), which could observe the order
#: between tables, and no column with a nondeterministic collation.
_BULK_OK = sql.SQL(
    "(c.relkind = 'r'"
    " AND NOT EXISTS (SELECT FROM pg_catalog.pg_trigger g WHERE g.tgrelid = c.oid AND g.tgenabled IN ('R', 'A'))"
    " AND NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite r WHERE r.ev_class = c.oid AND r.ev_enabled IN ('R', 'A'))"
    " AND NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_collation l ON l.oid = a.attcollation"
    "   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT l.collisdeterministic))"
)  # fmt: skip

#: the same, as plain SQL text (for a query on another session: applier.apply.worker)
BULK_OK_SQL = _BULK_OK.as_string(None)

#: A GID that is a valid SQL string literal once put in single quotes (see Target._gid_literal).
_PLAIN_GID = re.compile(r"[A-Za-z0-9_]+")


class TargetConnectionError(psycopg.OperationalError):
    """The target connection was lost (the worker reconnects with backoff)."""


def _result_error(res: pq.PGresult | Any, ctx: ErrorContext | None) -> ApplyError:
    msg = (res.error_message or b"").decode("utf-8", "replace").strip()
    if msg.startswith("ERROR:"):
        msg = msg[6:].strip()
    sqlstate = res.error_field(pq.DiagnosticField.SQLSTATE)
    return ApplyError(msg, ctx, sqlstate=sqlstate.decode() if sqlstate else None)


class Pipeline:
    """libpq pipeline mode over a non-blocking connection, with our own queue of pending results.

    Each queued statement has a context (for errors) and an optional ``on_ok(result)`` callback. The first error of
    a pipeline segment is kept and raised by :meth:`drain` / :meth:`poll` once its segment has been read: the
    caller then abandons the transaction (rolls back) as a whole, so nothing after it matters.
    """

    def __init__(self, pgconn: Any) -> None:
        self.pgconn = pgconn
        self._pending: deque[Any] = deque()  # (ctx, on_ok) tuples and _SYNC markers
        self._current: list[Any] = []  # results of the statement at the head of the queue
        self._error: ApplyError | None = None
        self.active = False
        #: roughly how many bytes libpq holds that have not been written to the socket yet
        self.unflushed = 0
        #: called with the context of an UPDATE/DELETE that found no row (queued with ``on_ok=CHECK_ROWS``)
        self.on_missing_row: Callable[[ErrorContext | None], None] | None = None

    # --- sending ---------------------------------------------------------------------------------------------
    def enter(self) -> None:
        if not self.active:
            self.pgconn.enter_pipeline_mode()
            self.active = True

    def send_prepare(
        self, name: bytes, command: bytes, types: Sequence[int], ctx: ErrorContext | None
    ) -> None:
        self.enter()
        self.pgconn.send_prepare(name, command, types)
        self._pending.append((ctx, None))

    def send_prepared(
        self,
        name: bytes,
        params: Sequence[bytes | None],
        formats: Sequence[int] | None,
        ctx: ErrorContext | None,
        on_ok: Callable[[Any], None] | None = None,
    ) -> None:
        self.enter()
        self.pgconn.send_query_prepared(name, params, formats)
        self.unflushed += 32 + sum(map(len, filter(None, params)))
        self._pending.append((ctx, on_ok))
        if len(self._pending) > MAX_IN_FLIGHT:
            self._relieve()

    def send_query(
        self,
        command: bytes,
        params: Sequence[bytes | None] | None = None,
        ctx: ErrorContext | None = None,
        on_ok: Callable[[Any], None] | None = None,
        types: Sequence[int] | None = None,
        formats: Sequence[int] | None = None,
    ) -> None:
        self.enter()
        self.pgconn.send_query_params(command, params, types, formats)
        self.unflushed += 32 + len(command) + (sum(map(len, filter(None, params))) if params else 0)
        self._pending.append((ctx, on_ok))

    def sync(self) -> None:
        """Mark a sync point. This also flushes: psycopg's ``pipeline_sync`` is libpq's ``PQpipelineSync``, which
        writes out everything buffered (``PQsendPipelineSync``, which would not, is not wrapped by psycopg 3.3). So
        sync points are kept rare: plain commits share a pipeline segment and need none."""
        self.enter()
        self.pgconn.pipeline_sync()
        self._pending.append(_SYNC)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- receiving -------------------------------------------------------------------------------------------
    def _flush_some(self) -> bool:
        """Push buffered output to the socket without blocking; True when everything was sent."""
        try:
            done = self.pgconn.flush() == 0
        except psycopg.OperationalError as exc:
            raise TargetConnectionError(f"connection to the target was lost: {exc}") from None
        if done:
            self.unflushed = 0
        return done

    def flush_all(self) -> None:
        """Write everything libpq holds to the socket (reading results meanwhile, so neither side can stall)."""
        while not self._flush_some():
            self._wait(1.0)

    def _wait(self, timeout: float | None) -> None:
        """Wait until the socket is readable (or writable, while output is pending), then read what arrived."""
        sock = self.pgconn.socket
        flushed = self._flush_some()
        r, _w, _ = select.select([sock], [] if flushed else [sock], [], timeout)
        try:
            if r:
                self.pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise TargetConnectionError(f"connection to the target was lost: {exc}") from None

    def _process_available(self) -> None:
        """Consume every result libpq already has, without blocking."""
        pgconn = self.pgconn
        pending = self._pending
        while pending and not pgconn.is_busy():
            head = pending[0]
            res = pgconn.get_result()
            if head is _SYNC:
                if res is None:
                    if pgconn.status == pq.ConnStatus.BAD:
                        raise TargetConnectionError(
                            "connection to the target was lost: "
                            + (pgconn.error_message or b"").decode("utf-8", "replace").strip()
                        )
                    continue
                if res.status != _S.PIPELINE_SYNC:  # pragma: no cover - protocol confusion
                    raise TargetConnectionError(
                        f"unexpected result {res.status!r} where a pipeline sync was due"
                    )
                pending.popleft()
                if self._error is not None:
                    err, self._error = self._error, None
                    self._current = []
                    raise err
                continue
            if res is not None:
                self._current.append(res)
                continue
            # end of the head statement's results
            pending.popleft()
            results, self._current = self._current, []
            ctx, on_ok = head
            status = results[-1].status if results else _S.COMMAND_OK
            if status in _OK:
                if on_ok is CHECK_ROWS:
                    if self.on_missing_row is not None and results and results[-1].command_tuples == 0:
                        self.on_missing_row(ctx)
                elif on_ok is not None:
                    on_ok(results[-1] if results else None)
            elif status == _S.FATAL_ERROR:
                if self._error is None:
                    self._error = _result_error(results[-1], ctx)
            elif status == _S.PIPELINE_ABORTED:
                pass
            else:  # pragma: no cover
                raise TargetConnectionError(f"unexpected result status {status!r} in the apply pipeline")

    def poll(self) -> None:
        """Read whatever results have arrived, never blocking. Raises the error of a finished segment.

        Without a sync the server keeps results in its output buffer; a flush request makes it send them."""
        if not self._pending:
            return
        if self._pending[-1] is not _SYNC:
            self.pgconn.send_flush_request()
        self._wait(0)
        self._process_available()

    def _relieve(self) -> None:
        """Too many statements in flight: make sure the server sees a sync point and wait for about half."""
        if self._pending[-1] is not _SYNC:
            self.sync()
        target = MAX_IN_FLIGHT // 2
        while len(self._pending) > target:
            self._process_available()
            if len(self._pending) > target:
                self._wait(None)

    def drain(self) -> None:
        """Wait for every queued statement's result; raise the first error."""
        if not self._pending:
            return
        if self._pending[-1] is not _SYNC:
            self.sync()
        while self._pending:
            self._process_available()
            if self._pending:
                self._wait(None)

    def exit(self) -> None:
        """Drain and leave pipeline mode (needed before COPY and before psycopg-level queries)."""
        if self.active:
            self.drain()
            self.pgconn.exit_pipeline_mode()
            self.active = False

    def discard(self) -> None:
        """After an error: read and drop everything still pending, ignoring errors; leave pipeline mode."""
        try:
            while self._pending and self.pgconn.status == pq.ConnStatus.OK:
                try:
                    self.drain()
                except ApplyError:
                    continue
            if self.active:
                self.pgconn.exit_pipeline_mode()
        finally:
            self.active = False
            self._pending.clear()
            self._current = []
            self._error = None


def _tbl(local: LocalTable) -> sql.Composable:
    return sql.Identifier(local.schema, local.name)


def _only(entry: RelMapEntry) -> sql.Composable:
    """ONLY for plain tables (inheritance children are separate publisher relations); a partitioned table's
    changes are meant for its partitions (behaviour 49)."""
    return sql.SQL("ONLY ") if entry.relkind == "r" else sql.SQL("")


def _param(n: int) -> sql.Composable:
    return sql.SQL("$" + str(n))


class Target:
    """The apply session on the target database."""

    def __init__(self, conn: psycopg.Connection[Any], *, origin: str = "", binary: bool = False) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.pipeline = Pipeline(self.pgconn)
        self.origin = origin
        #: the origin progress that confirmed commits justify (see :meth:`abort`); set by the worker at start
        self.good_origin_lsn = 0
        #: apply lag samples are added here when the worker attaches a window (applier.apply.lag)
        self.lag: LagWindow | None = None
        self.binary = binary
        self.in_transaction = False
        self._stmt_seq = 0
        self._fixed_prepared = False
        self._record_prepared_ready = False
        self._record_many_ready = False
        self._copy: _CopyRun | None = None

    # --- setup -----------------------------------------------------------------------------------------------
    @classmethod
    def connect(
        cls, conninfo: str, *, origin: str, application_name: str = "applier", binary: bool = False
    ) -> Target:
        """Connect and set the session up; ``origin`` becomes the session's replication origin.

        ``pg_replication_origin_session_setup`` fails if another session already uses the origin: that is how two
        workers of one subscription are kept from running at once.
        """
        conn = psycopg.connect(
            conninfo, autocommit=True, prepare_threshold=None, application_name=application_name
        )
        try:
            for name, value in SESSION_SETTINGS:
                conn.execute(sql.SQL("SELECT pg_catalog.set_config({}, {}, false)").format(
                    sql.Literal(name), sql.Literal(value)))  # fmt: skip
            conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", (origin,))
        except BaseException:
            conn.close()
            raise
        return cls(conn, origin=origin, binary=binary)

    def close(self) -> None:
        try:
            if not self.conn.closed:
                self.conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass

    @property
    def closed(self) -> bool:
        return self.conn.closed

    # --- synchronous queries (outside the pipeline) ----------------------------------------------------------
    def query(self, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        """Run a query through psycopg after draining the pipeline (raises any pending apply error first)."""
        self.end_copy()
        self.pipeline.exit()
        cur = self.conn.execute(query, params)
        return cur.fetchall() if cur.description is not None else []

    def origin_progress(self, origin: str) -> int:
        """The origin's remote_lsn, where streaming resumes (behaviour 5); 0 for a new origin."""
        rows = self.query("SELECT pg_catalog.pg_replication_origin_progress(%s, true)::text", (origin,))
        return parse_lsn(rows[0][0]) if rows and rows[0][0] else 0

    def wal_positions(self) -> tuple[int, int]:
        """(``pg_current_wal_insert_lsn()``, ``pg_current_wal_flush_lsn()``) for flush tracking (behaviour 115)."""
        got: list[Any] = []
        self.end_copy()
        self.pipeline.send_query(
            b"SELECT pg_catalog.pg_current_wal_insert_lsn()::text, pg_catalog.pg_current_wal_flush_lsn()::text",
            None, None, got.append,
        )  # fmt: skip
        self.pipeline.drain()
        res = got[0]
        return parse_lsn(res.get_value(0, 0).decode()), parse_lsn(res.get_value(0, 1).decode())

    def request_wal_positions(self, callback: Callable[[int, int], None]) -> bool:
        """Queue the query of :meth:`wal_positions` without waiting: ``callback(insert_lsn, flush_lsn)`` runs when
        its result comes back, after the results of everything queued before it (so every commit confirmed by
        then ends at or before ``insert_lsn``). Returns False (and queues nothing) while a COPY is open."""
        if self._copy is not None:
            return False

        def done(res: Any) -> None:
            callback(parse_lsn(res.get_value(0, 0).decode()), parse_lsn(res.get_value(0, 1).decode()))

        self.pipeline.send_query(
            b"SELECT pg_catalog.pg_current_wal_insert_lsn()::text, pg_catalog.pg_current_wal_flush_lsn()::text",
            None, None, done,
        )  # fmt: skip
        # a sync point, so that an error in what came before surfaces (results of an aborted pipeline segment
        # only come back with its sync); a few per second at most
        self.pipeline.sync()
        return True

    def load_local_table(self, schema: str, name: str) -> LocalTable | None:
        """Read a table's columns and key from the target's catalogs (``logicalrep_rel_open``); None if absent."""
        rows = self.query(
            sql.SQL(
                "SELECT c.oid, c.relkind::text, c.relreplident::text, {} FROM pg_catalog.pg_class c"
                " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s"
            ).format(_BULK_OK),
            (schema, name),
        )
        if not rows:
            return None
        oid, relkind, replident, bulk = rows[0]
        cols = self.query(
            "SELECT a.attname, a.atttypid::int, a.attgenerated::text,"
            " CASE WHEN t.typdelim = ',' THEN t.typarray::int ELSE 0 END, a.attidentity::text"
            " FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid"
            " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (oid,),
        )
        # GetRelationIdentityOrPK: the replica identity index when REPLICA IDENTITY USING INDEX, else the PK.
        key_rows = self.query(
            "SELECT a.attname FROM pg_catalog.pg_index i"
            " CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)"
            " JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
            " WHERE i.indrelid = %s AND i.indexrelid = ("
            "   SELECT i2.indexrelid FROM pg_catalog.pg_index i2 WHERE i2.indrelid = %s AND i2.indisvalid"
            "   AND ((%s = 'i' AND i2.indisreplident) OR i2.indisprimary)"
            "   ORDER BY (%s = 'i' AND i2.indisreplident) DESC LIMIT 1)"
            " ORDER BY k.ord",
            (oid, oid, replident, replident),
        )
        key = tuple(r[0] for r in key_rows) or None
        columns = tuple(LocalColumn(n, t, g or "", a, i or "") for n, t, g, a, i in cols)
        return LocalTable(int(oid), schema, name, relkind, columns, key, bool(bulk))

    def bulk_tables(self, oids: Sequence[int]) -> set[int]:
        """Which of these tables may still be applied a batch at a time (what ``LocalTable.bulk`` says, read
        now: a trigger enabled ALWAYS since the table was loaded makes it no longer so)."""
        rows = self.query(
            sql.SQL(
                "SELECT c.oid FROM pg_catalog.pg_class c WHERE c.oid = ANY(%s::pg_catalog.oid[]) AND {}"
            ).format(_BULK_OK),
            (list(oids),),
        )
        return {int(r[0]) for r in rows}

    # --- transactions ----------------------------------------------------------------------------------------
    def begin(self, ctx: ErrorContext | None = None) -> None:
        if not self.in_transaction:
            self._prepare_fixed(ctx)
            self.pipeline.send_prepared(b"applier_begin", (), None, ctx)
            self.in_transaction = True

    def _prepare_fixed(self, ctx: ErrorContext | None) -> None:
        """Statements every transaction uses, prepared once per session."""
        if not self._fixed_prepared:
            p = self.pipeline
            p.send_prepare(b"applier_begin", b"BEGIN", [], ctx)
            p.send_prepare(b"applier_commit", b"COMMIT", [], ctx)
            # the wire timestamp (µs since 2000-01-01 UTC) is converted exactly by the server
            p.send_prepare(
                b"applier_xact_setup",
                b"SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_catalog.pg_lsn,"
                b" '2000-01-01 00:00:00+00'::timestamptz + $2::bigint * '1 microsecond'::interval)",
                [], ctx,
            )  # fmt: skip
            self._fixed_prepared = True

    def _origin_setup(self, lsn: int, ts: int, ctx: ErrorContext | None) -> None:
        """Queue ``pg_replication_origin_xact_setup``: the next commit/prepare records this progress atomically.

        The statement that follows (COMMIT, PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED) must reach the server
        whenever this one does: should the session end between the two (our process killed), the server's abort
        would carry these values and, since PostgreSQL 16, advance the origin past a transaction that never
        committed. libpq writes its buffer out by itself once it holds 64 kB, so we empty it first when it holds
        more than a little: the pair then travels in one write, at the start of the next buffer.
        """
        if self.pipeline.unflushed > 16384:
            self.pipeline.flush_all()
        self._prepare_fixed(ctx)
        self.pipeline.send_prepared(
            b"applier_xact_setup",
            [f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}".encode(), str(ts).encode()],
            None,
            ctx,
        )

    def _confirming(
        self, lsn: int, on_ok: Callable[[Any], None] | None, ts: int = 0, kind: str = ""
    ) -> Callable[[Any], None]:
        """Wrap a commit's completion callback so that it also records the origin progress it justifies and, with
        a lag window attached, the apply lag of the remote transaction stamped ``ts`` (see applier.apply.lag)."""
        lag = self.lag if kind else None

        def done(res: Any) -> None:
            if lsn > self.good_origin_lsn:
                self.good_origin_lsn = lsn
            if lag is not None:
                lag.add(kind, ts, time.time())
            if on_ok is not None:
                on_ok(res)

        return done

    def commit(self, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]) -> None:
        """Queue origin progress + COMMIT; ``on_ok`` runs when the commit is confirmed.

        No sync point: consecutive transactions share a pipeline segment (an explicit COMMIT commits at once),
        so a burst of small transactions costs no round trip and no extra write each.
        """
        if self._copy is not None:
            self.end_copy()
        self._origin_setup(end_lsn, ts, ctx)
        self.pipeline.send_prepared(
            b"applier_commit", (), None, ctx, self._confirming(end_lsn, on_ok, ts, "commit")
        )
        self.in_transaction = False

    def prepare(
        self, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]
    ) -> None:
        """Queue origin progress + PREPARE TRANSACTION (the local transaction must be open)."""
        self.end_copy()
        self.begin(ctx)
        self._origin_setup(end_lsn, ts, ctx)
        self.pipeline.send_query(b"PREPARE TRANSACTION " + self._gid_literal(gid), None, ctx,
                                 self._confirming(end_lsn, on_ok, ts, "prepare"))  # fmt: skip
        self.in_transaction = False

    def finish_prepared(self, commit: bool, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None,
                        on_ok: Callable[[Any], None]) -> None:  # fmt: skip
        """COMMIT/ROLLBACK PREPARED, preceded by the origin setup as its own statement (behaviour 113: the values
        persist in the session until the next transaction that writes a commit/abort record)."""
        self.end_copy()
        self._origin_setup(end_lsn, ts, ctx)
        # COMMIT PREPARED refuses to run after another statement of its pipeline segment (PostgreSQL's "cannot be
        # executed within a pipeline"), so it starts a segment. Nothing needs to end one after it: it commits at
        # once, and what follows (BEGIN, or the origin setup of the next one) starts a transaction of its own. Its
        # error, if any, surfaces at the next sync point, as a plain COMMIT's does (see commit()).
        self.pipeline.sync()
        verb = b"COMMIT PREPARED " if commit else b"ROLLBACK PREPARED "
        kind = "commit_prepared" if commit else "rollback_prepared"
        self.pipeline.send_query(
            verb + self._gid_literal(gid), None, ctx, self._confirming(end_lsn, on_ok, ts, kind)
        )

    def mark_ready(
        self, subid: int, tables: Sequence[tuple[int, SyncState, int | None]], origin_lsn: int
    ) -> None:
        """Set table states and advance the session's origin to ``origin_lsn`` in one local transaction, and wait
        for it. Only between remote transactions (nothing else may be open)."""
        ctx = ErrorContext(f"applier_{subid}", "COMMIT")
        self.begin(ctx)
        for relid, state, lsn in tables:
            self.pipeline.send_query(
                catalog_sql.SET_TABLE_STATE,
                [state.value.encode(), None if lsn is None else format_lsn(lsn).encode(), str(subid).encode(),
                 str(relid).encode()],
                ctx,
            )  # fmt: skip
        self._origin_setup(origin_lsn, now_pg_timestamp(), ctx)
        self.pipeline.send_prepared(b"applier_commit", (), None, ctx, self._confirming(origin_lsn, None))
        self.in_transaction = False
        self.pipeline.drain()

    def record_prepared(self, gid: str, subid: int, xid: int, prepare_lsn: int, end_lsn: int, prepare_time: int,
                        ctx: ErrorContext | None) -> None:  # fmt: skip
        """Queue the ``applier.prepared_xact`` record of a transaction about to be prepared (behaviour 65), as a
        statement prepared once per session (no parse and plan per transaction): in a transaction of its own, or
        in the open local transaction, whose commit the caller then sends (a group commit's)."""
        self.end_copy()
        if not self._record_prepared_ready:
            self.pipeline.send_prepare(
                b"applier_record_prepared", catalog_sql.RECORD_PREPARED,
                [], ctx,
            )  # fmt: skip
            self._record_prepared_ready = True
        self._recording(
            ctx, b"applier_record_prepared",
            [gid.encode(), str(subid).encode(), str(xid).encode(), format_lsn(prepare_lsn).encode(),
             format_lsn(end_lsn).encode(), str(prepare_time).encode()],
        )  # fmt: skip

    def record_prepared_many(
        self, records: Sequence[tuple[str, int, int, int, int]], subid: int, ctx: ErrorContext | None
    ) -> None:
        """Queue the records of several transactions, ``(gid, remote xid, prepare LSN, prepare end LSN, prepare
        time)`` each (distinct GIDs), as :meth:`record_prepared` does one: one statement, one transaction."""
        if not all(_PLAIN_GID.fullmatch(r[0]) for r in records):  # pragma: no cover - gid_for makes them so
            raise ValueError("record_prepared_many takes plain GIDs only")
        self.end_copy()
        if not self._record_many_ready:
            self.pipeline.send_prepare(
                b"applier_record_prepared_many", catalog_sql.RECORD_PREPARED_MANY,
                [], ctx,
            )  # fmt: skip
            self._record_many_ready = True

        def array(values: Any) -> bytes:
            # GIDs (pg_gid_<subid>_<xid>), LSNs and integers need no quoting inside an array literal
            return b"{" + b",".join(values) + b"}"

        self._recording(
            ctx, b"applier_record_prepared_many",
            [array(r[0].encode() for r in records), str(subid).encode(), array(str(r[1]).encode() for r in records),
             array(format_lsn(r[2]).encode() for r in records), array(format_lsn(r[3]).encode() for r in records),
             array(str(r[4]).encode() for r in records)],
        )  # fmt: skip

    def _recording(self, ctx: ErrorContext | None, statement: bytes, params: list[bytes | None]) -> None:
        """Run a record statement in the open local transaction, or in one of its own."""
        own = not self.in_transaction  # else it rides in the open (group commit's) transaction
        p = self.pipeline
        if own:
            self._prepare_fixed(ctx)
            p.send_prepared(b"applier_begin", (), None, ctx)
        p.send_prepared(statement, params, None, ctx)
        if own:
            p.send_prepared(b"applier_commit", (), None, ctx)

    def _gid_literal(self, gid: str) -> bytes:
        """``gid`` as an SQL string literal; ours (``pg_gid_<subid>_<xid>``) need no escaping, so the general
        quoting (which asks the connection for its encoding and string settings) is only for anything else."""
        if _PLAIN_GID.fullmatch(gid):
            return b"'" + gid.encode() + b"'"
        return sql.Literal(gid).as_bytes(self.conn)

    def prepared_transactions(self, subid: int) -> dict[str, tuple[int, int]]:
        """Our recorded prepared transactions that exist on the target: gid -> (prepare_end_lsn, prepare_time)."""
        rows = self.query(catalog_sql.PREPARED_TRANSACTIONS, (subid,))
        return {gid: (parse_lsn(lsn), int(ts)) for gid, lsn, ts in rows}

    def abort(self) -> None:
        """Abandon the current transaction: drop pending results, ROLLBACK, reset the session's origin values
        (behaviour 95), and undo an origin advance that a failed COMMIT / PREPARE made.

        Why the last step: since PostgreSQL 16 an *abort* record also advances the session's origin to the values
        of ``pg_replication_origin_xact_setup`` (the native worker resets them before aborting; we set them with
        a statement just before COMMIT / PREPARE TRANSACTION, so when that very statement fails, e.g. PREPARE
        with ``max_prepared_transactions = 0`` or a deferred constraint at COMMIT, the abort carries them). The
        transaction would then never be re-sent. With every result of this session read, we know exactly which
        commits succeeded (:attr:`good_origin_lsn`); anything beyond that is such an abort, and we move the
        origin back. If the connection is gone we cannot tell, and say so (see the module notes).
        """
        try:
            if self._copy is not None:
                self._copy = None
                try:
                    self.pgconn.put_copy_end(b"abandoned")
                    while self.pgconn.get_result() is not None:
                        pass
                except psycopg.Error:
                    pass
            self.pipeline.discard()
            self.conn.execute("ROLLBACK")
            self.conn.execute("SELECT pg_catalog.pg_replication_origin_xact_reset()")
            if self.origin:
                self._undo_bogus_origin_advance()
        except psycopg.Error:
            self.close()
        finally:
            self.in_transaction = False

    def _undo_bogus_origin_advance(self) -> None:
        row = self.conn.execute(
            "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text", (self.origin,)
        ).fetchone()
        progress = parse_lsn(row[0]) if row and row[0] else 0
        good = self.good_origin_lsn
        if progress <= good:
            return
        log.warning(
            'moving replication origin "%s" back from %s to %s: a failed commit advanced it (an abort record '
            "carries the origin's values since PostgreSQL 16); the transaction will be applied again",
            self.origin, format_lsn(progress), format_lsn(good),
        )  # fmt: skip
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_advance(%s, %s::pg_lsn)",
                          (self.origin, format_lsn(good)))  # fmt: skip
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", (self.origin,))

    # --- row changes -----------------------------------------------------------------------------------------
    def _statement(self, entry: RelMapEntry, key: Any, build: Callable[[], tuple[sql.Composable, Sequence[int]]],
                   ctx: ErrorContext | None) -> bytes:  # fmt: skip
        name = entry.statements.get(key)
        if name is None:
            query, types = build()
            self._stmt_seq += 1
            name = f"applier_{self._stmt_seq}".encode()
            self.pipeline.send_prepare(name, query.as_bytes(self.conn), types, ctx)
            entry.statements[key] = name
        return name

    def _formats(self, kinds: bytes) -> list[int] | None:
        if not self.binary or KIND_BINARY not in kinds:
            return None
        return [1 if k == KIND_BINARY else 0 for k in kinds]

    def insert(self, entry: RelMapEntry, new: TupleData, ctx: ErrorContext | None) -> None:
        copy = self._copy
        if copy is not None:
            if copy.entry is entry and copy.accepts(new):
                copy.add(new)
                return
            self.end_copy()
        name = entry.statements.get("I")
        if name is None:
            name = self._statement(entry, "I", lambda: self._insert_sql(entry), ctx)
        self.pipeline.send_prepared(name, new.values, self._formats(new.kinds), ctx)

    def _insert_sql(self, entry: RelMapEntry) -> tuple[sql.Composable, Sequence[int]]:
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in entry.names)
        vals = sql.SQL(", ").join(_param(i + 1) for i in range(len(entry.names)))
        q = sql.SQL("INSERT INTO {} ({}){} VALUES ({})").format(
            _tbl(entry.local), cols, _overriding(entry), vals
        )
        return q, entry.types

    @staticmethod
    def _search_shape(entry: RelMapEntry, search: TupleData) -> bytes:
        """Per searched column: ``v`` value, ``n`` NULL, ``u`` unchanged TOAST: the part of a statement-cache key
        that decides the WHERE clause."""
        kinds = search.kinds
        if entry.key_positions is None:
            return kinds.translate(_SHAPE)
        if _N not in kinds and _U not in kinds:  # the usual case: every key column has a value
            return _ALL_VALUES[len(entry.key_positions)]
        return bytes([kinds[i] for i in entry.key_positions]).translate(_SHAPE)

    @staticmethod
    def _search_values(
        entry: RelMapEntry, search: TupleData, shape: bytes
    ) -> tuple[list[bytes | None], bytes]:
        """Parameter values (and their kinds) of the row-identifying condition for ``shape``."""
        positions = entry.key_positions if entry.key_positions is not None else range(len(entry.names))
        values = search.values
        if b"n" not in shape and b"u" not in shape:
            used: Sequence[int] = positions
        else:
            used = [i for i, c in zip(positions, shape, strict=True) if c == _V]
        if len(used) == 1:
            i = used[0]
            return [values[i]], search.kinds[i : i + 1]
        kinds = search.kinds
        return [values[i] for i in used], bytes([kinds[i] for i in used])

    @staticmethod
    def _search_condition(
        entry: RelMapEntry, shape: bytes, first_param: int
    ) -> tuple[sql.Composable, list[int]]:
        """The row-identifying condition: local key columns, or every sent column for a FULL publisher.

        NULLs become ``IS NULL`` (so the condition equals ``IS NOT DISTINCT FROM`` but stays indexable);
        unchanged-TOAST markers are left out. Returns (condition, parameter types).
        """
        positions = entry.key_positions if entry.key_positions is not None else range(len(entry.names))
        conds: list[sql.Composable] = []
        types: list[int] = []
        n = first_param
        for i, c in zip(positions, shape, strict=True):
            col = sql.Identifier(entry.names[i])
            if c == _N:
                conds.append(sql.SQL("{} IS NULL").format(col))
            elif c == _V:
                conds.append(sql.SQL("{} = {}").format(col, _param(n)))
                types.append(entry.types[i])
                n += 1
        cond = sql.SQL(" AND ").join(conds) if conds else sql.SQL("true")
        if entry.key_positions is None:
            # no key: the first matching row, as RelationFindReplTupleSeq does (duplicates stay duplicates)
            sub = sql.SQL("SELECT {cols} FROM {only}{tbl} WHERE {cond} LIMIT 1 FOR UPDATE").format(
                cols=sql.SQL("ctid" if entry.relkind == "r" else "tableoid, ctid"),
                only=_only(entry), tbl=_tbl(entry.local), cond=cond,
            )  # fmt: skip
            lhs = sql.SQL("ctid" if entry.relkind == "r" else "(tableoid, ctid)")
            cond = sql.SQL("{} = ({})").format(lhs, sub)
        return cond, types

    @staticmethod
    def _shape(t: TupleData) -> bytes:
        """A statement-cache key part: which columns are NULL / unchanged (text vs binary does not matter)."""
        return t.kinds.translate(_SHAPE)

    def update(
        self, entry: RelMapEntry, old: TupleData | None, new: TupleData, ctx: ErrorContext | None
    ) -> None:
        """UPDATE the row found by the old key (or the new tuple's key when the key did not change, behaviour
        45); unchanged-TOAST columns are left out of SET, so they keep the target's value (behaviour 46). No row
        found: :attr:`Pipeline.on_missing_row` hears of it.

        A GENERATED ALWAYS identity column can only be assigned DEFAULT by an UPDATE, so it is left out of SET when
        its value is known not to change (a key column without an old tuple, or an old tuple with the same value:
        nearly always, since the publisher itself can only change it with ``SET col = DEFAULT``); when it may
        change, :meth:`_update_identity` applies the row as the native worker does. When nothing is left to assign
        (every column unchanged TOAST), the row is still updated, with a no-op assignment, as the native worker
        updates it with its old values: update triggers enabled for replica fire."""
        if self._copy is not None:
            self.end_copy()
        search = old if old is not None else new
        kinds = new.kinds
        unchanged = KIND_UNCHANGED_TOAST in kinds
        omitted: tuple[int, ...] = ()
        if entry.always_identity:
            omitted, changing = _identity_split(entry, old, new)
            if changing:
                self._update_identity(entry, search, new, changing, ctx)
                return
        shape = self._search_shape(entry, search)
        key = ("U", self._shape(new) if unchanged else None, shape, omitted)
        name = entry.statements.get(key)
        set_pos: Sequence[int] = (
            [i for i, k in enumerate(kinds) if k != KIND_UNCHANGED_TOAST and i not in omitted]
            if unchanged or omitted
            else range(len(new))
        )
        if name is None:

            def build() -> tuple[sql.Composable, Sequence[int]]:
                return self._update_sql(entry, shape, set_pos)

            name = self._statement(entry, key, build, ctx)
        wparams, wkinds = self._search_values(entry, search, shape)
        values = new.values
        params = ([values[i] for i in set_pos] if unchanged or omitted else list(values)) + wparams
        formats = None
        if self.binary:
            pkinds = bytes([kinds[i] for i in set_pos]) + wkinds
            if KIND_BINARY in pkinds:
                formats = [1 if k == KIND_BINARY else 0 for k in pkinds]
        self.pipeline.send_prepared(name, params, formats, ctx, CHECK_ROWS)

    def _update_sql(
        self, entry: RelMapEntry, shape: bytes, set_pos: Sequence[int]
    ) -> tuple[sql.Composable, list[int]]:
        """The UPDATE assigning the columns at ``set_pos`` (parameters 1..n) of the row ``shape`` finds."""
        cond, wtypes = self._search_condition(entry, shape, len(set_pos) + 1)
        if set_pos:
            sets = sql.SQL(", ").join(
                sql.SQL("{} = {}").format(sql.Identifier(entry.names[i]), _param(j + 1))
                for j, i in enumerate(set_pos)
            )
        else:
            sets = _noop_assignment(entry, "")
        q = sql.SQL("UPDATE {only}{tbl} SET {sets} WHERE {where}").format(
            only=_only(entry), tbl=_tbl(entry.local), sets=sets, where=cond
        )
        return q, [entry.types[i] for i in set_pos] + wtypes

    def _update_identity(self, entry: RelMapEntry, search: TupleData, new: TupleData, changing: tuple[int, ...],
                         ctx: ErrorContext | None) -> None:  # fmt: skip
        """The rare UPDATE that may give a GENERATED ALWAYS identity column a new value (the publisher ran ``SET
        col = DEFAULT``, or the column is outside the key and the message has no old tuple to compare with).

        PostgreSQL lets nothing but DEFAULT be assigned to such a column, and ``OVERRIDING`` does not exist for
        UPDATE; so, within the apply transaction, the column is made BY DEFAULT for this one statement and ALWAYS
        again right after (both undone with the transaction should it fail). The cost is an ACCESS EXCLUSIVE lock
        on the target table until the local commit. The statement is unnamed: a prepared statement would be
        checked (and refused) while the column is ALWAYS."""
        kinds = new.kinds
        set_pos = [i for i, k in enumerate(kinds) if k != KIND_UNCHANGED_TOAST]
        shape = self._search_shape(entry, search)
        query, types = self._update_sql(entry, shape, set_pos)
        wparams, wkinds = self._search_values(entry, search, shape)
        params = [new.values[i] for i in set_pos] + wparams
        pkinds = bytes([kinds[i] for i in set_pos]) + wkinds
        formats = [1 if k == KIND_BINARY else 0 for k in pkinds] if KIND_BINARY in pkinds else None

        def alter(generated: str) -> bytes:
            return sql.SQL("ALTER TABLE {} {}").format(_tbl(entry.local), sql.SQL(", ").join(
                sql.SQL("ALTER COLUMN {} SET GENERATED " + generated).format(sql.Identifier(entry.names[i]))
                for i in changing
            )).as_bytes(self.conn)  # fmt: skip

        self.pipeline.send_query(alter("BY DEFAULT"), None, ctx)
        self.pipeline.send_query(query.as_bytes(self.conn), params, ctx, CHECK_ROWS, types, formats)
        self.pipeline.send_query(alter("ALWAYS"), None, ctx)

    def delete(self, entry: RelMapEntry, old: TupleData, ctx: ErrorContext | None) -> None:
        """DELETE the row found by the old key or, for a FULL publisher without a local key, the first match; no
        row found as for :meth:`update`."""
        if self._copy is not None:
            self.end_copy()
        shape = self._search_shape(entry, old)
        key = ("D", shape)
        name = entry.statements.get(key)
        if name is None:

            def build() -> tuple[sql.Composable, Sequence[int]]:
                cond, wtypes = self._search_condition(entry, shape, 1)
                q = sql.SQL("DELETE FROM {only}{tbl} WHERE {where}").format(
                    only=_only(entry), tbl=_tbl(entry.local), where=cond
                )
                return q, wtypes

            name = self._statement(entry, key, build, ctx)
        wparams, wkinds = self._search_values(entry, old, shape)
        formats = (
            [1 if k == KIND_BINARY else 0 for k in wkinds] if self.binary and KIND_BINARY in wkinds else None
        )
        self.pipeline.send_prepared(name, wparams, formats, ctx, CHECK_ROWS)

    def truncate(
        self, entries: Sequence[RelMapEntry], restart_identity: bool, ctx: ErrorContext | None
    ) -> None:
        """One TRUNCATE over the applicable relations, never CASCADE (behaviour 49)."""
        self.end_copy()
        targets = sql.SQL(", ").join(sql.SQL("{}{}").format(_only(e), _tbl(e.local)) for e in entries)
        q = sql.SQL("TRUNCATE {}{} RESTRICT").format(
            targets, sql.SQL(" RESTART IDENTITY" if restart_identity else ""))  # fmt: skip
        self.pipeline.send_query(q.as_bytes(self.conn), None, ctx)

    # --- a table's stretch of changes as one statement (applier.apply.bulk) -----------------------------------
    def bulk_insert(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None) -> None:
        """INSERT rows given as one array literal per column (in the publisher's column order)."""
        query = entry.statements.get(("bulk", "I"))
        if query is None:
            q = sql.SQL("INSERT INTO {} ({}){} SELECT * FROM {}").format(
                _tbl(entry.local), sql.SQL(", ").join(map(sql.Identifier, entry.names)), _overriding(entry),
                _unnest(len(entry.names)),
            )  # fmt: skip
            query = entry.statements[("bulk", "I")] = q.as_bytes(self.conn)
        self.end_copy()
        self.pipeline.send_query(query, columns, ctx, None, entry.array_types)

    def bulk_update(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None,
                    on_missing: Callable[[list[int]], None]) -> None:  # fmt: skip
        """UPDATE from new tuples given as one array literal per column: each key's row takes the last of its
        tuples. ``on_missing`` hears the (1-based) positions of the tuples whose row does not exist."""
        query = entry.statements.get(("bulk", "U"))
        if query is None:
            query = entry.statements[("bulk", "U")] = self._bulk_update_sql(entry).as_bytes(self.conn)
        self.end_copy()
        self.pipeline.send_query(query, columns, ctx, _missing_positions(on_missing), entry.array_types)

    def bulk_delete(self, entry: RelMapEntry, keys: Sequence[bytes], ctx: ErrorContext | None,
                    on_missing: Callable[[list[int]], None]) -> None:  # fmt: skip
        """DELETE the rows of keys given as one array literal per key column; ``on_missing`` as for
        :meth:`bulk_update`."""
        query = entry.statements.get(("bulk", "D"))
        if query is None:
            query = entry.statements[("bulk", "D")] = self._bulk_delete_sql(entry).as_bytes(self.conn)
        self.end_copy()
        self.pipeline.send_query(query, keys, ctx, _missing_positions(on_missing),
                                 [entry.array_types[i] for i in entry.key_positions or ()])  # fmt: skip

    @staticmethod
    def _bulk_delete_sql(entry: RelMapEntry) -> sql.Composable:
        """s: the keys with their position; d: the DELETE, returning the keys it found; what it returns: the
        positions of keys that found no row."""
        keys = [sql.Identifier(entry.names[i]) for i in entry.key_positions or ()]
        ordc = sql.Identifier(_ord_name(entry))
        return sql.SQL(
            "WITH s AS (SELECT * FROM {unnest} WITH ORDINALITY AS s({keys}, {ordc})),"
            " d AS (DELETE FROM {only}{tbl} AS t USING s WHERE {match} RETURNING {returning})"
            " SELECT s.{ordc} FROM s LEFT JOIN d ON {join} WHERE d.{first} IS NULL ORDER BY s.{ordc}"
        ).format(
            unnest=_unnest(len(keys)), keys=sql.SQL(", ").join(keys), ordc=ordc, only=_only(entry),
            tbl=_tbl(entry.local), first=keys[0],
            match=sql.SQL(" AND ").join(sql.SQL("t.{} = s.{}").format(k, k) for k in keys),
            returning=sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys),
            join=sql.SQL(" AND ").join(sql.SQL("d.{} = s.{}").format(k, k) for k in keys),
        )  # fmt: skip

    @staticmethod
    def _bulk_update_sql(entry: RelMapEntry) -> sql.Composable:
        """s: the tuples with their position; l: the last tuple of each key; u: the UPDATE; what it returns: the
        positions of tuples whose key matched no row (the UPDATE sees the table as before the statement, like the
        other parts do, so those are exactly the rows that were missing)."""
        names = entry.names
        ordc = sql.Identifier(_ord_name(entry))
        keys = [sql.Identifier(names[i]) for i in entry.key_positions or ()]
        key_list = sql.SQL(", ").join(keys)
        return sql.SQL(
            "WITH s AS (SELECT * FROM {unnest} WITH ORDINALITY AS s({cols}, {ordc})),"
            " l AS (SELECT DISTINCT ON ({keys}) * FROM s ORDER BY {keys}, {ordc} DESC),"
            " u AS (UPDATE {only}{tbl} AS t SET {sets} FROM l WHERE {match} RETURNING l.{ordc})"
            " SELECT s.{ordc} FROM s JOIN l ON {join} WHERE l.{ordc} NOT IN (SELECT u.{ordc} FROM u)"
            " ORDER BY s.{ordc}"
        ).format(
            unnest=_unnest(len(names)),
            cols=sql.SQL(", ").join(map(sql.Identifier, names)), ordc=ordc, keys=key_list,
            only=_only(entry), tbl=_tbl(entry.local),
            sets=sql.SQL(", ").join(
                [sql.SQL("{} = l.{}").format(sql.Identifier(n), sql.Identifier(n))
                 for i, n in enumerate(names) if i not in entry.always_identity]
                or [_noop_assignment(entry, "t.")]
            ),
            match=sql.SQL(" AND ").join(sql.SQL("t.{} = l.{}").format(k, k) for k in keys),
            join=sql.SQL(" AND ").join(sql.SQL("s.{} = l.{}").format(k, k) for k in keys),
        )  # fmt: skip

    # --- COPY for runs of inserts ----------------------------------------------------------------------------
    def start_copy(self, entry: RelMapEntry, rows: Sequence[TupleData], ctx: ErrorContext | None) -> None:
        """Begin a COPY for a run of inserts into ``entry`` and send ``rows``; later :meth:`insert` calls for the
        same relation go into the COPY until something else needs the connection."""
        self.end_copy()
        self.pipeline.exit()
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in entry.names)
        q = sql.SQL("COPY {} ({}) FROM STDIN").format(_tbl(entry.local), cols).as_bytes(self.conn)
        pgconn = self.pgconn
        pgconn.send_query(q)
        while True:
            self._wait_result()
            res = pgconn.get_result()
            if res is None:  # pragma: no cover
                raise TargetConnectionError("COPY did not start")
            if res.status == _S.COPY_IN:
                break
            if res.status == _S.FATAL_ERROR:
                err = _result_error(res, ctx)
                while pgconn.get_result() is not None:
                    pass
                raise err
        self._copy = _CopyRun(self, entry, ctx)
        for r in rows:
            self._copy.add(r)

    def _wait_result(self) -> None:
        while self.pgconn.is_busy():
            self.pipeline._wait(None)

    @property
    def copy_entry(self) -> RelMapEntry | None:
        """The relation an open COPY writes into, if any."""
        return None if self._copy is None else self._copy.entry

    @property
    def copy_run(self) -> _CopyRun | None:
        """The open COPY, if any (its ``add`` takes rows directly)."""
        return self._copy

    def end_copy(self) -> None:
        copy = self._copy
        if copy is None:
            return
        self._copy = None
        copy.finish()

    @staticmethod
    def copy_eligible(t: TupleData) -> bool:
        """COPY text format can carry text values and NULLs; binary values go through INSERT."""
        return copy_eligible(t)


def _overriding(entry: RelMapEntry) -> sql.Composable:
    """``OVERRIDING SYSTEM VALUE`` when a published column is GENERATED ALWAYS AS IDENTITY locally: the row keeps
    the publisher's value, as the native worker's does (BY DEFAULT columns take given values anyway)."""
    return sql.SQL(" OVERRIDING SYSTEM VALUE" if entry.always_identity else "")


def _noop_assignment(entry: RelMapEntry, qualifier: str) -> sql.Composable:
    """``col = col`` for an UPDATE with nothing to assign (every value unchanged TOAST, or only ALWAYS identity
    columns that keep their value): the row is still updated, as the native worker updates it with its old values,
    so update triggers enabled for replica fire. ``col`` is one the UPDATE may assign: not generated, not ALWAYS
    identity (``qualifier`` names the table in the right-hand side, e.g. ``t.``)."""
    for c in entry.local.columns:
        if not c.generated and c.identity != "a":
            return sql.SQL("{} = " + qualifier + "{}").format(sql.Identifier(c.name), sql.Identifier(c.name))
    # only ALWAYS identity and generated columns: assign DEFAULT to nothing; a generated column recomputes
    raise ApplyError(
        f'cannot update a row of "{entry.display}": it has no column an UPDATE may assign'
        " (every column is generated or GENERATED ALWAYS AS IDENTITY)"
    )


def _identity_split(
    entry: RelMapEntry, old: TupleData | None, new: TupleData
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split the ALWAYS identity columns an UPDATE carries into those known to keep their value (left out of SET)
    and those that may change (see :meth:`Target.update`). A key column keeps its value when the message has no
    old tuple (the publisher sends one when the key changes); any column keeps it when the old tuple shows the same
    value (same kind and bytes)."""
    keep: list[int] = []
    change: list[int] = []
    key = entry.key_positions or ()
    for i in entry.always_identity:
        if new.kinds[i] == KIND_UNCHANGED_TOAST:
            continue
        if old is None:
            (keep if i in key else change).append(i)
        elif old.kinds[i] == new.kinds[i] and old.values[i] == new.values[i]:
            keep.append(i)
        else:
            change.append(i)
    return tuple(keep), tuple(change)


def _unnest(n: int) -> sql.Composable:
    """The rows of ``n`` array parameters side by side (what ``unnest($1, $2)`` means, schema-qualified)."""
    return sql.SQL("ROWS FROM ({})").format(
        sql.SQL(", ").join(sql.SQL("pg_catalog.unnest({})").format(_param(i + 1)) for i in range(n))
    )


def _ord_name(entry: RelMapEntry) -> str:
    """A name for the position column of a bulk statement that no column of the table has."""
    name = "applier ord"
    while name in entry.names:
        name += "_"
    return name


def _missing_positions(on_missing: Callable[[list[int]], None]) -> Callable[[Any], None]:
    """The result callback of a bulk UPDATE/DELETE: its rows are the positions of changes that found no row."""

    def done(res: Any) -> None:
        if res is not None and res.ntuples:
            on_missing([int(res.get_value(i, 0)) for i in range(res.ntuples)])

    return done


_SHAPE = bytes.maketrans(b"tb", b"vv")
_COPY_CHUNK = 1 << 18


def _copy_escape(v: bytes | None) -> bytes:
    """One value in COPY text format. UTF-8 continuation bytes are never ASCII, so escaping byte-wise is exact."""
    if v is None:
        return b"\\N"
    if b"\\" in v or b"\t" in v or b"\n" in v or b"\r" in v:
        return v.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    return v


_V = ord("v")
_N = ord("n")
_U = ord("u")
#: the search shape when every key column has a value, by key width
_ALL_VALUES = [b"v" * n for n in range(33)]


class _CopyRun:
    """An open ``COPY ... FROM STDIN`` (text format) into one relation."""

    def __init__(self, target: Target, entry: RelMapEntry, ctx: ErrorContext | None) -> None:
        self.target = target
        self.entry = entry
        self.ctx = ctx
        self.buf = bytearray()
        self.rows = 0

    def accepts(self, t: TupleData) -> bool:
        return Target.copy_eligible(t)

    def add(self, t: TupleData) -> None:
        """Append one row in COPY text format (tab-separated, ``\\N`` for NULL, backslash escapes)."""
        values = t.values
        if None not in values:
            line = b"\t".join(values)
            # fast path: nothing to escape (the only tabs are our separators)
            if (
                b"\\" not in line
                and b"\n" not in line
                and b"\r" not in line
                and line.count(b"\t") == len(values) - 1
            ):
                self.buf += line + b"\n"
                self.rows += 1
                if len(self.buf) >= _COPY_CHUNK:
                    self._send()
                return
        self.buf += b"\t".join([_copy_escape(v) for v in values]) + b"\n"
        self.rows += 1
        if len(self.buf) >= _COPY_CHUNK:
            self._send()

    def add_text(self, text: bytes, rows: int) -> None:
        """Append ``rows`` rows already in COPY text format (from :mod:`applier.apply.copytext`)."""
        self.buf += text
        self.rows += rows
        if len(self.buf) >= _COPY_CHUNK:
            self._send()

    def _send(self) -> None:
        pgconn = self.target.pgconn
        data = bytes(self.buf)
        self.buf.clear()
        while pgconn.put_copy_data(data) == 0:
            self.target.pipeline._wait(1.0)
        self.target.pipeline._flush_some()

    def finish(self) -> None:
        pgconn = self.target.pgconn
        if self.buf:
            self._send()
        while pgconn.put_copy_end() == 0:
            self.target.pipeline._wait(1.0)
        while not self.target.pipeline._flush_some():
            self.target.pipeline._wait(1.0)
        error: ApplyError | None = None
        while True:
            self.target._wait_result()
            res = pgconn.get_result()
            if res is None:
                break
            if res.status == _S.FATAL_ERROR and error is None:
                error = _result_error(res, self.ctx)
        if error is not None:
            raise error
