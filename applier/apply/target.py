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
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.apply.conflict_table import ConflictTable
from applier.apply.context import ApplyError, ErrorContext
from applier.apply.lag import LagWindow
from applier.apply.origin_probe import read_setup as read_origin_setup
from applier.apply.pipeline import CHECK_ROWS, MAX_IN_FLIGHT, Pipeline, TargetConnectionError
from applier.apply.ports import copy_eligible
from applier.apply.relmap import LocalColumn, LocalTable
from applier.apply.target_catalog import CatalogWrites, gid_literal
from applier.apply.target_copy import CopyIn, _copy_escape
from applier.apply.target_ddl import DdlWrites
from applier.apply.target_dml import DmlStatements
from applier.catalog.trust import TYPE_WALK
from applier.errors import ApplierError
from applier.lsn import format_lsn, parse_lsn

__all__ = [
    "BULK_OK_SQL", "CHECK_ROWS", "MAX_IN_FLIGHT", "SESSION_SETTINGS", "SYNCHRONOUS_COMMIT_ENV", "Pipeline", "Target",
    "TargetConnectionError", "_copy_escape", "synchronous_commit_setting",
]  # fmt: skip

log = logging.getLogger(__name__)

#: Session settings of the apply session (behaviours 1 and 51). ``jit`` off: nothing the session runs is worth
#: compiling, but the local-table lookup (``_LOCAL_TABLES``, recursive type walks) is planned costly enough to be
#: JIT-compiled, which took 0.25-0.34 s of its 0.29-0.36 s for 25 tables on PostgreSQL 15 (0.02-0.03 s without),
#: before the worker's first stream (``preload_local_tables``) and at a table's first use after.
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (
    ("session_replication_role", "replica"),
    ("jit", "off"),
    ("synchronous_commit", "off"),
    ("datestyle", "ISO"),
    ("intervalstyle", "postgres"),
    ("extra_float_digits", "3"),
    ("search_path", ""),
    ("client_encoding", "UTF8"),
)

#: The apply session's ``synchronous_commit``, overriding the rule of :func:`_choose_synchronous_commit`.
SYNCHRONOUS_COMMIT_ENV = "APPLIER_SYNCHRONOUS_COMMIT"
_SYNCHRONOUS_COMMIT_VALUES = ("off", "local", "remote_write", "on", "remote_apply")


def synchronous_commit_setting(value: str | None) -> str | None:
    """``APPLIER_SYNCHRONOUS_COMMIT``: None when unset (the rule of :func:`_choose_synchronous_commit`), else one of
    PostgreSQL's ``synchronous_commit`` values; anything else is refused (``applier run`` checks it at start)."""
    if value is None or not value.strip():
        return None
    if value.strip().lower() not in _SYNCHRONOUS_COMMIT_VALUES:
        raise ApplierError(
            f"{SYNCHRONOUS_COMMIT_ENV} must be one of {', '.join(_SYNCHRONOUS_COMMIT_VALUES)}, not {value!r}"
        )
    return value.strip().lower()


def _choose_synchronous_commit(conn: psycopg.Connection[Any]) -> None:
    """The apply session commits asynchronously (``off``, as the native worker does by default): safe against a
    crash of the target because the flush position reported to the publisher follows the target's own WAL flush
    (applier.apply.feedback). Not against a *failover* of the target: a standby promoted after the primary's crash
    may lack a transaction already acknowledged to the publisher, which never sends it again. So when the target
    has synchronous standbys (``synchronous_standby_names``), the session keeps the target's own
    ``synchronous_commit`` (``on`` unless the role, database or server says otherwise) and every commit and
    PREPARE waits for them before it counts as flushed. ``APPLIER_SYNCHRONOUS_COMMIT`` overrides both."""
    wanted = synchronous_commit_setting(os.environ.get(SYNCHRONOUS_COMMIT_ENV))
    if wanted is None:
        row = conn.execute("SELECT pg_catalog.current_setting('synchronous_standby_names') <> ''").fetchone()
        if row is not None and row[0]:
            conn.execute("RESET synchronous_commit")
        return
    conn.execute("SELECT pg_catalog.set_config('synchronous_commit', %s, false)", (wanted,))


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

#: How long after the session's start the preloaded tables not used yet are kept (and the second connection that
#: checks them open): the start's burst of first uses is over by then; a table first used later is read then.
PRELOAD_KEEP_S = 30.0

