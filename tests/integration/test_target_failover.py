"""The target fails over (issue 30, item 4): ``applier run`` with a multi-host ``--target`` (``host=a,b port=pa,pb
target_session_attrs=read-write``) follows the target's promoted standby and resumes exactly once from the
replication origin's progress, which is WAL-logged and so on the standby too; transactions prepared on the target
survive (``pg_prepared_xacts`` is replicated) and are decided there.

The target primary has a synchronous standby: the apply session then waits for it at every commit and PREPARE
(applier.apply.target), so nothing the worker acknowledged to the publisher can be missing on the promoted
standby; the publisher never sends an acknowledged transaction again."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from applier.subscriptions import LOCK_NAMESPACE
from applier.testing import Database, PostgresBinaries, PostgresCluster, wait_until
from applier.testing.failover import multi_host_conninfo, primary_with_standby
from tests.support.cli import StartRun, alive, ok, run_log

TIMEOUT = 90.0


@pytest.fixture
def target_pair(pg_binaries: PostgresBinaries) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A target primary with database ``app`` (table t) and its synchronous physical standby."""
    with primary_with_standby(
        pg_binaries, "target-", "target_standby", primary_settings={"synchronous_standby_names": "*"}
    ) as (primary, standby):
        # created once the standby is synchronous: it has the database when it is promoted
        primary.create_database("app").execute("CREATE TABLE t (id int PRIMARY KEY, v bigint NOT NULL)")
        yield primary, standby


def _lock_holder(db: Database) -> str | None:
    return db.scalar(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid AND l.objsubid = 2",
        (LOCK_NAMESPACE,),
    )


def _commit(pub: Database, ids: range) -> None:
    for i in ids:
        pub.execute("INSERT INTO t VALUES (%s, %s)", (i, i * 7))


def _acknowledged_only_once_on_the_standby(primary: PostgresCluster, pub: Database, old: Database) -> None:
    """With a synchronous standby, the apply session's commit waits for it (applier.apply.target): with no standby
    to answer (a name that matches none), a new remote transaction is neither visible on the target nor
    acknowledged to the publisher; it is once the standby answers again."""
    primary.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
    primary.reload()
    pub.execute("INSERT INTO t VALUES (2000, 14000)")
    lsn = pub.scalar("SELECT pg_current_wal_lsn()::text")
    wait_until(lambda: old.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"), timeout=30,
               what="the apply session's commit to wait for the standby")  # fmt: skip
    assert old.scalar("SELECT count(*) FROM t WHERE id = 2000") == 0
    assert pub.scalar(
        "SELECT confirmed_flush_lsn < %s::pg_lsn FROM pg_replication_slots WHERE slot_name = 's'", (lsn,)
    )
    primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
    primary.reload()
    wait_until(lambda: old.scalar("SELECT count(*) FROM t WHERE id = 2000") == 1, timeout=30,
               what="the row once the standby answers")  # fmt: skip


def test_run_follows_the_promoted_target_standby(
    target_pair, publisher_cluster: PostgresCluster, start_run: StartRun
) -> None:
    primary, standby = target_pair
    pub = publisher_cluster.create_database("target_failover_pub")
    try:
        pub.execute(
            "CREATE TABLE t (id int PRIMARY KEY, v bigint NOT NULL); CREATE PUBLICATION p FOR TABLE t"
        )
        target = multi_host_conninfo(primary, standby, "app")
        ok(target, "create", "s", "--publisher", pub.dsn, "--publication", "p", "--two-phase",
           "--no-copy-data")  # fmt: skip
        run = start_run(SimpleNamespace(dsn=target), "s", "--max-retry-interval", "1")
        old, new = Database(primary, "app"), Database(standby, "app")

        _commit(pub, range(1, 51))
        # prepared on the publisher, not decided before the failover
        with pub.connect(autocommit=False) as conn:
            conn.execute("INSERT INTO t VALUES (1000, 7000)")
            conn.execute("PREPARE TRANSACTION 'undecided'")
        _commit(pub, range(51, 101))
        wait_until(lambda: alive(run)() and old.scalar("SELECT count(*) FROM t") == 100, timeout=TIMEOUT,
                   what="100 rows on the target primary")  # fmt: skip
        assert old.scalar("SELECT count(*) FROM pg_prepared_xacts") == 1
        assert _lock_holder(old) is not None
        _acknowledged_only_once_on_the_standby(primary, pub, old)

        primary.crash()
        standby.promote()
        # flushed on the standby before the PREPARE returned (synchronous); a hot standby shows prepared
        # transactions only once promoted
        assert new.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'pg\\_gid\\_%'") == 1
        pub.execute("COMMIT PREPARED 'undecided'")
        _commit(pub, range(101, 151))
        expected = pub.scalar("SELECT (count(*), sum(v))::text FROM t")
        assert expected == f"(152,{7 * 150 * 151 // 2 + 7000 + 14000})"
        wait_until(lambda: alive(run)() and new.scalar("SELECT (count(*), sum(v))::text FROM t") == expected,
                   timeout=TIMEOUT, what=f"the new target equal to the publisher; log:\n{run_log(run)[-3000:]}")  # fmt: skip
        assert new.scalar("SELECT count(*) FROM pg_prepared_xacts") == 0
        # the lock's session reconnected to the new primary too, under the run's name
        holder = wait_until(lambda: _lock_holder(new), timeout=30, what="the lock taken on the new primary")
        assert holder.startswith(f"applier[{run.pid}@") and holder.endswith(" run s")
        # and the worker's catalog engine: it sees a disable made on the new primary, and stops
        ok(target, "alter", "s", "--disable")
        assert run.wait(timeout=60) == 0, run_log(run)
        assert 'worker for subscription "s" stopped: the subscription is disabled' in run_log(run)
        pub.execute("SELECT pg_drop_replication_slot('s')")
    finally:
        publisher_cluster.drop_database(pub.name)
