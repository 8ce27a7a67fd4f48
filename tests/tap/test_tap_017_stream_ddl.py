"""Port of PostgreSQL's ``src/test/subscription/t/017_stream_ddl.pl`` ("streaming of large transaction with DDL
and subtransactions") to our applier, with the TAP file's ``logical_decoding_work_mem = 64kB``.

The publisher adds columns ``c``, ``d``, ``e``, ``f`` one by one with ``ALTER TABLE ... ADD COLUMN``, some of them
in the middle of a streamed transaction, between its rows and inside subtransactions; the subscriber's table has
all of them from the start (as in the TAP file), so every new Relation message, including the ones that arrive
mid-stream and are spooled with the changes, maps to it. Ported in full, with the TAP file's expected counts
(``2002|1999|1002|1`` then ``5005|5002|4005|3004|5``); the initial table synchronisation is replaced by the same
two rows on both sides. (The TAP file has no parallel apply variant either.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from applier.testing import PostgresCluster
from tests.support.tap import Nodes, psql, stream_txns, subscribed_nodes


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with subscribed_nodes(
        publisher_cluster, target_cluster, "tap017",
        publisher_sql="""
            CREATE TABLE test_tab (a int primary key, b varchar);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        subscriber_sql="""
            CREATE TABLE test_tab (a int primary key, b bytea, c INT, d INT, e INT, f INT);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');""",
        tables=["public.test_tab"],
    ) as n:  # fmt: skip
        assert n.result("SELECT count(*), count(c), count(d = 999) FROM test_tab") == (2, 0, 0), (
            "check initial data was copied to subscriber"
        )
        yield n


@pytest.mark.core
def test_streamed_transactions_with_ddl(nodes: Nodes) -> None:
    n, pub = nodes, nodes.publisher
    streamed = stream_txns(pub, n.appname)
    # a small (non-streamed) transaction with DDL and DML
    psql(pub, """BEGIN;
        INSERT INTO test_tab VALUES (3, sha256(3::text::bytea));
        ALTER TABLE test_tab ADD COLUMN c INT;
        SAVEPOINT s1;
        INSERT INTO test_tab VALUES (4, sha256(4::text::bytea), -4);
        COMMIT;""")  # fmt: skip
    # large (streamed) transaction with DDL and DML
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea), -i FROM generate_series(5, 1000) s(i);
        ALTER TABLE test_tab ADD COLUMN d INT;
        SAVEPOINT s1;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea), -i, 2*i FROM generate_series(1001, 2000) s(i);
        COMMIT;""")  # fmt: skip
    # a small (non-streamed) transaction with DDL and DML
    psql(pub, """BEGIN;
        INSERT INTO test_tab VALUES (2001, sha256(2001::text::bytea), -2001, 2*2001);
        ALTER TABLE test_tab ADD COLUMN e INT;
        SAVEPOINT s1;
        INSERT INTO test_tab VALUES (2002, sha256(2002::text::bytea), -2002, 2*2002, -3*2002);
        COMMIT;""")  # fmt: skip
    n.catchup()
    assert stream_txns(pub, n.appname) == streamed + 1, "only the large transaction was streamed"
    assert n.result("SELECT count(*), count(c), count(d), count(e) FROM test_tab") == (2002, 1999, 1002, 1), (
        "check data was copied to subscriber in streaming mode and extra columns contain local defaults"
    )

    # A large (streamed) transaction with DDL and DML. One of the DDL is performed after DML to ensure that we
    # invalidate the schema sent for test_tab so that the next transaction has to send the schema again.
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea), -i, 2*i, -3*i FROM generate_series(2003,5000) s(i);
        ALTER TABLE test_tab ADD COLUMN f INT;
        COMMIT;""")  # fmt: skip
    # A small transaction that won't get streamed. This is just to ensure that we send the schema again to
    # reflect the last column added in the previous test.
    psql(pub, """BEGIN;
        INSERT INTO test_tab SELECT i, sha256(i::text::bytea), -i, 2*i, -3*i, 4*i FROM generate_series(5001,5005) s(i);
        COMMIT;""")  # fmt: skip
    n.catchup()
    assert n.result("SELECT count(*), count(c), count(d), count(e), count(f) FROM test_tab") == (
        5005, 5002, 4005, 3004, 5,
    ), "check data was copied to subscriber for both streaming and non-streaming transactions"  # fmt: skip
    assert n.subscriber.query(
        "SELECT a, c, d, e, f FROM test_tab WHERE a IN (4, 1500, 2002, 4000, 5005) ORDER BY a"
    ) == [
        (4, -4, None, None, None),
        (1500, -1500, 3000, None, None),
        (2002, -2002, 4004, -6006, None),
        (4000, -4000, 8000, -12000, None),
        (5005, -5005, 10010, -15015, 20020),
    ]
