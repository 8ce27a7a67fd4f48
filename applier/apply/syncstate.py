"""Table states from the catalog for the apply worker, and its sync-state pass (behaviours 57, 76).

:class:`CatalogTables` is the :class:`~applier.apply.handlers.TableStates` the core asks whether a table takes a
change; after transactions (and while idle) it moves synced tables to ready, restarts the session when two-phase can
be enabled, and meets the synchronisation of tables added while streaming through the injected
:class:`~applier.apply.coordinator.TableSyncCoordinator` (:class:`LiveSyncDriver`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy.exc

from applier.apply.coordinator import SyncFailure, TableSync, TableSyncCoordinator
from applier.apply.handlers import TableStates
from applier.apply.housekeeping import Ended, Outcome, Restart, state_set
from applier.apply.target import Target
from applier.catalog.store import Catalog, RelState, Subscription
from applier.retry import DEFAULT_MAX_RETRY_INTERVAL, RETRY_INITIAL, retry_delay
from state.tables import SyncState, TableState, process_syncing_tables, should_apply_changes_for_rel
from state.twophase import TwoPhaseState, restart_for_two_phase_message, should_restart_for_two_phase

#: How often the sync-state pass re-reads the table states while the stream is busy (when idle: REREAD_INTERVAL).
TABLES_REREAD_INTERVAL = 2.0
#: the states of a table a live sync copies (a ``d``/``f`` one was left by a live sync that failed)
_TO_SYNC = (SyncState.INIT, SyncState.DATASYNC, SyncState.FINISHEDCOPY)
#: ``SyncState.READY`` looked up once: ``should_apply`` runs for every change, and an enum member lookup costs more
_READY = SyncState.READY


class LiveSyncDriver:
    """The apply worker's side of live table syncs: start one through the coordinator when tables wait, meet it at
    SYNCWAIT, forget it when finished.

    A failed sync is handled as the native worker handles a failing tablesync worker (behaviour 101, and
    ``sync_error_count``): recorded in the catalog for ``applier status`` and logged, with the tables as relation;
    then, with ``disable_on_error``, the subscription is disabled and the session ends; otherwise the next sync
    starts after the same growing wait as a failing apply (applier.retry, capped by ``--max-retry-interval``),
    which starts again from the first step once a sync succeeds. The apply stream keeps applying the other tables
    meanwhile."""

    def __init__(
        self,
        coordinator: TableSyncCoordinator,
        target_conninfo: str,
        subname: str,
        log: logging.Logger,
        stop: threading.Event,
        *,
        catalog: Catalog | None = None,
        initial: float = RETRY_INITIAL,
        cap: float = DEFAULT_MAX_RETRY_INTERVAL,
        counted: Callable[[], None] | None = None,
    ) -> None:
        self.coordinator, self.target_conninfo, self.subname, self.log = (
            coordinator,
            target_conninfo,
            subname,
            log,
        )
        self.stop = stop
        #: where failures are recorded (None: only logged, e.g. in unit tests without a target)
        self.catalog = catalog
        self.initial, self.cap = initial, cap
        #: counts each failure (the worker's ``applier_sync_errors_total``)
        self.counted = counted
        self.job: TableSync | None = None
        self.retry_at = 0.0
        self.failures = 0  # failed syncs in a row
        self.disabled = False  # a failure disabled the subscription (disable_on_error)

    def start_if_needed(self, states: list[RelState]) -> None:
        if (
            self.job is None
            and not self.disabled
            and time.monotonic() >= self.retry_at
            and any(r.state in _TO_SYNC for r in states)
        ):
            self.job = self.coordinator.start(self.target_conninfo, self.subname, self.log)

    def at_boundary(self, current_lsn: int, drain: Callable[[], None], keepalive: Callable[[], None]) -> bool:
        """At a transaction boundary at ``current_lsn``: let a waiting sync join the stream there and wait for it
        (``wait_for_relation_state_change``); True when a sync finished (the table states changed). Raises
        :class:`~applier.apply.housekeeping.Ended` when its failure disabled the subscription."""
        job = self.job
        if job is None:
            return False
        if job.waiting:
            drain()
            job.proceed(current_lsn)
            job.wait(self.stop, tick=keepalive)
        if not job.finished:
            return False
        self.end()
        if self.disabled:
            drain()
            raise Ended(Outcome.DISABLED)
        return True

    def end(self) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        job.close()
        if not job.failed:
            self.failures = 0  # the next failure starts the backoff from its first step again
        elif job.failure is not None and not self.stop.is_set():
            self._failed(job.failure)
        elif job.failure is not None:  # failed as the worker stops: not recorded, but not silent either
            self.log.error(
                'table synchronization for subscription "%s" failed as the worker stopped; it is '
                "copied again at the next start: %s",
                self.subname,
                " ".join(job.failure.message.split()),
            )
            self.retry_at = time.monotonic() + self.initial
        else:  # stopped, not failed: start again soon (the tables stay d/f, copied again)
            self.retry_at = time.monotonic() + self.initial

    def _failed(self, failure: SyncFailure) -> None:
        """Record the failure (``applier status``), then disable the subscription (``disable_on_error``) or plan
        the next attempt after a growing wait; log what happens and what to do."""
        self.failures += 1
        if self.counted is not None:
            self.counted()
        delay = retry_delay(self.failures, initial=self.initial, cap=self.cap)
        self.retry_at = time.monotonic() + delay
        disable = self._record(failure, delay)
        where = f"during {failure.message_type}" + (f" on {failure.relation}" if failure.relation else "")
        # one log line with everything: where, what comes next, the error and (a catch-up's) its context
        error = " ".join(failure.message.split()) + (
            f" CONTEXT: {failure.context}" if failure.context else ""
        )
        if disable:
            self.disabled = True
            self.log.error(
                'subscription "%s" has been disabled because of an error: table synchronization '
                "failed %s (disable_on_error): %s; fix the cause, then: applier alter %s --enable",
                self.subname,
                where,
                error,
                self.subname,
            )
            return
        self.log.error(
            'table synchronization for subscription "%s" failed %s: failure %d in a row; next attempt '
            "in %.1f s (applier status shows the error): %s",
            self.subname,
            where,
            self.failures,
            delay,
            error,
        )

    def _record(self, failure: SyncFailure, delay: float) -> bool:
        """The error into the catalog; disable the subscription when it says so. True when disabled. A target
        that is down records nothing (the failure is logged, and the sync retried)."""
        if self.catalog is None:
            return False
        try:
            sub = self.catalog.get(self.subname)
            if sub is None:
                return False
            disable = sub.subdisableonerr
            self.catalog.record_error(
                sub.subid,
                failure.message,
                remote_xid=failure.remote_xid,
                message_type=failure.message_type,
                relation=failure.relation,
                sqlstate=failure.sqlstate,
                retry_count=self.failures,
                retry_in=None if disable else delay,
            )
            if disable:
                self.catalog.update_subscription(sub.subid, subenabled=False)
            return disable
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as exc:
            self.log.warning("could not record the table synchronization's error in the catalog: %s", exc)
            return False


class CatalogTables(TableStates):
    """Table states from the catalog, cached; non-ready tables are re-read once per remote transaction
    (``logicalrep_rel_open`` re-reads them on every open while not READY)."""

    def __init__(
        self, catalog: Catalog, sub: Subscription, log: logging.Logger, live: LiveSyncDriver | None
    ) -> None:
        self.catalog, self.subid, self.subname, self.log, self.live = (
            catalog,
            sub.subid,
            sub.subname,
            log,
            live,
        )
        self.two_phase_state = sub.subtwophasestate
        self.by_oid: dict[int, RelState] = {}
        self._checked: dict[int, int] = {}
        self.all_ready = False
        self.target: Target | None = None
        #: sends the stream's last status again (set by the session): used while waiting for a live sync
        self.keepalive: Any = None
        #: the session's catalog watch (applier.apply.housekeeping.CatalogWatch), when it has one
        self.watch: Any = None
        self.reload()

    def reload(self) -> None:
        self._last_reload = time.monotonic()
        self._set({r.relid: r for r in self.catalog.table_states(self.subid)})

    def _watch_confirms(self) -> bool:
        """True when the catalog watch read the table states after our last reload and found them as cached: the
        periodic re-read then needs no round trip of its own (under a steady load it was a synchronous catalog
        query on the apply loop every TABLES_REREAD_INTERVAL). Anything else re-reads synchronously, as before."""
        snap = self.watch.latest if self.watch is not None else None
        if snap is None or snap.at < self._last_reload:
            return False
        if snap.states != state_set(self.by_oid.values()):
            return False
        self._last_reload = snap.at  # the cache is known current as of the snapshot
        return True

    def _set(self, by_oid: dict[int, RelState]) -> None:
        self.by_oid = by_oid
        self._checked.clear()
        self.all_ready = all(r.state == _READY for r in by_oid.values())

    def joined(self, local_oid: int, name: str, state: SyncState, lsn: int | None = None) -> None:
        self.by_oid = {
            **self.by_oid,
            local_oid: RelState(self.subid, local_oid, name, name, state, lsn, 0, 0),
        }
        self._checked.pop(local_oid, None)
        self.all_ready = self.all_ready and state == _READY

    def table_states(self) -> list[TableState]:
        no_lsn = (SyncState.INIT, SyncState.DATASYNC)
        return [
            TableState(r.name, r.state, r.lsn if r.state not in no_lsn else None)
            for r in self.by_oid.values()
        ]

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:
        rel = self.by_oid.get(local_oid)
        if rel is not None and rel.state == _READY:
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
        if time.monotonic() - self._last_reload >= TABLES_REREAD_INTERVAL and not self._watch_confirms():
            self.reload()  # notice tables added by alter --refresh-publication even when never idle
        if self.all_ready and self.two_phase_state != TwoPhaseState.PENDING:
            return
        self._live_sync_pass(current_lsn)
        ready = process_syncing_tables(self.table_states(), current_lsn)
        if ready:
            self._mark_ready(ready, current_lsn)
        if should_restart_for_two_phase(self.two_phase_state, self.table_states()):
            self._drain()
            self.log.info(restart_for_two_phase_message(self.subname))
            raise Restart()

    def _mark_ready(self, ready: list[TableState], current_lsn: int) -> None:
        """Only once what was applied before is known committed (were a queued commit to fail, the stream would
        restart before it and must still skip what the copy holds), and in the apply session with the origin
        advanced to current_lsn in the same transaction: a table becomes ready at L only together with "the stream
        resumes after L". Otherwise a restart would resume before L and re-send transactions this table skipped
        (its copy holds them) into a table that now takes everything."""
        if self.target is None:  # pragma: no cover - always set while streaming
            raise RuntimeError("sync-state pass without a target session")
        self.target.pipeline.drain()
        by_name = {r.name: r for r in self.by_oid.values()}
        self.target.mark_ready(
            self.subid, [(by_name[t.name].relid, t.state, t.lsn) for t in ready], current_lsn
        )
        for t in ready:
            self.log.info(
                'logical replication table synchronization for subscription "%s", table "%s" has finished',
                self.subname,
                t.name,
            )
        self.reload()

    def _drain(self) -> None:
        if self.target is not None:
            self.target.pipeline.drain()

    def _live_sync_pass(self, current_lsn: int) -> None:
        """Tables added while streaming (``i``; ``d``/``f`` left by a failed live sync) are copied and caught up by
        the coordinator's sync; at its SYNCWAIT the stream, here at a transaction boundary at ``current_lsn``,
        tells it where to join and waits until the tables are ``s`` (behaviour 76)."""
        if self.live is None:
            return
        if self.live.job is None:
            self.live.start_if_needed(list(self.by_oid.values()))
        elif self.live.at_boundary(current_lsn, self._drain, self.keepalive):
            self.reload()
