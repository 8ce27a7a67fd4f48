"""``status --json``'s ``stats``: pg_stat_subscription_stats' counters under PostgreSQL 18's column names (issue 40),
kept in the catalog (``applier.subscription_stats``) across restarts of ``run`` and zeroed by
``alter --reset-stats``. The conflicts we detect are counted once per detection per attempt, also in attempts that
are rolled back (as PostgreSQL counts them); where the server is 18, PostgreSQL's own subscriber, fed the same rows
from the same publication, is asked for its counts beside ours."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from psycopg import sql

from applier.testing import Database, PostgresCluster, wait_for_catchup, wait_until
from tests.support.cli import create, make_tables, ok, run_log, status
from tests.support.native import drop_native_subscription, native_cluster

__all__ = ["native_cluster"]  # the fixture, for this module

COUNTERS = ("apply_error_count", "sync_error_count", "confl_insert_exists", "confl_update_origin_differs",
            "confl_update_exists", "confl_update_missing", "confl_delete_origin_differs", "confl_delete_missing",
            "confl_multiple_unique_conflicts")  # fmt: skip


def _stats(target: Database, name: str) -> dict[str, Any]:
    return status(target, name)["stats"]


def _native_stats(native: Database, subname: str) -> dict[str, int]:
    """PostgreSQL 18's counters for the same rows (refreshed from the shared statistics at each call)."""
    with native.connect() as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        cur = conn.execute(
            "SELECT apply_error_count, confl_insert_exists, confl_update_missing, confl_delete_missing"
            " FROM pg_stat_subscription_stats WHERE subname = %s",
            (subname,),
        )
        names = [d.name for d in cur.description or []]
        return dict(zip(names, cur.fetchone() or (0, 0, 0, 0), strict=True))


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    assert proc.wait(timeout=60) == 0, run_log(proc)
    return run_log(proc)


