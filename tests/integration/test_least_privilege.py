"""Least privilege, end to end (docs/security.md): a subscription's whole life with no superuser on either side —
the target's apply role holds exactly the grants :func:`applier.privileges.least_privilege_grants` lists, the
publisher's role is LOGIN REPLICATION with SELECT on the published tables; ``create`` names a missing grant as a
ready-to-paste statement before it writes anything; and a superuser apply role is told, once, that it need not be.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from psycopg import sql

from applier.testing import Database, assert_tables_equal, wait_until
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.roles import create_apply_role, create_replication_role, drop_role
from tests.support.cli import (
    NOTHING,
    StartRun,
    alive,
    applier,
    fails,
    leftovers,
    make_tables,
    ok,
    run_log,
    status,
    stop,
)

TABLES = ("public.t1", "public.t2")
SUPERUSER_WARNING = "is a superuser; applier does not need one"


class Roles:
    """The pair's databases as the least-privileged roles, and the roles to drop afterwards."""

    def __init__(self, pair: ReplicationPair) -> None:
        self.pair = pair
        self.apply_name = f"apply_{pair.name}"[:63]
        self.repl_name = f"repl_{pair.name}"[:63]
        self.made: list[tuple[Database, str]] = []

    def publisher(self) -> Database:
        self.made.append((self.pair.publisher, self.repl_name))
        return create_replication_role(self.pair.publisher, self.repl_name, TABLES)

    def target(self, *, leave_out: tuple[str, ...] = ()) -> Database:
        self.made.append((self.pair.target, self.apply_name))
        return create_apply_role(self.pair.target, self.apply_name, TABLES, leave_out=leave_out)


@pytest.fixture
def roles(pair: ReplicationPair) -> Iterator[Roles]:
    made = Roles(pair)
    yield made
    for db, role in made.made:
        drop_role(db, role)


def stream_txns(pub: Database, slot: str) -> int:
    return int(pub.scalar("SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE slot_name = %s",
                          (slot,)))  # fmt: skip


@pytest.mark.core
def test_least_privileged_roles_run_a_subscriptions_whole_life(
    pair, roles: Roles, start_run: StartRun
) -> None:
    make_tables(pair, "t1", "t2", rows=300)
    # a few thousand rows then stream (decoding spills past 64 kB)
    pair.publisher.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'").format(sql.Identifier(pair.name))
    )
    pub, tgt = roles.publisher(), roles.target()
    res = applier(tgt, "create", "s", "--publisher", pub.dsn, "--publication", pair.name, "--two-phase",
                  "--streaming", "on")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert SUPERUSER_WARNING not in res.stderr
    subid = status(tgt, "s")["subid"]
    run = start_run(
        tgt, "s"
    )  # the initial copy on the driver, then streaming; two-phase once every table is ready
    wait_until(lambda: alive(run)() and status(tgt, "s")["two_phase"] == "e", timeout=120, interval=0.5,
               what="the copy and two-phase")  # fmt: skip

    with pair.publisher.connect(autocommit=False) as conn:  # a prepared transaction, arriving at its PREPARE
        conn.execute("INSERT INTO t2 VALUES (1001, 'prepared')")
        conn.execute("PREPARE TRANSACTION 'lp_gid'")
    wait_until(
        lambda: alive(run)() and status(tgt, "s")["prepared"], what="the transaction prepared on the target"
    )
    pair.publisher.execute("COMMIT PREPARED 'lp_gid'")
    pair.publisher.execute(
        "INSERT INTO t2 SELECT g, repeat('s', 100) FROM generate_series(1002, 6001) g;"
        " UPDATE t1 SET v = 'updated' WHERE id <= 10; DELETE FROM t1 WHERE id > 290"
    )  # one transaction, large enough to stream
    pair.publisher.execute("TRUNCATE t2")
    pair.publisher.execute("INSERT INTO t2 VALUES (7, 'after truncate')")
    wait_until(lambda: alive(run)() and tgt.scalar("SELECT v FROM t2") == "after truncate", what="the apply")
    assert stream_txns(pair.publisher, "s") >= 1
    for t in ("t1", "t2"):
        assert_tables_equal(pair.publisher, pair.target, t)
    assert ok(tgt, "verify", "s", "--settle-timeout", "5").rstrip().endswith("EQUAL")
    s = status(tgt, "s")
    assert {t["state"] for t in s["tables"]} == {"r"}
    # the walsender's positions are hidden from a role without pg_read_all_stats: the lag comes from the origin
    assert s["replication"]["publisher_reachable"] and s["replication"]["lag_bytes"] is not None, s

    ok(tgt, "alter", "s", "--disable")
    assert run.wait(timeout=60) == 0, run_log(run)
    assert SUPERUSER_WARNING not in run_log(run)
    ok(tgt, "alter", "s", "--set", "streaming=off")
    ok(tgt, "alter", "s", "--enable")
    ok(tgt, "drop", "s")
    assert leftovers(pair, subid, "s") == NOTHING