#: A check of the preloaded tables' stamps answers for up to ``CHECK_BATCH`` tables still preloaded, and a first use
#: of one of them within this long after it takes that answer: the first transaction after a start touches several
#: tables within a few milliseconds, and one check a table cost 1-2.6 ms each on a loaded host (a round trip to a
#: backend that must be scheduled). A change committed in the last 10 ms before a table's first use may thus be
#: missed, like one committed just after a lookup, before the statements queued behind it run (neither is seen until
#: the next session).
CHECK_FRESH_S = 0.01
#: How many tables one check covers at most (the first used and others still preloaded): with thousands of tables a
#: check of all would cost more than it saves.
CHECK_BATCH = 100

#: A stamp of the catalog rows a :class:`LocalTable` is read from (of table ``c`` in namespace ``n``): the
#: transaction ids that last wrote its pg_class and pg_namespace rows, its columns, indexes, triggers and rules.
#: Any ALTER of these writes a new row version (a new xmin), or adds or removes one, so a different stamp means
#: "read it again". It can change without a relevant change (a TRUNCATE rewrites pg_class): only a re-read follows.
#: ANALYZE and VACUUM update pg_class in place, keeping its xmin.
STAMP_SQL = (
    "c.xmin::text || '/' || n.xmin::text || '/' || c.relname || '/' || n.nspname"
    " || '/' || coalesce((SELECT string_agg(a.attnum::text || ':' || a.xmin::text, ',' ORDER BY a.attnum)"
    "   FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0), '')"
    " || '/' || coalesce((SELECT string_agg(x.indexrelid::text || ':' || x.xmin::text, ',' ORDER BY x.indexrelid)"
    "   FROM pg_catalog.pg_index x WHERE x.indrelid = c.oid), '')"
    " || '/' || coalesce((SELECT string_agg(g.oid::text || ':' || g.xmin::text, ',' ORDER BY g.oid)"
    "   FROM pg_catalog.pg_trigger g WHERE g.tgrelid = c.oid), '')"
    " || '/' || coalesce((SELECT string_agg(r.oid::text || ':' || r.xmin::text, ',' ORDER BY r.oid)"
    "   FROM pg_catalog.pg_rewrite r WHERE r.ev_class = c.oid), '')"
)

