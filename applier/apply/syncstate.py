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

from applier.apply.coordinator import TableSync, TableSyncCoordinator
from applier.apply.handlers import TableStates
from applier.apply.housekeeping import Restart, state_set
from applier.apply.target import Target
from applier.catalog.store import Catalog, RelState, Subscription
from state.tables import SyncState, TableState, process_syncing_tables, should_apply_changes_for_rel
from state.twophase import TwoPhaseState, restart_for_two_phase_message, should_restart_for_two_phase

#: How often the sync-state pass re-reads the table states while the stream is busy (when idle: REREAD_INTERVAL).
TABLES_REREAD_INTERVAL = 2.0
#: After a failed live table sync, the next attempt waits this long (wal_retrieve_retry_interval is 5 s).
LIVE_SYNC_RETRY = 5.0
#: the states of a table a live sync copies (a ``d``/``f`` one was left by a live sync that failed)
_TO_SYNC = (SyncState.INIT, SyncState.DATASYNC, SyncState.FINISHEDCOPY)
#: ``SyncState.READY`` looked up once: ``should_apply`` runs for every change, and an enum member lookup costs more
_READY = SyncState.READY


class LiveSyncDriver:
    """The apply worker's side of live table syncs: start one through the coordinator when tables wait, meet it at
    SYNCWAIT, forget it when finished (and after a failure, wait ``LIVE_SYNC_RETRY`` before the next)."""

    def __init__(self, coordinator: TableSyncCoordinator, target_conninfo: str, subname: str,
                 log: logging.Logger, stop: threading.Event) -> None:  # fmt: skip
        self.coordinator, self.target_conninfo, self.subname, self.log = (
            coordinator,
            target_conninfo,
            subname,
            log,
        )
        self.stop = stop
        self.job: TableSync | None = None
        self.retry_at = 0.0

    def start_if_needed(self, states: list[RelState]) -> None:
        if (
            self.job is None
            and time.monotonic() >= self.retry_at
            and any(r.state in _TO_SYNC for r in states)
        ):
            self.job = self.coordinator.start(self.target_conninfo, self.subname, self.log)

    def at_boundary(self, current_lsn: int, drain: Callable[[], None], keepalive: Callable[[], None]) -> bool:
        """At a transaction boundary at ``current_lsn``: let a waiting sync join the stream there and wait for it
        (``wait_for_relation_state_change``); True when a sync finished (the table states changed)."""
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
        return True

    def end(self) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        job.close()
        if job.failed:
            self.retry_at = time.monotonic() + LIVE_SYNC_RETRY


class CatalogTables(TableStates):
    """Table states from the catalog, cached; non-ready tables are re-read once per remote transaction
    (``logicalrep_rel_open`` re-reads them on every open while not READY)."""

    def __init__(self, catalog: Catalog, sub: Subscription, log: logging.Logger,
                 live: LiveSyncDriver | None) -> None:  # fmt: skip
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
            self.log.info('logical replication table synchronization for subscription "%s", table "%s" has '
                          "finished", self.subname, t.name)  # fmt: skip
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
