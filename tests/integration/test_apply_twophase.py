"""Two-phase commit end to end (behaviours 55-67): prepared transactions become local prepared transactions named
``pg_gid_<subid>_<xid>``, finished by COMMIT/ROLLBACK PREPARED, exactly once across a target crash."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from applier.apply.testing import setup_subscription
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until

pytestmark = pytest.mark.core


def both(pair, *statements: str) -> None:
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def prepare(db, gid: str, *statements: str) -> None:
    with db.connect() as conn:
        conn.execute("BEGIN")
        for s in statements:
            conn.execute(s)
        conn.execute(f"PREPARE TRANSACTION '{gid}'")


def ours(s) -> list[str]:
    return [r[0] for r in s.target.query("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s ORDER BY 1",
                                         (f"pg\\_gid\\_{s.sub.subid}\\_%",))]  # fmt: skip


def test_prepare_commit_rollback_and_empty_prepare(pair):
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.publisher.execute("CREATE TABLE unpublished (id int)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    w = s.start()
    try:
        pub = pair.publisher
        prepare(pub, "a", "INSERT INTO t VALUES (1, 'a'), (2, 'a')", "UPDATE t SET v = 'a2' WHERE id = 2")
        xid_a = pub.scalar("SELECT transaction FROM pg_prepared_xacts WHERE gid = 'a'")
        wait_until(
            lambda: ours(s) == [f"pg_gid_{s.sub.subid}_{xid_a}"], timeout=30, what="local prepare of a"
        )
        assert pair.target.scalar("SELECT count(*) FROM t") == 0  # invisible until COMMIT PREPARED
        record = s.catalog.prepared_record(f"pg_gid_{s.sub.subid}_{xid_a}")
        assert record is not None and record.remote_xid == int(xid_a)

        prepare(pub, "b", "INSERT INTO t VALUES (3, 'b')")
        prepare(pub, "empty", "INSERT INTO unpublished VALUES (1)")  # nothing for us: still prepared
        wait_until(lambda: len(ours(s)) == 3, timeout=30, what="three local prepared transactions")

        pub.execute("COMMIT PREPARED 'a'")
        pub.execute("ROLLBACK PREPARED 'b'")
        pub.execute("COMMIT PREPARED 'empty'")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert ours(s) == []
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (2, "a2")]
        assert_tables_equal(pub, pair.target, "public.t")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM applier.prepared_xact") == 0, timeout=10,
                   what="records of finished prepared transactions to be removed")  # fmt: skip
    finally:
        w.stop()


def test_enabling_two_phase_and_prepares_from_before(pair):
    """Tri-state ``p`` with every table ready: the worker streams with two_phase and records ``e``. Transactions
    prepared before two-phase was enabled arrive whole at COMMIT PREPARED (Begin Prepare..Prepare + Commit
    Prepared), and their ROLLBACK PREPARED, whose prepare we never saw, is skipped silently."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="d")
    pub = pair.publisher
    w = s.start()
    try:
        prepare(pub, "early_commit", "INSERT INTO t VALUES (1, 'early')")
        prepare(pub, "early_rollback", "INSERT INTO t VALUES (2, 'never')")
        pub.execute("INSERT INTO t VALUES (3, 'plain')")
        lsn = wait_for_catchup(pub, pair.name, timeout=30)
        wait_until(lambda: pub.scalar("SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots"
                                      " WHERE slot_name = %s", (lsn, pair.name)), timeout=30)  # fmt: skip
    finally:
        w.stop()
    s.catalog.update_subscription(s.sub.subid, subtwophasestate="p")
    w = s.start()
    try:
        wait_until(lambda: s.refresh().subtwophasestate == "e", timeout=30, what="two-phase enabled")
        pub.execute("COMMIT PREPARED 'early_commit'")
        pub.execute("ROLLBACK PREPARED 'early_rollback'")
        prepare(pub, "late", "INSERT INTO t VALUES (4, 'late')")
        wait_until(lambda: len(ours(s)) == 1, timeout=30, what="local prepare of late")
        pub.execute("COMMIT PREPARED 'late'")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [
            (1, "early"),
            (3, "plain"),
            (4, "late"),
        ]
        assert ours(s) == []
        assert w.alive and w.worker.stats.errors == 0, w.worker.stats.last_error
    finally:
        w.stop()