#: What ``logicalrep_rel_open`` reads about a local table, in one query (``{bulk}``: ``_BULK_OK``, ``{stamp}``:
#: ``STAMP_SQL``, ``{where}``: which tables): columns in attnum order, the key of GetRelationIdentityOrPK (the
#: replica identity index when REPLICA IDENTITY USING INDEX, else the primary key), and the stamp. No oid is cast
#: to int (the cast is binary-coercible): oids above 2^31, as after an OID wrap-around, would come back negative,
#: and the type oids are sent to libpq as parameter types. The table's oid stays ``oid``, the type oids are int8.
#: ``arrays``: each column type's array type, for bulk apply (applier.apply.bulk passes a stretch's values as one
#: array per column, unnested in ``ROWS FROM``), or 0 when its values cannot travel so: no array type with ',' as
#: delimiter, or a composite type or a domain over one (at any depth: ``typbasetype`` names the next type down),
#: which ``ROWS FROM`` would expand into its fields ("INSERT has more expressions than target columns").
_LOCAL_TABLES = (
    "SELECT c.oid, n.nspname::text, c.relname::text, c.relkind::text, {bulk},"
    " cols.names, cols.types, cols.generated, cols.arrays, cols.identity, keys.key, doms.schemas, doms.names,"
    " {stamp}"
    " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " LEFT JOIN LATERAL (SELECT array_agg(a.attname::text ORDER BY a.attnum) AS names,"
    "   array_agg(a.atttypid::int8 ORDER BY a.attnum) AS types, array_agg(a.attgenerated::text ORDER BY a.attnum)"
    "   AS generated, array_agg(CASE WHEN t.typdelim <> ',' OR t.typtype = 'c' THEN 0"
    "     WHEN t.typtype <> 'd' THEN t.typarray::int8"
    "     WHEN EXISTS (WITH RECURSIVE b(typ) AS (SELECT t.typbasetype UNION ALL SELECT d.typbasetype"
    "       FROM pg_catalog.pg_type d JOIN b ON d.oid = b.typ WHERE d.typtype = 'd')"
    "       SELECT FROM b JOIN pg_catalog.pg_type bt ON bt.oid = b.typ WHERE bt.typtype = 'c') THEN 0"
    "     ELSE t.typarray::int8 END ORDER BY a.attnum)"
    "   AS arrays, array_agg(a.attidentity::text ORDER BY a.attnum) AS identity"
    "   FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid"
    "   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped) cols ON true"
    " LEFT JOIN LATERAL (SELECT array_agg(a.attname::text ORDER BY k.ord) AS key FROM pg_catalog.pg_index i"
    "   CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)"
    "   JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    "   WHERE i.indexrelid = (SELECT i2.indexrelid FROM pg_catalog.pg_index i2 WHERE i2.indrelid = c.oid"
    "     AND i2.indisvalid AND ((c.relreplident = 'i' AND i2.indisreplident) OR i2.indisprimary)"
    "     ORDER BY (c.relreplident = 'i' AND i2.indisreplident) DESC LIMIT 1)) keys ON true"
    " LEFT JOIN LATERAL (WITH RECURSIVE {walk} SELECT"
    "   array_agg(dn.nspname::text ORDER BY d.oid) AS schemas, array_agg(d.typname::text ORDER BY d.oid) AS names"
    "   FROM types JOIN pg_catalog.pg_type d ON d.oid = types.typ AND d.typtype = 'd'"
    "   JOIN pg_catalog.pg_namespace dn ON dn.oid = d.typnamespace) doms ON true"
    " WHERE {where}"
)
_BY_NAME = sql.SQL("n.nspname = %s AND c.relname = %s")
#: the types a table's columns hold, for ``domains`` (applier.catalog.trust.TYPE_WALK)
_WALK = sql.SQL(TYPE_WALK.replace("{rels}", "c.oid"))
_BY_OIDS = sql.SQL("c.oid = ANY(%s::pg_catalog.oid[])")
_STAMPS = sql.SQL(
    "SELECT c.oid, {} FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " WHERE c.oid = ANY(%s::pg_catalog.oid[])"
).format(sql.SQL(STAMP_SQL))


def _local_table(row: Sequence[Any]) -> LocalTable:
    """A :class:`LocalTable` from a row of ``_LOCAL_TABLES``."""
    (
        oid,
        schema,
        name,
        relkind,
        bulk,
        names,
        types,
        generated,
        arrays,
        identity,
        key,
        dom_schemas,
        dom_names,
    ) = row[:13]
    columns = tuple(
        LocalColumn(n, t, g or "", a, i or "")
        for n, t, g, a, i in zip(
            names or (), types or (), generated or (), arrays or (), identity or (), strict=True
        )
    )
    domains = tuple(zip(dom_schemas or (), dom_names or (), strict=True))
    return LocalTable(
        int(oid), schema, name, relkind, columns, tuple(key) if key else None, bool(bulk), domains
    )


class Target:
    """The apply session on the target database."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        *,
        origin: str = "",
        binary: bool = False,
        run_as_owner: bool = False,
    ) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.pipeline = Pipeline(self.pgconn)
        self.origin = origin
        #: the origin progress that confirmed commits justify (see :meth:`abort`); set by the worker at start
        self.good_origin_lsn = 0
        #: apply lag samples are added here when the worker attaches a window (applier.apply.lag)
        self.lag: LagWindow | None = None
        #: queues statements into each COMMIT's local transaction, just before it (a table sync's catch-up moves
        #: its tables' LSN there: tablesync.live); called with (end_lsn, ctx)
        self.before_commit: Callable[[int, ErrorContext | None], None] | None = None
        self.binary = binary
        #: local tables read at the session's start, by (schema, name), with their catalog stamp
        #: (:meth:`preload_local_tables`); each is used once, by :meth:`load_local_table`
        self.preloaded: dict[tuple[str, str], tuple[LocalTable, str]] = {}
        #: the second connection that checks the preloaded tables' stamps; open while some are left
        self._side: psycopg.Connection[Any] | None = None
        self._side_until = 0.0  # time.monotonic() when the preloaded tables left are dropped and it is closed
        #: the preloaded tables (oids) the last check found unchanged, and when (time.monotonic())
        self._checked: set[int] = set()
        self._checked_at = 0.0
        self.in_transaction = False
        self._fixed_prepared = False
        #: each UPDATE/DELETE checks its row's origin first (track_commit_timestamp on: applier.apply.origin_probe)
        self.origin_checks = False
        #: the conflict rows of the open transaction, written before its COMMIT/PREPARE (--conflict-log table|all)
        self.conflict_table: ConflictTable | None = None
        # the parts, by what they hold: COPY state, the row-change statements, the catalog statements
        self.copy = CopyIn(conn, self.pipeline)
        self.dml = DmlStatements(conn, self.pipeline, self.copy, binary, run_as_owner)
        self.catalog = CatalogWrites(self)
        self.ddl = DdlWrites(self)
        # the calls the apply core makes (ports.ApplyTarget), bound once: no extra call on the hot path
        dml = self.dml
        self.insert, self.update, self.delete, self.truncate = (
            dml.insert,
            dml.update,
            dml.delete,
            dml.truncate,
        )
        self.bulk_insert, self.bulk_update, self.bulk_delete = (
            dml.bulk_insert,
            dml.bulk_update,
            dml.bulk_delete,
        )
        self.bulk_origins = dml.bulk_origins  # with origin checks on (applier.apply.origin_probe)
        self.end_copy = self.copy.end
        cat = self.catalog
        self.record_prepared, self.record_prepared_many = cat.record_prepared, cat.record_prepared_many
        self.mark_ready, self.prepared_transactions = cat.mark_ready, cat.prepared_transactions

    # --- setup -----------------------------------------------------------------------------------------------
    @classmethod
    def connect(
        cls, conninfo: str, *, origin: str, application_name: str = "applier", binary: bool = False,
        run_as_owner: bool = False,
    ) -> Target:  # fmt: skip
        """Connect and set the session up; ``origin`` becomes the session's replication origin. Unless
        ``run_as_owner``, every change is checked first for code the apply role does not trust
        (:meth:`~applier.apply.target_trust.TrustedStatements.check`), which needs the catalog's functions (applier.catalog.trust).

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
            _choose_synchronous_commit(conn)
            conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", (origin,))
            roident = read_origin_setup(conn, origin)  # origin-differs checks: read once
        except BaseException:
            conn.close()
            raise
        target = cls(conn, origin=origin, binary=binary, run_as_owner=run_as_owner)
        target.dml.watch_origins(roident)
        target.origin_checks = roident is not None
        return target

    def close(self) -> None:
        self._close_side()
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
        if self.copy.run is not None:
            return False
        if self._side is not None and time.monotonic() > self._side_until:
            self._close_side()  # the tables not used by now are read at their first use

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
        """A table's columns and key from the target's catalogs (``logicalrep_rel_open``); None if absent.

        A table preloaded at the session's start (:meth:`preload_local_tables`) is taken from there, once, if its
        catalog stamp is still the one it was read with (:meth:`_unchanged`); else (a table the preload did not
        know, a lookup again after a Relation message, a table altered since) it is read now, in one query after
        draining the pipeline."""
        found = self.preloaded.get((schema, name))
        if found is not None:
            unchanged = self._unchanged(found[0])
            self.preloaded.pop((schema, name), None)
            if not self.preloaded:
                self._close_side()
            if unchanged:
                return found[0]
        rows = self.query(
            sql.SQL(_LOCAL_TABLES).format(
                bulk=_BULK_OK, stamp=sql.SQL(STAMP_SQL), walk=_WALK, where=_BY_NAME
            ),
            (schema, name),
        )
        return _local_table(rows[0]) if rows else None

    def preload_local_tables(self, oids: Sequence[int], conninfo: str) -> int:
        """Read the local tables ``oids`` (the subscription's) in one query, before streaming starts, so that the
        first change of each needs no catalog lookup on this session, which drains the pipeline and took 3-8 ms a
        table (docs/live-replication.md, "The first transactions after a start"). Each is kept with a stamp of its
        catalog rows (``STAMP_SQL``), checked again at its first use on a second connection (``conninfo``), so
        that nothing waits here: that is where the native worker would have seen a change, through the relcache
        invalidation that marks its entry invalid. Returns how many were found; 0 (nothing preloaded) when the
        second connection cannot be opened."""
        if not oids:
            return 0
        try:
            name = (self.conn.info.parameter_status("application_name") or "applier") + " catalog check"
            self._side = psycopg.connect(conninfo, autocommit=True, application_name=name)
        except psycopg.Error as exc:
            log.debug("no preloaded tables: %s", exc)
            return 0
        self._side_until = time.monotonic() + PRELOAD_KEEP_S
        rows = self.query(
            sql.SQL(_LOCAL_TABLES).format(
                bulk=_BULK_OK, stamp=sql.SQL(STAMP_SQL), walk=_WALK, where=_BY_OIDS
            ),
            (list(oids),),
        )
        self.preloaded = {(r[1], r[2]): (_local_table(r), r[-1]) for r in rows}
        if not self.preloaded:
            self._close_side()
            return 0
        self._check_stamps()  # prepares the check's statement and warms its backend
        return len(rows)

    def _unchanged(self, table: LocalTable) -> bool:
        """Whether preloaded ``table`` still has the catalog stamp it was read with: by the last check if it is at
        most ``CHECK_FRESH_S`` old and covered it, else by a new one (of it and other tables still preloaded)."""
        if self._side is None:
            return False
        if table.oid not in self._checked or time.monotonic() - self._checked_at > CHECK_FRESH_S:
            self._check_stamps(table.oid)
        return table.oid in self._checked

    def _check_stamps(self, first: int | None = None) -> None:
        """Check the stamps of table ``first`` and of other preloaded tables, ``CHECK_BATCH`` in all, in one
        statement on the second connection (prepared): the unchanged ones go to ``_checked``, the others are no
        longer preloaded. A failure there only means reading tables again."""
        stamps = {t.oid: stamp for t, stamp in self.preloaded.values()}
        oids = ([first] if first in stamps else []) + [o for o in stamps if o != first][: CHECK_BATCH - 1]
        side = self._side
        if side is None or not oids:
            return
        try:
            rows = side.execute(_STAMPS, (oids,), prepare=True).fetchall()
        except psycopg.Error as exc:
            log.debug("catalog check failed, reading the tables again: %s", exc)
            self._close_side()
            return
        self._checked_at = time.monotonic()
        self._checked = {oid for oid, stamp in rows if stamps[oid] == stamp}
        changed = set(oids) - self._checked
        self.preloaded = {k: v for k, v in self.preloaded.items() if v[0].oid not in changed}

    def forget_local_tables(self) -> None:
        """A replayed DDL changed the local tables: none preloaded before it may be used after it."""
        self._close_side()

    def _close_side(self) -> None:
        side, self._side, self.preloaded, self._checked = self._side, None, {}, set()
        if side is not None:
            try:
                side.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

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
            self.prepare_fixed(ctx)
            self.pipeline.send_prepared(b"applier_begin", (), None, ctx)
            self.in_transaction = True
            self.dml.new_transaction()

    def start_copy(self, entry: Any, rows: Sequence[Any], ctx: ErrorContext | None) -> None:
        """Begin a COPY into ``entry``'s table (:class:`CopyIn`), after its trust check (a COPY runs the table's
        INSERT triggers, and the defaults of the columns it does not send)."""
        self.dml.check(entry, "I", ctx)
        self.copy.start(entry, rows, ctx)

    def prepare_fixed(self, ctx: ErrorContext | None) -> None:
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

    def origin_setup(self, lsn: int, ts: int, ctx: ErrorContext | None) -> None:
        """Queue ``pg_replication_origin_xact_setup``: the next commit/prepare records this progress atomically.

        The statement that follows (COMMIT, PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED) must reach the server
        whenever this one does: should the session end between the two (our process killed), the server's abort
        would carry these values and, since PostgreSQL 16, advance the origin past a transaction that never
        committed. libpq writes its buffer out by itself once it holds 64 kB, so we empty it first when it holds
        more than a little: the pair then travels in one write, at the start of the next buffer.
        """
        if self.pipeline.unflushed > 16384:
            self.pipeline.flush_all()
        self.prepare_fixed(ctx)
        self.pipeline.send_prepared(
            b"applier_xact_setup",
            [f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}".encode(), str(ts).encode()],
            None,
            ctx,
        )

    def confirming(
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

    def _log_conflicts(self, ts: int, ctx: ErrorContext | None) -> None:
        """Every result of the transaction read (its conflicts found), their rows queued into it (one round trip:
        only for ``--conflict-log table|all``, applier.apply.conflict_table)."""
        assert self.conflict_table is not None
        self.pipeline.drain()
        self.conflict_table.flush(self.pipeline, ts, ctx)

    def commit(self, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]) -> None:
        """Queue origin progress + COMMIT; ``on_ok`` runs when the commit is confirmed.

        No sync point: consecutive transactions share a pipeline segment (an explicit COMMIT commits at once),
        so a burst of small transactions costs no round trip and no extra write each.
        """
        if self.copy.run is not None:
            self.end_copy()
        if self.conflict_table is not None:
            self._log_conflicts(ts, ctx)
        if self.before_commit is not None:
            self.before_commit(end_lsn, ctx)
        self.origin_setup(end_lsn, ts, ctx)
        self.pipeline.send_prepared(
            b"applier_commit", (), None, ctx, self.confirming(end_lsn, on_ok, ts, "commit")
        )
        self.in_transaction = False

    def prepare(
        self, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]
    ) -> None:
        """Queue origin progress + PREPARE TRANSACTION (the local transaction must be open)."""
        self.end_copy()
        self.begin(ctx)
        if self.conflict_table is not None:
            self._log_conflicts(ts, ctx)
        self.origin_setup(end_lsn, ts, ctx)
        self.pipeline.send_query(b"PREPARE TRANSACTION " + gid_literal(gid, self.conn), None, ctx,
                                 self.confirming(end_lsn, on_ok, ts, "prepare"))  # fmt: skip
        self.in_transaction = False
        self.pipeline.push()  # the target starts it now, not when the loop's round ends

    def finish_prepared(self, commit: bool, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None,
                        on_ok: Callable[[Any], None]) -> None:  # fmt: skip
        """COMMIT/ROLLBACK PREPARED, its origin setup queued just before it in an empty transaction of its own:
        BEGIN, ``pg_replication_origin_xact_setup``, COMMIT, then the command, all in the open pipeline segment.

        Why the empty transaction: COMMIT PREPARED refuses to run after a statement of its pipeline segment that
        left the implicit transaction open (PostgreSQL's "cannot be executed within a pipeline"), which the origin
        setup, a SELECT, does; a transaction command (COMMIT, PREPARE TRANSACTION) closes it. It used to be a sync
        point, which made libpq write the origin setup to the socket at once (``pipeline_sync`` flushes) and the
        target answer it on its own: one more write on each side per prepared transaction. The origin values
        persist in the session until a transaction writes a commit or abort record (behaviour 113); the empty
        transaction writes none, so COMMIT PREPARED records them. Nothing needs to end a segment after it: it
        commits at once, and what follows starts a transaction of its own. Its error, if any, surfaces at the next
        sync point, as a plain COMMIT's does (see commit()), with its own context."""
        self.end_copy()
        # In an open local transaction the BEGIN below would open none and the COMMIT would end that one. The server
        # refused COMMIT PREPARED there (an error that restarts the session), and so does this.
        if self.in_transaction:
            raise ApplyError("COMMIT/ROLLBACK PREPARED cannot run inside a transaction block", ctx)
        self.prepare_fixed(ctx)
        p = self.pipeline
        p.send_prepared(b"applier_begin", (), None, ctx)
        self.origin_setup(end_lsn, ts, ctx)
        p.send_prepared(b"applier_commit", (), None, ctx)
        verb = b"COMMIT PREPARED " if commit else b"ROLLBACK PREPARED "
        kind = "commit_prepared" if commit else "rollback_prepared"
        p.send_query(verb + gid_literal(gid, self.conn), None, ctx, self.confirming(end_lsn, on_ok, ts, kind))
        p.push()  # as prepare()

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
            self._abandon_copy()
            self.pipeline.discard()
            self.conn.execute("ROLLBACK")
            self.conn.execute("SELECT pg_catalog.pg_replication_origin_xact_reset()")
            if self.origin:
                self._undo_bogus_origin_advance()
        except psycopg.Error:
            self.close()
        finally:
            self.in_transaction = False

    def _abandon_copy(self) -> None:
        """End an open COPY with an error, so the session can roll back (its rows are lost with the transaction)."""
        if self.copy.run is None:
            return
        self.copy.run = None
        try:
            self.pgconn.put_copy_end(b"abandoned")
            while self.pgconn.get_result() is not None:
                pass
        except psycopg.Error:
            pass

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

    # --- COPY (applier.apply.target_copy) -------------------------------------------------------------------
    @property
    def copy_entry(self) -> Any:
        """The relation an open COPY writes into, if any."""
        return None if self.copy.run is None else self.copy.run.entry

    @property
    def copy_run(self) -> Any:
        """The open COPY, if any (its ``add`` takes rows directly)."""
        return self.copy.run

    @staticmethod
    def copy_eligible(t: Any) -> bool:
        """COPY text format can carry text values and NULLs; binary values go through INSERT."""
        return copy_eligible(t)
