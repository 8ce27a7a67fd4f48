"""The harness itself: real clusters of the selected version, configured for logical replication and 2PC."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from applier.testing import PostgresCluster, assert_tables_equal, table_digest, tables_differ, wait_until
from applier.testing.cluster import OWNER_FILE, reap_orphans

pytestmark = pytest.mark.core


def test_clusters_are_configured_for_logical_replication_and_2pc(
    publisher_cluster: PostgresCluster, pg_binaries
):
    assert publisher_cluster.scalar("SHOW wal_level") == "logical"
    assert int(publisher_cluster.scalar("SHOW max_prepared_transactions")) >= 10
    version = int(publisher_cluster.scalar("SHOW server_version_num"))
    assert version // 10000 == pg_binaries.major
    assert publisher_cluster.scalar("SHOW listen_addresses") == "127.0.0.1"


def test_pair_databases_are_fresh_and_comparable(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        db.execute("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 100) g")
    assert_tables_equal(pair.publisher, pair.target, "public.t")
    assert table_digest(pair.publisher, "t") == table_digest(pair.target, "t")
    pair.target.execute("UPDATE t SET v = 'changed' WHERE id = 7")
    diff = tables_differ(pair.publisher, pair.target, "t")
    assert diff is not None and "changed" in diff


def test_crash_and_restart_keeps_committed_and_prepared_work(pg_binaries):
    with PostgresCluster(pg_binaries, name="crashme") as cluster:
        cluster.execute("CREATE TABLE t (id int)")
        with cluster.connect() as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (1)")
            conn.execute("PREPARE TRANSACTION 'gid1'")
        cluster.crash()
        cluster.start()
        assert cluster.scalar("SELECT gid FROM pg_prepared_xacts") == "gid1"
        cluster.execute("COMMIT PREPARED 'gid1'")
        assert wait_until(lambda: cluster.scalar("SELECT count(*) FROM t") == 1, timeout=5)


def test_comparison_of_a_table_with_a_column_named_like_an_alias(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE odd (t int, applier_row int, x text)")
        db.execute("INSERT INTO odd VALUES (1, 1, 'a')")
    pair.target.execute("UPDATE odd SET x = 'b'")
    assert tables_differ(pair.publisher, pair.target, "odd") is not None


@pytest.mark.core
@pytest.mark.anyversion  # the harness's own clean-up
def test_clusters_of_a_dead_test_process_are_reaped(pg_binaries):
    """A killed test run leaves its servers running; the next run's harness stops and removes them, and leaves the
    clusters of live processes alone."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    orphan, live = PostgresCluster(pg_binaries, name="orphan"), PostgresCluster(pg_binaries, name="live")
    with orphan, live:
        (orphan.datadir / OWNER_FILE).write_text(dead.stdout)
        postmaster = int((orphan.datadir / "postmaster.pid").read_text().split()[0])
        reaped = reap_orphans()
        assert orphan.datadir in reaped and not orphan.datadir.exists()
        wait_until(lambda: not os.path.exists(f"/proc/{postmaster}"), what="the orphan's postmaster to exit")
        assert live.datadir not in reaped and live.scalar("SELECT 1") == 1
