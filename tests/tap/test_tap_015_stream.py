"""Port of PostgreSQL's ``src/test/subscription/t/015_stream.pl`` ("streaming of simple large transaction") to our
applier, with the TAP file's ``logical_decoding_work_mem = 64kB`` on the publisher database.

Ported, with the TAP file's workloads and expected ``count(*), count(c), count(d = 999)``:

* ``test_streaming``, once with ``streaming = on`` and once with ``streaming = parallel`` (PostgreSQL ≥ 16
  publishers, as in the TAP file; our applier spools to disk in both modes):
  a pair of interleaved transactions each exceeding 64kB, one of them committed while the other is being streamed
  (``3334|3334|3334``); ``binary = on`` and another streamed transaction (``6667|6667|6667``); local values of
  the subscriber-only column ``c`` survive a streamed UPDATE of every row;
* the parallel-apply "deadlock" sections, as far as they concern the data: two transactions whose rows collide on
  a unique index that only the subscriber has. The native parallel apply deadlocks; ours, which replays a streamed
  transaction at its commit, meets a unique violation instead. Either way the apply fails and retries until the
  index is dropped, then everything arrives: ``5001`` rows, then ``10000``; then the "serialize" section's
  streamed 5000 rows (``15000``).

Not ported: the log checks of the parallel apply worker ("finished processing the STREAM COMMIT command",
"applied N changes in the streaming chunk", "deadlock detected", "will serialize the remaining changes"), which
have no counterpart in our applier; the subscriber-side ``deadlock_timeout`` and
``debug_logical_replication_streaming`` settings for the same reason; and the initial table synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from applier.testing import PostgresCluster, wait_until
from tests.support.tap import (
    TIMEOUT,
    Nodes,
    alter_subscription,
    stream_txns,
    subscribed_nodes,
)

COUNTS = "SELECT count(*), count(c), count(d = 999) FROM test_tab"


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with subscribed_nodes(
        publisher_cluster, target_cluster, "tap015",
        publisher_sql="""
            CREATE TABLE test_tab (a int primary key, b bytea);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
            CREATE TABLE test_tab_2 (a int);""",
        subscriber_sql="""
            CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
            INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
            CREATE TABLE test_tab_2 (a int);
            CREATE UNIQUE INDEX idx_tab on test_tab_2(a);""",
        tables=["public.test_tab", "public.test_tab_2"],
        streaming="on",
    ) as n:  # fmt: skip
        assert n.result(COUNTS) == (2, 2, 2), "check initial data was copied to subscriber"
        yield n


def run_test_streaming(n: Nodes) -> None:
    """The TAP file's ``test_streaming``: common steps for the streaming=on and streaming=parallel cases."""
    pub = n.publisher
    streamed = stream_txns(pub, n.appname)
    # Interleave a pair of transactions, each exceeding the 64kB limit.
    with pub.connect() as h:
        h.execute("BEGIN")
        h.execute("INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i)")
        h.execute("UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0")
        h.execute("DELETE FROM test_tab WHERE mod(a,3) = 0")
        wait_until(
            lambda: stream_txns(pub, n.appname) > streamed, timeout=TIMEOUT, what="the first to stream"
        )
        with pub.connect() as other:
            other.execute("BEGIN")
            other.execute(
                "INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(5001, 9999) s(i)"
            )
            other.execute("DELETE FROM test_tab WHERE a > 5000")
            other.execute("COMMIT")
        h.execute("COMMIT")
    n.catchup()
    assert stream_txns(pub, n.appname) >= streamed + 2, "both transactions were streamed"
    assert n.result(COUNTS) == (3334, 3334, 3334), "check extra columns contain local defaults"

    # Test the streaming in binary mode
    alter_subscription(n.setup, subbinary=True)
    with pub.connect() as conn:
        conn.execute("BEGIN")
        conn.execute(
            "INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(5001, 10000) s(i)"
        )
        conn.execute("UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0")
        conn.execute("DELETE FROM test_tab WHERE mod(a,3) = 0")
        conn.execute("COMMIT")
    n.catchup()
    assert n.result(COUNTS) == (6667, 6667, 6667), "check extra columns contain local defaults"

    # Change the local values of the extra columns on the subscriber, update publisher, and check that
    # subscriber retains the expected values.
    n.subscriber.execute("UPDATE test_tab SET c = 'epoch'::timestamptz + 987654321 * interval '1s'")
    pub.execute("UPDATE test_tab SET b = sha256(a::text::bytea)")
    n.catchup()
    assert n.result(
        "SELECT count(*), count(extract(epoch from c) = 987654321), count(d = 999) FROM test_tab"
    ) == (6667, 6667, 6667), "check extra columns contain locally changed data"
    assert n.subscriber.query("SELECT count(*) FROM test_tab WHERE b <> sha256(a::text::bytea)") == [(0,)]

    # Cleanup the test data
    pub.execute("DELETE FROM test_tab WHERE (a > 2)")
    n.catchup()


