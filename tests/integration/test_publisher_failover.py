"""The publisher fails over and the subscription goes on (issue 30): a failover slot (``create --failover``,
PostgreSQL 17+) is kept on a standby with ``sync_replication_slots``; the primary crashes, the standby is promoted,
``alter --connection`` points the subscription at it, and the running worker resumes there from the synchronized
slot: every row the old primary sent and every row the new one takes arrives exactly once, with no new copy.

The primary holds the subscriber back until the standby has the WAL (``synchronized_standby_slots``), which is what
makes the synchronized slot a safe place to resume from."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, PostgresBinaries, PostgresCluster, wait_until
from applier.testing.failover import multi_host_conninfo, primary_with_standby, slot_synced
from applier.testing.pytest_plugin import drop_our_origins
from tests.support.cli import StartRun, fails, ok, run_log, status, stop
from tests.support.native import drop_native_subscription

pytestmark = pytest.mark.core

TIMEOUT = 90.0


@pytest.fixture(params=["synchronized"])
def primary_and_standby(
    request: pytest.FixtureRequest, pg_binaries: PostgresBinaries
) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A primary and its standby with ``sync_replication_slots``; the primary holds logical walsenders back for
    the standby (``synchronized_standby_slots``) unless the parameter is ``"unsynchronized"``."""
    if pg_binaries.major < 17:
        pytest.skip(f"failover slots need PostgreSQL 17 (this run's is {pg_binaries.major})")
    held = {"synchronized_standby_slots": "standby1"} if request.param == "synchronized" else {}
    with primary_with_standby(
        pg_binaries, "", "standby1", standby_settings={"sync_replication_slots": "on"}, primary_settings=held
    ) as pair:
        yield pair


@contextlib.contextmanager
def failover_subscription(
    primary: PostgresCluster,
    target_cluster: PostgresCluster,
    start_run: StartRun,
    *,
    rows_before: int = 0,
    publisher: str | None = None,
    failover: bool = True,
    options: tuple[str, ...] = (),
) -> Iterator[tuple[Database, Database, subprocess.Popen[str]]]:
    """Database ``app`` on the primary with table t (``rows_before`` rows, for the initial copy) published as p, a
    target database with t, subscription "s" with ``--failover`` (to ``publisher``, a conninfo of the primary's
    ``app`` by default) and its ``applier run`` (quick retries); stopped and dropped afterwards."""
    pub = primary.create_database("app")
    pub.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE t")
    # walsenders of this database stream a transaction past 64 kB (read at connection: set before any)
    pub.execute("ALTER DATABASE app SET logical_decoding_work_mem = '64kB'")
    pub.execute("INSERT INTO t SELECT g, 'before' FROM generate_series(1, %s) g", (rows_before,))
    tgt = target_cluster.create_database("failover_target")
    proc = None
    try:
        tgt.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        ok(tgt, "create", "s", "--publisher", publisher or pub.dsn, "--publication", "p",
           *(["--failover"] if failover else []), *options)  # fmt: skip
        proc = start_run(tgt, "s", "--max-retry-interval", "2")
        wait_until(lambda: "has started streaming" in run_log(proc), timeout=TIMEOUT, what="streaming")
        yield pub, tgt, proc
    finally:
        if proc is not None:
            stop(proc)
        drop_our_origins(tgt)
        target_cluster.drop_database(tgt.name)


def _writes_on_the_new_primary_arrive(new_pub: Database, tgt: Database, proc: subprocess.Popen[str]) -> None:
    """Rows inserted and updated on the promoted standby reach the target, and the worker still runs."""
    new_pub.execute("INSERT INTO t SELECT g, 'on the new primary' FROM generate_series(251, 300) g")
    new_pub.execute("UPDATE t SET v = 'updated after the failover' WHERE id <= 10")
    expected = new_pub.query("SELECT * FROM t ORDER BY id")
    wait_until(lambda: tgt.query("SELECT * FROM t ORDER BY id") == expected, timeout=TIMEOUT,
               what=f"the target equal to the new primary; log:\n{run_log(proc)[-3000:]}")  # fmt: skip
    assert proc.poll() is None