def test_target_crash_between_prepare_and_commit_prepared_is_exactly_once(pair):
    """An immediate stop of the target after the local PREPARE: the prepared transaction and the origin's
    progress survive together, the worker reconnects, and COMMIT PREPARED applies the rows once. Committed
    transactions in flight at the crash are applied once too (the table has no key, so a duplicate would show)."""
    both(pair, "CREATE TABLE t (id int, v text)", "CREATE TABLE k (id int PRIMARY KEY)")
    pair.publisher.execute("ALTER TABLE t REPLICA IDENTITY FULL")
    s = setup_subscription(
        pair.publisher, pair.target, pair.name, ["public.t", "public.k"], two_phase_state="e"
    )
    pub = pair.publisher
    w = s.start()
    try:
        prepare(pub, "p1", "INSERT INTO t VALUES (1, 'prepared')", "INSERT INTO k VALUES (1)")
        wait_until(lambda: len(ours(s)) == 1, timeout=30, what="local prepare")
        with pub.connect() as conn:
            for i in range(100, 160):
                conn.execute("INSERT INTO t VALUES (%s, 'committed')", (i,))
        pair.target.cluster.crash()
        pair.target.cluster.start()
        assert len(ours(s)) == 1
        pub.execute("COMMIT PREPARED 'p1'")
        wait_for_catchup(pub, pair.name, timeout=60)
        assert ours(s) == []
        assert_tables_equal(pub, pair.target, "public.t", "public.k")
        assert pair.target.scalar("SELECT count(*) FROM t") == 61
    finally:
        w.stop()


