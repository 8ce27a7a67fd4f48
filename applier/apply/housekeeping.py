"""The apply worker's housekeeping between two rounds of the apply loop (:mod:`applier.apply.loop`).

After each round of reads, :class:`ApplyHousekeeping` (the apply worker's :class:`~applier.apply.loop.WorkerContext`)
commits an open group, publishes the counters, polls the pipeline, keeps the publisher from timing the stream out
(``wal_receiver_timeout``), and, while no remote transaction is open, re-reads the subscription
(``maybe_reread_subscription``, behaviour 52) with the help of the :class:`CatalogWatch` thread, removes the records
of finished prepared transactions, and runs the sync-state pass (behaviour 76). Last, feedback (behaviour 9): the
target's WAL positions are asked for down the pipeline and the status is sent when it changed.

Ending the session is done by raising :class:`Restart` or :class:`Ended`; the stop request ends the loop
(:meth:`ApplyHousekeeping.should_stop`) and the worker then stops the session cleanly.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from applier.apply.feedback import FeedbackTracker
from applier.apply.handlers import Applier, SkipState
from applier.apply.pacing import StatusPacer
from applier.apply.target import Target
from applier.catalog.store import Catalog, RelState, Subscription
from applier.replication import ReplicationConnection, ReplicationConnectionError
from state.twophase import TwoPhaseState

log = logging.getLogger("applier.apply")

#: How often the worker re-reads its subscription row while idle (PostgreSQL reacts to catalog invalidations).
REREAD_INTERVAL = 1.0
#: wal_receiver_status_interval: an unchanged status is still sent this often.
STATUS_INTERVAL = 10.0
#: How often, at most, the target's WAL flush position is read while commits wait to become durable.
FLUSH_POLL_INTERVAL = 0.1
#: How often, at most, the housekeeping reads the target's results under a steady load, and how many statements'
#: results it lets wait before it reads them anyway (see housekeeping())
RESULTS_INTERVAL = 0.002
RESULTS_OWED = 256
#: How often the worker hands its counters to the Prometheus metrics (off the per-message path).
METRICS_INTERVAL = 1.0
#: A catalog-watch snapshot older than this is not trusted: the loop re-reads synchronously, as it did before.
WATCH_STALE = 5.0
#: wal_receiver_timeout: silence from the publisher this long ends the session (a ping is sent at half of it).
RECEIVER_TIMEOUT = 60.0
#: the subscription options the stream depends on: a change restarts the session
STREAM_OPTIONS = (
    "subconninfo",
    "subslotname",
    "subbinary",
    "substream",
    "suborigin",
    "subpublications",
    "subrunasowner",  # the session's statements carry the trust check or not (applier.apply.target_trust)
    "subconflictlog",  # the session writes conflict rows or not (applier.apply.conflict_table)
    "subddl",  # the stream carries the DDL capture's messages and the core replays them, or not (applier.ddl)
)


def state_set(rels: Iterable[RelState]) -> frozenset[tuple[int, str, int | None]]:
    """Table states as a comparable value: what the catalog watch snapshots, and what the caches are checked
    against."""
    return frozenset((r.relid, r.state, r.lsn) for r in rels)


class Outcome(enum.Enum):
    STOPPED = "stopped"
    DISABLED = "disabled"
    DROPPED = "dropped"
    RESTART = "restart"


class Restart(Exception):
    """End the session and start the next one at once (two-phase enabling, changed subscription options)."""


class Ended(Exception):
    """End the session and return from ``ApplyWorker.run`` with ``outcome``."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome


class CatalogWatch(threading.Thread):
    """Reads, every ``REREAD_INTERVAL``, what the idle housekeeping compares (the subscription row, the table
    states, which mapped tables may still be applied in bulk) on the catalog's session, and writes the apply lag
    summary, all off the apply loop: under a steady load three synchronous round trips a second made the loop stall
    for tens to hundreds of milliseconds once a second (bench/live_bench.py, the chart's periodic spikes).

    The loop only uses a snapshot to conclude that *nothing changed* (:func:`unchanged`); anything else, or no
    snapshot for ``WATCH_STALE`` seconds, falls back to the synchronous re-read it always did, so no change is
    applied from a possibly stale snapshot."""

    def __init__(self, catalog: Catalog, subname: str, bulk_tables: Any) -> None:
        super().__init__(daemon=True, name=f"applier-catalog-watch {subname}")
        self.catalog, self.subname, self._bulk_tables = catalog, subname, bulk_tables
        self.oids: frozenset[int] = frozenset()  # set by the loop: the tables mapped for bulk apply
        self.lag: tuple[int, dict[str, Any]] | None = None  # set by the loop: (subid, figures) to write
        self.latest: SimpleNamespace | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        # the first snapshot at once: without one, the loop's first re-read (a second into the session) is
        # synchronous, and stalled the apply for 10-15 ms just as an application's load arrived
        while True:
            try:
                self._snapshot()
            except Exception as exc:  # noqa: BLE001 - the loop falls back to reading synchronously
                log.debug("catalog watch: %s", exc)
            if self._stop_event.wait(REREAD_INTERVAL):
                return

    def _snapshot(self) -> None:
        """Everything on one connection in one short transaction (one pool pre-ping, not three): the thread's own
        Python work holds the GIL that the apply loop waits for."""
        oids, catalog = self.oids, self.catalog
        with catalog.engine.connect() as c:
            with c.begin():
                sub = catalog.get(self.subname, c)
                states = state_set(catalog.table_states(sub.subid, c)) if sub is not None else frozenset()
                bulk_ok = frozenset(self._bulk_tables(sorted(oids), c)) if oids else frozenset()
            self.latest = SimpleNamespace(
                at=time.monotonic(), sub=sub, states=states, oids=oids, bulk_ok=bulk_ok
            )
            lag, self.lag = self.lag, None
            if lag is not None:
                with c.begin():
                    catalog.record_lag(*lag, conn=c)

    def close(self) -> None:
        self._stop_event.set()
        self.join(5)


