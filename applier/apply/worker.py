"""The apply worker: stream from the publisher's slot and apply on the target until told to stop.

``ApplyWorker(target_conninfo, subname, stop=event).run()`` is the entry point ``applier run`` uses. One *session*
is: read the subscription, connect to the target (session origin ``applier_<subid>``), connect to the publisher,
``START_REPLICATION`` at the origin's progress, then read / apply / report until something ends it. Anything that
goes wrong ends the session: the local transaction is abandoned (so the origin is not advanced), and the next
session starts again from the origin's progress, which is exactly what was committed, so every remote transaction
is applied exactly once (behaviours 53, 89, 94-96). Sessions are retried with exponential backoff (tenacity) for
errors that can go away by themselves (a server restarting, a unique violation someone fixes, a missing table someone
creates), and the error is recorded in the catalog with its context (behaviour 54) so ``applier status`` shows it.

The worker returns when the stop event is set (abandoning a remote transaction that is half applied: it is
re-sent), when the subscription is disabled or dropped, or when ``disable_on_error`` disables it (behaviour 101).
It raises :class:`ApplyWorkerError` for what cannot get better by waiting (no such subscription, no slot, no origin,
no privilege), with a message that says what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
import sqlalchemy.exc

from applier.apply import conflict_table, failover
from applier.apply.capture_keys import CaptureKeys
from applier.apply.context import ApplyError
from applier.apply.coordinator import TableSyncCoordinator
from applier.apply.feedback import FeedbackTracker
from applier.apply.handlers import Applier, SkipState
from applier.apply.housekeeping import (
    REREAD_INTERVAL,
    WATCH_STALE,
    ApplyHousekeeping,
    CatalogWatch,
    Ended,
    Outcome,
    Restart,
    Session,
)
from applier.apply.lag_summary import LagSummary
from applier.apply.loop import ApplyLoop
from applier.apply.retries import ApplyWorkerError, SessionRetries
from applier.apply.spool import Spool, default_spool_dir
from applier.apply.stall import StallWatchdog, stall_after_default, start_watchdog
from applier.apply.syncstate import CatalogTables, LiveSyncDriver
from applier.apply.target import BULK_OK_SQL, Target, TargetConnectionError
from applier.catalog.store import Catalog, Subscription
from applier.errors import ApplierError, ProtocolError
from applier.lsn import format_lsn
from applier.metrics import WorkerMetrics
from applier.replication import ReplicationConnection, ReplicationConnectionError, StreamOptions
from applier.retry import RETRY_INITIAL, max_retry_interval_default
from state.twophase import TwoPhaseState, stream_two_phase

log = logging.getLogger("applier.apply")


def group_commit_default() -> bool:
    """Group commit is on unless the environment says ``APPLIER_GROUP_COMMIT=0`` (or off/false/no)."""
    return _switch("APPLIER_GROUP_COMMIT")


def fold_prepares_default() -> bool:
    """Folding decided prepared transactions (applier.apply.fold) is on unless the environment says
    ``APPLIER_FOLD_PREPARES=0`` (or off/false/no)."""
    return _switch("APPLIER_FOLD_PREPARES")


def _switch(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def bulk_apply_default() -> bool:
    """Bulk apply (applier.apply.bulk) is on unless the environment says ``APPLIER_BULK_APPLY=0`` (or off/false/no);
    it needs group commit."""
    return _switch("APPLIER_BULK_APPLY")


@dataclass
class WorkerStats:
    """Counters for tests, ``status`` and benchmarks."""

    sessions: int = 0
    transactions: int = 0
    messages: int = 0
    errors: int = 0
    groups: int = 0  # group commits of several remote transactions
    records_in_group: int = 0  # prepared_xact records committed in a group commit rather than on their own
    records_batched: int = 0  # prepared_xact records written ahead, several in one transaction
    converted_rows: int = 0  # Inserts converted into COPY text a stretch at a time (applier.apply.copytext)
    bulk_transactions: int = 0  # remote transactions applied a batch at a time (applier.apply.bulk)
    folded_prepares: int = 0  # prepared transactions applied folded with their decision (applier.apply.fold)
    last_error: str | None = None
    started_streaming: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Held:
    """What a session opened so far, closed at its end whatever happened."""

    target: Target
    spool: Spool | None = None
    repl: ReplicationConnection | None = None
    applier: Applier | None = None
    tracker: FeedbackTracker | None = None


class ApplyWorker:
    """Streams one subscription's changes from its publisher and applies them to the target (see module doc).

    ``stop`` ends :meth:`run` cleanly; ``spool_dir`` holds streamed transactions (default: a per-user directory
    under the system temporary directory). ``retry_initial``/``retry_max`` bound the exponential backoff between
    failed sessions. ``table_sync`` synchronises tables added while streaming (the composition root passes
    ``tablesync.live.LiveSyncCoordinator``); without it they wait in ``i``.
    """

    #: the publisher the last session streamed from: a failover since is recognised (applier.apply.failover)
    publisher_seen: failover.PublisherSeen | None = None

    def __init__(
        self,
        target_conninfo: str,
        subname: str,
        *,
        stop: threading.Event | None = None,
        spool_dir: Path | None = None,
        logger: logging.Logger | None = None,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float | None = None,
        table_sync: TableSyncCoordinator | None = None,
        group_commit: bool | None = None,
        bulk: bool | None = None,
        fold_prepares: bool | None = None,
        stall_after: float | None = None,
    ) -> None:
        self.target_conninfo = target_conninfo
        self.subname = subname
        self.stop = stop if stop is not None else threading.Event()
        self.spool_dir = spool_dir or default_spool_dir()
        self.log = logger or log
        self.retry_initial = retry_initial
        #: the cap of the backoff (applier.retry): ``--max-retry-interval`` / ``APPLIER_MAX_RETRY_INTERVAL``, 5 s
        self.retry_max = retry_max if retry_max is not None else max_retry_interval_default()
        self.catalog = Catalog.connect(target_conninfo)
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics(subname, self.catalog)  # and subscription_stats, once subid is set
        #: apply lag samples (applier.apply.lag), kept across sessions; summarised into the catalog for status
        self.lag_summary = LagSummary(self.catalog, self.metrics, self.log)
        self.lag = self.lag_summary.window
        #: the backoff between sessions and the records of failed remote transactions
        self.retries = SessionRetries(self, initial=self.retry_initial, cap=self.retry_max)
        self.subid: int | None = None  # known once a session read the subscription
        self.capture_keys = CaptureKeys(self.catalog, self.log)  # the DDL capture's key (applier.ddl)
        #: tables added while streaming are copied and caught up live, through the injected coordinator
        #: (a failed sync is recorded and retried with the same backoff and cap as a failed session)
        self._live: LiveSyncDriver | None = None
        if table_sync is not None:
            self._live = LiveSyncDriver(
                table_sync,
                target_conninfo,
                subname,
                self.log,
                self.stop,
                catalog=self.catalog,
                initial=self.retry_initial,
                cap=self.retry_max,
                counted=self.metrics.sync_error,
            )
        #: group commit (docs/differences.md); off with ``APPLIER_GROUP_COMMIT=0`` / ``run --no-group-commit``
        self.group_commit = group_commit if group_commit is not None else group_commit_default()
        #: bulk apply of whole plain transactions (docs/differences.md); off with ``APPLIER_BULK_APPLY=0``
        self.bulk = bulk if bulk is not None else bulk_apply_default()
        #: decided prepared transactions applied as plain ones (docs/differences.md); ``APPLIER_FOLD_PREPARES=0``
        self.fold_prepares = fold_prepares if fold_prepares is not None else fold_prepares_default()
        #: behind without progress this long is reported as a stall (applier.apply.stall; ``APPLIER_STALL_AFTER``)
        self.stall_after = stall_after if stall_after is not None else stall_after_default()
        self.watchdog: StallWatchdog | None = None  # the current session's (applier.apply.stall)

    # --- the outer loop ----------------------------------------------------------------------------------------
    def run(self) -> None:
        """Stream and apply until stopped, disabled or dropped; raise :class:`ApplyWorkerError` when waiting cannot
        help. Reconnects with exponential backoff through publisher and target restarts (applier.apply.retries)."""
        try:
            while self.retries.run(self._attempt) is Outcome.RESTART:
                pass
        finally:
            if self._live is not None:
                self._live.end()
            self.catalog.engine.dispose()

    def _attempt(self) -> Outcome:
        if self.stop.is_set():
            return Outcome.STOPPED
        try:
            return self._session()
        except Restart:
            return Outcome.RESTART
        except Ended as end:
            return end.outcome
        except (ApplyError, ProtocolError) as exc:
            return self.retries.apply_failed(exc)

    # --- one session ---------------------------------------------------------------------------------------------
    def _session(self) -> Outcome:
        """Read the subscription, connect both sides, stream until something ends the session."""
        self.retries.grouped_session = False
        sub = self._session_subscription()
        if isinstance(sub, Outcome):
            return sub
        self.stats.sessions += 1
        self.subid = self.metrics.subid = sub.subid
        tables = CatalogTables(self.catalog, sub, self.log, self._live)
        target = self._connect_target(sub)
        target.lag = self.lag
        tables.target = target
        self.lag_summary.session_started()
        held = _Held(target)
        clean = False
        try:
            session = self._start_streaming(sub, target, tables, held)
            watch = CatalogWatch(self.catalog, sub.subname, self.bulk_tables)
            watch.start()
            self.lag_summary.watch = session.watch = tables.watch = watch
            watchdog = self.watchdog = self._stall_watchdog(session)
            try:
                with _long_lived_frozen():
                    outcome = self._stream(session)
            finally:
                self.lag_summary.watch = None
                watchdog.close()
                watch.close()
            clean = True
            return outcome
        finally:
            self._end_session(held, clean)

    def _stall_watchdog(self, session: Session) -> StallWatchdog:
        """The session's stall watchdog (applier.apply.stall), started."""
        subid, catalog = session.sub.subid, self.catalog
        return start_watchdog(self.subname, session.tracker, session.target.pipeline, self.metrics, self.log,
                              after=self.stall_after, record=lambda figures: catalog.record_stall(subid, figures))  # fmt: skip

    def _session_subscription(self) -> Subscription | Outcome:
        """The subscription, when a session may start; else why not (or :class:`ApplyWorkerError`)."""
        sub = self.catalog.get(self.subname) if self.catalog.exists() else None
        if sub is None:
            if self.stats.sessions == 0:
                raise ApplyWorkerError(
                    f'subscription "{self.subname}" does not exist on the target (see: applier status; '
                    f"create it with applier create {self.subname} ...)"
                )
            return Outcome.DROPPED
        if not sub.subenabled:
            self.log.info(
                'logical replication apply worker for subscription "%s" will stop because the '
                "subscription was disabled",
                self.subname,
            )
            return Outcome.DISABLED
        if not sub.subslotname:
            raise ApplyWorkerError(
                f'subscription "{sub.subname}" has no replication slot set: '
                f"set one with applier alter {sub.subname} --set slot_name=NAME"
            )
        return sub

    def _start_streaming(
        self, sub: Subscription, target: Target, tables: CatalogTables, held: _Held
    ) -> Session:
        """Spool, origin progress, START_REPLICATION there (two-phase when it may be), and the apply core."""
        held.spool = spool = Spool(self._spool_directory(target, sub), sub.subid)
        self.catalog.reconcile_prepared(sub.subid)
        spool.cleanup()
        start_lsn = target.origin_progress(sub.origin_name)
        target.good_origin_lsn = start_lsn
        # the local tables, now: the first change of each then needs no lookup that would stall the pipeline
        target.preload_local_tables(sorted(tables.by_oid), self.target_conninfo)
        held.tracker = tracker = FeedbackTracker(start_lsn)
        two_phase = stream_two_phase(sub.subtwophasestate, tables.table_states())
        held.repl = repl = self._connect_publisher(sub, start_lsn, two_phase)
        repl.peer = target.pipeline  # its results and notices are read while the loop waits on the publisher
        tables.keepalive = lambda: repl.send_status(*dataclasses.astuple(tracker.last_sent))
        if two_phase and sub.subtwophasestate == TwoPhaseState.PENDING:
            self.catalog.update_subscription(sub.subid, subtwophasestate=TwoPhaseState.ENABLED)
            tables.two_phase_state = TwoPhaseState.ENABLED
        self.log.info(
            'logical replication apply worker for subscription "%s" has started streaming at %s%s',
            sub.subname,
            format_lsn(start_lsn),
            " with two_phase" if two_phase else "",
        )
        self.stats.started_streaming.set()
        skip = SkipState(sub.subskiplsn or 0, sub.subname)
        held.applier = applier = Applier(
            subid=sub.subid,
            subname=sub.subname,
            target=target,
            tracker=tracker,
            spool=spool,
            tables=tables,
            skip=skip,
            clear_skip_lsn=self.catalog.clear_skip_lsn,
            logger=self.log,
            prepared=target.prepared_transactions(sub.subid),
            group_commit=self.group_commit,
            ungrouped_until=self.retries.ungrouped_until,
            bulk=self.bulk,
            ddl=self.capture_keys.consumer(sub),
        )
        applier.records.original_gids = sub.original_gids
        conflict_table.attach(applier.stats, target, sub.subid, sub.subconflictlog, self.metrics.conflict)
        self.retries.session_started(self.group_commit)
        return Session(sub, repl, target, applier, tracker, tables, skip)

    def _stream(self, session: Session) -> Outcome:
        """The apply loop in the apply worker's context, until stopped (anything else ends it by raising)."""
        housekeeping = ApplyHousekeeping(self, session)
        loop = ApplyLoop(
            session.repl,
            session.applier,
            session.tracker,
            housekeeping,
            two_phase=session.tables.two_phase_state != TwoPhaseState.DISABLED,
            fold_prepares=self.fold_prepares,
            status_pacer=housekeeping.status_pacer,
        )
        loop.run()
        return self._stop_session(session)

    def _end_session(self, held: _Held, clean: bool) -> None:
        """Count, publish, and close what the session held; after an error, abandon the open local transaction."""
        target = held.target
        if held.applier is not None:
            self._count(held.applier, target)
        if not clean and held.tracker is not None:
            self.retries.session_failed(held.tracker.last_received)
        if not clean and not target.closed:
            target.abort()
        target.close()
        if held.repl is not None:
            held.repl.close()
        if held.spool is not None:
            held.spool.cleanup()

    def _count(self, applier: Applier, target: Target) -> None:
        """The session's counters into the worker's; progress past the failing transaction resets the backoff."""
        stats = self.stats
        stats.transactions += applier.transactions
        stats.groups += applier.groups
        stats.records_in_group += applier.records_in_group
        stats.records_batched += applier.records_batched
        stats.converted_rows += applier.converted_rows
        stats.bulk_transactions += applier.bulk_transactions
        stats.folded_prepares += applier.folded_prepares
        self.publish(applier, record_lag=False)
        self.metrics.session_ended()
        self.retries.progress(applier.transactions, target.good_origin_lsn)

    def _spool_directory(self, target: Target, sub: Subscription) -> Path:
        """``<spool_dir>/<target system identifier>-<subid>``: subids are unique only within a target cluster,
        and several workers (of other targets) may share one spool directory; each removes only its own files."""
        sysid = target.query("SELECT system_identifier::text FROM pg_catalog.pg_control_system()")[0][0]
        return self.spool_dir / f"{sysid}-{sub.subid}"

    def _connect_target(self, sub: Subscription) -> Target:
        try:
            return Target.connect(
                self.target_conninfo,
                origin=sub.origin_name,
                application_name=f"applier {sub.subname}",
                binary=sub.subbinary,
                run_as_owner=sub.subrunasowner,
            )
        except psycopg.errors.UndefinedObject as exc:
            raise ApplyWorkerError(
                f'replication origin "{sub.origin_name}" of subscription "{sub.subname}" does not exist on the '
                f"target ({exc}): drop and create the subscription again"
            ) from exc
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ApplyWorkerError(
                f"the target role may not run an apply session ({exc}): grant it SET ON PARAMETER "
                "session_replication_role and the pg_replication_origin_* functions (docs/security.md)"
            ) from exc

    def _connect_publisher(self, sub: Subscription, start_lsn: int, two_phase: bool) -> ReplicationConnection:
        repl = ReplicationConnection.open(sub.subconninfo, application_name=sub.subname)
        try:
            system = repl.identify_system()
            verdict, seen = failover.examine(repl, sub.subslotname or sub.subname, system.systemid,
                                             system.timeline, system.xlogpos, start_lsn, self.publisher_seen)  # fmt: skip
            if verdict.stop is not None:  # the slot is gone, or this server's history left ours
                self.retries.stop_subscription(sub, verdict.stop)
            if verdict.note is not None:  # a failover we can follow
                self.log.warning('logical replication apply worker for subscription "%s": %s', sub.subname,
                                 verdict.note)  # fmt: skip
            origin = sub.suborigin if sub.suborigin in ("any", "none") else None
            options = StreamOptions(
                publications=list(sub.subpublications),
                streaming="on" if sub.substream in ("on", "parallel") else "off",
                two_phase=two_phase,
                origin=origin,  # type: ignore[arg-type]
                binary=sub.subbinary,
                messages=True,  # a capture installed while streaming restarts the session (applier.apply.ddl_replay)
            )
            self.capture_keys.read(repl, sub)
            repl.start_replication(sub.subslotname or sub.subname, start_lsn, options)
        except ReplicationConnectionError as exc:
            repl.close()
            if exc.sqlstate == "42704":  # undefined_object: the slot is gone (since examine looked)
                self.retries.stop_subscription(
                    sub,
                    f'{exc}: the subscription\'s slot "{sub.subslotname}" does not exist on the publisher. '
                    "The subscription has been disabled; " + failover.RECOVER,
                )
            raise
        except BaseException:
            repl.close()
            raise
        self.publisher_seen = seen
        return repl

    def publish(self, applier: Applier, *, record_lag: bool = True) -> None:
        """Counters and lag samples to the metrics; the lag summary to the catalog (not when a session ends: the
        target may be what failed, and a connection attempt must not delay the reconnect)."""
        self.metrics.publish(
            applier.kinds, applier.rows, bulk=applier.bulk_transactions, folded=applier.folded_prepares
        )
        self.lag_summary.publish(self.subid, record=record_lag)

    def bulk_tables(self, oids: list[int], conn: sqlalchemy.Connection | None = None) -> set[int]:
        """``Target.bulk_tables`` on the catalog's connection (``conn``, or one of its own): the same committed
        catalog state, without draining the apply session's pipeline (which, under a steady load, would stall it
        once a second)."""
        with contextlib.nullcontext(conn) if conn is not None else self.catalog.engine.connect() as c:
            rows = c.execute(
                sqlalchemy.text(
                    "SELECT c.oid FROM pg_catalog.pg_class c WHERE c.oid = ANY(CAST(:oids AS pg_catalog.oid[]))"  # noqa: S608 - constant SQL of ours
                    " AND " + BULK_OK_SQL
                ),
                {"oids": oids},
            ).fetchall()
        return {int(r[0]) for r in rows}

    def _stop_session(self, session: Session) -> Outcome:
        """Stop requested: finish what is committed, abandon a half-applied remote transaction (it is re-sent)."""
        repl, target, applier, tracker = session.repl, session.target, session.applier, session.tracker
        if applier.in_remote_transaction or applier.group_pending:
            self.log.info(
                "abandoning remote transaction %s on stop; it will be applied after restart",
                applier.remote_xid,
            )
            target.abort()
            tracker.forget_unconfirmed()
        else:
            target.pipeline.drain()
            if applier.finished_prepared:
                # every queued PREPARE has run: the records of finished ones go now rather than at the next start
                # (the idle housekeeping removes them at most once a second, and a stop can come first)
                with contextlib.suppress(Exception):
                    self.catalog.reconcile_prepared(applier.subid)
        try:
            if tracker.pending and not target.closed:
                insert_lsn, flush_lsn = target.wal_positions()
                tracker.resolve(insert_lsn)
                pos = tracker.positions(flush_lsn)
            else:
                pos = tracker.positions(None)
            repl.send_status(pos.write, pos.flush, pos.apply)
        except (ApplierError, psycopg.Error) as exc:
            self.log.debug("final status update failed: %s", exc)
        return Outcome.STOPPED