@pytest.mark.core
def test_streaming_on(nodes: Nodes) -> None:
    """Test using streaming mode 'on'"""
    run_test_streaming(nodes)


def test_streaming_parallel(nodes: Nodes) -> None:
    """Test using streaming mode 'parallel' (with ``binary = off`` again)."""
    if nodes.publisher.cluster.binaries.major < 16:
        pytest.skip("streaming = parallel needs a PostgreSQL 16 publisher")
    alter_subscription(nodes.setup, substream="parallel", subbinary=False)
    run_test_streaming(nodes)


def last_error_id(n: Nodes) -> int:
    err = n.setup.catalog.last_error(n.setup.sub.subid)
    return int(err["id"]) if err else 0


def wait_for_apply_error(n: Nodes, after: int, text: str) -> None:
    """The worker recorded an apply error newer than ``after`` mentioning ``text`` (and is retrying)."""

    def seen() -> bool:
        err = n.setup.catalog.last_error(n.setup.sub.subid)
        return bool(err and int(err["id"]) > after and text in str(err["message"]))

    wait_until(seen, timeout=TIMEOUT, what=f"an apply error about {text!r}")


def test_conflicting_streamed_transactions_retry_until_fixed(nodes: Nodes) -> None:
    """The "deadlock" sections: a streamed transaction and a later-started, earlier-committed one insert the same
    keys into ``test_tab_2``, unique only on the subscriber. Applying fails and is retried until the index is
    dropped; then every row arrives."""
    n, pub, sub = nodes, nodes.publisher, nodes.subscriber
    count = "SELECT count(*) FROM test_tab_2"

    # between the leader (a one-row commit) and a streamed transaction
    errors = last_error_id(n)
    streamed = stream_txns(pub, n.appname)
    with pub.connect() as h:
        h.execute("BEGIN")
        h.execute("INSERT INTO test_tab_2 SELECT i FROM generate_series(1, 5000) s(i)")
        wait_until(lambda: stream_txns(pub, n.appname) > streamed, timeout=TIMEOUT, what="streaming")
        pub.execute("INSERT INTO test_tab_2 values(1)")
        h.execute("COMMIT")
    wait_for_apply_error(n, errors, "duplicate key value violates unique constraint")
    # In order for the two transactions to be completed normally without causing conflicts due to the unique
    # index, we temporarily drop it.
    sub.execute("DROP INDEX idx_tab")
    n.catchup()
    assert n.result(count) == (5001,), "data replicated to subscriber after dropping index"

    # Clean up test data from the environment.
    pub.execute("TRUNCATE TABLE test_tab_2")
    n.catchup()
    sub.execute("CREATE UNIQUE INDEX idx_tab on test_tab_2(a)")

    # between two streamed transactions
    errors = last_error_id(n)
    streamed = stream_txns(pub, n.appname)
    with pub.connect() as h:
        h.execute("BEGIN")
        h.execute("INSERT INTO test_tab_2 SELECT i FROM generate_series(1, 5000) s(i)")
        wait_until(lambda: stream_txns(pub, n.appname) > streamed, timeout=TIMEOUT, what="streaming")
        pub.execute("INSERT INTO test_tab_2 SELECT i FROM generate_series(1, 5000) s(i)")
        h.execute("COMMIT")
    wait_for_apply_error(n, errors, "duplicate key value violates unique constraint")
    sub.execute("DROP INDEX idx_tab")
    n.catchup()
    assert n.result(count) == (10000,), "data replicated to subscriber after dropping index"

    # The "serialize" section: one more streamed transaction, applied from the spool at its commit.
    pub.execute("INSERT INTO test_tab_2 SELECT i FROM generate_series(1, 5000) s(i)")
    n.catchup()
    assert n.result(count) == (15000,), "parallel apply worker replayed all changes from file"
    assert n.worker.alive
