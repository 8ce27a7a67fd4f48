"""A subscription's whole life through the real command line, with ``applier run`` as background processes:
create -> run (initial copy, then streaming; two-phase pending, then enabled) -> disable -> two_phase off -> enable
-> drop, which leaves nothing on either server. Plus the ``--no-copy-data`` path, ``run``'s one-process-per-
subscription rule, side-by-side runs, and what ``status`` reports."""

from __future__ import annotations

import json
import urllib.request

import pytest

from applier.catalog.store import Catalog
from applier.subscriptions import LOCK_NAMESPACE
from applier.testing import Database, assert_tables_equal, wait_until
from applier.testing.cluster import free_port
from tests.support.cli import (
    NOTHING,
    StartRun,
    alive,
    applier,
    catalog_row,
    create,
    fails,
    leftovers,
    make_tables,
    ok,
    run_log,
    status,
    stop,
)


def lock_taken(target: Database, subid: int) -> bool:
    return bool(
        target.scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s::oid"
            " AND objid = %s::oid AND objsubid = 2",
            (LOCK_NAMESPACE, subid),
        )
    )


@pytest.mark.slow
@pytest.mark.spark
def test_life_of_a_two_phase_subscription(pair, start_run: StartRun) -> None:
    make_tables(pair, "t1", "t2", rows=200)
    create(pair, "s", "--two-phase")
    s = status(pair.target, "s")
    assert s["two_phase"] == "p" and s["enabled"]
    assert [(t["name"], t["state"]) for t in s["tables"]] == [("public.t1", "i"), ("public.t2", "i")]
    subid = s["subid"]
    assert pair.publisher.scalar("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 's'") is False

    run = start_run(pair.target, "s")
    # the copy, then streaming without two-phase until every table is ready, then a restart with two-phase on
    wait_until(lambda: alive(run)() and status(pair.target, "s")["two_phase"] == "e", timeout=400, interval=0.5,
               what="two-phase to be enabled")  # fmt: skip
    s = status(pair.target, "s")
    assert {t["state"] for t in s["tables"]} == {"r"}
    assert sum(t["rows"] for t in s["tables"]) == 400
    assert s["worker"] and "run s" in s["worker"]
    for t in ("t1", "t2"):
        assert_tables_equal(pair.publisher, pair.target, t)

    # a prepared transaction now arrives at PREPARE, under our GID, and status shows it pending
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute("INSERT INTO t1 VALUES (1001, 'prepared')")
        xid = conn.execute("SELECT txid_current()").fetchone()[0]  # type: ignore[index]
        conn.execute("PREPARE TRANSACTION 'pub_gid'")
    gid = f"pg_gid_{subid}_{xid}"
    wait_until(lambda: alive(run)() and [p["gid"] for p in status(pair.target, "s")["prepared"]] == [gid],
               what="the prepared transaction on the target")  # fmt: skip
    pair.publisher.execute("COMMIT PREPARED 'pub_gid'")
    wait_until(
        lambda: pair.target.scalar("SELECT count(*) FROM t1 WHERE id = 1001") == 1, what="commit prepared"
    )
    published = pair.publisher.scalar("SELECT pg_current_wal_lsn()::text")
    rep = wait_until(
        lambda: (
            (r := status(pair.target, "s")["replication"])["applied_lsn"]
            and pair.publisher.scalar("SELECT %s::pg_lsn >= %s::pg_lsn", (r["applied_lsn"], published))
            and r
        ),
        what="applied to catch up",
    )
    assert rep["received_lsn"] and rep["flushed_lsn"] and rep["origin_lsn"]
    assert rep["lag_bytes"] == 0 and rep["slot_two_phase"] is True

    # disable: the worker stops by itself and run exits cleanly; then two-phase can be turned off
    ok(pair.target, "alter", "s", "--disable")
    assert run.wait(timeout=60) == 0, run_log(run)
    assert "stopped: the subscription is disabled" in run_log(run)
    if pair.publisher.cluster.binaries.major < 18:
        # before 18 a slot's two_phase cannot be changed (ALTER_REPLICATION_SLOT), so the catalog must not say it was
        err = fails(pair.target, "alter", "s", "--set", "two_phase=off")
        assert "needs PostgreSQL 18" in err and "applier drop s" in err
        assert status(pair.target, "s")["two_phase"] == "e"
    else:
        out = ok(pair.target, "alter", "s", "--set", "two_phase=off")
        assert 'two-phase turned off on slot "s"' in out
        s = status(pair.target, "s")
        assert (s["two_phase"], s["enabled"], s["worker"]) == ("d", False, None)
        slot_2pc = pair.publisher.scalar("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 's'")
        assert slot_2pc is False
    ok(pair.target, "alter", "s", "--enable")
    assert catalog_row(pair.target, "s")["subenabled"] is True

    ok(pair.target, "drop", "s")
    assert leftovers(pair, subid, "s") == NOTHING


