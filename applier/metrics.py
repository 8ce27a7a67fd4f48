"""Prometheus metrics for ``applier run --metrics-port N``.

Two kinds of numbers, gathered two ways:

* **Events counted by the workers** (transactions applied by kind, rows by operation, apply errors and conflicts by
  kind). ``run`` uses one process per subscription, so these use
  ``prometheus_client``'s multi-process mode: :func:`enable_multiprocess` points ``PROMETHEUS_MULTIPROC_DIR`` at a
  private directory *before* the workers start, each worker's counters live in memory-mapped files there, and the
  parent's HTTP endpoint sums them. Without ``--metrics-port`` the counters are plain in-process objects (cheap).
* **Positions read at scrape time** (received/flushed/applied LSN, lag in bytes and seconds, prepared transactions
  pending, table states, rows/bytes copied so far by the initial copy): a collector queries the target's catalog and origin and the publisher's slot, the same
  sources as ``applier status``, so the numbers are what the servers say, not what a worker believes.

Names follow Prometheus conventions: ``applier_`` prefix, ``_total`` for counters, base units (bytes, seconds).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from applier.apply.lag import HistogramDelta
from applier.lsn import parse_lsn
from applier.metrics_http import ReadyFilesCollector, start_server
from state.tables import SyncState
from state.twophase import TwoPhaseState

log = logging.getLogger("applier.metrics")

TRANSACTIONS = Counter(
    "applier_transactions_applied_total",
    "Remote transactions finished on the target, by kind "
    "(commit, prepare, commit_prepared, rollback_prepared, stream_commit, stream_prepare, stream_abort, skipped).",
    ["subscription", "kind"],
)
ROWS = Counter(
    "applier_rows_applied_total",
    "Row changes applied on the target, by operation (insert, update, delete, truncate).",
    ["subscription", "operation"],
)
ERRORS = Counter(
    "applier_apply_errors_total",
    "Errors that rolled back a local transaction (the worker retries or disables), by kind.",
    ["subscription", "kind"],
)
SYNC_ERRORS = Counter(
    "applier_sync_errors_total",
    "Table synchronizations that failed (the initial copy, or a live sync's copy or catch-up), as "
    "pg_stat_subscription_stats.sync_error_count counts them; each is retried or disables the subscription.",
    ["subscription"],
)
STALLS = Counter(
    "applier_apply_stalls_total",
    "Stalls: behind, and no progress for APPLIER_STALL_AFTER seconds (30), by what the worker waited on "
    "(target, publisher); one per stall (applier.apply.stall).",
    ["subscription", "waiting_on"],
)
STALLED = Counter(
    "applier_apply_stalled_seconds_total",
    "Seconds spent stalled (from each stall's start); a rate above 0 means a stall is going on now.",
    ["subscription"],
)
CONFLICTS = Counter(
    "applier_conflicts_total",
    "Conflicts met while applying, by kind (update_missing, delete_missing, insert_exists, ...).",
    ["subscription", "kind"],
)
BULK = Counter(
    "applier_bulk_transactions_total",
    "Remote transactions applied a batch at a time, one statement per table and kind of change (bulk apply; a part "
    'of applier_transactions_applied_total{kind="commit"}).',
    ["subscription"],
)
FOLDED = Counter(
    "applier_folded_prepares_total",
    "Prepared transactions whose COMMIT or ROLLBACK PREPARED arrived with them, applied as one plain transaction "
    "(or, rolled back, not at all) instead of PREPARE TRANSACTION then COMMIT/ROLLBACK PREPARED.",
    ["subscription"],
)

#: the apply-lag histogram's bucket bounds (seconds); the worker counts its samples into these (applier.apply.lag)
APPLY_LAG_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    300.0)  # fmt: skip
APPLY_LAG = Histogram(
    "applier_apply_lag_seconds",
    "Apply lag: from the publisher's commit (or prepare) timestamp in the message to the local commit (or prepare) "
    "being confirmed by the target, by kind (commit, prepare, commit_prepared, rollback_prepared); with group "
    "commit, one observation per local commit, for its last remote transaction. Includes any clock difference "
    "between the two hosts.",
    ["subscription", "kind"],
    buckets=APPLY_LAG_BOUNDS,
)


def observe_counts(child: Any, delta: HistogramDelta) -> None:
    """``Histogram.observe`` for every sample counted in ``delta``, done once per bucket: observing each sample
    (thousands a second at high rates, each walking the bounds, in multi-process mode each writing a memory-mapped
    file) stalled the apply loop for milliseconds once a second. This uses what ``observe`` itself updates, the
    child's non-cumulative bucket values (``_buckets``) and its sum (``_sum``), both with ``inc(amount)`` in either
    mode; ``tests/unit/test_metrics_lag.py`` compares the result with ``observe`` per sample, so a
    ``prometheus_client`` that stores them otherwise fails there rather than counting wrong."""
    buckets = child._buckets  # noqa: SLF001 - see the docstring
    if len(buckets) != len(delta.counts):
        raise ValueError(f"histogram has {len(buckets)} buckets, the counts {len(delta.counts)}")
    child._sum.inc(delta.total)  # noqa: SLF001
    for bucket, count in zip(buckets, delta.counts, strict=True):
        if count:
            bucket.inc(count)


class StatsStore(Protocol):
    """Where the counters kept across restarts go: :meth:`applier.catalog.store.Catalog.count_stats`
    (``applier.subscription_stats``, pg_stat_subscription_stats' columns)."""

    def count_stats(self, subid: int, counts: dict[str, int]) -> None: ...


class WorkerMetrics:
    """A worker's view of the counters: it hands over its running totals now and then (about once a second, off
    the per-row path) and this turns them into increments. Errors and conflicts are counted as they happen
    (:meth:`error`, :meth:`sync_error`, :meth:`conflict`), each into Prometheus and, given a ``store`` and the
    subscription's ``subid``, into the catalog's ``subscription_stats`` (what ``status`` shows as ``stats``)."""

    def __init__(self, subscription: str, store: StatsStore | None = None, subid: int | None = None) -> None:
        self.subscription = subscription
        self.store = store
        self.subid = subid
        self._seen: dict[tuple[str, str], int] = {}
        #: conflicts counted since the catalog was last written (see :meth:`conflict`)
        self._unstored: dict[str, int] = {}

    def publish(
        self,
        kinds: Mapping[str, int],
        rows: Mapping[str, int],
        bulk: int = 0,
        folded: int = 0,
    ) -> None:
        """``kinds``/``rows``/``bulk``/``folded`` are totals that only grow while one session lasts (see
        :meth:`session_ended`); conflicts are counted as they are met (:meth:`conflict`), and written to the
        catalog here."""
        self.store_conflicts()
        for family, counter, totals in (
            ("k", TRANSACTIONS, kinds),
            ("r", ROWS, rows),
        ):
            for key, total in totals.items():
                seen = self._seen.get((family, key), 0)
                if total > seen:
                    counter.labels(self.subscription, key).inc(total - seen)
                self._seen[(family, key)] = total
        for family, one, total in (("b", BULK, bulk), ("f", FOLDED, folded)):
            seen = self._seen.get((family, ""), 0)
            if total > seen:
                one.labels(self.subscription).inc(total - seen)
                self._seen[(family, "")] = total

    def observe_lag(self, new: Mapping[str, HistogramDelta]) -> None:
        """Apply lag samples taken since the last call (counted per bucket, by kind), into the histogram."""
        for kind, delta in new.items():
            observe_counts(APPLY_LAG.labels(self.subscription, kind), delta)

    def session_ended(self) -> None:
        """The next session's totals start from zero again (the conflicts counted are written first)."""
        self.store_conflicts()
        self._seen.clear()

    def error(self, exc: BaseException) -> None:
        """Count an error that ended an apply attempt (``apply_error_count``, every attempt); a unique violation
        is also the conflict its report found (``conflict_kind``: applier.apply.unique_conflicts), else an
        ``insert_exists`` (PostgreSQL 18's name for it)."""
        ERRORS.labels(self.subscription, type(exc).__name__).inc()
        counts, self._unstored = {**self._unstored, "apply_error_count": 1}, {}
        cause = exc.__cause__ or exc.__context__
        kind = getattr(exc, "conflict_kind", None)  # insert_exists, update_exists, multiple_unique_conflicts
        if kind is None and "23505" in (getattr(exc, "sqlstate", None), getattr(cause, "sqlstate", None)):
            kind = "insert_exists"
        if kind is not None:
            CONFLICTS.labels(self.subscription, kind).inc()
            counts[f"confl_{kind}"] = counts.get(f"confl_{kind}", 0) + 1
        self._store(counts)

    def conflict(self, kind: str) -> None:
        """Count a conflict met while applying (``update_missing``, ``update_origin_differs``, ...), when it is
        met: the count stays when the attempt that met it is rolled back, as PostgreSQL's does. Into Prometheus at
        once; into the catalog with the next :meth:`publish` (about once a second), error or end of session: one
        write then, not one per conflict (a table loaded locally and then updated by the publisher meets one
        ``update_origin_differs`` per row, thousands a second)."""
        CONFLICTS.labels(self.subscription, kind).inc()
        name = f"confl_{kind}"
        self._unstored[name] = self._unstored.get(name, 0) + 1

    def store_conflicts(self) -> None:
        """Write the conflicts counted since the last write to the catalog."""
        if self._unstored:
            counts, self._unstored = self._unstored, {}
            self._store(counts)

    def _store(self, counts: dict[str, int]) -> None:
        """The counts into the catalog (its own short transaction); a target that cannot take them now (it is
        what failed, or restarting) loses them with a warning rather than failing the worker."""
        if self.store is None or self.subid is None:
            return
        try:
            self.store.count_stats(self.subid, counts)
        except Exception as exc:  # noqa: BLE001 - a count must never stop the apply or its retry
            log.warning(
                'subscription "%s": could not count %s in the catalog: %s',
                self.subscription,
                ", ".join(counts),
                exc,
            )

    def stalled(self, waiting_on: str) -> None:
        """Count a stall that began (applier.apply.stall)."""
        STALLS.labels(self.subscription, waiting_on).inc()

    def stalled_for(self, seconds: float) -> None:
        """Add time spent stalled."""
        STALLED.labels(self.subscription).inc(seconds)

    def sync_error(self) -> None:
        """Count a failed table synchronization (``sync_error_count``)."""
        SYNC_ERRORS.labels(self.subscription).inc()
        self._store({"sync_error_count": 1})


def enable_multiprocess() -> str:
    """Make counters of processes started from now on shared through a private directory; return it.

    Must run before the worker processes start (they read the variable when they import prometheus_client). A
    directory made here goes when this process exits (each ``run`` used to leave one behind); one the user named
    stays theirs.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="applier-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class PositionCollector(Collector):
    """Scrape-time gauges from the servers, one label set per subscription."""

    def __init__(self, target: str, names: Sequence[str]) -> None:
        self.target, self.names = target, list(names)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from applier.subscriptions import status  # the same view as `applier status`

        gauges = {
            "received": GaugeMetricFamily("applier_received_lsn", "Last WAL position received (as reported).", labels=["subscription"]),
            "flushed": GaugeMetricFamily("applier_flushed_lsn", "WAL position whose changes are durable on the target.", labels=["subscription"]),
            "applied": GaugeMetricFamily("applier_applied_lsn", "End of the last remote transaction applied (origin progress).", labels=["subscription"]),
            "lag_bytes": GaugeMetricFamily("applier_lag_bytes", "Publisher WAL position minus the applied position.", labels=["subscription"]),
            "lag_seconds": GaugeMetricFamily("applier_lag_seconds", "Replay lag reported by the publisher.", labels=["subscription"]),
            "prepared": GaugeMetricFamily("applier_prepared_transactions_pending", "Transactions prepared on the target awaiting COMMIT/ROLLBACK PREPARED.", labels=["subscription"]),
            "enabled": GaugeMetricFamily("applier_subscription_enabled", "1 when the subscription is enabled.", labels=["subscription"]),
            "two_phase": GaugeMetricFamily("applier_two_phase_state", "Two-phase tri-state, one series per state (1 = current).", labels=["subscription", "state"]),
            "tables": GaugeMetricFamily("applier_tables", "Tables per sync state.", labels=["subscription", "state"]),
            "up": GaugeMetricFamily("applier_publisher_up", "1 when the publisher answered the scrape.", labels=["subscription"]),
            "copied_rows": GaugeMetricFamily("applier_tablesync_rows_copied", "Rows copied so far by the initial copy, per table.", labels=["subscription", "table"]),
            "copied_bytes": GaugeMetricFamily("applier_tablesync_bytes_copied", "COPY bytes moved so far by the initial copy, per table.", labels=["subscription", "table"]),
        }  # fmt: skip
        try:
            entries = status(self.target, None)
        except Exception as exc:  # noqa: BLE001 - a scrape must not crash the worker; say why in the log
            log.warning("metrics: cannot read status from the target: %s", exc)
            return
        for st in entries:
            if self.names and st["name"] not in self.names:
                continue
            name = st["name"]
            rep: dict[str, Any] = st.get("replication", {})
            for key, field in (
                ("received", "received_lsn"),
                ("flushed", "flushed_lsn"),
                ("applied", "origin_lsn"),
            ):
                if rep.get(field):
                    gauges[key].add_metric([name], parse_lsn(rep[field]))
            if rep.get("lag_bytes") is not None:
                gauges["lag_bytes"].add_metric([name], rep["lag_bytes"])
            if rep.get("lag_seconds") is not None:
                gauges["lag_seconds"].add_metric([name], rep["lag_seconds"])
            gauges["up"].add_metric([name], 1 if rep.get("publisher_reachable") else 0)
            gauges["prepared"].add_metric([name], len(st["prepared"]))
            gauges["enabled"].add_metric([name], 1 if st["enabled"] else 0)
            for two_phase in TwoPhaseState:  # labels and the status document: the catalog's letters
                gauges["two_phase"].add_metric(
                    [name, two_phase.value], 1 if st["two_phase"] == two_phase.value else 0
                )
            counts: dict[str, int] = {}
            for t in st["tables"]:
                counts[t["state"]] = counts.get(t["state"], 0) + 1
                gauges["copied_rows"].add_metric([name, t["name"]], t["rows"])
                gauges["copied_bytes"].add_metric([name, t["name"]], t["bytes"])
            for state in SyncState:
                if state.persisted:
                    gauges["tables"].add_metric([name, state.value], counts.get(state.value, 0))
        yield from gauges.values()


def serve(port: int, target: str, names: Sequence[str] = (), *, addr: str = "127.0.0.1") -> CollectorRegistry:
    """Serve ``/metrics`` on ``addr:port`` from a background thread: worker counters plus scrape-time positions."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        ReadyFilesCollector(registry)
    else:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    registry.register(PositionCollector(target, names))
    start_server(registry, port, addr)
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return registry
