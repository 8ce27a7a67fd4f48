"""Port of PostgreSQL's ``src/test/subscription/t/022_twophase_cascade.pl`` ("cascading logical replication of
2PC"), with OUR applier on both hops: node A → node B → node C.

* node A is the test's publisher database; node B is the target database of subscription ``tap_sub_B`` *and* the
  publisher of ``tap_sub_C`` (what B applies carries our replication origin, and B's walsender decodes the local
  prepared transactions ``pg_gid_<subid>_<xid>`` our applier makes there); node C is a third database, created on
  the target cluster. Both hops use ``logical_decoding_work_mem = 64kB``, as the TAP file's nodes do.

Ported, with the TAP file's workloads, expected rows and ``pg_prepared_xacts`` counts on B and C:

* set-up: ``two_phase = on, streaming = off`` on both subscriptions, pending (``p``) until the workers enable it;
* 2PC (not streamed): PREPARE → COMMIT PREPARED, PREPARE → ROLLBACK PREPARED, nested ROLLBACK TO SAVEPOINT;
* ``ALTER SUBSCRIPTION ... SET (streaming = on)`` on both (the workers restart: new walsender pids);
* 2PC + streaming: a streamed 5000-row PREPARE → COMMIT PREPARED (extra local columns get their defaults on B and
  on C: ``3334|3334|3334``), and a streamed PREPARE whose streamed part is rolled back to a savepoint.

Not ported: the initial table synchronisation (tables start ready with the same rows on every node; the copy has
its own tests) and "check all the cleanup" (``DROP SUBSCRIPTION``: ``applier drop`` is checked at the end of
``test_tap_021_twophase.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from applier.apply.testing import ApplySetup, setup_subscription
from applier.apply.worker import WorkerThread
from applier.testing import Database, PostgresCluster, wait_until
from tests.support.tap import (
    TIMEOUT,
    catchup,
    extra_database,
    module_pair,
    prepared_count,
    psql,
    rollback_prepared,
    set_decoding_work_mem,
    stream_txns,
    wait_for_new_walsender,
    walsender_pid,
)

TABLES = ["public.tab_full", "public.test_tab"]


@dataclass
class Cascade:
    node_A: Database  # noqa: N815 - the TAP file's names
    node_B: Database  # noqa: N815
    node_C: Database  # noqa: N815
    sub_B: ApplySetup  # noqa: N815
    sub_C: ApplySetup  # noqa: N815
    workers: list[WorkerThread]

    @property
    def appname_B(self) -> str:  # noqa: N802
        return self.sub_B.name

    @property
    def appname_C(self) -> str:  # noqa: N802
        return self.sub_C.name

    def catchup(self) -> None:
        """``$node_A->wait_for_catchup($appname_B); $node_B->wait_for_catchup($appname_C);``"""
        catchup(self.node_A, self.appname_B)
        catchup(self.node_B, self.appname_C)

    def both(self, query: str) -> tuple[object, object]:
        """The result of ``query`` on B and on C."""
        return self.node_B.query(query)[0], self.node_C.query(query)[0]

    def prepared(self) -> tuple[int, int]:
        return prepared_count(self.node_B), prepared_count(self.node_C)


@pytest.fixture(scope="module")
def cascade(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Cascade]:
    with (
        module_pair(publisher_cluster, target_cluster, "tap022") as pair,
        extra_database(target_cluster, "tap022_c") as node_C,  # noqa: N806
    ):
        node_A, node_B = pair.publisher, pair.target  # noqa: N806
        for db in (node_A, node_B):
            set_decoding_work_mem(db)  # both publishers of the cascade
        # Create some pre-existing content on node_A, and the same on B and C (the initial copy, not ported)
        for db in (node_A, node_B, node_C):
            db.execute("CREATE TABLE tab_full (a int PRIMARY KEY)")
            db.execute("INSERT INTO tab_full SELECT generate_series(1,10)")
        node_A.execute("CREATE TABLE test_tab (a int primary key, b bytea)")
        for db in (node_B, node_C):
            # columns a and b are compatible with same table name on node_A
            db.execute(
                "CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999)"
            )
        for db in (node_A, node_B, node_C):
            db.execute("INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar')")

        # node_A (pub) -> node_B (sub) and node_B (pub) -> node_C (sub), two_phase = on, streaming = off
        sub_B = setup_subscription(node_A, node_B, f"{pair.name}_b", TABLES, two_phase_state="p")  # noqa: N806
        sub_C = setup_subscription(node_B, node_C, f"{pair.name}_c", TABLES, two_phase_state="p")  # noqa: N806
        workers = [sub_B.start(), sub_C.start()]
        try:
            c = Cascade(node_A, node_B, node_C, sub_B, sub_C, workers)
            c.catchup()
            for s in (sub_B, sub_C):  # Also wait for two-phase to be enabled
                wait_until(lambda s=s: s.refresh().subtwophasestate == "e", timeout=TIMEOUT,
                           what=f"{s.name} to enable two-phase")  # fmt: skip
            yield c
        finally:
            for w in workers:
                w.stop()


@pytest.fixture(autouse=True)
def no_prepared_left_behind(cascade: Cascade) -> Iterator[None]:
    """A failed section must not leave a prepared transaction on the publisher: its row locks would hang the next
    section's workload instead of letting it fail on its own."""
    yield
    rollback_prepared(cascade.node_A)


