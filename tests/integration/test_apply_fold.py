"""Folding decided prepared transactions (applier.apply.fold) against real servers: a prepared transaction whose
COMMIT/ROLLBACK PREPARED arrives with it is applied as a plain transaction, or not at all, and the target ends as
PREPARE + COMMIT/ROLLBACK PREPARED would have left it."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from psycopg import sql

from applier.apply.testing import setup_subscription
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until
from tests.support.tap import CliApplier, catchup, walsender_pid

pytestmark = pytest.mark.core


def _backlog(pair, decided: int) -> None:
    """``decided`` prepared transactions committed or rolled back at once (every fourth rolled back), plain ones
    between them, and one left prepared."""
    with pair.publisher.connect() as conn:
        conn.autocommit = True
        for n in range(decided):
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (%s, 'p')", (n,))
            conn.execute("UPDATE t SET v = 'u' WHERE id = %s", (n - 1,))
            conn.execute(f"PREPARE TRANSACTION 'g{n}'")
            conn.execute(f"{'ROLLBACK' if n % 4 == 3 else 'COMMIT'} PREPARED 'g{n}'")
            if n % 5 == 0:
                conn.execute("INSERT INTO t VALUES (%s, 'plain')", (1000 + n,))
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (-1, 'open')")
        conn.execute("PREPARE TRANSACTION 'open'")


def _ours(s) -> list[str]:
    return [r[0] for r in s.target.query("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                                         (f"pg\\_gid\\_{s.sub.subid}\\_%",))]  # fmt: skip


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "prepared"])
def test_a_backlog_of_decided_prepared_transactions(pair, fold):
    """The same backlog folded and not: the same rows, only the undecided transaction prepared on the target, no
    records of folded ones left behind; folding applied nearly all of them, and the metrics say so."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    _backlog(pair, 40)
    w = s.start(fold_prepares=fold)
    try:
        pub = pair.publisher
        open_xid = pub.scalar("SELECT transaction FROM pg_prepared_xacts WHERE gid = 'open'")
        # the undecided one, by name: unfolded, each decided transaction is prepared on the target for a moment too
        gid = f"pg_gid_{s.sub.subid}_{open_xid}"
        wait_until(lambda: gid in _ours(s), timeout=60, what="the undecided transaction prepared")
        wait_for_catchup(pub, pair.name, timeout=60)
        assert _ours(s) == [gid]
        pub.execute("COMMIT PREPARED 'open'")
        wait_for_catchup(pub, pair.name, timeout=60)
        assert_tables_equal(pub, pair.target, "public.t")
        assert _ours(s) == []
        assert pair.target.scalar("SELECT count(*) FROM t WHERE v = 'plain'") == 8
        stats = w.worker.stats
        assert stats.errors == 0, stats.last_error
    finally:
        w.stop()
    if fold:
        # a read can end between a PREPARE and its decision (then it is prepared as usual): most, not all
        assert stats.folded_prepares >= 20
        exported = REGISTRY.get_sample_value("applier_folded_prepares_total", {"subscription": pair.name})
        assert exported == stats.folded_prepares
    else:
        assert stats.folded_prepares == 0
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM applier.prepared_xact") == 0, timeout=10,
               what="no prepared_xact record left")  # fmt: skip


def test_a_folded_rollback_applies_nothing_so_its_conflict_does_not_stop_the_worker(pair):
    """A prepared transaction that would fail on the target (a duplicate key), rolled back on the publisher before
    the worker saw it: folded, nothing of it runs, and what follows applies. (Prepared as PostgreSQL does it, its
    PREPARE fails and is retried until someone steps in; the decision behind it is never reached.)"""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute("INSERT INTO t VALUES (1, 'local')")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    with pair.publisher.connect() as conn:
        conn.autocommit = True
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (1, 'remote'), (2, 'remote')")
        conn.execute("PREPARE TRANSACTION 'doomed'")
        conn.execute("ROLLBACK PREPARED 'doomed'")
        conn.execute("INSERT INTO t VALUES (3, 'after')")
    w = s.start()
    try:
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "local"), (3, "after")]
        assert w.worker.stats.errors == 0, w.worker.stats.last_error
        assert _ours(s) == []
    finally:
        w.stop()
    assert w.worker.stats.folded_prepares == 1  # (counted when the session ends)


@pytest.mark.anyversion  # exactly-once after kill -9: the origin and our commit order
def test_kill9_while_folding_a_backlog_applies_each_transaction_once(pair):
    """``kill -9`` of ``applier run`` at three points of a backlog of decided prepared transactions, then a restart:
    every committed one's row is there exactly once (the table has no key to refuse a duplicate), no rolled back
    one's, and nothing is left prepared."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE f (n int, v text)")
    pair.publisher.execute("ALTER TABLE f REPLICA IDENTITY FULL")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.f"], two_phase_state="e")
    with pair.publisher.connect() as conn, conn.pipeline() as p:
        conn.autocommit = True
        for n in range(3000):
            gid = sql.Literal(f"k{n}")
            conn.execute("BEGIN")
            conn.execute("INSERT INTO f VALUES (%s, 'p'), (%s, 'q')", (n, -n))
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(gid))
            p.sync()
            conn.execute(sql.SQL("ROLLBACK PREPARED {}" if n % 10 == 7 else "COMMIT PREPARED {}").format(gid))
            p.sync()
            if n % 50 == 0:
                conn.execute("INSERT INTO f VALUES (%s, 'plain')", (n,))
    end = int(pair.publisher.scalar("SELECT pg_current_wal_lsn() - '0/0'"))
    origin = s.sub.origin_name
    progress: list[int] = []

    def applied() -> int:
        return int(
            pair.target.scalar("SELECT pg_replication_origin_progress(%s, true) - '0/0'", (origin,)) or 0
        )

    def moved_on(last: int) -> bool:
        """This start committed something past ``last``, or has nothing left to apply (a fast machine)."""
        replayed = pair.publisher.cluster.scalar(
            "SELECT replay_lsn - '0/0' FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'",
            (pair.name,),
        )
        return applied() > last or (replayed is not None and int(replayed) >= end)

    with CliApplier(pair.target, pair.name) as applier:
        for _ in range(3):
            last = progress[-1] if progress else 0
            applier.start()
            wait_until(
                lambda last=last: moved_on(last), timeout=60, what="the restarted applier to commit progress"
            )
            applier.kill9()
            progress.append(applied())
            wait_until(lambda: walsender_pid(pair.publisher, pair.name) is None, timeout=60,
                       what="the killed applier's walsender to go")  # fmt: skip
        applier.start()
        catchup(pair.publisher, pair.name)
        assert applier.alive, applier.log_tail()
    assert any(0 < at < end for at in progress), (
        f"no kill landed in the middle of the backlog: {progress}, {end}"
    )
    assert_tables_equal(pair.publisher, pair.target, "public.f")
    assert pair.target.query("SELECT n, v FROM f GROUP BY n, v HAVING count(*) > 1") == []
    assert pair.target.scalar("SELECT count(*) FROM f WHERE v = 'p'") == 2700
    assert (
        pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()") == 0
    )