@pytest.mark.core
def test_no_copy_data_starts_ready_with_two_phase_enabled(pair) -> None:
    make_tables(pair, "t1", rows=5)
    out = create(pair, "s", "--two-phase", "--no-copy-data")
    assert "1 table(s) in state r, two-phase state e" in out
    s = status(pair.target, "s")
    assert s["two_phase"] == "e"
    assert [(t["name"], t["state"], t["lsn"]) for t in s["tables"]] == [("public.t1", "r", None)]
    assert pair.publisher.scalar("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 's'") is True
    # without tables two-phase stays pending, so a later refresh with copy stays possible (behaviour 55)
    pair.publisher.execute("CREATE PUBLICATION empty_pub")
    create(pair, "s_empty", "--two-phase", "--no-copy-data", publication="empty_pub")
    assert status(pair.target, "s_empty")["two_phase"] == "p"


@pytest.mark.core
@pytest.mark.anyversion  # advisory locks and our processes, not the server version's
def test_one_run_per_subscription_and_side_by_side(pair, start_run: StartRun) -> None:
    """Two subscriptions in two run processes both apply; a second run of either is refused and names the first."""
    make_tables(pair, "a", publication="pub_a")
    make_tables(pair, "b", publication="pub_b")
    create(pair, "sa", "--no-copy-data", "--slot-name", "slot_a", publication="pub_a")
    create(pair, "sb", "--no-copy-data", "--two-phase", "--slot-name", "slot_b", publication="pub_b")
    ids = {n: catalog_row(pair.target, n)["subid"] for n in ("sa", "sb")}
    port = free_port()
    run_a = start_run(pair.target, "sa", "--metrics-port", str(port))
    run_b = start_run(pair.target, "sb")
    for proc, name in ((run_a, "sa"), (run_b, "sb")):
        wait_until(
            lambda p=proc, n=name: alive(p)() and lock_taken(pair.target, ids[n]), what=f"{name} to run"
        )

    res = applier(pair.target, "run", "sa", "--log-format", "json")
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), res.stderr  # stderr is the log, JSON records only
    logged = "\n".join(json.loads(line)["message"] for line in lines)
    assert f'subscription "sa" is in use by another applier process: applier[{run_a.pid}@' in logged
    assert "SIGTERM" in logged
    assert f"applier[{run_b.pid}@" in fails(pair.target, "drop", "sb")

    pair.publisher.execute("INSERT INTO a VALUES (1, 'a')")
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute("INSERT INTO b VALUES (1, 'b')")
        conn.execute("PREPARE TRANSACTION 'b1'")
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM a") == 1, what="sa to apply")
    wait_until(
        lambda: pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts") == 1, what="sb to prepare"
    )
    pair.publisher.execute("COMMIT PREPARED 'b1'")
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM b") == 1, what="sb to commit prepared")
    metrics = wait_until(lambda: _scrape(port), what="metrics")
    assert 'applier_subscription_enabled{subscription="sa"} 1.0' in metrics
    assert 'applier_tables{state="r",subscription="sa"} 1.0' in metrics
    assert (stop(run_a), stop(run_b)) == (0, 0)
    assert "stopped: asked to stop" in run_log(run_a)
    for name, slot in (("sa", "slot_a"), ("sb", "slot_b")):
        ok(pair.target, "drop", name)
        assert leftovers(pair, ids[name], slot) == NOTHING