def unchanged(
    watch: CatalogWatch, sub: Subscription, skip: SkipState, tables: Any, applier: Applier, now: float
) -> bool:
    """True when the watch's latest snapshot (fresh enough) shows nothing the synchronous re-read would act on:
    the same subscription options, skip-LSN and two-phase state, every table ready with the same state, and the
    same bulk fitness for every mapped table. Then the loop needs no round trip of its own."""
    snap = watch.latest
    if snap is None or now - snap.at > WATCH_STALE or not tables.all_ready:
        return False
    fresh = snap.sub
    if fresh is None or fresh.subid != sub.subid or not fresh.subenabled:
        return False
    if any(getattr(fresh, attr) != getattr(sub, attr) for attr in STREAM_OPTIONS):
        return False
    if (fresh.subskiplsn or 0) != skip.skip_lsn or fresh.subtwophasestate != tables.two_phase_state:
        return False
    if snap.states != state_set(tables.by_oid.values()):
        return False
    if not applier.bulk:
        return True
    # A table mapped after the snapshot's table list was handed over (``oids``) was read when it was mapped, so
    # its fitness is as fresh as the snapshot; the next snapshot covers it. (Re-reading at once for it stalled the
    # loop a second after a load's first change of each table.)
    return all(
        e.local.bulk == (e.local.oid in snap.bulk_ok)
        for e in applier.entries.values()
        if e.local.oid in snap.oids
    )


@dataclass
class Session:
    """What one streaming session holds: the subscription as read at its start, the two connections, the core."""

    sub: Subscription
    repl: ReplicationConnection
    target: Target
    applier: Applier
    tracker: FeedbackTracker
    tables: Any  # the worker's catalog-backed TableStates
    skip: SkipState
    watch: CatalogWatch | None = None


