"""Port of PostgreSQL's ``src/test/subscription/t/016_stream_subxact.pl`` ("streaming of transaction containing
subtransactions") to our applier.

The current TAP file streams with the publisher's ``debug_logical_replication_streaming = immediate`` (PostgreSQL
16+) and three rows per subtransaction; this port uses the 64kB version of the same file (PostgreSQL 15:
``logical_decoding_work_mem = 64kB`` and 498-500 rows per subtransaction, expecting ``1667|1667|1667``), so the
transaction really streams on every supported version. The workload is otherwise the same: four savepoints, each
subtransaction inserting, updating and deleting, all committed; the subscriber's extra columns get local defaults.

Ported: ``test_streaming`` with ``streaming = on`` and with ``streaming = parallel`` (PostgreSQL ≥ 16
publishers). Not ported: the parallel apply worker's log checks (our applier has none) and the initial table
synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from applier.testing import PostgresCluster
from tests.support.tap import Nodes, alter_subscription, psql, stream_txns, subscribed_nodes

COUNTS = "SELECT count(*), count(c), count(d = 999) FROM test_tab"


#: Insert, update and delete enough rows to exceed the 64kB limit, in a transaction and four subtransactions.
WORKLOAD = """BEGIN;
    INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(    3,  500) s(i);
    UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    SAVEPOINT s1;
    INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(501,  1000) s(i);
    UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    SAVEPOINT s2;
    INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(1001,  1500) s(i);
    UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    SAVEPOINT s3;
    INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(1501,  2000) s(i);
    UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    SAVEPOINT s4;
    INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(2001, 2500) s(i);
    UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0;
    DELETE FROM test_tab WHERE mod(a,3) = 0;
    COMMIT;"""


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with subscribed_nodes(
        publisher_cluster, target_cluster, "tap016",
        publisher_sql="""
            CREATE TABLE test_tab (a int primary key, b varchar);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        subscriber_sql="""
            CREATE TABLE test_tab (a int primary key, b text, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        tables=["public.test_tab"],
    ) as n:  # fmt: skip
        assert n.result(COUNTS) == (2, 2, 2), "check initial data was copied to subscriber"
        yield n


def run_test_streaming(n: Nodes) -> None:
    """Insert, update and delete enough rows to exceed 64kB limit, in five (sub)transactions."""
    streamed = stream_txns(n.publisher, n.appname)
    psql(n.publisher, WORKLOAD)
    n.catchup()
    assert stream_txns(n.publisher, n.appname) > streamed, "the transaction was streamed"
    assert n.result(COUNTS) == (1667, 1667, 1667), (
        "check data was copied to subscriber in streaming mode and extra columns contain local defaults"
    )
    # Cleanup the test data
    n.publisher.execute("DELETE FROM test_tab WHERE (a > 2)")
    n.catchup()
    assert n.result(COUNTS) == (2, 2, 2)


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
