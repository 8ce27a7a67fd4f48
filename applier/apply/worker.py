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
import enum
import logging
import operator
import os
import re
import shlex
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import sqlalchemy
import sqlalchemy.exc
import tenacity

from applier.apply.bulk import MIN_TRANSACTIONS as BULK_MIN_TRANSACTIONS
from applier.apply.bulk import Batch
from applier.apply.context import ApplyError, ErrorContext
from applier.apply.copytext import InsertRun
from applier.apply.feedback import FeedbackTracker
from applier.apply.fold import decided_prepares
from applier.apply.handlers import RAW_SPOOL_TYPES, VECTOR_MIN, Applier, SkipState, TableStates
from applier.apply.lag import LagWindow
from applier.apply.spool import Spool, default_spool_dir
from applier.apply.target import BULK_OK_SQL, Target, TargetConnectionError
from applier.catalog.store import Catalog, CatalogError, RelState, Subscription
from applier.decoder import MessageDecoder, decode_message
from applier.errors import ApplierError, ProtocolError
from applier.lsn import format_lsn
from applier.messages import PrimaryKeepalive, XLogData
from applier.metrics import WorkerMetrics
from applier.replication import ReplicationConnection, ReplicationConnectionError, StreamOptions
from applier.retry import RETRY_INITIAL, max_retry_interval_default, retry_delay
from state.tables import SyncState, TableState, process_syncing_tables, should_apply_changes_for_rel
from state.twophase import (
    TwoPhaseState,
    restart_for_two_phase_message,
    should_restart_for_two_phase,
    stream_two_phase,
)

log = logging.getLogger("applier.apply")

#: How often the worker re-reads its subscription row while idle (PostgreSQL reacts to catalog invalidations).
REREAD_INTERVAL = 1.0
#: wal_receiver_status_interval: an unchanged status is still sent this often.
STATUS_INTERVAL = 10.0
#: How often, at most, the target's WAL flush position is read while commits wait to become durable.
FLUSH_POLL_INTERVAL = 0.1
#: Messages applied before the loop looks at feedback, results and the stop event again.
BURST = 5000
#: A read that emptied the socket in the middle of a remote transaction (the walsender is still sending it: it
#: only sends committed ones, or a streamed chunk), or after at least READ_PAUSE_AFTER messages (a backlog), is
#: followed by a READ_PAUSE wait before reading on. The walsender sends each message with its own send(), cheap
#: while the socket is full and about 1.3 µs more per message while the reader keeps up (ReplicationConnection's
#: receive buffer); the pause lets its output queue up again, so the worker reads large batches. The cost is at
#: most this much latency, and only while a transaction is arriving or traffic is heavy. Measured on bulk inserts:
#: bench/RESULTS.md. The pause adapts to what the reads show: mid-transaction it is taken only after a read of at
#: least READ_PAUSE_IN_TXN_AFTER messages (a large transaction arriving). A small transaction that a steady load's
#: read caught half-sent (a few messages; the rest follows within microseconds) is read on at once: there the pause
#: was pure latency (bench/live_bench.py).
READ_PAUSE_AFTER = 200
READ_PAUSE_IN_TXN_AFTER = 32
READ_PAUSE = 0.002
#: the pgoutput message type of an XLogData read undecoded (after its 25-byte envelope)
_MESSAGE_TYPE = operator.itemgetter(25)
#: over a batch's message types: where a run of Inserts ends
_NOT_INSERT = re.compile(rb"[^I]")
#: dataStart and walEnd of an XLogData envelope
_XLOG_POSITIONS = struct.Struct(">QQ").unpack_from
#: every XLogData is read undecoded (ReplicationConnection.read_undecoded) and handled in batches
XLOG_MESSAGE = bytes([1] * 256)
#: the changes that a stream chunk spools
STREAMED_CHANGE = bytes(1 if t in RAW_SPOOL_TYPES else 0 for t in range(256))
#: over a batch's message types: where a run of such changes ends
_NOT_STREAMED_CHANGE = re.compile(
    b"[^" + b"".join(re.escape(bytes([t])) for t in sorted(RAW_SPOOL_TYPES)) + b"]"
)
#: How often the worker hands its counters to the Prometheus metrics (off the per-message path).
METRICS_INTERVAL = 1.0
#: Records of finished prepared transactions are removed (which drains the apply pipeline) when nothing arrived in
#: the last round of reads, or the pipeline holds at most RECONCILE_DRAIN_MAX statements, or after
#: RECONCILE_MAX_DEFER seconds whatever it holds.
RECONCILE_DRAIN_MAX = 64
RECONCILE_MAX_DEFER = 10.0
#: A catalog-watch snapshot older than this is not trusted: the loop re-reads synchronously, as it did before.
WATCH_STALE = 5.0
#: How often, at most, the apply lag summary is written to the catalog for ``applier status`` (only when it changed).
LAG_WRITE_INTERVAL = 2.0
#: How often the sync-state pass re-reads the table states while the stream is busy (when idle: REREAD_INTERVAL).
TABLES_REREAD_INTERVAL = 2.0
#: ``SyncState.READY`` looked up once: ``should_apply`` runs for every change, and an enum member lookup costs more
_READY = SyncState.READY
#: After a failed live table sync, the next attempt waits this long (wal_retrieve_retry_interval is 5 s).
LIVE_SYNC_RETRY = 5.0
#: wal_receiver_timeout: silence from the publisher this long ends the session (a ping is sent at half of it).
RECEIVER_TIMEOUT = 60.0


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