class ApplyHousekeeping:
    """The apply worker's context of the apply loop (see the module docstring). ``worker`` is the
    :class:`~applier.apply.worker.ApplyWorker`: its stop event, stats, catalog and metrics."""

    def __init__(self, worker: Any, session: Session) -> None:
        self.worker, self.s = worker, session
        now = time.monotonic()
        self.last_status = self.last_published = self.last_flush_poll = self.last_results = 0.0
        self.status_pacer = StatusPacer()  # shared with the loop, whose read wait it bounds
        self.last_reread = self.last_heard = now
        self.pinged = False
        self.wal_query_open = False  # a WAL positions query in flight
        self.flush_lsn = 0  # the last flush LSN one returned

    # --- WorkerContext ---------------------------------------------------------------------------------------
    def should_stop(self) -> bool:
        return bool(self.worker.stop.is_set())

    def caught_up(self) -> bool:
        return False

    def housekeeping(self, received: int, reply_requested: bool) -> None:
        s, now = self.s, time.monotonic()
        applier = s.applier  # its parts read directly (not through its aliases): this runs every round
        self.worker.stats.messages += received
        if applier.commit_policy.pending is not None and not applier.tx.active:
            applier.group.end()  # the publisher has nothing more waiting (or a burst ended): commit the group
        if now - self.last_published >= METRICS_INTERVAL:
            self.last_published = now
            self.worker.publish(s.applier)
        pipeline = s.target.pipeline
        if pipeline.pending:
            # The round's statements go out now; their results are read every RESULTS_INTERVAL (or when the
            # publisher asks, or many are owed): above 500 transactions a second, one select and one recv for
            # several rounds instead of each (issue 29). An error surfaces at that read, as before, and the apply
            # lag that the confirmations time (applier.apply.lag) reads at most that much high.
            if (
                reply_requested
                or pipeline.pending > RESULTS_OWED
                or now - self.last_results >= RESULTS_INTERVAL
            ):
                self.last_results = now
                pipeline.poll()
            else:
                pipeline.push()
        self._keep_alive(received, now)
        if not applier.tx.active and applier.stream.xid is None:  # Applier.idle
            self._idle(received, now)
        self._feedback(reply_requested, now)

    # --- the parts -------------------------------------------------------------------------------------------
    def _keep_alive(self, received: int, now: float) -> None:
        """``wal_receiver_timeout``: end the session after a silence, ping the publisher half-way through it."""
        if received:
            self.last_heard, self.pinged = now, False
        elif now - self.last_heard >= RECEIVER_TIMEOUT:
            raise ReplicationConnectionError("terminating logical replication worker due to timeout")
        elif now - self.last_heard >= RECEIVER_TIMEOUT / 2 and not self.pinged:
            self.pinged = True
            pos = self.s.tracker.last_sent
            self.s.repl.send_status(pos.write, pos.flush, pos.apply, reply_requested=True)

    def _idle(self, received: int, now: float) -> None:
        """No remote transaction open: re-read the subscription, reconcile prepared records, sync-state pass."""
        s = self.s
        if now - self.last_reread >= REREAD_INTERVAL:
            self.last_reread = now
            self._reread_if_changed(now)
            if s.applier.finished_prepared and not s.target.in_transaction:
                # queued behind everything sent so far, so nothing waits for it (target_catalog.reconcile_prepared)
                s.applier.finished_prepared = 0
                s.target.catalog.reconcile_prepared(s.sub.subid)
        if not s.tables.all_ready or s.tables.two_phase_state == TwoPhaseState.PENDING:
            s.tables.after_transaction(s.tracker.last_received)

    def _reread_if_changed(self, now: float) -> None:
        s, watch = self.s, self.s.watch
        if watch is not None:
            watch.oids = (
                frozenset(e.local.oid for e in s.applier.entries.values()) if s.applier.bulk else frozenset()
            )
        if watch is None or not unchanged(watch, s.sub, s.skip, s.tables, s.applier, now):
            self.reread()
            if s.applier.bulk:
                # on a session of its own: a query on the apply session would wait for the pipeline
                s.applier.recheck_bulk(self.worker.bulk_tables)

    def reread(self) -> None:
        """``maybe_reread_subscription`` (behaviour 52): stop when dropped/disabled, restart when an option the
        stream depends on changed, pick up a new skip-LSN and table states."""
        s, subname, wlog = self.s, self.worker.subname, self.worker.log
        fresh = self.worker.catalog.get(subname)
        why = _why_stop(fresh, s.sub)
        if why is not None:
            s.target.pipeline.drain()
            outcome, reason = why
            verb = "restart" if outcome is Outcome.RESTART else "stop"
            wlog.info(
                'logical replication apply worker for subscription "%s" will %s because %s',
                subname,
                verb,
                reason,
            )
            if outcome is Outcome.RESTART:
                raise Restart()
            raise Ended(outcome)
        s.skip.skip_lsn = fresh.subskiplsn or 0  # type: ignore[union-attr]
        s.tables.two_phase_state = fresh.subtwophasestate  # type: ignore[union-attr]
        s.tables.reload()

    def _feedback(self, reply_requested: bool, now: float) -> None:
        """Behaviour 9: the target's WAL positions are asked for down the pipeline and used when they come back,
        so reading them never stalls the pipeline; the status goes out when it changed (or is asked for, or due)."""
        s = self.s
        if (
            s.tracker.pending
            and not self.wal_query_open
            and (reply_requested or now - self.last_flush_poll >= FLUSH_POLL_INTERVAL)
            and s.target.request_wal_positions(self._on_wal_positions)
        ):
            self.last_flush_poll = now
            self.wal_query_open = True
            s.target.pipeline.poll()
        if not self.status_pacer.due(now, reply_requested):
            return  # owed: the loop's next read wait ends in time for it (applier.apply.pacing)
        before = s.tracker.last_sent
        pos = s.tracker.positions(self.flush_lsn or None)
        if reply_requested or pos != before or now - self.last_status >= STATUS_INTERVAL:
            s.repl.send_status(pos.write, pos.flush, pos.apply)
            self.last_status = now
            self.status_pacer.sent(now)
        else:
            self.status_pacer.settled()

    def _on_wal_positions(self, insert_lsn: int, flush_lsn: int) -> None:
        self.s.tracker.resolve(insert_lsn)
        self.wal_query_open = False
        self.flush_lsn = flush_lsn


def _why_stop(fresh: Subscription | None, sub: Subscription) -> tuple[Outcome, str] | None:
    """Whether the re-read subscription ends the session: (outcome, the reason PostgreSQL's worker logs)."""
    if fresh is None or fresh.subid != sub.subid:
        return Outcome.DROPPED, "the subscription was removed"
    if not fresh.subenabled:
        return Outcome.DISABLED, "the subscription was disabled"
    if any(getattr(fresh, attr) != getattr(sub, attr) for attr in STREAM_OPTIONS):
        return Outcome.RESTART, "of a parameter change"
    return None
