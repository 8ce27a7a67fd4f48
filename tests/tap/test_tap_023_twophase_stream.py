"""Port of PostgreSQL's ``src/test/subscription/t/023_twophase_stream.pl`` ("logical replication of 2PC with
streaming") to our applier.

The publisher database decodes with ``logical_decoding_work_mem = 64kB`` and the workloads are the 64kB
version's (PostgreSQL 15: 4998 rows inserted, then updated and deleted in part), so every prepared transaction
below really streams (checked with ``pg_stat_replication_slots.stream_txns``) on every supported version.

Ported: the TAP file's ``test_streaming`` sequence, run once with ``streaming = on`` and once with ``streaming =
parallel`` (PostgreSQL ≥ 16 publishers, as in the TAP file; our applier serialises streamed transactions to disk
in both modes, so the second run checks that the option is accepted and changes nothing visible):

* streamed PREPARE → COMMIT PREPARED (``4998 - deleted`` rows with the subscriber's extra columns at their local
  defaults: ``3334|3334|3334``); streamed PREPARE → ROLLBACK PREPARED (``2|2|2``);
* streamed PREPARE, then an immediate stop of both nodes, then COMMIT PREPARED after the restart;
* an INSERT of another key between the PREPARE and the ROLLBACK PREPARED (``3|3|3``) and between the PREPARE and
  the COMMIT PREPARED (``3335|3335|3335``): the prepared transaction holds its row locks on the subscriber;
* the last section (a one-row prepared transaction on ``test_tab_2``): on PostgreSQL ≥ 16 with the publisher's
  ``debug_logical_replication_streaming = immediate``, so that even this one streams, as the TAP file makes it.

Not ported: the parallel apply worker's log checks ("finished processing the STREAM PREPARE command", "will
serialize the remaining changes"): our applier has no parallel apply worker; the subscriber-side
``debug_logical_replication_streaming`` has no equivalent for the same reason. The initial table synchronisation
(tables start ready with the same rows) and "check all the cleanup" (``test_tap_021_twophase.py``) neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from psycopg import sql

from applier.apply.testing import ApplySetup, setup_subscription
from applier.apply.worker import WorkerThread
from applier.testing import Database, PostgresCluster, wait_until
from tests.support.tap import (
    TIMEOUT,
    catchup,
    module_pair,
    prepared_count,
    psql,
    rollback_prepared,
    set_decoding_work_mem,
    stream_txns,
    wait_for_new_walsender,
    walsender_pid,
)

#: The TAP file's streamed workload: insert, update and delete enough rows to exceed the 64kB limit.
STREAMED_PREPARE = """BEGIN;
    INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i);
    UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    PREPARE TRANSACTION 'test_prepared_tab';"""


@dataclass
class Nodes:
    publisher: Database
    subscriber: Database
    setup: ApplySetup
    worker: WorkerThread

    @property
    def appname(self) -> str:
        return self.setup.name

    def counts(self) -> tuple[int, int, int]:
        row = self.subscriber.query("SELECT count(*), count(c), count(d = 999) FROM test_tab")[0]
        return int(row[0]), int(row[1]), int(row[2])

    def restart_worker(self) -> None:
        self.worker.stop()
        self.worker = self.setup.start()


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with module_pair(publisher_cluster, target_cluster, "tap023") as pair:
        pub, sub = pair.publisher, pair.target
        set_decoding_work_mem(pub)
        pub.execute("CREATE TABLE test_tab (a int primary key, b bytea)")
        pub.execute("CREATE TABLE test_tab_2 (a int)")
        # columns a and b are compatible with same table name on publisher
        sub.execute(
            "CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999)"
        )
        sub.execute("CREATE TABLE test_tab_2 (a int)")
        for db in (pub, sub):  # pre-existing content (copied by the initial sync in the TAP file)
            db.execute("INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar')")
        setup = setup_subscription(
            pub, sub, pair.name, ["public.test_tab", "public.test_tab_2"], two_phase_state="p", streaming="on"
        )
        n = Nodes(pub, sub, setup, setup.start())
        try:
            wait_until(
                lambda: setup.refresh().subtwophasestate == "e", timeout=TIMEOUT, what="two-phase enabled"
            )
            assert n.counts() == (2, 2, 2), "check initial data was copied to subscriber"
            yield n
        finally:
            n.worker.stop()


@pytest.fixture(autouse=True)
def no_prepared_left_behind(nodes: Nodes) -> Iterator[None]:
    """A failed section must not leave a prepared transaction on the publisher: its row locks would hang the next
    section's workload instead of letting it fail on its own."""
    yield
    rollback_prepared(nodes.publisher)


def streamed_prepare(n: Nodes) -> None:
    """Run :data:`STREAMED_PREPARE`, wait for the subscriber and check that it streamed and is prepared there."""
    before = stream_txns(n.publisher, n.appname)
    psql(n.publisher, STREAMED_PREPARE)
    catchup(n.publisher, n.appname)
    assert stream_txns(n.publisher, n.appname) > before, "the prepared transaction was streamed"
    assert prepared_count(n.subscriber) == 1, "transaction is prepared on subscriber"


