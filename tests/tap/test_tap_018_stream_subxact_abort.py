"""Port of PostgreSQL's ``src/test/subscription/t/018_stream_subxact_abort.pl`` ("streaming of transaction
containing multiple subtransactions and rollbacks") to our applier.

The current TAP file streams with the publisher's ``debug_logical_replication_streaming = immediate`` (PostgreSQL
16+) and one row per subtransaction; this port runs the 64kB version of the same file (PostgreSQL 15:
``logical_decoding_work_mem = 64kB``, 500 rows per subtransaction, expecting ``2000|0``, ``2500|0``,
``2500|0``), which streams on every supported version:

* ROLLBACK TO nested savepoints inside a streamed transaction, then more subtransactions, committed;
* subtransaction aborts the subscriber receives "out of order" (``RELEASE s2`` then ``ROLLBACK TO s1``);
* a streamed transaction rolled back as a whole (PostgreSQL 18 may not stream it at all once it knows the
  transaction aborted: only the rows are checked);
* each with ``streaming = on`` and ``streaming = parallel`` (PostgreSQL ≥ 16 publishers);
* the last two sections, on ``test_tab_2``: a one-row transaction rolled back, and one whose second row is rolled
  back to a savepoint; streamed on PostgreSQL ≥ 16 (``debug_logical_replication_streaming = immediate`` on the
  publisher database, as the TAP file's publisher has it), not streamed on 15.

Not ported: the parallel apply worker's log checks (our applier has none) and the initial table synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from psycopg import sql

from applier.testing import PostgresCluster
from tests.support.tap import Nodes, alter_subscription, psql, stream_txns, subscribed_nodes

COUNTS = "SELECT count(*), count(c) FROM test_tab"


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with subscribed_nodes(
        publisher_cluster, target_cluster, "tap018",
        publisher_sql="""
            CREATE TABLE test_tab (a int primary key, b varchar);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
            CREATE TABLE test_tab_2 (a int);""",
        subscriber_sql="""
            CREATE TABLE test_tab (a int primary key, b text, c INT, d INT, e INT);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
            CREATE TABLE test_tab_2 (a int);""",
        tables=["public.test_tab", "public.test_tab_2"],
    ) as n:  # fmt: skip
        assert n.result(COUNTS) == (2, 0), "check initial data was copied to subscriber"
        yield n


def run_test_streaming(n: Nodes) -> None:
    """The TAP file's three streamed transactions, then the cleanup."""
    pub = n.publisher
    streamed = stream_txns(pub, n.appname)
    # large (streamed) transaction with DDL, DML and ROLLBACKs
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(3,500) s(i);
        SAVEPOINT s1;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(501,1000) s(i);
        SAVEPOINT s2;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(1001,1500) s(i);
        SAVEPOINT s3;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(1501,2000) s(i);
        ROLLBACK TO s2;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(2001,2500) s(i);
        ROLLBACK TO s1;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(2501,3000) s(i);
        SAVEPOINT s4;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(3001,3500) s(i);
        SAVEPOINT s5;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(3501,4000) s(i);
        COMMIT;""")  # fmt: skip
    n.catchup()
    assert stream_txns(pub, n.appname) > streamed, "the transaction was streamed"
    assert n.result(COUNTS) == (2000, 0), (
        "check rollback to savepoint was reflected on subscriber and extra columns contain local defaults"
    )
    assert n.result("SELECT count(*) FROM test_tab WHERE a BETWEEN 501 AND 2500") == (0,)

    # large (streamed) transaction with subscriber receiving out of order subtransaction ROLLBACKs
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(4001,4500) s(i);
        SAVEPOINT s1;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(5001,5500) s(i);
        SAVEPOINT s2;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(6001,6500) s(i);
        SAVEPOINT s3;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(7001,7500) s(i);
        RELEASE s2;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(8001,8500) s(i);
        ROLLBACK TO s1;
        COMMIT;""")  # fmt: skip
    n.catchup()
    assert n.result(COUNTS) == (2500, 0), "check rollback to savepoint was reflected on subscriber"

    # large (streamed) transaction with subscriber receiving rollback
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(8501,9000) s(i);
        SAVEPOINT s1;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(9001,9500) s(i);
        SAVEPOINT s2;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(9501,10000) s(i);
        ROLLBACK;""")  # fmt: skip
    n.catchup()
    assert n.result(COUNTS) == (2500, 0), "check rollback was reflected on subscriber"

    # Cleanup the test data
    pub.execute("DELETE FROM test_tab WHERE (a > 2)")
    n.catchup()


@pytest.mark.core
def test_streaming_on(nodes: Nodes) -> None:
    """Test using streaming mode 'on'"""
    run_test_streaming(nodes)


def test_streaming_parallel(nodes: Nodes) -> None:
    """Test using streaming mode 'parallel'"""
    if nodes.publisher.cluster.binaries.major < 16:
        pytest.skip("streaming = parallel needs a PostgreSQL 16 publisher")
    alter_subscription(nodes.setup, substream="parallel")
    run_test_streaming(nodes)


def test_small_aborts_streamed_immediately(nodes: Nodes) -> None:
    """The last two sections: a one-row transaction rolled back, and a subtransaction's row rolled back to a
    savepoint (the TAP file checks that the parallel apply leader serialises them; here they stream to our spool
    on PostgreSQL ≥ 16)."""
    n, pub = nodes, nodes.publisher
    if pub.cluster.binaries.major >= 16:
        pub.execute(
            sql.SQL("ALTER DATABASE {} SET debug_logical_replication_streaming = immediate").format(
                sql.Identifier(pub.name)
            )
        )
        n.restart_worker()  # a new walsender reads the database's settings
    psql(pub, """BEGIN;
        INSERT INTO test_tab_2 values(1);
        ROLLBACK;""")  # fmt: skip
    n.catchup()
    assert n.result("SELECT count(*) FROM test_tab_2") == (0,), "check rollback was reflected on subscriber"

    streamed = stream_txns(pub, n.appname)
    psql(pub, """BEGIN;
        INSERT INTO test_tab_2 values(1);
        SAVEPOINT sp;
        INSERT INTO test_tab_2 values(1);
        ROLLBACK TO sp;
        COMMIT;""")  # fmt: skip
    n.catchup()
    if pub.cluster.binaries.major >= 16:
        assert stream_txns(pub, n.appname) > streamed, "the transaction was streamed"
    assert n.result("SELECT count(*) FROM test_tab_2") == (1,), (
        "check rollback to savepoint was reflected on subscriber"
    )
