"""Progress, restarts and stops (behaviours 5-9, 53, 76, 89, 94-96, 115-116): whatever happens to the worker or
either server, every remote transaction is applied exactly once and the slot's confirmed position follows."""

from __future__ import annotations

import pytest

from applier.apply.testing import setup_subscription
from applier.lsn import parse_lsn
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until

pytestmark = pytest.mark.core


def both(pair, *statements: str) -> None:
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def slot_confirmed(pair) -> int:
    value = pair.publisher.scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (pair.name,)
    )
    return parse_lsn(value) if value else 0


def test_confirmed_flush_follows_and_restarts_resume_exactly_once(pair):
    """The slot's confirmed_flush_lsn reaches the publisher's position once the applied commits are flushed on the
    target, also across WAL with nothing for us. A publisher restart and a stop of the worker in the middle of
    applying both resume exactly once (no key on the table, so a duplicate would show)."""
    both(pair, "CREATE TABLE t (id int, v text)", "CREATE TABLE other (id int)")
    pair.publisher.execute("ALTER TABLE t REPLICA IDENTITY FULL")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    pub = pair.publisher
    w = s.start()
    try:
        with pub.connect() as conn:
            for i in range(50):
                conn.execute("INSERT INTO t VALUES (%s, 'a')", (i,))
        conn_lsn = parse_lsn(wait_for_catchup(pub, pair.name, timeout=30))
        wait_until(
            lambda: slot_confirmed(pair) >= conn_lsn, timeout=30, what="confirmed_flush_lsn to catch up"
        )
        pub.execute(
            "INSERT INTO other SELECT generate_series(1, 1000)"
        )  # not published: WAL with nothing for us
        idle_lsn = parse_lsn(wait_for_catchup(pub, pair.name, timeout=30))
        wait_until(
            lambda: slot_confirmed(pair) >= idle_lsn, timeout=30, what="confirmed_flush_lsn past idle WAL"
        )

        pub.cluster.restart()  # the walsender goes away: reconnect with backoff
        with pub.connect() as conn:
            for i in range(50, 100):
                conn.execute("INSERT INTO t VALUES (%s, 'b')", (i,))
        wait_for_catchup(pub, pair.name, timeout=60)
        assert_tables_equal(pub, pair.target, "public.t")
    finally:
        w.stop()

    # stop while a big backlog is being applied, then start again
    with pub.connect() as conn:
        for i in range(20):
            conn.execute("INSERT INTO t SELECT g, 'c' FROM generate_series(%s::int, %s::int) g",
                         (1000 + i * 2000, 1000 + i * 2000 + 1999))  # fmt: skip
    w = s.start()
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") > 100, timeout=30, what="apply to begin")
    w.stop()
    w = s.start()
    try:
        wait_for_catchup(pub, pair.name, timeout=60)
        assert_tables_equal(pub, pair.target, "public.t")
        assert pair.target.scalar("SELECT count(*) FROM t") == 100 + 40000
    finally:
        w.stop()


def test_syncdone_table_skips_what_its_copy_holds_then_enables_two_phase(pair):
    """A table in ``s`` at LSN Y (its copy holds everything before Y): changes of transactions finishing before Y
    are skipped, later ones applied, and the table becomes ``r`` once the stream passes Y. With two-phase pending
    (``p``) the worker then restarts its stream with two_phase and records ``e`` (behaviours 55-57, 75-76)."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="p",
                           table_state="s")  # fmt: skip
    pub = pair.publisher
    pub.execute("INSERT INTO t SELECT g, 'in the copy' FROM generate_series(1, 10) g")
    y = pub.scalar("SELECT pg_current_wal_insert_lsn()::text")
    pair.target.execute("INSERT INTO t SELECT g, 'in the copy' FROM generate_series(1, 10) g")
    relid = pair.target.scalar("SELECT 'public.t'::regclass::oid")
    s.catalog.set_table_state(s.sub.subid, int(relid), "s", parse_lsn(y))
    pub.execute("INSERT INTO t SELECT g, 'streamed' FROM generate_series(11, 20) g")
    w = s.start()
    try:
        wait_for_catchup(pub, pair.name, timeout=30)
        assert_tables_equal(pub, pair.target, "public.t")
        wait_until(lambda: s.refresh().subtwophasestate == "e", timeout=30, what="two-phase enabled")
        states = s.catalog.table_states(s.sub.subid)
        assert [(r.state, r.lsn is not None and r.lsn >= parse_lsn(y)) for r in states] == [("r", True)]
        with pub.connect() as conn:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (21, 'prepared')")
            conn.execute("PREPARE TRANSACTION 'x'")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s",
                                              (f"pg\\_gid\\_{s.sub.subid}\\_%",)) == 1, timeout=30)  # fmt: skip
        pub.execute("COMMIT PREPARED 'x'")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert_tables_equal(pub, pair.target, "public.t")
    finally:
        w.stop()


@pytest.mark.anyversion  # our re-read of the catalog
def test_worker_returns_when_the_subscription_is_disabled_or_dropped(pair):
    """``maybe_reread_subscription`` (behaviour 52): a disabled or removed subscription ends ``run()`` cleanly."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    pair.publisher.execute("INSERT INTO t VALUES (1)")
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    s.catalog.update_subscription(s.sub.subid, subenabled=False)
    w.thread.join(15)
    assert not w.alive and w.error is None
    s.catalog.update_subscription(s.sub.subid, subenabled=True)
    w = s.start()
    pair.publisher.execute("INSERT INTO t VALUES (2)")
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    pair.target.execute("DELETE FROM applier.subscription WHERE subid = %s", (s.sub.subid,))
    w.thread.join(15)
    assert not w.alive and w.error is None
    assert pair.target.query("SELECT id FROM t ORDER BY id") == [(1,), (2,)]
    # origins are cluster-wide: the fixture cannot find this one any more
    pair.target.drop_origin(s.sub.origin_name)