@pytest.mark.core
@pytest.mark.anyversion  # our counters; PostgreSQL 18's own are compared where the server is 18
def test_conflicts_and_errors_are_counted_kept_across_restarts_and_reset(
    pair, start_run: Callable[..., subprocess.Popen[str]], native_cluster: PostgresCluster
) -> None:
    make_tables(pair, "t")
    create(pair, "s", "--no-copy-data")
    assert _stats(pair.target, "s") == {**dict.fromkeys(COUNTERS, 0), "stats_reset": None}
    native: Database | None = None
    if native_cluster.scalar("SELECT current_setting('server_version_num')::int") >= 180000:
        native = native_cluster.create_database(pair.name)
        native.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        native.execute(
            sql.SQL("CREATE SUBSCRIPTION n_s CONNECTION {} PUBLICATION {} WITH (copy_data = false)").format(
                sql.Literal(pair.publisher.dsn), sql.Identifier(pair.name)
            )
        )
    subscribers = [pair.target, *([native] if native else [])]
    proc = start_run(pair.target, "--max-retry-interval", "0.5")
    try:
        pair.publisher.execute("INSERT INTO t SELECT g, 'row' FROM generate_series(1, 3) g")
        for db in subscribers:
            wait_until(lambda db=db: db.scalar("SELECT count(*) FROM t") == 3, timeout=60, what="3 rows")
            db.execute("DELETE FROM t WHERE id IN (1, 2)")
        # a row missing for an UPDATE and one for a DELETE: skipped, one conflict each
        pair.publisher.execute("UPDATE t SET v = 'updated' WHERE id = 1")
        pair.publisher.execute("DELETE FROM t WHERE id = 2")
        wait_for_catchup(pair.publisher, "s", timeout=60)
        # the catalog takes the conflicts counted about once a second (WorkerMetrics.conflict)
        wait_until(lambda: _stats(pair.target, "s")["confl_delete_missing"] == 1, timeout=10, what="stored")
        st = _stats(pair.target, "s")
        assert (st["confl_update_missing"], st["confl_delete_missing"]) == (1, 1), st
        assert st["apply_error_count"] == st["confl_insert_exists"] == 0, st
        if native is not None:
            wait_until(lambda: _native_stats(native, "n_s")["confl_delete_missing"] == 1, timeout=30,
                       what="PostgreSQL 18 counting delete_missing")  # fmt: skip
            assert _native_stats(native, "n_s") == {
                "apply_error_count": 0, "confl_insert_exists": 0, "confl_update_missing": 1,
                "confl_delete_missing": 1,
            }  # fmt: skip
        # a duplicate key stops the transaction, retried: each attempt counts an error and an insert_exists, and the
        # update_missing met before it in the same (rolled back) transaction
        for db in subscribers:
            db.execute("INSERT INTO t VALUES (10, 'in the way')")
        with pair.publisher.connect() as conn, conn.transaction():
            conn.execute("UPDATE t SET v = 'again' WHERE id = 1")
            conn.execute("INSERT INTO t VALUES (10, 'remote')")
        wait_until(
            lambda: _stats(pair.target, "s")["confl_insert_exists"] >= 2, timeout=60, what="2 attempts"
        )
        first = _stats(pair.target, "s")
        wait_until(lambda: _stats(pair.target, "s")["confl_insert_exists"] > first["confl_insert_exists"],
                   timeout=60, what="one more attempt counted")  # fmt: skip
        if native is not None:
            wait_until(lambda: _native_stats(native, "n_s")["confl_insert_exists"] >= 2, timeout=60,
                       what="PostgreSQL 18 counting insert_exists in its attempts")  # fmt: skip
            n = _native_stats(native, "n_s")
            assert n["apply_error_count"] >= n["confl_insert_exists"] >= 2, n
            assert n["confl_update_missing"] >= 2, n  # counted in the attempts that were rolled back too
            native.execute("DELETE FROM t WHERE id = 10")
        pair.target.execute("DELETE FROM t WHERE id = 10")
        wait_for_catchup(pair.publisher, "s", timeout=60)
        # the attempt that committed met the missing row too: stored with the next write (about a second)
        wait_until(lambda: (s := _stats(pair.target, "s"))["confl_update_missing"] >= 2 + s["confl_insert_exists"],
                   timeout=10, what="the last attempt's update_missing stored")  # fmt: skip
        st = _stats(pair.target, "s")
        assert st["confl_insert_exists"] >= 3 and st["apply_error_count"] >= st["confl_insert_exists"], st
        assert st["confl_update_missing"] >= 1 + st["confl_insert_exists"], st  # rolled-back attempts count
        assert st["confl_delete_missing"] == 1 and st["sync_error_count"] == 0, st
        assert all(
            st[k] == 0 for k in COUNTERS if "origin" in k or k.endswith(("_update_exists", "conflicts"))
        )
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(3, "row"), (10, "remote")]
        text = ok(pair.target, "status", "s")
        assert (
            f"stats: apply errors {st['apply_error_count']}, sync errors 0, conflicts: insert_exists "
            f"{st['confl_insert_exists']}, update_missing {st['confl_update_missing']}, delete_missing 1"
        ) in text, text
    finally:
        _stop(proc)
        if native is not None:
            drop_native_subscription(native, "n_s")
            native_cluster.drop_database(native.name)
    # kept across a restart of run (what the stopped run counted last is written as it stops), and counted on
    st = _stats(pair.target, "s")
    assert st["confl_delete_missing"] == 1 and st["confl_update_missing"] >= 1 + st["confl_insert_exists"], st
    proc = start_run(pair.target)
    try:
        pair.target.execute("DELETE FROM t WHERE id = 3")
        pair.publisher.execute("DELETE FROM t WHERE id = 3")
        wait_for_catchup(pair.publisher, "s", timeout=60)
        wait_until(lambda: _stats(pair.target, "s") == {**st, "confl_delete_missing": 2}, timeout=10,
                   what="the DELETE's delete_missing stored, nothing else")  # fmt: skip
        out = ok(pair.target, "alter", "s", "--reset-stats")
        assert "statistics reset" in out
        after = _stats(pair.target, "s")
        assert {k: after[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0) and after["stats_reset"], after
        pair.target.execute("DELETE FROM t WHERE id = 10")
        pair.publisher.execute("UPDATE t SET v = 'x' WHERE id = 10")
        wait_for_catchup(pair.publisher, "s", timeout=60)
        wait_until(lambda: _stats(pair.target, "s")["confl_update_missing"] == 1, timeout=10, what="stored")
        again = _stats(pair.target, "s")
        assert again["confl_update_missing"] == 1 and again["stats_reset"] == after["stats_reset"], again
        assert "(since reset at" in ok(pair.target, "status", "s")
    finally:
        _stop(proc)


@pytest.mark.spark
def test_failing_initial_copy_counts_sync_errors(
    pair, start_run: Callable[..., subprocess.Popen[str]]
) -> None:
    """Each failed attempt of the initial copy is one ``sync_error_count``, not an apply error."""
    make_tables(pair, "t1", rows=5)
    pair.target.execute("INSERT INTO t1 VALUES (3, 'in the way')")
    create(pair, "s")
    proc = start_run(pair.target, "--max-retry-interval", "1")
    try:
        wait_until(
            lambda: _stats(pair.target, "s")["sync_error_count"] >= 2, timeout=240, what="2 failed copies"
        )
        retries = status(pair.target, "s")["last_error"]["retry_count"]
        st = _stats(pair.target, "s")
        assert st["sync_error_count"] >= 2 and st["sync_error_count"] in (retries, retries + 1), (st, retries)
        assert st["apply_error_count"] == 0, st
    finally:
        _stop(proc)
    assert _stats(pair.target, "s")["sync_error_count"] >= 2