def skip_command(subname: str, finish_lsn: int) -> str:
    """The command that skips the remote transaction finishing at ``finish_lsn`` (behaviours 97-100)."""
    return f"applier alter {shlex.quote(subname)} --skip-lsn {format_lsn(finish_lsn)}"


class _CatalogWatch(threading.Thread):
    """Reads, every ``REREAD_INTERVAL``, what the idle housekeeping compares (the subscription row, the table
    states, which mapped tables may still be applied in bulk) on the catalog's session, and writes the apply lag
    summary, all off the apply loop: under a steady load three synchronous round trips a second made the loop stall
    for tens to hundreds of milliseconds once a second (bench/live_bench.py, the chart's periodic spikes).

    The loop only uses a snapshot to conclude that *nothing changed* (:meth:`ApplyWorker._unchanged`); anything
    else, or no snapshot for ``WATCH_STALE`` seconds, falls back to the synchronous re-read it always did, so no
    change is applied from a possibly stale snapshot."""

    def __init__(self, catalog: Catalog, subname: str, bulk_tables: Any) -> None:
        super().__init__(daemon=True, name=f"applier-catalog-watch {subname}")
        self.catalog, self.subname, self._bulk_tables = catalog, subname, bulk_tables
        self.oids: frozenset[int] = frozenset()  # set by the loop: the tables mapped for bulk apply
        self.lag: tuple[int, dict[str, Any]] | None = None  # set by the loop: (subid, figures) to write
        self.latest: SimpleNamespace | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(REREAD_INTERVAL):
            try:
                sub = self.catalog.get(self.subname)
                states = (
                    frozenset((r.relid, r.state, r.lsn) for r in self.catalog.table_states(sub.subid))
                    if sub is not None
                    else frozenset()
                )
                oids = self.oids
                bulk_ok = frozenset(self._bulk_tables(sorted(oids))) if oids else frozenset()
                self.latest = SimpleNamespace(
                    at=time.monotonic(), sub=sub, states=states, oids=oids, bulk_ok=bulk_ok
                )
                lag, self.lag = self.lag, None
                if lag is not None:
                    self.catalog.record_lag(*lag)
            except Exception as exc:  # noqa: BLE001 - the loop falls back to reading synchronously
                log.debug("catalog watch: %s", exc)

    def close(self) -> None:
        self._stop_event.set()
        self.join(5)


class ApplyWorkerError(ApplierError):
    """An error waiting will not fix; the message says what to do."""


class _Outcome(enum.Enum):
    STOPPED = "stopped"
    DISABLED = "disabled"
    DROPPED = "dropped"
    RESTART = "restart"


class _Restart(Exception):
    """End the session and start the next one at once (two-phase enabling, changed subscription options)."""


class _Ended(Exception):
    """End the session and return from :meth:`ApplyWorker.run` with ``outcome``."""

    def __init__(self, outcome: _Outcome) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome


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


class _CatalogTables(TableStates):
    """Table states from the catalog, cached; non-ready tables are re-read once per remote transaction
    (``logicalrep_rel_open`` re-reads them on every open while not READY)."""

    def __init__(self, worker: ApplyWorker, sub: Subscription) -> None:
        self.worker = worker
        self.catalog = worker.catalog
        self.subid = sub.subid
        self.two_phase_state = sub.subtwophasestate
        self.by_oid: dict[int, RelState] = {}
        self._checked: dict[int, int] = {}
        self.all_ready = False
        self.target: Target | None = None
        #: sends the stream's last status again (set by the session): used while waiting for a live sync
        self.keepalive: Any = None
        self.reload()

    def reload(self) -> None:
        self._last_reload = time.monotonic()
        self._set({r.relid: r for r in self.catalog.table_states(self.subid)})

    def _set(self, by_oid: dict[int, RelState]) -> None:
        self.by_oid = by_oid
        self._checked.clear()
        self.all_ready = all(r.state == SyncState.READY for r in by_oid.values())

    def table_states(self) -> list[TableState]:
        return [
            TableState(
                r.name, r.state, r.lsn if r.state not in (SyncState.INIT, SyncState.DATASYNC) else None
            )
            for r in self.by_oid.values()
        ]

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:
        rel = self.by_oid.get(local_oid)
        if rel is not None and rel.state is _READY:
            return True
        if self._checked.get(local_oid) != remote_final_lsn:
            self._checked[local_oid] = remote_final_lsn
            fresh = {r.relid: r for r in self.catalog.table_states(self.subid)}
            checked = dict(self._checked)
            self._set(fresh)
            self._checked = checked
            rel = fresh.get(local_oid)
        if rel is None:
            return False
        return should_apply_changes_for_rel(rel.state, rel.lsn, remote_final_lsn)

    def after_transaction(self, current_lsn: int) -> None:
        """The sync-state pass (behaviour 76) and the two-phase restart check (57)."""
        if time.monotonic() - self._last_reload >= TABLES_REREAD_INTERVAL:
            self.reload()  # notice tables added by alter --refresh-publication even when never idle
        if self.all_ready and self.two_phase_state != TwoPhaseState.PENDING:
            return
        self._live_sync_pass(current_lsn)
        ready = process_syncing_tables(self.table_states(), current_lsn)
        if ready:
            if self.target is None:  # pragma: no cover - always set while streaming
                raise RuntimeError("sync-state pass without a target session")
            # Only once what was applied before is known committed (were a queued commit to fail, the stream
            # would restart before it and must still skip what the copy holds), and in the apply session with the
            # origin advanced to current_lsn in the same transaction: a table becomes ready at L only together
            # with "the stream resumes after L". Otherwise a restart would resume before L and re-send
            # transactions this table skipped (its copy holds them) into a table that now takes everything.
            self.target.pipeline.drain()
            by_name = {r.name: r for r in self.by_oid.values()}
            self.target.mark_ready(
                self.subid, [(by_name[t.name].relid, t.state, t.lsn) for t in ready], current_lsn
            )
            for t in ready:
                self.worker.log.info(
                    'logical replication table synchronization for subscription "%s", table "%s" has finished',
                    self.worker.subname, t.name,
                )  # fmt: skip
            self.reload()
        if should_restart_for_two_phase(self.two_phase_state, self.table_states()):
            if self.target is not None:
                self.target.pipeline.drain()
            self.worker.log.info(restart_for_two_phase_message(self.worker.subname))
            raise _Restart()

    def _live_sync_pass(self, current_lsn: int) -> None:
        """Tables added while streaming (``i``; ``d``/``f`` left by a failed live sync) are copied and caught up by
        a :class:`tablesync.live.LiveSync` thread; at its SYNCWAIT the stream, here at a transaction boundary at
        ``current_lsn``, tells it where to join and waits until the tables are ``s`` (behaviour 76)."""
        worker = self.worker
        live = worker.live_sync
        if live is None:
            if (
                worker.live_sync_enabled
                and time.monotonic() >= worker.live_retry_at
                and any(r.state.needs_table_sync for r in self.by_oid.values())
            ):
                worker.start_live_sync()
            return
        if live.phase.value == "copying":
            return
        if live.phase.value == "syncwait":
            if self.target is not None:
                self.target.pipeline.drain()
            live.proceed(current_lsn)
            live.wait(worker.stop, tick=self.keepalive)
        if live.finished:
            worker.end_live_sync()
            self.reload()


