"""The apply worker's side of live table syncs (applier.apply.syncstate.LiveSyncDriver) against a scripted
coordinator: when a sync starts, how the stream meets it at SYNCWAIT, and the growing wait after failed ones (the
catalog side, recording and disable_on_error, is tested with real servers: tests/integration/test_tablesync_refresh.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from applier.apply.coordinator import SyncFailure
from applier.apply.syncstate import LiveSyncDriver
from applier.catalog.store import RelState


@dataclass
class ScriptedSync:
    """A TableSync whose phase the test sets; records what the driver asked of it."""

    waiting: bool = False
    finished: bool = False
    failed: bool = False
    failure: SyncFailure | None = None
    calls: list[str] = field(default_factory=list)

    def proceed(self, current_lsn: int) -> None:
        self.calls.append(f"proceed {current_lsn}")

    def wait(self, interrupt: threading.Event | None = None, timeout: float | None = None, *,
             tick: Callable[[], None] | None = None) -> bool:  # fmt: skip
        self.calls.append("wait")
        self.waiting, self.finished = False, True  # the catch-up ran to its end
        return True

    def close(self) -> None:
        self.calls.append("close")


@dataclass
class Coordinator:
    syncs: list[ScriptedSync] = field(default_factory=list)

    def start(self, target_conninfo: str, subname: str, log: logging.Logger) -> ScriptedSync:
        self.syncs.append(ScriptedSync())
        return self.syncs[-1]


def rel(state: str) -> RelState:
    return RelState(7, 16400, "public.t", "public.t", state, None, 0, 0)


def driver() -> tuple[LiveSyncDriver, Coordinator]:
    coordinator = Coordinator()
    return LiveSyncDriver(
        coordinator, "dbname=x", "s", logging.getLogger("t"), threading.Event(), initial=1.0, cap=4.0
    ), coordinator


def test_a_sync_starts_only_when_a_table_waits_for_one() -> None:
    live, coordinator = driver()
    live.start_if_needed([rel("r"), rel("s")])
    assert live.job is None
    live.start_if_needed([rel("r"), rel("i")])
    live.start_if_needed([rel("r"), rel("i")])  # one at a time
    assert len(coordinator.syncs) == 1 and live.job is coordinator.syncs[0]


def test_at_syncwait_the_stream_drains_tells_its_position_and_waits() -> None:
    live, coordinator = driver()
    live.start_if_needed([rel("d")])
    sync = coordinator.syncs[0]
    drained: list[bool] = []
    assert not live.at_boundary(100, lambda: drained.append(True), lambda: None)  # still copying
    sync.waiting = True
    assert live.at_boundary(200, lambda: drained.append(True), lambda: None)
    assert drained == [True] and sync.calls == ["proceed 200", "wait", "close"] and live.job is None


def fail(live: LiveSyncDriver, coordinator: Coordinator) -> float:
    """Start a sync, let it fail, return how long the driver waits before the next one (jitter: up to 1 s)."""
    live.retry_at = 0.0
    live.start_if_needed([rel("f")])
    sync = coordinator.syncs[-1]
    sync.finished = sync.failed = True
    sync.failure = SyncFailure("duplicate key", "public.t", "COPY", "23505")
    now = time.monotonic()
    assert live.at_boundary(300, lambda: None, lambda: None)
    return live.retry_at - now


def test_after_a_failed_sync_the_next_waits_longer_each_time_up_to_the_cap() -> None:
    live, coordinator = driver()
    waits = [fail(live, coordinator) for _ in range(5)]
    assert live.failures == 5
    for got, step in zip(waits, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert step - 0.1 <= got <= min(step + 1.0, 4.0) + 0.1, waits
    live.start_if_needed([rel("f")])
    assert len(coordinator.syncs) == 5  # not before the wait
    live.retry_at = 0.0
    live.start_if_needed([rel("f")])
    assert len(coordinator.syncs) == 6


def test_a_successful_sync_starts_the_backoff_again() -> None:
    live, coordinator = driver()
    fail(live, coordinator)
    fail(live, coordinator)
    live.retry_at = 0.0
    live.start_if_needed([rel("f")])
    coordinator.syncs[-1].finished = True
    assert live.at_boundary(400, lambda: None, lambda: None)
    assert live.failures == 0 and fail(live, coordinator) <= 2.1


def test_a_stopped_sync_is_no_failure() -> None:
    live, coordinator = driver()
    live.start_if_needed([rel("d")])
    coordinator.syncs[0].finished = coordinator.syncs[0].failed = True  # stopped: no failure to report
    assert live.at_boundary(500, lambda: None, lambda: None)
    assert live.failures == 0 and not live.disabled


def test_every_failure_is_counted_once_and_a_stop_is_not() -> None:
    counted: list[int] = []
    coordinator = Coordinator()
    live = LiveSyncDriver(coordinator, "dbname=x", "s", logging.getLogger("t"), threading.Event(),
                          initial=1.0, cap=4.0, counted=lambda: counted.append(1))  # fmt: skip
    fail(live, coordinator)
    fail(live, coordinator)
    live.retry_at = 0.0
    live.start_if_needed([rel("d")])
    coordinator.syncs[-1].finished = coordinator.syncs[-1].failed = True  # stopped
    live.at_boundary(600, lambda: None, lambda: None)
    assert len(counted) == 2


def test_a_failure_is_one_log_line_with_the_error_where_and_the_next_attempt(caplog) -> None:
    """One ERROR record per failed sync (the sync thread's own line is debug only), on one line: where it failed,
    the failure count and wait, the error with its DETAIL folded in, and a catch-up error's context."""
    live, coordinator = driver()
    live.retry_at = 0.0
    live.start_if_needed([rel("f")])
    sync = coordinator.syncs[-1]
    sync.finished = sync.failed = True
    sync.failure = SyncFailure(
        'duplicate key value violates unique constraint "t_pkey"\nDETAIL:  Key (id)=(5) already exists.',
        "public.t", "INSERT", "23505", 812,
        'processing remote data for replication origin "applier_7_sync" during message type "INSERT"',
    )  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="t"):
        assert live.at_boundary(300, lambda: None, lambda: None)
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    line = errors[0].getMessage()
    assert "\n" not in line, line
    assert line.startswith(
        'table synchronization for subscription "s" failed during INSERT on public.t: failure 1 in a row; next '
        "attempt in "
    ), line
    assert line.endswith(
        '(applier status shows the error): duplicate key value violates unique constraint "t_pkey" DETAIL: Key '
        '(id)=(5) already exists. CONTEXT: processing remote data for replication origin "applier_7_sync" during '
        'message type "INSERT"'
    ), line


def test_a_failure_while_the_worker_stops_is_logged_not_recorded(caplog) -> None:
    """A sync that fails as the worker stops is not counted nor recorded (the table is copied again at the next
    start), but its error still reaches the log at ERROR: the sync thread's own line is debug only."""
    live, coordinator = driver()
    live.retry_at = 0.0
    live.start_if_needed([rel("d")])
    sync = coordinator.syncs[-1]
    sync.finished = sync.failed = True
    sync.failure = SyncFailure("connection to the target was lost", "public.t", "COPY", "08006", None)
    live.stop.set()
    with caplog.at_level(logging.DEBUG, logger="t"):
        live.end()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        'table synchronization for subscription "s" failed as the worker stopped; it is copied again at the next '
        "start: connection to the target was lost"
    ]
    assert live.failures == 0