def test_failed_prepare_is_retried_not_lost(pair):
    """A local PREPARE TRANSACTION that fails (here: the GID is taken) aborts after the origin's values were set;
    since PostgreSQL 16 that abort would advance the origin past the transaction. The worker moves the origin
    back, retries with backoff, and applies the transaction once the obstacle is gone."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    w = s.start()
    try:
        with pair.publisher.connect() as conn, pair.target.connect() as blocker:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (1, 'prepared')")
            xid = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
            gid = f"pg_gid_{s.sub.subid}_{xid}"
            blocker.execute("BEGIN")
            blocker.execute(f"PREPARE TRANSACTION '{gid}'")
            conn.execute("PREPARE TRANSACTION 'x'")
        wait_until(lambda: (e := s.catalog.last_error(s.sub.subid)) and "already in use" in e["message"],
                   timeout=30, what="the PREPARE to fail")  # fmt: skip
        pair.target.execute(f"ROLLBACK PREPARED '{gid}'")
        wait_until(lambda: ours(s) == [gid], timeout=30, what="the retried PREPARE")
        pair.publisher.execute("COMMIT PREPARED 'x'")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert pair.target.query("SELECT id, v FROM t") == [(1, "prepared")]
        assert ours(s) == []
    finally:
        w.stop()


def test_skip_lsn_of_a_prepared_transaction_prepares_it_empty(pair):
    """SKIP with a prepared transaction's prepare LSN (from the error): the local transaction is prepared empty
    (a later COMMIT PREPARED must find it), the skip-LSN is cleared, and later transactions apply (behaviour 99)."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute("INSERT INTO t VALUES (1, 'local')")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    w = s.start()
    try:
        prepare(pair.publisher, "conflict", "INSERT INTO t VALUES (1, 'remote'), (2, 'remote')")
        err = wait_until(
            lambda: (e := s.catalog.last_error(s.sub.subid)) and e, timeout=30, what="the conflict"
        )
        assert err["message_type"] == "INSERT" and "duplicate key" in err["message"]
        s.catalog.update_subscription(s.sub.subid, subskiplsn=err["finish_lsn"])
        wait_until(lambda: len(ours(s)) == 1, timeout=30, what="the empty local prepare")
        pair.publisher.execute("COMMIT PREPARED 'conflict'")
        pair.publisher.execute("INSERT INTO t VALUES (3, 'after')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "local"), (3, "after")]
        assert s.refresh().subskiplsn is None and ours(s) == []
    finally:
        w.stop()


def _apply_session(pair: Any) -> tuple[Any, str, int, Any]:
    """Table ``t`` on both sides, a subscription with two-phase enabled, and an apply session (``Target``) on its
    origin, for the tests that drive the 2PC statements directly: (subscription, origin, subid, target)."""
    from applier.apply.target import Target

    both(pair, "CREATE TABLE t (id int PRIMARY KEY)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], two_phase_state="e")
    origin, subid = s.sub.origin_name, s.sub.subid
    return s, origin, subid, Target.connect(pair.target.dsn, origin=origin)


def _record_and_prepare(target: Any, origin: str, subid: int, n: int, lsn: int,
                        on_prepared: Callable[[Any], None]) -> tuple[Any, str]:  # fmt: skip
    """Queue what the apply session sends for remote prepared transaction ``n`` (finish LSN ``lsn``): its record,
    BEGIN, one row into t, PREPARE TRANSACTION; return its error context and GID."""
    from applier.apply.context import ErrorContext

    ctx = ErrorContext(origin, "BEGIN PREPARE", None, n, lsn)
    gid = f"pg_gid_{subid}_{n}"
    target.record_prepared(gid, subid, n, lsn, lsn + 8, 1000 + n, ctx)
    target.begin(ctx)
    target.pipeline.send_query(b"INSERT INTO public.t VALUES ($1::int)", [str(n).encode()], ctx)
    target.prepare(gid, lsn + 8, 1000 + n, ctx, on_prepared)
    return ctx, gid


def test_target_two_phase_statements_share_pipeline_segments(pair):
    """What the 2PC path of the apply session relies on (applier/apply/target.py): COMMIT/ROLLBACK PREPARED start a
    pipeline segment but need no sync point after them, so the next transaction (the prepared_xact record, BEGIN,
    the changes, PREPARE TRANSACTION) rides in the same segment; the record is a statement prepared once per
    session; and a failing COMMIT PREPARED still reports its own context (remote xid, finish LSN) once the segment
    is read, with nothing after it applied."""
    from applier.apply.context import ApplyError, ErrorContext

    s, origin, subid, target = _apply_session(pair)
    done: list[int] = []
    try:
        for n, lsn in ((1, 0x1000), (2, 0x2000), (3, 0x3000)):
            ctx, gid = _record_and_prepare(target, origin, subid, n, lsn, lambda _r, n=n: done.append(n))
            target.finish_prepared(n != 2, gid, lsn + 16, 2000 + n, ctx, lambda _r, n=n: done.append(-n))
        target.pipeline.drain()
        assert done == [1, -1, 2, -2, 3, -3]
        assert pair.target.query("SELECT id FROM public.t ORDER BY 1") == [(1,), (3,)]
        assert ours(s) == []
        recorded = pair.target.query(
            "SELECT gid, remote_xid, prepare_end_lsn::text, prepare_time FROM applier.prepared_xact ORDER BY 1"
        )
        assert recorded == [(f"pg_gid_{subid}_{n}", n, f"0/{n}008", 1000 + n) for n in (1, 2, 3)]
        assert (
            pair.target.scalar("SELECT pg_replication_origin_progress(%s, false)::text", (origin,))
            == "0/3010"
        )

        # an unknown GID: the error surfaces with COMMIT PREPARED's context, and the transaction queued after it
        # in the same segment is not applied
        bad = ErrorContext(origin, "COMMIT PREPARED", None, 77, 0x7000)
        target.finish_prepared(True, f"pg_gid_{subid}_77", 0x7010, 1, bad, lambda _r: done.append(77))
        target.begin(bad)
        target.pipeline.send_query(b"INSERT INTO public.t VALUES (4)", None, bad)
        target.commit(0x8000, 1, bad, lambda _r: done.append(8))
        with pytest.raises(ApplyError) as err:
            target.pipeline.drain()
        assert err.value.context is bad
        assert "does not exist" in err.value.message
        target.abort()
        assert done[-1] == -3
        assert pair.target.query("SELECT id FROM public.t ORDER BY 1") == [(1,), (3,)]
    finally:
        target.close()


@pytest.mark.anyversion  # our pipeline's pushes; what the server's pipeline does with 2PC statements stays in test_target_two_phase_statements_share_pipeline_segments
def test_prepare_and_commit_prepared_reach_the_target_without_a_poll(pair):
    """``Target.prepare`` and ``Target.finish_prepared`` write their statements to the socket themselves
    (``Pipeline.push``): the target runs them while the apply loop goes on with what else it read, instead of when
    the loop's round ends and polls. Nothing here reads a result or polls until both have been seen on the target;
    the results then arrive in order. COMMIT and ROLLBACK PREPARED record their origin progress (set in an empty
    transaction just before them, in the same pipeline segment)."""
    from applier.apply.context import ApplyError

    s, origin, subid, target = _apply_session(pair)
    done: list[int] = []
    try:
        ctx, gid = _record_and_prepare(target, origin, subid, 1, 0x1000, lambda _r: done.append(1))
        wait_until(lambda: ours(s) == [gid], timeout=30, what="the PREPARE to run without a poll")
        target.finish_prepared(True, gid, 0x1010, 2001, ctx, lambda _r: done.append(-1))
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM public.t") == 1, timeout=30,
                   what="the COMMIT PREPARED to run without a poll")  # fmt: skip
        assert ours(s) == [] and done == [] and target.pipeline.pending > 0
        target.pipeline.drain()
        assert done == [1, -1]
        progress = "SELECT pg_replication_origin_progress(%s, false)::text"
        assert pair.target.scalar(progress, (origin,)) == "0/1010"
        # ROLLBACK PREPARED carries its origin values too (from the empty transaction before it)
        ctx, gid = _record_and_prepare(target, origin, subid, 2, 0x2000, lambda _r: done.append(2))
        target.finish_prepared(False, gid, 0x2010, 2002, ctx, lambda _r: done.append(-2))
        target.pipeline.drain()
        assert done == [1, -1, 2, -2] and ours(s) == []
        assert pair.target.scalar(progress, (origin,)) == "0/2010"
        # inside an open local transaction it is refused, as the server refused it, instead of committing that one
        target.begin(ctx)
        with pytest.raises(ApplyError, match="inside a transaction block"):
            target.finish_prepared(True, gid, 0x3010, 2003, ctx, lambda _r: done.append(-3))
        target.abort()
        assert pair.target.scalar(progress, (origin,)) == "0/2010" and done[-1] == -2
    finally:
        target.close()


@pytest.mark.anyversion  # our catalog's records, one statement
def test_records_of_several_prepared_transactions_are_written_in_one_statement(pair):
    """``Target.record_prepared_many`` (records written ahead for a batch of BEGIN PREPAREs): one transaction, every
    record as ``record_prepared`` writes it, and a record already there (a transaction prepared again after a
    crash) replaced."""
    from applier.apply.context import ErrorContext

    s, origin, subid, target = _apply_session(pair)
    try:
        ctx = ErrorContext(origin, "BEGIN PREPARE", None, 1, 0x1000)
        target.record_prepared(f"pg_gid_{subid}_2", subid, 2, 0x10, 0x18, 5, ctx)  # an old record of xid 2
        target.record_prepared_many(
            [(f"pg_gid_{subid}_{n}", n, n << 12, (n << 12) + 8, 1000 + n) for n in (1, 2, 3)], subid, ctx
        )
        target.pipeline.drain()
        assert not target.in_transaction
        recorded = pair.target.query(
            "SELECT gid, subid, remote_xid, prepare_lsn::text, prepare_end_lsn::text, prepare_time"
            " FROM applier.prepared_xact ORDER BY 1"
        )
        assert recorded == [
            (f"pg_gid_{subid}_{n}", subid, n, f"0/{n}000", f"0/{n}008", 1000 + n) for n in (1, 2, 3)
        ]
    finally:
        target.close()


@pytest.mark.anyversion  # our queueing of the records' removal
def test_records_of_finished_prepared_transactions_are_removed_in_pipeline_order(pair):
    """``Target.catalog.reconcile_prepared`` is queued behind what the apply session already sent, without a drain:
    a record whose PREPARE TRANSACTION was sent before it is kept even if that PREPARE has not run when the
    removal is queued, a record of a transaction still prepared is kept (behaviour 65: ROLLBACK PREPARED after a
    restart needs it), and only the records of finished ones go. Another session's work is left alone."""
    from applier.apply.context import ErrorContext

    s, origin, subid, target = _apply_session(pair)
    try:
        for n, lsn in ((1, 0x1000), (2, 0x2000), (3, 0x3000)):
            ctx, gid = _record_and_prepare(target, origin, subid, n, lsn, lambda _r: None)
            if n == 1:  # 1 finishes; 2 stays prepared; 3's PREPARE is queued just before the removal
                target.finish_prepared(True, gid, lsn + 16, 2000 + n, ctx, lambda _r: None)
        target.catalog.reconcile_prepared(subid)
        assert target.pipeline.pending > 0  # queued, not waited for
        assert not target.in_transaction
        target.pipeline.drain()
        assert pair.target.query("SELECT gid FROM applier.prepared_xact ORDER BY 1") == [
            (f"pg_gid_{subid}_2",),
            (f"pg_gid_{subid}_3",),
        ]
        assert ours(s) == [f"pg_gid_{subid}_2", f"pg_gid_{subid}_3"]
        # the next transaction on the session is unaffected by the removal's own transaction
        ctx = ErrorContext(origin, "ROLLBACK PREPARED", None, 2, 0x2000)
        target.finish_prepared(False, f"pg_gid_{subid}_2", 0x2010, 3002, ctx, lambda _r: None)
        target.finish_prepared(True, f"pg_gid_{subid}_3", 0x3010, 3003, ctx, lambda _r: None)
        target.catalog.reconcile_prepared(subid)
        target.pipeline.drain()
        assert pair.target.scalar("SELECT count(*) FROM applier.prepared_xact") == 0
        assert ours(s) == []
        assert pair.target.query("SELECT id FROM public.t ORDER BY 1") == [(1,), (3,)]
    finally:
        target.close()