class ApplyWorker:
    """Streams one subscription's changes from its publisher and applies them to the target (see module doc).

    ``stop`` ends :meth:`run` cleanly; ``spool_dir`` holds streamed transactions (default: a per-user directory
    under the system temporary directory). ``retry_initial``/``retry_max`` bound the exponential backoff between
    failed sessions.
    """

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
        live_sync: bool = True,
        group_commit: bool | None = None,
        bulk: bool | None = None,
        fold_prepares: bool | None = None,
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
        self.metrics = WorkerMetrics(subname)
        #: apply lag samples (applier.apply.lag), kept across sessions; summarised into the catalog for status
        self.lag = LagWindow()
        self._lag_written = 0  # LagWindow.added when the summary was last written
        self._lag_written_at = 0.0
        self._lag_table: bool | None = None  # whether the catalog has applier.apply_lag (version 3)
        self._watch: _CatalogWatch | None = None  # the session's catalog watch, which writes the lag summary
        self._failures = 0
        #: (xid, finish LSN) of the remote transaction that failed last, while it keeps failing: the backoff grows
        #: until a session commits past it (or another one fails)
        self._failing: tuple[int | None, int] | None = None
        #: the wait _apply_failed computed (and recorded) for the retry that follows it
        self._planned_delay: float | None = None
        self._subid: int | None = None
        #: tables added while streaming are copied and caught up live (tablesync.live)
        self.live_sync_enabled = live_sync
        self.live_sync: Any = None  # a running tablesync.live.LiveSync
        self.live_retry_at = 0.0
        #: group commit (docs/differences.md); off with ``APPLIER_GROUP_COMMIT=0`` / ``run --no-group-commit``
        self.group_commit = group_commit if group_commit is not None else group_commit_default()
        #: bulk apply of whole plain transactions (docs/differences.md); off with ``APPLIER_BULK_APPLY=0``
        self.bulk = bulk if bulk is not None else bulk_apply_default()
        #: decided prepared transactions applied as plain ones (docs/differences.md); ``APPLIER_FOLD_PREPARES=0``
        self.fold_prepares = fold_prepares if fold_prepares is not None else fold_prepares_default()
        #: after a session ended by an error, remote transactions up to what it had received are applied one local
        #: transaction each, so that an error recurring there names exactly one remote transaction
        self._ungrouped_until = 0
        self._grouped_session = False  # the last session grouped transactions finishing after _grouped_after
        self._grouped_after = 0

    # --- the outer loop ----------------------------------------------------------------------------------------
    def run(self) -> None:
        """Stream and apply until stopped, disabled or dropped; raise :class:`ApplyWorkerError` when waiting cannot
        help. Reconnects with exponential backoff through publisher and target restarts."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self._retryable),
            wait=self._backoff,
            sleep=self._sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            while True:
                outcome = retrying(self._attempt)
                if outcome is not _Outcome.RESTART:
                    return
        finally:
            if self.live_sync is not None:
                self.live_sync.close()
                self.live_sync = None
            self.catalog.engine.dispose()

    # --- live table sync -------------------------------------------------------------------------------------------
    def start_live_sync(self) -> None:
        from tablesync.live import LiveSync

        self.live_sync = LiveSync(self.target_conninfo, self.subname, log=self.log).start()

    def end_live_sync(self) -> None:
        """Forget a finished live sync; after a failure, the next one starts after ``LIVE_SYNC_RETRY``."""
        live, self.live_sync = self.live_sync, None
        if live is None:
            return
        live.close()
        if live.phase.value == "failed":
            self.live_retry_at = time.monotonic() + LIVE_SYNC_RETRY

    def _attempt(self) -> _Outcome:
        if self.stop.is_set():
            return _Outcome.STOPPED
        try:
            return self._session()
        except _Restart:
            return _Outcome.RESTART
        except _Ended as end:
            return end.outcome
        except (ApplyError, ProtocolError) as exc:
            return self._apply_failed(exc)

    def _apply_failed(self, exc: ApplierError) -> _Outcome:
        """Record an apply error; disable the subscription if it says so (behaviour 101), else let it retry."""
        ctx: ErrorContext | None = exc.context if isinstance(exc, ApplyError) else None
        if (
            self._grouped_session
            and ctx is not None
            and ctx.finish_lsn
            and ctx.finish_lsn > self._grouped_after
        ):
            # the failing remote transaction may have shared its local transaction with others (group commit), which
            # the error then rolled back too: retry at once, applying what this session received one remote
            # transaction per local one, and let that attempt record the error (and disable the subscription) for
            # the one transaction it concerns, with everything before it committed, as the native worker would;
            # that attempt also counts it (once, as the native worker's apply_error_count would)
            self.log.warning('logical replication apply worker for subscription "%s" will apply the transactions '
                             "it received one by one after: %s", self.subname, exc)  # fmt: skip
            self._ungrouped_until = max(self._ungrouped_until, ctx.finish_lsn)
            return _Outcome.RESTART
        self.stats.errors += 1
        self.stats.last_error = str(exc)
        self.metrics.error(exc)
        failing = (ctx.xid, ctx.finish_lsn) if ctx is not None and ctx.finish_lsn else None
        if failing != self._failing:
            self._failures = 0  # another transaction: its own backoff starts from the beginning
        self._failing = failing
        delay = self._planned_delay = self._next_delay()
        sqlstate = exc.sqlstate if isinstance(exc, ApplyError) else None
        disable = False
        try:
            sub = self.catalog.get(self.subname)
            if sub is None:
                return _Outcome.DROPPED
            disable = sub.subdisableonerr
            message = exc.message if isinstance(exc, ApplyError) else str(exc)
            self.catalog.record_error(
                sub.subid, message, remote_xid=ctx.xid if ctx else None, finish_lsn=ctx.finish_lsn if ctx else None,
                message_type=ctx.message_type if ctx else None, relation=ctx.relation if ctx else None,
                sqlstate=sqlstate, gid=ctx.gid if ctx else None, retry_count=self._failures,
                retry_in=None if disable else delay,
            )  # fmt: skip
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as db_exc:  # the target is down: retry anyway
            self.log.warning("could not record the error in the catalog: %s", db_exc)
        self._log_failure(exc, ctx, sqlstate, None if disable else delay)
        if disable:
            try:
                self.catalog.update_subscription(sub.subid, subenabled=False)
            except (psycopg.Error, sqlalchemy.exc.DBAPIError) as db_exc:  # the target is down: retry anyway
                self.log.warning("could not disable the subscription: %s", db_exc)
                raise exc from None
            self.log.info('subscription "%s" has been disabled because of an error', self.subname)
            return _Outcome.DISABLED
        raise exc

    def _log_failure(self, exc: ApplierError, ctx: ErrorContext | None, sqlstate: str | None,
                     delay: float | None) -> None:  # fmt: skip
        """The error line of a failed remote transaction: what failed, where, when we try again and how to skip
        it; with ``--log-format json`` each part is a field of its own."""
        fields: dict[str, Any] = {
            "subscription": self.subname,
            "sqlstate": sqlstate,
            "retry_count": self._failures,
        }
        text = str(exc)
        if sqlstate:
            text = f"{text}\nSQLSTATE: {sqlstate}"
        if ctx is not None and ctx.finish_lsn:
            skip = skip_command(self.subname, ctx.finish_lsn)
            fields.update(remote_xid=ctx.xid, finish_lsn=format_lsn(ctx.finish_lsn), gid=ctx.gid,
                          relation=ctx.relation, message_type=ctx.message_type, skip_command=skip)  # fmt: skip
            if ctx.gid:
                text += f"\nprepared transaction GID: {ctx.gid}"
            text += f"\nto skip this remote transaction: {skip}"
        if delay is not None:
            fields["retry_in"] = round(delay, 3)
            text += f"\nfailure {self._failures} of this transaction; next attempt in {delay:.1f} s"
        self.log.error('logical replication apply worker for subscription "%s": %s', self.subname, text,
                       extra={"failure": fields})  # fmt: skip

    def _retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, ApplyWorkerError | CatalogError):
            return False
        # SQLAlchemy wraps the catalog's driver errors (a target restarting shows up there first)
        return isinstance(exc, ApplierError | psycopg.Error | sqlalchemy.exc.DBAPIError | OSError)

    def _next_delay(self) -> float:
        """Count one more failure in a row and return the wait before the next attempt (applier.retry)."""
        self._failures += 1
        return retry_delay(self._failures, initial=self.retry_initial, cap=self.retry_max)

    def _backoff(self, retry_state: Any) -> float:
        """The wait before the next session: what :meth:`_apply_failed` computed and recorded for an apply error,
        else the next step of the backoff. It grows while failures follow each other and starts again after a
        session that made progress (past the failing remote transaction, when one failed)."""
        planned, self._planned_delay = self._planned_delay, None
        return planned if planned is not None else self._next_delay()

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _before_sleep(self, retry_state: tenacity.RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if not isinstance(exc, ApplyError | ProtocolError):
            self.stats.errors += 1
            self.stats.last_error = str(exc)
            if exc is not None:
                self.metrics.error(exc)
            delay = retry_state.upcoming_sleep
            self.log.warning("logical replication apply worker for subscription \"%s\" will retry in %.1f s: %s",
                             self.subname, delay, exc)  # fmt: skip
            if self._subid is not None and not isinstance(
                exc, psycopg.OperationalError | sqlalchemy.exc.DBAPIError
            ):
                # e.g. the publisher refused START_REPLICATION: worth showing in applier status (a target that
                # is down cannot record anything, so connection errors are only logged)
                with contextlib.suppress(Exception):
                    self.catalog.record_error(
                        self._subid, str(exc), retry_count=self._failures, retry_in=delay
                    )

    # --- one session ---------------------------------------------------------------------------------------------
    def _session(self) -> _Outcome:
        self._grouped_session = False
        sub = self.catalog.get(self.subname) if self.catalog.exists() else None
        if sub is None:
            if self.stats.sessions == 0:
                raise ApplyWorkerError(
                    f'subscription "{self.subname}" does not exist on the target (see: applier status; '
                    f"create it with applier create {self.subname} ...)"
                )
            return _Outcome.DROPPED
        if not sub.subenabled:
            self.log.info('logical replication apply worker for subscription "%s" will stop because the '
                          "subscription was disabled", self.subname)  # fmt: skip
            return _Outcome.DISABLED
        if not sub.subslotname:
            raise ApplyWorkerError(
                f'subscription "{sub.subname}" has no replication slot set: '
                f"set one with applier alter {sub.subname} --set slot_name=NAME"
            )
        self.stats.sessions += 1
        self._subid = sub.subid
        tables = _CatalogTables(self, sub)
        target = self._connect_target(sub)
        target.lag = self.lag
        tables.target = target
        if self._lag_table is None:
            self._lag_table = self._ensure_lag_table()
        spool: Spool | None = None
        repl: ReplicationConnection | None = None
        applier: Applier | None = None
        tracker: FeedbackTracker | None = None
        clean = False
        try:
            spool = Spool(self._spool_directory(target, sub), sub.subid)
            self.catalog.reconcile_prepared(sub.subid)
            spool.cleanup()
            start_lsn = target.origin_progress(sub.origin_name)
            target.good_origin_lsn = start_lsn
            tracker = FeedbackTracker(start_lsn)
            two_phase = stream_two_phase(sub.subtwophasestate, tables.table_states())
            repl = self._connect_publisher(sub, start_lsn, two_phase)
            tables.keepalive = lambda: repl.send_status(*dataclasses.astuple(tracker.last_sent))  # type: ignore[union-attr]
            if two_phase and sub.subtwophasestate == TwoPhaseState.PENDING:
                self.catalog.update_subscription(sub.subid, subtwophasestate=TwoPhaseState.ENABLED)
                tables.two_phase_state = TwoPhaseState.ENABLED
            self.log.info('logical replication apply worker for subscription "%s" has started streaming at %s%s',
                          sub.subname, format_lsn(start_lsn), " with two_phase" if two_phase else "")  # fmt: skip
            self.stats.started_streaming.set()
            skip = SkipState(sub.subskiplsn or 0, sub.subname)
            applier = Applier(
                subid=sub.subid, subname=sub.subname, target=target, tracker=tracker, spool=spool,
                tables=tables, skip=skip, clear_skip_lsn=self.catalog.clear_skip_lsn, logger=self.log,
                prepared=target.prepared_transactions(sub.subid), group_commit=self.group_commit,
                ungrouped_until=self._ungrouped_until, bulk=self.bulk,
            )  # fmt: skip
            self._grouped_session = self.group_commit
            self._grouped_after = self._ungrouped_until
            watch = _CatalogWatch(self.catalog, sub.subname, self._bulk_tables)
            watch.start()
            self._watch = watch
            try:
                outcome = self._stream(sub, repl, target, applier, tracker, tables, skip, watch)
            finally:
                self._watch = None
                watch.close()
            clean = True
            return outcome
        finally:
            if applier is not None:
                self.stats.transactions += applier.transactions
                self.stats.groups += applier.groups
                self.stats.records_in_group += applier.records_in_group
                self.stats.records_batched += applier.records_batched
                self.stats.converted_rows += applier.converted_rows
                self.stats.bulk_transactions += applier.bulk_transactions
                self.stats.folded_prepares += applier.folded_prepares
                self._publish(applier, record_lag=False)
                self.metrics.session_ended()
                if applier.transactions and (
                    self._failing is None or target.good_origin_lsn > self._failing[1]
                ):
                    # progress (past the transaction that failed, if one did): the next failure starts the
                    # backoff again, so an occasional one after hours of work is retried quickly
                    self._failures = 0
                    self._failing = None
            if not clean and tracker is not None:
                self._ungrouped_until = max(self._ungrouped_until, tracker.last_received)
            if not clean and not target.closed:
                target.abort()
            target.close()
            if repl is not None:
                repl.close()
            if spool is not None:
                spool.cleanup()

    def _spool_directory(self, target: Target, sub: Subscription) -> Path:
        """``<spool_dir>/<target system identifier>-<subid>``: subids are unique only within a target cluster,
        and several workers (of other targets) may share one spool directory; each removes only its own files."""
        sysid = target.query("SELECT system_identifier::text FROM pg_catalog.pg_control_system()")[0][0]
        return self.spool_dir / f"{sysid}-{sub.subid}"

    def _connect_target(self, sub: Subscription) -> Target:
        try:
            return Target.connect(self.target_conninfo, origin=sub.origin_name,
                                  application_name=f"applier {sub.subname}", binary=sub.subbinary)  # fmt: skip
        except psycopg.errors.UndefinedObject as exc:
            raise ApplyWorkerError(
                f'replication origin "{sub.origin_name}" of subscription "{sub.subname}" does not exist on the '
                f"target ({exc}): drop and create the subscription again"
            ) from exc
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ApplyWorkerError(
                f"the target role may not run an apply session ({exc}): connect as a superuser, or grant it "
                "SET ON PARAMETER session_replication_role and the pg_replication_origin_* functions"
            ) from exc

    def _connect_publisher(self, sub: Subscription, start_lsn: int, two_phase: bool) -> ReplicationConnection:
        repl = ReplicationConnection.open(sub.subconninfo, application_name=sub.subname)
        try:
            repl.identify_system()
            origin = sub.suborigin if sub.suborigin in ("any", "none") else None
            options = StreamOptions(
                publications=list(sub.subpublications),
                streaming="on" if sub.substream in ("on", "parallel") else "off",
                two_phase=two_phase,
                origin=origin,  # type: ignore[arg-type]
                binary=sub.subbinary,
            )
            repl.start_replication(sub.subslotname or sub.subname, start_lsn, options)
        except ReplicationConnectionError as exc:
            repl.close()
            if exc.sqlstate == "42704":  # undefined_object: the slot is gone
                raise ApplyWorkerError(
                    f'{exc}: the subscription\'s slot "{sub.subslotname}" does not exist on the publisher; '
                    f"create it (or drop and create the subscription)"
                ) from exc
            raise
        except BaseException:
            repl.close()
            raise
        return repl

    def _stream(self, sub: Subscription, repl: ReplicationConnection, target: Target, applier: Applier,
                tracker: FeedbackTracker, tables: _CatalogTables, skip: SkipState,
                watch: _CatalogWatch | None = None) -> _Outcome:  # fmt: skip
        decoder = MessageDecoder()
        last_status = 0.0
        last_published = 0.0
        last_flush_poll = 0.0
        last_reread = time.monotonic()
        last_reconcile = last_reread
        read = repl.read
        handle = applier.handle
        spool_raw = applier.spool_raw
        insert = applier.handle_insert_bytes
        copy_lane = applier.copy_lane
        read_undecoded = repl.read_undecoded
        insert_run = applier.handle_insert_run
        spool_batch = applier.spool_batch
        bulk: list[bytes] = []  # XLogData read undecoded, envelope included, handled together
        two_phase = (
            tables.two_phase_state != TwoPhaseState.DISABLED
        )  # (prepared transactions can come: their records are batched)
        fold = self.fold_prepares

        def dispatch(payload: bytes) -> None:
            """One pgoutput message."""
            if decoder.in_stream:
                if payload[0] in RAW_SPOOL_TYPES:
                    spool_raw(payload)  # a streamed change: spooled undecoded, decoded once at replay
                else:
                    handle(decode(payload), payload)
            elif payload[0] == 73:  # 'I'
                insert(payload)
            else:
                handle(decode(payload), payload)

        def dispatch_bulk(messages: list[bytes]) -> None:
            """XLogData in stream order. Message by message, except two kinds of stretches, handled together: the
            changes of a stream chunk (spooled with one write) and Inserts into an open COPY (converted into COPY
            text at once, applier.apply.copytext)."""
            i, count = 0, len(messages)
            kinds = bytes(map(_MESSAGE_TYPE, messages))  # each one's pgoutput type byte, gathered at C speed
            if two_phase and count > 1 and 98 in kinds:  # 'b': BEGIN PREPARE
                decided = applier.decided
                if fold:  # those whose COMMIT/ROLLBACK PREPARED is here too are applied folded (apply.fold)
                    decided.update(decided_prepares(messages, 25))
                begins = [b for b in (decode_message(m[25:]) for m in messages if m[25] == 98)
                          if b.xid not in decided]  # type: ignore[union-attr]  # fmt: skip
                if len(begins) > 1:  # their prepared_xact records are written together, at the first
                    applier.expect_prepares(begins)  # type: ignore[arg-type]
            # whole transactions a batch at a time (applier.apply.bulk), when there can be enough of them
            batch: Batch | None = None
            bulk = (
                applier.bulk
                and count >= 3 * BULK_MIN_TRANSACTIONS
                and kinds.count(66) >= BULK_MIN_TRANSACTIONS
            )
            while i < count:
                kind = kinds[i]
                if kind == 66 and bulk and not decoder.in_stream and applier.bulk_ready():  # 'B'
                    if batch is None:
                        batch = Batch(messages)
                    j = applier.apply_bulk(batch, i)
                    if j > i:
                        i = j
                        continue
                if decoder.in_stream and applier.stream_xid is not None and STREAMED_CHANGE[kind]:
                    end = _NOT_STREAMED_CHANGE.search(kinds, i + 1)  # the end of this chunk's run of changes
                    j = count if end is None else end.start()
                    spool_batch(messages[i:j], 25)
                    i = j
                    continue
                if kind == 73 and not decoder.in_stream and copy_lane() is not None:
                    end = _NOT_INSERT.search(kinds, i + 1)  # the end of this run of Inserts
                    j = count if end is None else end.start()
                    if j - i >= VECTOR_MIN:
                        stretch = messages[i:j]
                        insert_run(
                            InsertRun.of(stretch, 25, 26), 0, j - i,
                            lambda k, stretch=stretch: insert(stretch[k][25:]),  # type: ignore[misc]
                        )  # fmt: skip
                        i = j
                        continue
                dispatch(messages[i][25:])
                i += 1

        decode = decoder.decode
        stats = self.stats
        last_heard = time.monotonic()
        pinged = False
        wal_query: list[Any] = [False, 0]  # a positions query in flight; the last flush LSN it returned

        def on_wal_positions(insert_lsn: int, flush_lsn: int) -> None:
            tracker.resolve(insert_lsn)
            wal_query[0] = False
            wal_query[1] = flush_lsn

        while True:
            if self.stop.is_set():
                return self._stop_session(repl, target, applier, tracker)
            force = False
            timeout = 0.2 if tracker.pending else 1.0
            n = 0
            while n < BURST:
                # what libpq already holds is taken undecoded, as a batch (see dispatch_bulk)
                item = read_undecoded(bulk, BURST - n, XLOG_MESSAGE, refill=True)
                if bulk:
                    got = len(bulk)
                    n += got
                    data_start, wal_end = _XLOG_POSITIONS(bulk[-1], 1)
                    tracker.received(max(data_start, wal_end))
                    dispatch_bulk(bulk)
                    bulk.clear()
                    if (
                        item is None
                        and repl.ran_dry
                        and (
                            got >= READ_PAUSE_AFTER
                            or (got >= READ_PAUSE_IN_TXN_AFTER and applier.in_remote_transaction)
                        )
                    ):
                        # more is on its way: let the walsender's output queue up (READ_PAUSE)
                        time.sleep(READ_PAUSE)
                    if item is None:
                        continue
                if item is None:
                    item = read(timeout if n == 0 else 0)
                    if item is None:
                        break
                n += 1
                if item.__class__ is XLogData:
                    tracker.received(max(item.data_start, item.wal_end))
                    dispatch(item.payload)
                elif item.__class__ is PrimaryKeepalive:
                    tracker.received(item.wal_end)
                    if item.reply_requested:
                        force = True
            stats.messages += n
            if applier.group_pending and not applier.in_remote_transaction:
                applier.end_group()  # the publisher has nothing more waiting (or a burst ended): commit the group
            if time.monotonic() - last_published >= METRICS_INTERVAL:
                last_published = time.monotonic()
                self._publish(applier)
            if target.pipeline.pending:
                target.pipeline.poll()
            now = time.monotonic()
            if n:
                last_heard = now
                pinged = False
            elif now - last_heard >= RECEIVER_TIMEOUT:
                raise ReplicationConnectionError("terminating logical replication worker due to timeout")
            elif now - last_heard >= RECEIVER_TIMEOUT / 2 and not pinged:
                pinged = True
                pos = tracker.last_sent
                repl.send_status(pos.write, pos.flush, pos.apply, reply_requested=True)
            if applier.idle:
                if now - last_reread >= REREAD_INTERVAL:
                    last_reread = now
                    if watch is not None:
                        watch.oids = (
                            frozenset(e.local.oid for e in applier.entries.values())
                            if applier.bulk
                            else frozenset()
                        )
                    if watch is None or not self._unchanged(watch, sub, skip, tables, applier, now):
                        self._reread(sub, skip, tables, target)
                        if applier.bulk:
                            # on a session of its own: a query on the apply session would wait for the pipeline
                            applier.recheck_bulk(self._bulk_tables)
                    if applier.finished_prepared and (
                        not n  # nothing arrived this round: waiting for the pipeline delays nothing
                        or target.pipeline.pending <= RECONCILE_DRAIN_MAX
                        or now - last_reconcile >= RECONCILE_MAX_DEFER
                    ):
                        # Removing the records of finished prepared transactions needs the pipeline drained (what
                        # is queued first: a record whose PREPARE TRANSACTION has not run yet looks finished), so
                        # it waits for a moment when little is in flight rather than stall a steady load.
                        last_reconcile = now
                        applier.finished_prepared = 0
                        target.pipeline.drain()
                        self.catalog.reconcile_prepared(sub.subid)
                if not tables.all_ready or tables.two_phase_state == TwoPhaseState.PENDING:
                    tables.after_transaction(tracker.last_received)
            # feedback (behaviour 9): the target's WAL positions are asked for down the pipeline and used when
            # they come back, so reading them never stalls the pipeline
            if (
                tracker.pending
                and not wal_query[0]
                and (force or now - last_flush_poll >= FLUSH_POLL_INTERVAL)
                and target.request_wal_positions(on_wal_positions)
            ):
                last_flush_poll = now
                wal_query[0] = True
                target.pipeline.poll()
            before = tracker.last_sent
            pos = tracker.positions(wal_query[1] or None)
            if force or pos != before or now - last_status >= STATUS_INTERVAL:
                repl.send_status(pos.write, pos.flush, pos.apply)
                last_status = now

    def _publish(self, applier: Applier, *, record_lag: bool = True) -> None:
        """Counters and lag samples to the metrics; the lag summary to the catalog (not when a session ends: the
        target may be what failed, and a connection attempt must not delay the reconnect)."""
        self.metrics.publish(applier.kinds, applier.rows, applier.conflicts, applier.bulk_transactions,
                             applier.folded_prepares)  # fmt: skip
        lag = self.lag
        if lag.added == self._lag_written:
            return
        self.metrics.observe_lag(lag.take_new())
        now = time.monotonic()
        if (
            record_lag
            and self._lag_table
            and self._subid is not None
            and now - self._lag_written_at >= LAG_WRITE_INTERVAL
        ):
            self._lag_written_at = now
            self._lag_written = lag.added
            summary = lag.summary(time.time())
            if summary is not None and self._watch is not None:
                self._watch.lag = (self._subid, dataclasses.asdict(summary))  # written off the apply loop
            elif summary is not None:
                try:
                    self.catalog.record_lag(self._subid, dataclasses.asdict(summary))
                except Exception as exc:  # noqa: BLE001 - a live figure: never worth failing the apply for
                    self.log.debug("could not record the apply lag: %s", exc)

    @staticmethod
    def _unchanged(watch: _CatalogWatch, sub: Subscription, skip: SkipState, tables: _CatalogTables,
                   applier: Applier, now: float) -> bool:  # fmt: skip
        """True when the watch's latest snapshot (fresh enough) shows nothing the synchronous re-read would act on:
        the same subscription options, skip-LSN and two-phase state, every table ready with the same state, and the
        same bulk fitness for every mapped table. Then the loop needs no round trip of its own."""
        snap = watch.latest
        if snap is None or now - snap.at > WATCH_STALE or not tables.all_ready:
            return False
        fresh = snap.sub
        if fresh is None or fresh.subid != sub.subid or not fresh.subenabled:
            return False
        for attr in ("subconninfo", "subslotname", "subbinary", "substream", "suborigin", "subpublications"):
            if getattr(fresh, attr) != getattr(sub, attr):
                return False
        if (fresh.subskiplsn or 0) != skip.skip_lsn or fresh.subtwophasestate != tables.two_phase_state:
            return False
        if snap.states != frozenset((r.relid, r.state, r.lsn) for r in tables.by_oid.values()):
            return False
        if applier.bulk:
            mapped = {e.local.oid: e.local.bulk for e in applier.entries.values()}
            if not set(mapped) <= snap.oids:
                return False
            if any(bulk != (oid in snap.bulk_ok) for oid, bulk in mapped.items()):
                return False
        return True

    def _bulk_tables(self, oids: list[int]) -> set[int]:
        """``Target.bulk_tables`` on the catalog's connection: the same committed catalog state, without draining
        the apply session's pipeline (which, under a steady load, would stall it once a second)."""
        with self.catalog.engine.connect() as c:
            rows = c.execute(
                sqlalchemy.text(
                    "SELECT c.oid FROM pg_catalog.pg_class c WHERE c.oid = ANY(CAST(:oids AS pg_catalog.oid[]))"  # noqa: S608 - constant SQL of ours
                    " AND " + BULK_OK_SQL
                ),
                {"oids": oids},
            ).fetchall()
        return {int(r[0]) for r in rows}

    def _ensure_lag_table(self) -> bool:
        """Whether ``applier.apply_lag`` exists, upgrading a version-1 catalog in place if needed (the upgrade
        only adds that table); False, and no lag in ``applier status``, when the upgrade is refused."""
        try:
            if not self.catalog.has_lag_table():
                self.catalog.ensure()
            return self.catalog.has_lag_table()
        except Exception as exc:  # noqa: BLE001
            self.log.warning(
                "apply lag will not show in applier status: cannot add applier.apply_lag: %s", exc
            )
            return False

    def _reread(self, sub: Subscription, skip: SkipState, tables: _CatalogTables, target: Target) -> None:
        """``maybe_reread_subscription`` (behaviour 52): stop when dropped/disabled, restart when an option the
        stream depends on changed, pick up a new skip-LSN and table states."""
        fresh = self.catalog.get(self.subname)
        if fresh is None or fresh.subid != sub.subid:
            target.pipeline.drain()
            self.log.info('logical replication apply worker for subscription "%s" will stop because the '
                          "subscription was removed", self.subname)  # fmt: skip
            raise _Ended(_Outcome.DROPPED)
        if not fresh.subenabled:
            target.pipeline.drain()
            self.log.info('logical replication apply worker for subscription "%s" will stop because the '
                          "subscription was disabled", self.subname)  # fmt: skip
            raise _Ended(_Outcome.DISABLED)
        for attr in ("subconninfo", "subslotname", "subbinary", "substream", "suborigin", "subpublications"):
            if getattr(fresh, attr) != getattr(sub, attr):
                target.pipeline.drain()
                self.log.info('logical replication apply worker for subscription "%s" will restart because of a '
                              "parameter change", self.subname)  # fmt: skip
                raise _Restart()
        skip.skip_lsn = fresh.subskiplsn or 0
        tables.two_phase_state = fresh.subtwophasestate
        tables.reload()

    def _stop_session(self, repl: ReplicationConnection, target: Target, applier: Applier,
                      tracker: FeedbackTracker) -> _Outcome:  # fmt: skip
        """Stop requested: finish what is committed, abandon a half-applied remote transaction (it is re-sent)."""
        if applier.in_remote_transaction or applier.group_pending:
            self.log.info("abandoning remote transaction %s on stop; it will be applied after restart",
                          applier.remote_xid)  # fmt: skip
            target.abort()
            tracker.forget_unconfirmed()
        else:
            target.pipeline.drain()
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
        return _Outcome.STOPPED


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


__all__ = ["ApplyWorker", "ApplyWorkerError", "TargetConnectionError", "WorkerThread", "start_worker"]