def run_test_streaming(n: Nodes) -> None:
    """The TAP file's ``test_streaming``: common steps for the streaming=on and streaming=parallel cases."""
    # Test 2PC PREPARE / COMMIT PREPARED.
    streamed_prepare(n)
    n.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(n.publisher, n.appname)
    assert n.counts() == (3334, 3334, 3334), (
        "Rows inserted by 2PC have committed on subscriber, and extra columns contain local defaults"
    )
    assert prepared_count(n.subscriber) == 0, "transaction is committed on subscriber"

    # Test 2PC PREPARE / ROLLBACK PREPARED.
    n.publisher.execute("DELETE FROM test_tab WHERE a > 2")
    streamed_prepare(n)
    n.publisher.execute("ROLLBACK PREPARED 'test_prepared_tab'")
    catchup(n.publisher, n.appname)
    assert n.counts() == (2, 2, 2), "Rows inserted by 2PC are rolled back, leaving only the original 2 rows"
    assert prepared_count(n.subscriber) == 0, "transaction is aborted on subscriber"

    # Check that 2PC COMMIT PREPARED is decoded properly on crash restart (both publisher and subscriber).
    psql(n.publisher, STREAMED_PREPARE)
    for c in (n.subscriber.cluster, n.publisher.cluster):
        c.crash()
    n.publisher.cluster.start()
    n.subscriber.cluster.start()
    n.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(n.publisher, n.appname)
    assert n.counts() == (3334, 3334, 3334), (
        "Rows inserted by 2PC have committed on subscriber, and extra columns contain local defaults"
    )
    assert prepared_count(n.subscriber) == 0

    # Do INSERT after the PREPARE but before ROLLBACK PREPARED.
    n.publisher.execute("DELETE FROM test_tab WHERE a > 2")
    streamed_prepare(n)
    # the 2PC transaction still holds row locks so make sure this insert is for a separate primary key
    n.publisher.execute("INSERT INTO test_tab VALUES (99999, 'foobar')")
    n.publisher.execute("ROLLBACK PREPARED 'test_prepared_tab'")
    catchup(n.publisher, n.appname)
    assert n.counts() == (3, 3, 3), "check the outside insert was copied to subscriber"
    assert prepared_count(n.subscriber) == 0, "transaction is aborted on subscriber"

    # Do INSERT after the PREPARE but before COMMIT PREPARED.
    n.publisher.execute("DELETE FROM test_tab WHERE a > 2")
    streamed_prepare(n)
    n.publisher.execute("INSERT INTO test_tab VALUES (99999, 'foobar')")
    n.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(n.publisher, n.appname)
    assert n.counts() == (3335, 3335, 3335), (
        "Rows inserted by 2PC (as well as outside insert) have committed on subscriber, and extra columns "
        "contain local defaults"
    )
    assert prepared_count(n.subscriber) == 0, "transaction is committed on subscriber"

    # Cleanup the test data
    n.publisher.execute("DELETE FROM test_tab WHERE a > 2")
    catchup(n.publisher, n.appname)


@pytest.mark.core
def test_streaming_on(nodes: Nodes) -> None:
    """Test using streaming mode 'on'"""
    run_test_streaming(nodes)


def test_streaming_parallel(nodes: Nodes) -> None:
    """Test using streaming mode 'parallel' (``ALTER SUBSCRIPTION tap_sub SET (streaming = parallel)`` restarts
    the worker: a new walsender)."""
    if nodes.publisher.cluster.binaries.major < 16:
        pytest.skip("streaming = parallel needs a PostgreSQL 16 publisher")
    old = walsender_pid(nodes.publisher, nodes.appname)
    nodes.setup.catalog.update_subscription(nodes.setup.sub.subid, substream="parallel")
    wait_for_new_walsender(nodes.publisher, nodes.appname, old)
    run_test_streaming(nodes)


def test_small_prepared_transaction_streamed_immediately(nodes: Nodes) -> None:
    """The last section: a one-row prepared transaction on ``test_tab_2``, streamed (PostgreSQL ≥ 16:
    ``debug_logical_replication_streaming = immediate`` on the publisher) or not (15), then COMMIT PREPARED."""
    pub = nodes.publisher
    before = stream_txns(pub, nodes.appname)
    immediate = pub.cluster.binaries.major >= 16
    if immediate:
        pub.execute(
            sql.SQL("ALTER DATABASE {} SET debug_logical_replication_streaming = immediate").format(
                sql.Identifier(pub.name)
            )
        )
        nodes.restart_worker()  # a new walsender reads the database's settings
    psql(pub, """BEGIN;
        INSERT INTO test_tab_2 values(1);
        PREPARE TRANSACTION 'xact';""")  # fmt: skip
    catchup(pub, nodes.appname)
    if immediate:
        assert stream_txns(pub, nodes.appname) > before, "the one-row transaction was streamed"
    assert prepared_count(nodes.subscriber) == 1, "transaction is prepared on subscriber"

    pub.execute("COMMIT PREPARED 'xact'")
    catchup(pub, nodes.appname)
    assert int(nodes.subscriber.scalar("SELECT count(*) FROM test_tab_2")) == 1, (
        "transaction is committed on subscriber"
    )
    assert prepared_count(nodes.subscriber) == 0
