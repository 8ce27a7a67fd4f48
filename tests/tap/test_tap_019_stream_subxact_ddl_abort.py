"""Port of PostgreSQL's ``src/test/subscription/t/019_stream_subxact_ddl_abort.pl`` ("streaming of transaction
with subtransactions, DDLs, DMLs, and rollbacks") to our applier.

The current TAP file streams with the publisher's ``debug_logical_replication_streaming = immediate`` (PostgreSQL
16+) and one row per step; this port uses the 64kB version of the same file (PostgreSQL 15:
``logical_decoding_work_mem = 64kB`` and 500 rows per step, expecting ``1000|500``) so that it streams on every
supported version. The workload: columns added (and one dropped) inside nested subtransactions, all of it rolled
back to the first savepoint, then more rows with the column list as it was there. The subscriber's spool is
truncated back to that savepoint, Relation messages included, and the later rows map with the right columns.

Ported in full (the TAP file has no parallel apply variant); the initial table synchronisation is replaced by
the same two rows on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from applier.testing import PostgresCluster
from tests.support.tap import Nodes, psql, stream_txns, subscribed_nodes


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with subscribed_nodes(
        publisher_cluster, target_cluster, "tap019",
        publisher_sql="""
            CREATE TABLE test_tab (a int primary key, b varchar);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        subscriber_sql="""
            CREATE TABLE test_tab (a int primary key, b text, c INT, d INT, e INT);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        tables=["public.test_tab"],
    ) as n:  # fmt: skip
        assert n.result("SELECT count(*), count(c) FROM test_tab") == (2, 0), (
            "check initial data was copied to subscriber"
        )
        yield n


@pytest.mark.core
def test_streamed_transaction_with_ddl_and_rollback_to_savepoint(nodes: Nodes) -> None:
    """large (streamed) transaction with DDL, DML and ROLLBACKs"""
    n = nodes
    streamed = stream_txns(n.publisher, n.appname)
    psql(n.publisher, """BEGIN;
        INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series(3,500) s(i);
        ALTER TABLE test_tab ADD COLUMN c INT;
        SAVEPOINT s1;
        INSERT INTO test_tab SELECT i, md5(i::text), -i FROM generate_series(501,1000) s(i);
        ALTER TABLE test_tab ADD COLUMN d INT;
        SAVEPOINT s2;
        INSERT INTO test_tab SELECT i, md5(i::text), -i, 2*i FROM generate_series(1001,1500) s(i);
        ALTER TABLE test_tab ADD COLUMN e INT;
        SAVEPOINT s3;
        INSERT INTO test_tab SELECT i, md5(i::text), -i, 2*i, -3*i FROM generate_series(1501,2000) s(i);
        ALTER TABLE test_tab DROP COLUMN c;
        ROLLBACK TO s1;
        INSERT INTO test_tab SELECT i, md5(i::text), i FROM generate_series(501,1000) s(i);
        COMMIT;""")  # fmt: skip
    n.catchup()
    assert stream_txns(n.publisher, n.appname) > streamed, "the transaction was streamed"
    assert n.result("SELECT count(*), count(c) FROM test_tab") == (1000, 500), (
        "check rollback to savepoint was reflected on subscriber and extra columns contain local defaults"
    )
    assert n.result("SELECT count(d), count(e), sum(c) FROM test_tab") == (0, 0, sum(range(501, 1001)))