def test_the_subscription_follows_a_promoted_standby(
    primary_and_standby, target_cluster, start_run: StartRun
) -> None:
    primary, standby = primary_and_standby
    with failover_subscription(primary, target_cluster, start_run, rows_before=100) as (pub, tgt, proc):
        assert status(tgt, "s")["failover"] is True
        assert primary.scalar("SELECT failover FROM pg_replication_slots WHERE slot_name = 's'") is True
        pub.execute("INSERT INTO t SELECT g, 'streamed' FROM generate_series(101, 200) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 200, timeout=TIMEOUT, what="200 rows")
        wait_until(
            lambda: slot_synced(primary, standby, "s"),
            timeout=TIMEOUT,
            what="the slot synchronized to the standby",
        )

        # the failover: rows committed just before the crash, then the old primary is gone
        pub.execute("INSERT INTO t SELECT g, 'last on the old primary' FROM generate_series(201, 250) g")
        wait_until(
            lambda: standby.scalar("SELECT count(*) FROM t", dbname="app") == 250,
            timeout=TIMEOUT,
            what="replayed",
        )
        primary.crash()
        standby.promote()
        new_pub = Database(standby, "app")
        err = fails(tgt, "alter", "s", "--connection", primary.dsn("app"))
        assert "needed to check the new connection" in err, err
        ok(tgt, "alter", "s", "--connection", new_pub.dsn)
        _writes_on_the_new_primary_arrive(new_pub, tgt, proc)
        assert "initial copy" not in run_log(proc).split("has started streaming", 1)[1]  # no second copy


def test_a_multi_host_conninfo_follows_the_promoted_standby_by_itself(
    primary_and_standby, target_cluster, start_run: StartRun
) -> None:
    """``host=a,b ... target_session_attrs=read-write`` for the replication connection, the copy, ``verify`` and
    ``create``'s checks: libpq takes the primary (a standby refuses a read-write session, walsender or not); after
    the promotion the worker's own reconnect reaches the new primary, nothing altered."""
    primary, standby = primary_and_standby
    conninfo = multi_host_conninfo(primary, standby, "app")
    with failover_subscription(primary, target_cluster, start_run, rows_before=100, publisher=conninfo) as (
        pub,
        tgt,
        proc,
    ):
        assert status(tgt, "s")["failover"] is True
        pub.execute("INSERT INTO t SELECT g, 'streamed' FROM generate_series(101, 200) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 200, timeout=TIMEOUT, what="200 rows")
        ok(tgt, "verify", "s")  # exit status 0: every table equal
        wait_until(lambda: slot_synced(primary, standby, "s"), timeout=TIMEOUT, what="the slot synchronized")
        pub.execute("INSERT INTO t SELECT g, 'last on the old primary' FROM generate_series(201, 250) g")
        wait_until(lambda: standby.scalar("SELECT count(*) FROM t", dbname="app") == 250, timeout=TIMEOUT,
                   what="replayed")  # fmt: skip
        primary.crash()
        standby.promote()
        new_pub = Database(standby, "app")
        _writes_on_the_new_primary_arrive(new_pub, tgt, proc)
        log = run_log(proc)
        assert "the publisher failed over: timeline 1 ended at" in log, log[-3000:]
        assert "initial copy" not in log.split("has started streaming", 1)[1]  # no second copy
        ok(tgt, "verify", "s")  # exit status 0: every table equal
        # a worker started anew on the promoted server (it has no earlier session to compare with) goes on too
        stop(proc)
        again = start_run(tgt, "s")
        try:
            new_pub.execute("INSERT INTO t VALUES (301, 'after a restart')")
            wait_until(lambda: tgt.scalar("SELECT count(*) FROM t WHERE id = 301") == 1, timeout=TIMEOUT,
                       what=f"a row after the restart; log:\n{run_log(again)[-3000:]}")  # fmt: skip
        finally:
            assert stop(again) == 0, run_log(again)[-3000:]


def test_alter_sets_failover_on_the_slot_of_a_disabled_subscription(
    pair, pg_binaries: PostgresBinaries
) -> None:
    if pg_binaries.major < 17:
        pytest.skip(f"failover slots need PostgreSQL 17 (this run's is {pg_binaries.major})")
    pair.publisher.execute(f"CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION {pair.name} FOR TABLE t")
    pair.target.execute("CREATE TABLE t (id int PRIMARY KEY)")
    ok(
        pair.target,
        "create",
        "s",
        "--publisher",
        pair.publisher.dsn,
        "--publication",
        pair.name,
        "--disabled",
    )

    def slot_failover() -> bool:
        return bool(pair.publisher.scalar("SELECT failover FROM pg_replication_slots WHERE slot_name = 's'"))

    assert not slot_failover() and status(pair.target, "s")["failover"] is False
    out = ok(pair.target, "alter", "s", "--set", "failover=true")
    assert 'failover turned on on slot "s"' in out, out
    assert slot_failover() and status(pair.target, "s")["failover"] is True
    assert "(failover)" in ok(pair.target, "status", "s")
    ok(pair.target, "alter", "s", "--enable")
    err = fails(pair.target, "alter", "s", "--set", "failover=false")
    assert 'cannot set failover for enabled subscription "s"' in err, err
    ok(pair.target, "alter", "s", "--disable")
    ok(pair.target, "alter", "s", "--set", "failover=false")
    assert not slot_failover() and status(pair.target, "s")["failover"] is False
    ok(pair.target, "drop", "s")


@pytest.mark.parametrize("primary_and_standby", ["unsynchronized"], indirect=True)
def test_a_promoted_standby_that_lacks_applied_transactions_is_refused(
    primary_and_standby, target_cluster, start_run: StartRun
) -> None:
    """Without ``synchronized_standby_slots`` the target can apply what the standby never received: after the
    failover, ``alter --connection`` sees the new primary's WAL end before the target's progress and refuses."""
    primary, standby = primary_and_standby
    with failover_subscription(primary, target_cluster, start_run) as (pub, tgt, _proc):
        pub.execute("INSERT INTO t SELECT g, 'both have it' FROM generate_series(1, 100) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 100, timeout=TIMEOUT, what="100 rows")
        wait_until(lambda: slot_synced(primary, standby, "s"), timeout=TIMEOUT, what="the slot synchronized")
        standby.stop()  # the standby falls behind; the target does not
        pub.execute("INSERT INTO t SELECT g, 'only the target has it' FROM generate_series(101, 150) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 150, timeout=TIMEOUT, what="150 rows")
        primary.crash()
        standby.start()
        standby.promote()
        err = fails(tgt, "alter", "s", "--connection", Database(standby, "app").dsn)
        assert "it lacks transactions that the target holds" in err and "synchronized_standby_slots" in err, (
            err
        )
        assert "the connection is unchanged" in err


def _stopped_with(tgt: Database, proc: subprocess.Popen[str], *needles: str) -> dict[str, object]:
    """The run process ended by itself (its one worker failed: no retry loop), the subscription is disabled, and
    ``applier status`` shows the error with every needle; the error is in the log once. Returns the status."""
    proc.wait(timeout=TIMEOUT)
    log = run_log(proc)
    assert proc.returncode == 1, log[-3000:]
    st = status(tgt, "s")
    assert st["enabled"] is False, st
    message = st["last_error"]["message"]  # type: ignore[index]
    for needle in needles:
        assert needle in message, f"{message}\n{log[-4000:]}"
    assert "applier drop s" in message and "applier alter s --connection" in message, message
    assert log.count("has been disabled") >= 1 and log.count("started streaming") <= 1, log[-3000:]
    return st


def test_a_failover_without_a_failover_slot_stops_the_subscription(
    primary_and_standby, target_cluster, start_run: StartRun
) -> None:
    """The conninfo follows the promotion, but the slot was not a failover slot: the new primary has none. The
    worker says so, disables the subscription and ends (no loop); nothing is applied from the new primary."""
    primary, standby = primary_and_standby
    with failover_subscription(
        primary,
        target_cluster,
        start_run,
        publisher=multi_host_conninfo(primary, standby, "app"),
        failover=False,
    ) as (pub, tgt, proc):
        pub.execute("INSERT INTO t SELECT g, 'before' FROM generate_series(1, 100) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 100, timeout=TIMEOUT, what="100 rows")
        wait_until(lambda: standby.scalar("SELECT count(*) FROM t", dbname="app") == 100, timeout=TIMEOUT,
                   what="replayed")  # fmt: skip
        primary.crash()
        standby.promote()
        Database(standby, "app").execute("INSERT INTO t VALUES (101, 'on the new primary')")
        _stopped_with(
            tgt, proc, 'replication slot "s" does not exist on the publisher', "failed over: timeline 1 ended at",
            "failover slot",
        )  # fmt: skip
        assert tgt.scalar("SELECT count(*) FROM t") == 100


def _hba_reject_tcp(cluster: PostgresCluster, reject: bool) -> None:
    """Refuse (or admit again) TCP connections to ``cluster``; the unix socket stays open for the test itself."""
    assert cluster.datadir is not None
    hba = cluster.datadir / "pg_hba.conf"
    line = "host all all 127.0.0.1/32 reject\n"
    text = hba.read_text().replace(line, "")
    hba.write_text(line + text if reject else text)
    _local(cluster, "postgres").execute("SELECT pg_reload_conf()")


def _local(cluster: PostgresCluster, dbname: str) -> psycopg.Connection:
    return psycopg.connect(cluster.dsn(dbname, host=str(cluster.datadir)), autocommit=True)


@pytest.mark.parametrize("primary_and_standby", ["unsynchronized"], indirect=True)
@pytest.mark.parametrize("worker", ["running", "restarted"])
def test_a_promoted_standby_that_forked_before_what_was_applied_stops_the_subscription(
    primary_and_standby, target_cluster, start_run: StartRun, worker: str
) -> None:
    """The silent-skip case: the target applied up to P from the old primary, the standby never got it, and after
    the promotion the new primary's WAL goes past P. Streaming from P there would skip the new primary's own
    transactions up to P. A running worker sees its publisher's timeline change with P after the switch point; a
    worker started after the failover sees P after the start of the publisher's timeline and a slot that confirmed
    nothing past it. Either stops the subscription with the reason, rather than resume."""
    primary, standby = primary_and_standby
    with failover_subscription(
        primary, target_cluster, start_run, publisher=multi_host_conninfo(primary, standby, "app")
    ) as (
        pub,
        tgt,
        proc,
    ):
        pub.execute("INSERT INTO t SELECT g, 'both have it' FROM generate_series(1, 100) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 100, timeout=TIMEOUT, what="100 rows")
        wait_until(lambda: slot_synced(primary, standby, "s"), timeout=TIMEOUT, what="the slot synchronized")
        standby.stop()  # the standby falls behind; the target does not
        pub.execute("INSERT INTO t SELECT g, 'only the target has it' FROM generate_series(101, 150) g")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM t") == 150, timeout=TIMEOUT, what="150 rows")
        applied = tgt.scalar("SELECT remote_lsn::text FROM pg_replication_origin_status")
        if worker == "restarted":
            stop(proc)
        primary.crash()
        standby.start()
        # the worker waits until the new primary's WAL has passed what it applied
        _hba_reject_tcp(standby, True)
        standby.promote()
        with _local(standby, "app") as conn:
            conn.execute("INSERT INTO t SELECT g, 'the new primary''s own' FROM generate_series(101, 5000) g")
            past = conn.execute("SELECT pg_current_wal_lsn() > %s::pg_lsn", (applied,)).fetchone()
            assert past == (True,)
        _hba_reject_tcp(standby, False)
        if worker == "running":
            _stopped_with(tgt, proc, "that timeline ended at", "diverged", "failed over: timeline 1 ended at")
        else:
            _stopped_with(tgt, start_run(tgt, "s"), "began its timeline at", "diverged", "on timeline 2")
        assert tgt.scalar("SELECT count(*) FROM t") == 150


def _prepared(db: Database) -> list[str]:
    """The GIDs of the transactions prepared in ``db``'s database."""
    return [r[0] for r in db.query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")]


def test_two_phase_through_a_failover_as_the_native_subscriber(
    primary_and_standby, target_cluster, start_run: StartRun, pg_binaries: PostgresBinaries
) -> None:
    """PostgreSQL 18 synchronizes a two-phase failover slot (17 does not sync ``two_phase_at``). Commits, a
    streamed transaction and a transaction prepared but undecided when the primary is killed; the promoted standby
    decides it (COMMIT PREPARED) and takes more commits. Ours (multi-host conninfo: no command after the failover)
    and PostgreSQL's own subscriber (``failover, two_phase``, same conninfo) both end equal to the new primary,
    with the prepared transaction committed once and nothing left prepared."""
    if pg_binaries.major < 18:
        pytest.skip(f"failover slots with two-phase need PostgreSQL 18 (this run's is {pg_binaries.major})")
    primary, standby = primary_and_standby
    conninfo = multi_host_conninfo(primary, standby, "app")
    with failover_subscription(primary, target_cluster, start_run, publisher=conninfo,
                               options=("--two-phase", "--streaming", "on")) as (pub, tgt, proc):  # fmt: skip
        native = target_cluster.create_database("failover_native")
        try:
            native.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
            native.execute(
                sql.SQL(
                    "CREATE SUBSCRIPTION native CONNECTION {} PUBLICATION p WITH (failover = true, "
                    "two_phase = true, streaming = on)"
                ).format(sql.Literal(conninfo))  # fmt: skip
            )
            wait_until(lambda: status(tgt, "s")["two_phase"] == "e", timeout=TIMEOUT, what="our two-phase on")
            wait_until(lambda: native.scalar("SELECT subtwophasestate FROM pg_subscription") == "e",
                       timeout=TIMEOUT, what="native two-phase on")  # fmt: skip

            pub.execute("INSERT INTO t SELECT g, 'committed' FROM generate_series(1, 100) g")
            pub.execute("INSERT INTO t SELECT g, repeat('streamed ', 40) FROM generate_series(101, 3100) g")
            with pub.connect() as conn:
                conn.execute("BEGIN")
                conn.execute("INSERT INTO t SELECT g, 'prepared' FROM generate_series(5001, 5010) g")
                conn.execute("UPDATE t SET v = 'updated by the prepared one' WHERE id <= 5")
                conn.execute("PREPARE TRANSACTION 'gx'")
            for db in (tgt, native):
                wait_until(lambda db=db: len(_prepared(db)) == 1 and db.scalar("SELECT count(*) FROM t") == 3100,
                           timeout=TIMEOUT, what=f"{db.name}: the commits, and the prepared one prepared")  # fmt: skip
            streamed = primary.scalar(
                "SELECT sum(stream_txns) FROM pg_stat_replication_slots WHERE slot_name IN ('s', 'native')"
            )
            assert streamed >= 2, streamed  # the 3000-row transaction reached each of them streamed
            for slot in ("s", "native"):
                wait_until(lambda slot=slot: slot_synced(primary, standby, slot), timeout=TIMEOUT,
                           what=f"slot {slot} synchronized")  # fmt: skip
            assert standby.scalar("SELECT bool_and(two_phase) FROM pg_replication_slots WHERE synced") is True
            wal = primary.scalar("SELECT pg_current_wal_lsn()::text")
            wait_until(lambda: standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (wal,)),
                       timeout=TIMEOUT, what="the standby replayed the prepare")  # fmt: skip

            primary.crash()
            standby.promote()
            new_pub = Database(standby, "app")
            new_pub.execute("COMMIT PREPARED 'gx'")
            new_pub.execute("INSERT INTO t SELECT g, 'on the new primary' FROM generate_series(6001, 6100) g")
            new_pub.execute("DELETE FROM t WHERE id BETWEEN 50 AND 60")
            expected = new_pub.query("SELECT * FROM t ORDER BY id")
            for db in (tgt, native):
                wait_until(lambda db=db: db.query("SELECT * FROM t ORDER BY id") == expected, timeout=TIMEOUT,
                           what=f"{db.name} equal to the new primary; log:\n{run_log(proc)[-3000:]}")  # fmt: skip
                assert _prepared(db) == [], db.name
            assert proc.poll() is None
            assert status(tgt, "s")["prepared"] == []
            assert "the publisher failed over: timeline 1 ended at" in run_log(proc)
        finally:
            drop_native_subscription(native, "native")
            target_cluster.drop_database(native.name)
