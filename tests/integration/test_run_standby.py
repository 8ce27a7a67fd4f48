"""``applier run --standby`` (issue 30, item 5): a second ``run`` that waits for a subscription another process
runs, shows in ``status``, stops cleanly on SIGTERM while it waits, takes over within a few seconds of the active
one's death (``kill -9`` of its whole process tree) or of its sessions on the target being dropped, with every
transaction applied exactly once, and never runs a subscription dropped while it waited.

The cut-off test is not ``core``: the old run needs its lock watchdog's next check (5 s) to stop, which makes it
20-25 s here."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from applier.catalog.store import Catalog
from applier.subscriptions import LOCK_NAMESPACE, format_status
from applier.subscriptions import status as status_of
from applier.testing import Database, wait_until
from tests.support.cli import StartRun, alive, catalog_row, create, run_log, status, stop


def _lock_backend(target: Database, subid: int) -> int | None:
    return target.scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s::oid AND objid = %s::oid"
        " AND objsubid = 2",
        (LOCK_NAMESPACE, subid),
    )


def _standby_sessions(target: Database) -> int:
    return int(
        target.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'applier[%] standby %'"
        )
    )


def _tables(pair, *, two_phase: bool = False) -> int:
    """Table ``t`` (unique key, a value to sum) on both sides, a subscription ``s`` streaming it; its subid."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v bigint NOT NULL)")
    pair.publisher.execute(f"CREATE PUBLICATION {pair.name} FOR TABLE t")
    create(pair, "s", "--no-copy-data", *(["--two-phase"] if two_phase else []))
    return int(catalog_row(pair.target, "s")["subid"])


def _standing_by(proc) -> bool:
    return alive(proc)() and ": standing by" in run_log(proc)


@pytest.mark.core
@pytest.mark.anyversion  # advisory locks and our processes, not the server version's
def test_a_standby_waits_shows_in_status_and_stops_on_sigterm(pair, start_run: StartRun) -> None:
    """While the active run holds the subscription, a standby waits (saying once who holds it), status names both
    processes, and SIGTERM ends the waiting standby with exit 0, the active one untouched."""
    subid = _tables(pair)
    active = start_run(pair.target, "s")
    wait_until(lambda: alive(active)() and _lock_backend(pair.target, subid), what="the active worker's lock")
    standby = start_run(pair.target, "s", "--standby")
    wait_until(lambda: _standing_by(standby), timeout=30, what="the standby to stand by")
    log = run_log(standby)
    assert f'subscription "s" is held by applier[{active.pid}@' in log
    assert log.count(": standing by") == 1, log

    s = status(pair.target, "s")
    assert s["holder"]["pid"] == active.pid and s["holder"]["purpose"] == "run"
    assert s["holder"]["host"] == socket.gethostname()
    assert [(w["pid"], w["purpose"]) for w in s["standbys"]] == [(standby.pid, "standby")]
    text = format_status(status_of(pair.target.dsn, "s"))  # in process: a second CLI start costs seconds here
    assert f"worker: applier[{active.pid}@" in text and f"standby: applier[{standby.pid}@" in text

    assert stop(standby) == 0
    assert 'standby for subscription "s" stopped: asked to stop' in run_log(standby)
    assert _standby_sessions(pair.target) == 0
    assert alive(active)() and _lock_backend(pair.target, subid) == s["holder"]["backend_pid"]
    assert stop(active) == 0


class _Workload(threading.Thread):
    """Transactions on the publisher, one row each under a unique key (every 10th a prepared transaction committed
    at once), until stopped: a transaction applied twice would fail the key, one lost would show in the count."""

    def __init__(self, publisher: Database) -> None:
        super().__init__(name="workload", daemon=True)
        self.publisher = publisher
        self.done = threading.Event()
        self.count = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.publisher.connect(autocommit=False) as conn:
                while not self.done.is_set():
                    self.count += 1
                    conn.execute("INSERT INTO t VALUES (%s, %s)", (self.count, self.count * 7))
                    if self.count % 10:
                        conn.commit()
                        continue
                    conn.execute(f"PREPARE TRANSACTION 'w{self.count}'")
                    conn.autocommit = True
                    conn.execute(f"COMMIT PREPARED 'w{self.count}'")
                    conn.autocommit = False
                    self.done.wait(0.002)  # a pace, not a wait for a condition
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


