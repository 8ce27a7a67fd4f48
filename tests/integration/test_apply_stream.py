"""Streamed (in-progress) transactions end to end (behaviours 84-90): spooled to disk per remote xid, replayed at
Stream Commit / Stream Prepare, discarded at Stream Abort, truncated back at a subtransaction's abort."""

from __future__ import annotations

import pytest
from psycopg import sql

from applier.apply.testing import setup_subscription
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until

pytestmark = pytest.mark.core


@pytest.fixture
def streaming_pair(pair):
    """The publisher database decodes with a 64kB memory limit, so a few thousand rows stream."""
    pair.publisher.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'").format(sql.Identifier(pair.name))
    )
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        db.execute("CREATE TABLE small (id int PRIMARY KEY)")
    return pair


def stream_txns(pair) -> int:
    return int(pair.publisher.scalar(
        "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE slot_name = %s", (pair.name,)))  # fmt: skip


def test_streamed_commit_with_rolled_back_subtransaction_and_abort(streaming_pair, tmp_path):
    pair = streaming_pair
    s = setup_subscription(
        pair.publisher, pair.target, pair.name, ["public.t", "public.small"], streaming="on"
    )
    w = s.start(spool_dir=tmp_path)
    try:
        with pair.publisher.connect() as big, pair.publisher.connect() as other:
            big.execute("BEGIN")
            big.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
            big.execute("SAVEPOINT s1")
            big.execute("INSERT INTO t SELECT g, 'gone' FROM generate_series(3001, 6000) g")
            big.execute("SAVEPOINT s1b")
            big.execute("UPDATE t SET v = 'gone too' WHERE id <= 10")
            big.execute("ROLLBACK TO s1")
            big.execute("SAVEPOINT s2")
            big.execute("UPDATE t SET v = 'kept' WHERE id <= 100")
            big.execute("RELEASE s2")
            other.execute("INSERT INTO small SELECT generate_series(1, 10)")  # commits while t's xact streams
            big.execute("DELETE FROM t WHERE id > 2900")
            big.execute("INSERT INTO t SELECT g, repeat('y', 100) FROM generate_series(7001, 9000) g")
            wait_until(lambda: stream_txns(pair) >= 1, timeout=30, what="the transaction to stream")
            big.execute("COMMIT")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert_tables_equal(pair.publisher, pair.target, "public.t", "public.small")
        assert pair.target.scalar("SELECT count(*) FROM t WHERE v = 'kept'") == 100

        before = pair.target.scalar("SELECT count(*) FROM t")
        with pair.publisher.connect() as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t SELECT g, repeat('z', 100) FROM generate_series(10001, 14000) g")
            # PostgreSQL 18 does not stream a transaction it already knows aborted: abort only once it streamed
            wait_until(lambda: stream_txns(pair) >= 2, timeout=30, what="the transaction to stream")
            conn.execute("ROLLBACK")
        pair.publisher.execute("INSERT INTO small VALUES (11)")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert pair.target.scalar("SELECT count(*) FROM t") == before
        assert_tables_equal(pair.publisher, pair.target, "public.t", "public.small")
        assert list(tmp_path.rglob("*.changes")) == []  # spool files removed when their transaction ended
    finally:
        w.stop()


def test_a_streamed_transaction_updates_and_deletes_rows_it_inserted(streaming_pair, tmp_path):
    """Rows inserted, then updated or deleted, in one streamed transaction: the replay sends each Update/Delete
    after the Inserts before it (the few inserted rows of ``small`` wait in the insert run until something ends it;
    the Delete once went out first and missed its row)."""
    pair = streaming_pair
    s = setup_subscription(
        pair.publisher, pair.target, pair.name, ["public.t", "public.small"], streaming="on"
    )
    w = s.start(spool_dir=tmp_path)
    try:
        with pair.publisher.connect() as big:
            big.execute("BEGIN")
            big.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
            big.execute("INSERT INTO small VALUES (1), (2), (3)")
            big.execute("DELETE FROM small WHERE id = 2")
            big.execute("UPDATE small SET id = 10 WHERE id = 3")
            big.execute("INSERT INTO t VALUES (5000, 'last')")
            big.execute("DELETE FROM t WHERE id = 5000")
            wait_until(lambda: stream_txns(pair) >= 1, timeout=30, what="the transaction to stream")
            big.execute("COMMIT")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert [r[0] for r in pair.target.query("SELECT id FROM small ORDER BY id")] == [1, 10]
        assert_tables_equal(pair.publisher, pair.target, "public.t", "public.small")
    finally:
        w.stop()


def test_streamed_prepare_then_commit_and_rollback_prepared(streaming_pair, tmp_path):
    pair = streaming_pair
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], streaming="on",
                           two_phase_state="e")  # fmt: skip
    w = s.start(spool_dir=tmp_path)
    ours = f"pg\\_gid\\_{s.sub.subid}\\_%"
    try:
        for gid, first in (("sp1", 1), ("sp2", 5001)):
            with pair.publisher.connect() as conn:
                conn.execute("BEGIN")
                conn.execute(
                    "INSERT INTO t SELECT g, repeat('p', 100) FROM generate_series(%s::int, %s::int) g",
                    (first, first + 2999),
                )
                wait_until(
                    lambda n=first: stream_txns(pair) >= (1 if n == 1 else 2), timeout=30, what="streaming"
                )
                conn.execute(f"PREPARE TRANSACTION '{gid}'")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (ours,))
                   == 2, timeout=60, what="two streamed prepares")  # fmt: skip
        assert pair.target.scalar("SELECT count(*) FROM t") == 0
        pair.publisher.execute("COMMIT PREPARED 'sp1'")
        pair.publisher.execute("ROLLBACK PREPARED 'sp2'")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (ours,)) == 0
        assert pair.target.scalar("SELECT count(*) FROM t") == 3000
        assert_tables_equal(pair.publisher, pair.target, "public.t")
    finally:
        w.stop()