@pytest.mark.core
@pytest.mark.anyversion  # the grants are the whole-life test's; this adds the live sync's path
def test_a_table_added_while_streaming_is_synced_as_the_apply_role(
    pair, roles: Roles, start_run: StartRun
) -> None:
    make_tables(pair, "t1", "t2", rows=10)
    pub, tgt = roles.publisher(), roles.target()
    ok(tgt, "create", "s", "--publisher", pub.dsn, "--publication", pair.name)
    run = start_run(tgt, "s")
    wait_until(lambda: alive(run)() and {t["state"] for t in status(tgt, "s")["tables"]} == {"r"},
               what="the first tables")  # fmt: skip
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t3 (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO t3 SELECT g, 'x' FROM generate_series(1, 100) g")
    pair.publisher.execute(sql.SQL("GRANT SELECT ON t3 TO {}").format(sql.Identifier(roles.repl_name)))
    pair.publisher.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE t3").format(sql.Identifier(pair.name)))
    pair.target.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON t3 TO {}").format(
        sql.Identifier(roles.apply_name)))  # fmt: skip
    ok(
        tgt, "alter", "s", "--refresh-publication"
    )  # copied and caught up by the running worker (tablesync.live)
    pair.publisher.execute("INSERT INTO t3 VALUES (101, 'after')")
    wait_until(lambda: alive(run)() and tgt.scalar("SELECT count(*) FROM t3") == 101, what="t3 to sync")
    wait_until(lambda: {t["state"] for t in status(tgt, "s")["tables"]} == {"r"}, what="t3 to be ready")
    assert stop(run) == 0
    ok(tgt, "drop", "s")


@pytest.mark.slow  # a Spark start-up: about a minute on two cores, so in the full suite only
@pytest.mark.spark
def test_the_spark_copy_runs_as_the_apply_role(pair, roles: Roles, start_run: StartRun,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    make_tables(pair, "t1", "t2", rows=2000)
    pub, tgt = roles.publisher(), roles.target()
    ok(tgt, "create", "s", "--publisher", pub.dsn, "--publication", pair.name)
    monkeypatch.setenv("APPLIER_TABLESYNC_HEAD_START", "0")  # no copy on the driver: Spark copies everything
    run = start_run(tgt, "s")
    wait_until(lambda: alive(run)() and {t["state"] for t in status(tgt, "s")["tables"]} == {"r"}, timeout=180,
               interval=0.5, what="the copy on Spark")  # fmt: skip
    assert "copying on the driver" not in run_log(run)
    for t in ("t1", "t2"):
        assert_tables_equal(pair.publisher, pair.target, t)
    assert stop(run) == 0
    ok(tgt, "drop", "s")


@pytest.mark.core
def test_create_names_the_missing_grants_and_writes_nothing(pair, roles: Roles) -> None:
    make_tables(pair, "t1", "t2")
    pub = roles.publisher()
    tgt = roles.target(leave_out=("pg_replication_origin_xact_setup", "ON TABLE public.t2"))
    err = fails(tgt, "create", "s", "--publisher", pub.dsn, "--publication", pair.name, "--two-phase")
    role = roles.apply_name
    grants = [line for line in err.splitlines() if line.startswith("GRANT")]
    assert grants == [
        "GRANT EXECUTE ON FUNCTION pg_catalog.pg_replication_origin_xact_setup(pg_lsn, timestamp with time zone)"
        f" TO {role};",
        f"GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLE public.t2 TO {role};",
    ], err
    assert "nothing was written" in err
    assert (
        pair.target.scalar("SELECT count(*) FROM pg_class WHERE relnamespace = 'applier'::regnamespace") == 0
    )
    assert pair.target.query("SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%'") == []
    assert pair.publisher.query("SELECT slot_name FROM pg_replication_slots") == []
    # pasted as printed, they are all that was missing
    for line in grants:
        pair.target.execute(line)
    ok(tgt, "create", "s", "--publisher", pub.dsn, "--publication", pair.name, "--two-phase")
    ok(tgt, "drop", "s")


@pytest.mark.core
@pytest.mark.anyversion  # our notice
def test_a_superuser_apply_role_is_told_once_that_it_need_not_be(pair, start_run: StartRun) -> None:
    make_tables(pair, "t1")
    res = applier(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name,
                  "--no-copy-data")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stderr.count(SUPERUSER_WARNING) == 1 and "docs/security.md" in res.stderr
    run = start_run(pair.target, "s")
    wait_until(lambda: alive(run)() and "has started streaming" in run_log(run), what="the worker to stream")
    assert stop(run) == 0
    log = run_log(run)
    assert log.count(SUPERUSER_WARNING) == 1, log
    ok(pair.target, "drop", "s")