@pytest.mark.core
@pytest.mark.anyversion  # advisory locks and our processes, not the server version's
def test_a_standby_takes_over_after_kill_9_exactly_once(pair, start_run: StartRun) -> None:
    """kill -9 of the active run's whole process tree under a workload: the standby takes the lock within a few
    seconds and carries on from the replication origin, so the target ends equal to the publisher with each
    transaction applied once (unique key, count and sum)."""
    subid = _tables(pair, two_phase=True)
    active = start_run(pair.target, "s", session=True)
    wait_until(lambda: alive(active)() and _lock_backend(pair.target, subid), what="the active worker's lock")
    standby = start_run(pair.target, "s", "--standby")
    wait_until(lambda: _standing_by(standby), timeout=30, what="the standby to stand by")

    workload = _Workload(pair.publisher)
    workload.start()
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") >= 200, timeout=30, what="the workload")
    os.killpg(active.pid, signal.SIGKILL)
    killed = time.monotonic()
    active.wait(timeout=10)
    wait_until(lambda: alive(standby)() and _lock_backend(pair.target, subid), timeout=30,
               interval=0.05, what="the standby to take the lock")  # fmt: skip
    locked = time.monotonic() - killed
    applied_at_kill = pair.target.scalar("SELECT count(*) FROM t")
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") > applied_at_kill, timeout=30,
               interval=0.05, what="the standby to apply")  # fmt: skip
    applying = time.monotonic() - killed
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") >= applied_at_kill + 100, timeout=30,
               what="the workload to go on under the standby")  # fmt: skip
    workload.done.set()
    workload.join(timeout=30)
    assert workload.error is None, workload.error
    print(f"\ntakeover after kill -9: lock taken in {locked:.2f} s, first transaction applied in {applying:.2f} s "
          f"({workload.count} transactions)")  # fmt: skip

    expected = pair.publisher.scalar("SELECT (count(*), sum(v))::text FROM t")
    wait_until(lambda: alive(standby)() and pair.target.scalar("SELECT (count(*), sum(v))::text FROM t") == expected,
               timeout=60, what="the target to equal the publisher")  # fmt: skip
    assert expected == f"({workload.count},{7 * workload.count * (workload.count + 1) // 2})"
    assert pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts") == 0
    assert applying < 10, f"the takeover took {applying:.1f} s"
    s = status(pair.target, "s")
    assert s["holder"]["pid"] == standby.pid and s["standbys"] == []
    assert 'standby took over subscription "s"' in run_log(standby)
    assert stop(standby) == 0


@pytest.mark.core
@pytest.mark.anyversion  # advisory locks and our processes, not the server version's
def test_a_standby_does_not_run_a_subscription_dropped_while_it_waited(pair, start_run: StartRun) -> None:
    """The lock's holder may be a ``drop``: once the standby has the lock it reads the subscription again, finds it
    gone, and ends cleanly (exit 0) instead of running it."""
    subid = _tables(pair)
    with pair.target.connect() as dropper:  # a drop in progress: it holds the lock while it deletes
        dropper.execute("SET application_name = 'applier[1@elsewhere] drop s'")
        dropper.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", (LOCK_NAMESPACE, subid))
        standby = start_run(pair.target, "s", "--standby")
        wait_until(lambda: _standing_by(standby), timeout=30, what="the standby to stand by")
        assert "held by applier[1@elsewhere] drop s" in run_log(standby)
        catalog = Catalog.connect(pair.target.dsn)
        try:
            catalog.delete_subscription(subid)
        finally:
            catalog.engine.dispose()
    assert standby.wait(timeout=30) == 0, run_log(standby)
    assert "the subscription was dropped while this standby waited" in run_log(standby)
    pair.publisher.execute("SELECT pg_drop_replication_slot('s')")


def test_a_standby_takes_over_from_a_run_cut_off_from_the_target(pair, start_run: StartRun) -> None:
    """The active run's host freezes and the target drops its sessions (a network partition, seen from the target):
    the standby takes over; when the old run comes back, its lock watchdog finds the lock taken and stops it
    (exit 1), and every transaction is applied once."""
    subid = _tables(pair)
    active = start_run(pair.target, "s", session=True)
    wait_until(lambda: alive(active)() and _lock_backend(pair.target, subid), what="the active worker's lock")
    standby = start_run(pair.target, "s", "--standby")
    wait_until(lambda: _standing_by(standby), timeout=30, what="the standby to stand by")
    _insert(pair.publisher, range(1, 51))
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") == 50, what="the active worker to apply")

    os.killpg(active.pid, signal.SIGSTOP)
    try:
        pair.target.execute(  # its lock's session and its apply session
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE %s OR application_name = 'applier s'",
            (f"applier[{active.pid}@%",),
        )
        wait_until(lambda: 'standby took over subscription "s"' in run_log(standby), timeout=30,
                   what="the standby to take the lock")  # fmt: skip
        _insert(pair.publisher, range(51, 101))
    finally:
        os.killpg(active.pid, signal.SIGCONT)
    assert active.wait(timeout=60) == 1
    assert "another process took over while the target connection was down" in run_log(active)
    expected = f"(100,{7 * 100 * 101 // 2})"
    wait_until(lambda: alive(standby)() and pair.target.scalar("SELECT (count(*), sum(v))::text FROM t") == expected,
               timeout=60, what="the standby to apply the rest")  # fmt: skip
    assert stop(standby) == 0


def _insert(publisher: Database, ids: range) -> None:
    with publisher.connect() as conn:
        for i in ids:
            conn.execute("INSERT INTO t VALUES (%s, %s)", (i, i * 7))
