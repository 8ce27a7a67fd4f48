"""The apply worker's side of live table syncs (applier.apply.syncstate.LiveSyncDriver) against a scripted
coordinator: when a sync starts, how the stream meets it at SYNCWAIT, and the wait after a failed one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from applier.apply.syncstate import LIVE_SYNC_RETRY, LiveSyncDriver
from applier.catalog.store import RelState


@dataclass
class ScriptedSync:
    """A TableSync whose phase the test sets; records what the driver asked of it."""

    waiting: bool = False
    finished: bool = False
    failed: bool = False
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
        coordinator, "dbname=x", "s", logging.getLogger("t"), threading.Event()
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


def test_after_a_failed_sync_the_next_waits() -> None:
    live, coordinator = driver()
    live.start_if_needed([rel("f")])
    coordinator.syncs[0].finished = coordinator.syncs[0].failed = True
    assert live.at_boundary(300, lambda: None, lambda: None)
    assert live.retry_at > 0
    live.start_if_needed([rel("f")])
    assert len(coordinator.syncs) == 1  # not before LIVE_SYNC_RETRY
    live.retry_at -= LIVE_SYNC_RETRY
    live.start_if_needed([rel("f")])
    assert len(coordinator.syncs) == 2