def test_prepare_then_commit_prepared(cascade: Cascade) -> None:
    """check that 2PC gets replicated to subscriber(s) then COMMIT PREPARED"""
    psql(cascade.node_A, """BEGIN;
        INSERT INTO tab_full VALUES (11);
        PREPARE TRANSACTION 'test_prepared_tab_full';""")  # fmt: skip
    cascade.catchup()
    assert cascade.prepared() == (1, 1), "transaction is prepared on subscriber B and C"

    cascade.node_A.execute("COMMIT PREPARED 'test_prepared_tab_full'")
    cascade.catchup()
    assert cascade.both("SELECT count(*) FROM tab_full where a = 11") == ((1,), (1,)), (
        "Row inserted via 2PC has committed on subscriber B and C"
    )
    assert cascade.prepared() == (0, 0), "transaction is committed on subscriber B and C"


def test_prepare_then_rollback_prepared(cascade: Cascade) -> None:
    """check that 2PC gets replicated to subscriber(s) then ROLLBACK PREPARED"""
    psql(cascade.node_A, """BEGIN;
        INSERT INTO tab_full VALUES (12);
        PREPARE TRANSACTION 'test_prepared_tab_full';""")  # fmt: skip
    cascade.catchup()
    assert cascade.prepared() == (1, 1), "transaction is prepared on subscriber B and C"

    cascade.node_A.execute("ROLLBACK PREPARED 'test_prepared_tab_full'")
    cascade.catchup()
    assert cascade.both("SELECT count(*) FROM tab_full where a = 12") == ((0,), (0,)), (
        "Row inserted via 2PC is not present on subscriber B and C"
    )
    assert cascade.prepared() == (0, 0), "transaction is ended on subscriber B and C"


@pytest.mark.core
def test_nested_transactions(cascade: Cascade) -> None:
    """Test nested transactions with 2PC (a nested ROLLBACK TO SAVEPOINT)"""
    psql(cascade.node_A, """BEGIN;
        INSERT INTO tab_full VALUES (21);
        SAVEPOINT sp_inner;
        INSERT INTO tab_full VALUES (22);
        ROLLBACK TO SAVEPOINT sp_inner;
        PREPARE TRANSACTION 'outer';""")  # fmt: skip
    cascade.catchup()
    assert cascade.prepared() == (1, 1), "transaction is prepared on subscriber B and C"

    cascade.node_A.execute("COMMIT PREPARED 'outer'")
    cascade.catchup()
    assert cascade.prepared() == (0, 0), "transaction is ended on subscriber B and C"
    # 22 should be rolled back. 21 should be committed.
    assert cascade.node_B.query("SELECT a FROM tab_full where a IN (21,22)") == [(21,)], (
        "Rows committed are present on subscriber B"
    )
    assert cascade.node_C.query("SELECT a FROM tab_full where a IN (21,22)") == [(21,)], (
        "Rows committed are present on subscriber C"
    )


