"""Live table synchronisation: tables added (``alter --refresh-publication``) while the apply worker streams.

PostgreSQL's tablesync worker, adapted to our Spark copy (behaviours 76-78). :class:`LiveSync` runs in a background
thread of the apply worker's process, so the apply loop keeps applying the other tables meanwhile:

1. copy: every table in ``i``/``d``/``f`` (a ``d``/``f`` one is left by an earlier live sync that failed: it is
   emptied and copied again) is copied with the initial copy's machinery (:class:`~tablesync.initial.InitialCopy`:
   a *temporary* slot with an exported snapshot at consistent point C on a replication connection of its own, the
   plan, the claim with exactly-once partition markers, the copy on the driver and Spark for what it leaves). The
   tables go ``i`` -> ``d`` -> ``f`` at C; the slot's connection stays open and idle.
2. SYNCWAIT (``w``, in memory only): the thread waits for the apply loop. At a transaction boundary, at position P
   (the end of the last transaction it processed, or the last received position when idle), the apply loop calls
   :meth:`LiveSync.proceed` (:func:`state.tables.join_apply_stream`):

   - P <= C: nothing of the tables' went by since C: they become ``s`` at C, and the stream applies their changes
     from C on.
   - P > C: CATCHUP (``c`` at P): on the temporary slot's own connection, START_REPLICATION from C (streaming and
     two_phase off, behaviour 70) and apply, with the apply worker's own loop (:class:`~applier.apply.loop.ApplyLoop`)
     and core (:class:`~applier.apply.handlers.Applier`) in a sync-worker context (:class:`_CatchupContext`, as
     PostgreSQL's ``am_tablesync_worker()``) on a target session of its own, every transaction up to the first
     commit ending at or after P (or an idle position at or after P); then SYNCDONE: ``s`` at that LSN L. Each
     caught-up transaction commits together with the tables' ``f`` LSN moved to its end (the target's
     ``before_commit``), so the rows and the LSN they are complete up to never disagree.

   The apply loop waits for ``s`` (``wait_for_relation_state_change``), skips the tables' changes up to its LSN
   and applies the later ones; the sync-state pass turns them ``r``.

The catch-up session uses its own replication origin ``applier_<subid>_sync`` (created when needed, dropped at the
end), never the subscription's ``applier_<subid>``, which is ahead already.

Crash safety: if the process dies, the temporary slot goes with its connection; the tables are left ``d`` (copy
unfinished: the next ``run`` empties and copies them again) or ``f`` with the LSN their rows are complete up to
(the next ``run``'s initial copy makes them ``s`` there when the stream resumes at or before it, and copies them
again otherwise). Nothing is lost or applied twice.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import psycopg

from applier.apply.context import ApplyError, ErrorContext
from applier.apply.coordinator import SyncFailure
from applier.apply.feedback import FeedbackTracker
from applier.apply.handlers import Applier, SkipState, TableStates
from applier.apply.loop import ApplyLoop
from applier.apply.spool import Spool
from applier.apply.target import Target
from applier.catalog import sql as catalog_sql
from applier.catalog.store import RelState
from applier.lsn import format_lsn
from applier.replication import ReplicationConnection, StreamOptions
from state.tables import SyncState, TableState, join_apply_stream
from tablesync.initial import COPY_STATES, CopyResult, InitialCopy, TablesyncError, copy_claimed
from tablesync.progress import CopyProgress

#: wal_receiver_status_interval for the catch-up stream.
STATUS_INTERVAL = 10.0


class LiveSyncError(TablesyncError):
    """A live table sync failed; the message says which tables and why. They stay ``d``/``f`` and are retried."""


class Phase(enum.Enum):
    COPYING = "copying"
    SYNCWAIT = "syncwait"
    CATCHUP = "catchup"
    SYNCDONE = "syncdone"
    FAILED = "failed"


def sync_origin_name(subid: int) -> str:
    """The replication origin of catch-up sessions (never the subscription's own ``applier_<subid>``)."""
    return f"applier_{subid}_sync"


def explain(exc: BaseException) -> str:
    """The error, with what to do about the usual causes."""
    text = " ".join(str(exc).split())  # one log line
    low = text.lower()
    if " -- " in text:
        pass  # explained already
    elif "replication slots are in use" in low or "max_replication_slots" in low:
        text += (
            " -- the publisher has no free replication slot for the table sync's temporary slot: raise "
            "max_replication_slots on the publisher (or drop unused slots); the sync is retried"
        )
    elif "max_wal_senders" in low or "too many clients" in low:
        text += (
            " -- the publisher refused another replication connection for the table sync: raise max_wal_senders "
            "(or max_connections) on the publisher; the sync is retried"
        )
    return text


class LiveCopy(InitialCopy):
    """:class:`InitialCopy` for tables added while streaming: every ``i``/``d``/``f`` table is copied (a ``d`` or
    ``f`` one is emptied first), and they end ``f`` at the snapshot point (:meth:`finish_tables`), not ``s``: how
    they join the stream is decided against the stream's position, which only the apply loop knows."""

    def complete(self) -> CopyResult:
        """Every copied table to ``f`` at the snapshot point; the apply loop decides how they join the stream."""
        return self.finish_tables(SyncState.FINISHEDCOPY)

    def load(self) -> list[RelState]:
        self.sub = self.catalog.require(self.subname)
        states = self.catalog.table_states(self.sub.subid)
        self.skipped = [rs.name for rs in states if rs.state not in COPY_STATES]
        self.to_copy = [rs for rs in states if rs.state in COPY_STATES]
        return self.to_copy


class _SyncingTables(TableStates):
    """The catch-up applies only the syncing tables, every transaction of theirs after C, up to the first commit
    ending at or after P."""

    def __init__(self, oids: set[int], until: int) -> None:
        self.oids = oids
        self.until = until
        self.reached: int | None = None

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:
        return local_oid in self.oids

    def after_transaction(self, current_lsn: int) -> None:
        if self.reached is None and current_lsn >= self.until:
            self.reached = current_lsn

    def joined(self, local_oid: int, name: str, state: SyncState, lsn: int | None = None) -> None:
        """Never: the catch-up's stream asks for no capture messages (the subscription's own apply replays DDL)."""


#: what each caught-up transaction also does, in its own local transaction: move the syncing tables' ``f`` LSN to
#: its end, so that the rows and the LSN they are complete up to never disagree
_MOVE_SYNC_LSN = catalog_sql.ADVANCE_FINISHED_COPY


def _moving_sync_lsn(
    target: Target, subid: int, oids: Iterable[int]
) -> Callable[[int, ErrorContext | None], None]:
    """The catch-up target's ``before_commit``: queue :data:`_MOVE_SYNC_LSN` into each commit's transaction."""
    params = (str(subid).encode(), ("{" + ",".join(str(r) for r in oids) + "}").encode())

    def before_commit(end_lsn: int, ctx: ErrorContext | None) -> None:
        target.pipeline.send_query(_MOVE_SYNC_LSN, [format_lsn(end_lsn).encode(), *params], ctx)

    return before_commit


class _CatchupContext:
    """The sync worker's context of the apply loop (``am_tablesync_worker()``; applier.apply.loop): the same loop
    as the apply worker's, which stops at the end point (the first commit ending at or after P, or an idle position
    at or after P, behaviour 78) and keeps the temporary slot's stream alive with status updates."""

    def __init__(
        self,
        stop: threading.Event,
        repl: ReplicationConnection,
        target: Target,
        applier: Applier,
        tracker: FeedbackTracker,
        tables: _SyncingTables,
    ) -> None:
        self.stop, self.repl, self.target, self.applier = stop, repl, target, applier
        self.tracker, self.tables = tracker, tables
        self.last_status = time.monotonic()

    def should_stop(self) -> bool:
        if self.stop.is_set():
            raise LiveSyncError("stopped during catch-up")
        return self.tables.reached is not None

    def caught_up(self) -> bool:
        return self.tables.reached is not None

    def housekeeping(self, received: int, reply_requested: bool) -> None:
        tables, tracker = self.tables, self.tracker
        if self.target.pipeline.pending:
            self.target.pipeline.poll()
        if tables.reached is None and self.applier.idle and tracker.last_received >= tables.until:
            tables.reached = tracker.last_received  # idle at or past P (behaviour 78: checked when idle too)
        if reply_requested or time.monotonic() - self.last_status >= STATUS_INTERVAL:
            pos = tracker.positions(None)
            self.repl.send_status(pos.write, pos.flush, pos.apply)
            self.last_status = time.monotonic()


class LiveSync:
    """One live sync of every table in ``i``/``d``/``f``, in a background thread (see the module docstring).

    The apply loop polls :attr:`phase`; at ``SYNCWAIT`` it calls :meth:`proceed` with its position and then
    :meth:`wait` until ``SYNCDONE`` or ``FAILED``.
    """

    def __init__(
        self,
        target_conninfo: str,
        subname: str,
        *,
        log: logging.Logger,
        spark_master: str | None = None,
        spark_conf: Mapping[str, str] | None = None,
    ) -> None:
        self.target_conninfo = target_conninfo
        self.subname = subname
        self.log = log
        self.spark_master = spark_master
        self.spark_conf = dict(spark_conf or {})
        self.stop = threading.Event()
        self.phase = Phase.COPYING
        self.tables: dict[str, int] = {}  # name -> relid
        self.snapshot_lsn: int | None = None  # C
        self.catchup_lsn: int | None = None  # P, when a catch-up is needed
        self.done_lsn: int | None = None  # L
        self.caught_up = 0  # transactions applied by the catch-up
        self.error: BaseException | None = None
        #: what the apply worker records and logs about a failure (None when stopped: not an error)
        self.failure: SyncFailure | None = None
        self._cond = threading.Condition()
        self._go: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"tablesync-{subname}", daemon=True)

    # --- the apply loop's side -----------------------------------------------------------------------------------
    def start(self) -> LiveSync:
        self.thread.start()
        return self

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.SYNCDONE, Phase.FAILED)

    @property
    def waiting(self) -> bool:
        """At SYNCWAIT: the apply loop is to call :meth:`proceed` at its next transaction boundary."""
        return self.phase is Phase.SYNCWAIT

    @property
    def failed(self) -> bool:
        return self.phase is Phase.FAILED

    def proceed(self, current_lsn: int) -> None:
        """The apply loop is at a transaction boundary at ``current_lsn``: join the stream there."""
        with self._cond:
            if self.phase is not Phase.SYNCWAIT or self._go is not None:
                return
            self._go = current_lsn
            self._cond.notify_all()

    def wait(
        self,
        interrupt: threading.Event | None = None,
        timeout: float | None = None,
        *,
        tick: Callable[[], None] | None = None,
        tick_interval: float = STATUS_INTERVAL,
    ) -> bool:
        """Block until the sync is done or failed (the apply loop's ``wait_for_relation_state_change``); stop
        the sync when ``interrupt`` is set; call ``tick`` (the apply stream's status update, so that the publisher
        does not time the waiting stream out) every ``tick_interval`` seconds. True when finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_tick = time.monotonic()
        with self._cond:
            while not self.finished:
                if interrupt is not None and interrupt.is_set():
                    self.stop.set()
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                if tick is not None and time.monotonic() - last_tick >= tick_interval:
                    last_tick = time.monotonic()
                    tick()
                self._cond.wait(0.2)
        return True

    def close(self, timeout: float = 60.0) -> None:
        """Stop the sync (if still running) and wait for its thread."""
        self.stop.set()
        with self._cond:
            self._cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # --- the sync thread -------------------------------------------------------------------------------------------
    def _set_phase(self, phase: Phase) -> None:
        with self._cond:
            self.phase = phase
            self._cond.notify_all()

    def _state_log(self, name: str, state: SyncState, lsn: int | None, extra: str = "") -> None:
        self.log.info(
            'logical replication table synchronization for subscription "%s", table "%s": state %s%s%s',
            self.subname,
            name,
            state.value,
            f" at {format_lsn(lsn)}" if lsn is not None else "",
            extra,
        )

    def _run(self) -> None:
        try:
            self._sync()
            self._set_phase(Phase.SYNCDONE)
        except BaseException as exc:  # noqa: BLE001 - reported to the apply loop
            self.error = exc
            if self.stop.is_set():
                self.log.info(
                    'table synchronization for subscription "%s" stopped; the tables (%s) are copied '
                    "again later",
                    self.subname,
                    ", ".join(self.tables) or "none",
                )
            else:
                # logged once, by the apply worker's LiveSyncDriver, with the retry it plans (one line for all)
                self.failure = self._failure_of(exc)
                self.log.debug(
                    'table synchronization for subscription "%s" failed (tables %s): %s',
                    self.subname,
                    ", ".join(self.tables) or "?",
                    explain(exc),
                )
            self._set_phase(Phase.FAILED)

    def _failure_of(self, exc: BaseException) -> SyncFailure:
        """The failure as the apply worker records it: an error of the catch-up's apply carries its context (the
        message and relation being applied; no finish LSN, as a skip-LSN does not apply to the catch-up); a copy
        error names its table when it knows it, else every table of this sync is the relation."""
        tables = ", ".join(self.tables) or None
        if isinstance(exc, ApplyError):
            ctx = exc.context
            return SyncFailure(
                exc.message,
                (ctx.relation if ctx else None) or tables,
                ctx.message_type if ctx else "CATCHUP",
                exc.sqlstate,
                ctx.xid if ctx else None,
                ctx.describe() if ctx else None,
            )
        relation = getattr(exc, "relation", None) or tables
        sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
        return SyncFailure(
            explain(exc), relation, "COPY" if self.phase is Phase.COPYING else "CATCHUP", sqlstate
        )

    def _sync(self) -> None:
        """The three steps of the module docstring, each on the one copier (its temporary slot stays open from
        the copy to the end of the catch-up: its snapshot point C is where the catch-up streams from)."""
        copier = LiveCopy(
            self.target_conninfo,
            self.subname,
            stop=self.stop,
            reporter=CopyProgress.to_log(
                self.log, f'table synchronization for subscription "{self.subname}": '
            ),
        )
        try:
            c_lsn = self._copy(copier)
            if c_lsn is None:
                return
            self._join(copier, c_lsn, self._syncwait(c_lsn))
        finally:
            copier.close()

    def _copy(self, copier: LiveCopy) -> int | None:
        """Step 1: copy every ``i``/``d``/``f`` table at a temporary slot's snapshot and leave them ``f`` there;
        return that snapshot point C (None: no table to copy)."""
        to_copy = copier.load()
        if not to_copy:
            return None
        self.tables = {rs.name: rs.relid for rs in to_copy}
        for rs in to_copy:
            self.log.info(
                'logical replication table synchronization worker for subscription "%s", table "%s" '
                "has started",
                self.subname,
                rs.name,
            )
        try:
            copier.open_snapshot()
        except TablesyncError as exc:
            raise LiveSyncError(
                f"cannot get a temporary slot on the publisher: {explain(exc.__cause__ or exc)}"
            ) from exc
        assert copier.slot is not None
        c_lsn = copier.slot.lsn
        copier.plan()
        copier.claim()
        for name in self.tables:
            self._state_log(
                name, SyncState.DATASYNC, None, f" (copying at snapshot point {format_lsn(c_lsn)})"
            )
        if self.stop.is_set():
            raise LiveSyncError("stopped")
        # on the driver first, like the initial copy: a table added to a running subscription is copied without
        # waiting for a JVM, unless the driver leaves partitions over
        result = copy_claimed(copier, self.spark_master, self.spark_conf)
        if result.stopped:
            raise LiveSyncError("stopped")
        for name, t in result.tables.items():
            self._state_log(name, SyncState.FINISHEDCOPY, c_lsn, f" ({t.rows} rows copied)")
        return c_lsn

    def _syncwait(self, c_lsn: int) -> int:
        """Step 2, SYNCWAIT (in memory only): wait for the apply loop's position P (:meth:`proceed`), which
        decides how the tables join its stream; return P."""
        with self._cond:
            self.snapshot_lsn = c_lsn
            self.phase = Phase.SYNCWAIT
            self._cond.notify_all()
            for name in self.tables:
                self._state_log(name, SyncState.SYNCWAIT, c_lsn)
            while self._go is None and not self.stop.is_set():
                self._cond.wait(0.5)
        if self._go is None:
            raise LiveSyncError("stopped")
        return self._go

    def _join(self, copier: LiveCopy, c_lsn: int, go: int) -> None:
        """Step 3: the tables join the stream at P = ``go``: ``s`` at C when P <= C, else after a catch-up from C
        to P (``c``, then ``s`` at the LSN L reached)."""
        joined = join_apply_stream(TableState("*", SyncState.SYNCWAIT, c_lsn), go)
        if joined.state is SyncState.SYNCDONE:
            self.done_lsn = c_lsn
            with copier.catalog.engine.begin() as c:
                for relid in self.tables.values():
                    copier.catalog.set_table_state(copier.subid, relid, SyncState.SYNCDONE, c_lsn, conn=c)
            for name in self.tables:
                self._state_log(
                    name,
                    SyncState.SYNCDONE,
                    c_lsn,
                    f" (the apply stream is at {format_lsn(go)}: no catch-up needed)",
                )
            return
        self.catchup_lsn = go
        self._set_phase(Phase.CATCHUP)
        for name in self.tables:
            self._state_log(name, SyncState.CATCHUP, go, f" (catching up from {format_lsn(c_lsn)})")
        self.done_lsn = self._catch_up(copier, c_lsn, go)
        for name in self.tables:
            self._state_log(
                name, SyncState.SYNCDONE, self.done_lsn, f" (caught up {self.caught_up} transaction(s))"
            )

    def _catch_up(self, copier: LiveCopy, c_lsn: int, until: int) -> int:
        """Stream the temporary slot from C and apply the syncing tables' transactions up to ``until``; set them
        ``s`` at the LSN reached, which is returned."""
        assert copier.slot is not None and copier.sub is not None
        sub = copier.sub
        repl = copier.slot.conn
        origin = sync_origin_name(sub.subid)
        with psycopg.connect(self.target_conninfo, autocommit=True) as c:
            c.execute(
                "SELECT pg_catalog.pg_replication_origin_create(%(o)s) WHERE NOT EXISTS"
                " (SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = %(o)s)",
                {"o": origin},
            )
        options = StreamOptions(
            publications=list(sub.subpublications), streaming="off", two_phase=False,
            origin=sub.suborigin if sub.suborigin in ("any", "none") else None,  # type: ignore[arg-type]
            binary=sub.subbinary,
        )  # fmt: skip
        repl.start_replication(copier.slot.slot_name, c_lsn, options)
        target = Target.connect(
            self.target_conninfo, origin=origin, application_name=f"applier {sub.subname} tablesync",
            binary=sub.subbinary, run_as_owner=sub.subrunasowner,
        )  # fmt: skip
        target.before_commit = _moving_sync_lsn(target, sub.subid, self.tables.values())
        repl.peer = target.pipeline  # read while the loop waits on the publisher, as the apply worker's is
        spool_dir = Path(tempfile.mkdtemp(prefix=f"applier-sync-{sub.subid}-"))
        try:
            target.good_origin_lsn = target.origin_progress(origin)
            tracker = FeedbackTracker(c_lsn)
            tables = _SyncingTables(set(self.tables.values()), until)
            applier = Applier(
                subid=sub.subid, subname=sub.subname, target=target, tracker=tracker,
                spool=Spool(spool_dir, sub.subid), tables=tables, skip=SkipState(0, sub.subname),
                clear_skip_lsn=lambda _subid, _lsn: False, logger=self.log,
            )  # fmt: skip
            # its errors' context names the origin this session applies through, not the subscription's
            applier.origin = origin
            context = _CatchupContext(self.stop, repl, target, applier, tracker, tables)
            # one message per read: the catch-up stops right after its end point, never past it
            ApplyLoop(repl, applier, tracker, context, batch_limit=1).run()
            reached = tables.reached
            assert reached is not None  # the loop ends only there (or raises)
            target.pipeline.drain()
            self.caught_up = applier.transactions
            target.mark_ready(
                sub.subid, [(relid, SyncState.SYNCDONE, reached) for relid in self.tables.values()], reached,
                origin,
            )  # fmt: skip
            with contextlib.suppress(Exception):
                target.query("SELECT pg_catalog.pg_replication_origin_session_reset()")
                target.query("SELECT pg_catalog.pg_replication_origin_drop(%s)", (origin,))
            return reached
        except BaseException:
            with contextlib.suppress(Exception):
                target.abort()
            raise
        finally:
            target.close()
            shutil.rmtree(spool_dir, ignore_errors=True)


class LiveSyncCoordinator:
    """The :class:`applier.apply.coordinator.TableSyncCoordinator` the composition root (applier.runner) hands the
    apply worker: each sync is a :class:`LiveSync` thread."""

    def __init__(
        self, *, spark_master: str | None = None, spark_conf: Mapping[str, str] | None = None
    ) -> None:
        self.spark_master, self.spark_conf = spark_master, spark_conf

    def start(self, target_conninfo: str, subname: str, log: logging.Logger) -> LiveSync:
        return LiveSync(
            target_conninfo, subname, log=log, spark_master=self.spark_master, spark_conf=self.spark_conf
        ).start()