@pytest.mark.core
@pytest.mark.anyversion  # our status output
def test_status_reports_prepared_transactions_and_the_last_error(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase", "--no-copy-data")
    subid = catalog_row(pair.target, "s")["subid"]
    with pair.target.connect(autocommit=False) as conn:
        conn.execute("INSERT INTO t1 VALUES (1, 'x')")
        conn.execute(f"PREPARE TRANSACTION 'pg_gid_{subid}_900'")
    Catalog.connect(pair.target.dsn).record_error(subid, "duplicate key value violates unique constraint",
                                                  remote_xid=901, message_type="INSERT", relation="public.t1")  # fmt: skip
    text = ok(pair.target, "status")
    assert 'subscription "s"' in text and "two-phase e (enabled)" in text
    assert f"prepared on the target: pg_gid_{subid}_900" in text
    assert "last error" in text and "duplicate key value" in text
    assert "worker: not running" in text
    s = status(pair.target, "s")
    assert s["last_error"]["remote_xid"] == 901 and s["last_error"]["relation"] == "public.t1"
    assert s["replication"]["publisher_reachable"] and s["replication"]["slot_exists"]
    pair.target.execute(f"ROLLBACK PREPARED 'pg_gid_{subid}_900'")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _lock_backend(target: Database, subid: int) -> int | None:
    return target.scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s::oid AND objid = %s::oid"
        " AND objsubid = 2",
        (LOCK_NAMESPACE, subid),
    )


@pytest.mark.core
@pytest.mark.anyversion  # advisory locks and our processes, not the server version's
def test_run_takes_its_lock_again_after_losing_the_session(pair, start_run: StartRun) -> None:
    """A target restart ends the lock's session while the worker reconnects and carries on: the lock is taken again;
    and if another process took it meanwhile, the worker stops with a message saying so."""
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    subid = catalog_row(pair.target, "s")["subid"]
    run = start_run(pair.target, "s")
    first = wait_until(lambda: alive(run)() and _lock_backend(pair.target, subid), what="the worker's lock")
    pair.target.execute("SELECT pg_terminate_backend(%s)", (first,))
    wait_until(lambda: alive(run)() and _lock_backend(pair.target, subid) not in (None, first), timeout=30,
               what="the lock to be taken again")  # fmt: skip
    wait_until(lambda: 'lock of subscription "s" taken again' in run_log(run), what="the worker to say so")

    # now someone else grabs it the moment the worker's session goes
    second = _lock_backend(pair.target, subid)
    with pair.target.connect() as thief:
        thief.execute("SELECT pg_terminate_backend(%s)", (second,))
        wait_until(lambda: _lock_backend(pair.target, subid) is None, what="the lock to be free")
        thief.execute("SET application_name = 'the thief'")
        thief.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", (LOCK_NAMESPACE, subid))
        assert run.wait(timeout=60) == 1
    log = run_log(run)
    assert "another process took over while the target connection was down" in log and "the thief" in log


@pytest.mark.core
@pytest.mark.anyversion  # our processes
def test_a_worker_does_not_outlive_a_killed_run(pair, start_run: StartRun) -> None:
    """``kill -9`` of the run process alone must not leave its worker running as an orphan that holds the lock."""
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    subid = catalog_row(pair.target, "s")["subid"]
    run = start_run(pair.target, "s")
    wait_until(lambda: alive(run)() and lock_taken(pair.target, subid), what="the worker's lock")
    run.kill()  # the parent only: its worker is another process
    run.wait(timeout=30)
    wait_until(lambda: not lock_taken(pair.target, subid), timeout=30, what="the orphaned worker to stop")
    assert "the applier run process has gone: stopping this worker" in run_log(run)


@pytest.mark.core
@pytest.mark.anyversion  # our wait for the target
def test_run_waits_for_a_target_that_is_down_or_starting(pair, start_run: StartRun) -> None:
    """A service may start before its target (at boot, or during the target's crash recovery): ``run`` waits for it,
    saying so, and then streams; with ``--wait-target 0`` it fails at once with the usual message."""
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    cluster = pair.target.cluster
    cluster.stop()
    try:
        impatient = start_run(pair.target, "s", "--wait-target", "0")
        assert impatient.wait(timeout=60) == 1
        assert "could not connect to the target" in run_log(impatient)
        run = start_run(pair.target, "s")
        wait_until(lambda: alive(run)() and "the target is not taking connections yet" in run_log(run),
                   what="run to wait for the target")  # fmt: skip
    finally:
        cluster.start()
    pair.publisher.execute("INSERT INTO t1 VALUES (1001, 'after the wait')")
    wait_until(lambda: alive(run)() and pair.target.scalar("SELECT count(*) FROM t1 WHERE id = 1001") == 1,
               what="the row to arrive")  # fmt: skip
    assert stop(run) == 0