@pytest.fixture(scope="module")
def streaming_cascade(cascade: Cascade) -> Cascade:
    """``ALTER SUBSCRIPTION tap_sub_B/C SET (streaming = on)`` and wait for both workers to restart."""
    old_B = walsender_pid(cascade.node_A, cascade.appname_B)  # noqa: N806
    old_C = walsender_pid(cascade.node_B, cascade.appname_C)  # noqa: N806
    for s in (cascade.sub_B, cascade.sub_C):
        s.catalog.update_subscription(s.sub.subid, substream="on")
    wait_for_new_walsender(cascade.node_A, cascade.appname_B, old_B)
    wait_for_new_walsender(cascade.node_B, cascade.appname_C, old_C)
    return cascade


@pytest.mark.core
def test_streamed_prepare_then_commit_prepared(streaming_cascade: Cascade) -> None:
    """Test 2PC PREPARE / COMMIT PREPARED: data is streamed as a 2PC transaction, then COMMIT PREPARED.
    Expect all data is replicated on subscriber(s) after the commit."""
    c = streaming_cascade
    streamed = stream_txns(c.node_A, c.appname_B), stream_txns(c.node_B, c.appname_C)
    # Insert, update and delete enough rows to exceed the 64kB limit.
    psql(c.node_A, """BEGIN;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i);
        UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0;
        DELETE FROM test_tab WHERE mod(a,3) = 0;
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    c.catchup()
    assert c.prepared() == (1, 1), "transaction is prepared on subscriber B and C"
    assert stream_txns(c.node_A, c.appname_B) > streamed[0], "A streamed the transaction to B"
    assert stream_txns(c.node_B, c.appname_C) > streamed[1], "B streamed the transaction to C"

    c.node_A.execute("COMMIT PREPARED 'test_prepared_tab'")
    c.catchup()
    assert c.both("SELECT count(*), count(c), count(d = 999) FROM test_tab") == ((3334, 3334, 3334),) * 2, (
        "Rows inserted by 2PC have committed on subscriber B and C, and extra columns have local defaults"
    )
    assert c.prepared() == (0, 0), "transaction is committed on subscriber B and C"


def test_streamed_prepare_with_rollback_to_savepoint(streaming_cascade: Cascade) -> None:
    """Test 2PC PREPARE with a nested ROLLBACK TO SAVEPOINT: the streamed part after the savepoint is rolled back,
    leaving only 3 rows (2 original + 1 from before the savepoint)."""
    c = streaming_cascade
    # First, delete the data except for 2 rows (delete will be replicated)
    c.node_A.execute("DELETE FROM test_tab WHERE a > 2")
    psql(c.node_A, """BEGIN;
        INSERT INTO test_tab VALUES (9999, 'foobar');
        SAVEPOINT sp_inner;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i);
        UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0;
        DELETE FROM test_tab WHERE mod(a,3) = 0;
        ROLLBACK TO SAVEPOINT sp_inner;
        PREPARE TRANSACTION 'outer';""")  # fmt: skip
    c.catchup()
    assert c.prepared() == (1, 1), "transaction is prepared on subscriber B and C"

    c.node_A.execute("COMMIT PREPARED 'outer'")
    c.catchup()
    assert c.prepared() == (0, 0), "transaction is ended on subscriber B and C"
    assert c.both("SELECT count(*) FROM test_tab where b = 'foobar'") == ((1,), (1,)), (
        "Rows committed are present on subscriber B and C"
    )
    assert c.both("SELECT count(*) FROM test_tab") == ((3,), (3,)), "Rows committed are present on B and C"