@contextlib.contextmanager
def _long_lived_frozen() -> Iterator[None]:
    """Keep what exists when streaming starts (modules, caches, the preloaded tables: ~75,000 objects) out of the
    garbage collector's full passes while the session streams: a full pass over them took 25-30 ms, a stall that
    lands on whichever change arrives meanwhile. Objects created while streaming are collected as before; at the
    session's end everything is handed back (``gc.unfreeze``), so a worker that reconnects many times keeps
    nothing for good."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class WorkerThread:
    """Run an :class:`ApplyWorker` in a background thread (tests, the demo): ``stop()`` then ``join()``, which
    re-raises what the worker raised."""

    def __init__(self, worker: ApplyWorker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"apply-{worker.subname}", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # noqa: BLE001 - handed to join()
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.stop.set()
        self.join(timeout)

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"apply worker for {self.worker.subname} did not stop within {timeout}s")
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


def start_worker(target_conninfo: str, subname: str, **kwargs: Any) -> WorkerThread:
    """Start an :class:`ApplyWorker` in a thread with its own stop event; ``kwargs`` go to the constructor."""
    return WorkerThread(ApplyWorker(target_conninfo, subname, **kwargs)).start()


__all__ = [
    "REREAD_INTERVAL",
    "WATCH_STALE",
    "ApplyWorker",
    "ApplyWorkerError",
    "TargetConnectionError",
    "WorkerThread",
    "start_worker",
]
