"""Port of PostgreSQL's ``src/test/subscription/t/029_on_error.pl`` ("Tests for disable_on_error and SKIP
transaction features") to our applier, run as users run it: ``applier create``, ``applier run`` (a separate OS
process), ``applier alter``.

Ported, in the TAP file's order, on one pair of databases (the publisher's ``logical_decoding_work_mem = 64kB``):

* the subscription ``WITH (disable_on_error = true, streaming = on, two_phase = on)``; a row already on the
  subscriber makes the initial synchronisation fail on the unique violation, which disables the subscription
  (behaviour 101) and stops the worker (``applier run`` then exits 0: nothing is left to run). ``TRUNCATE`` on the
  subscriber, ``ENABLE``: the table syncs (``1`` row);
* ``test_skip_lsn`` for a plain transaction (``2``), a prepared one committed at once (``3``) and a streamed one
  (``4``): the conflict disables the subscription; the finish LSN is taken from the error's CONTEXT line in the
  log, as the TAP file takes it from the server log; ``SKIP (lsn = ...)`` (``applier alter --skip-lsn``) and
  ``ENABLE``; the skip-LSN is cleared, the log says ``logical replication completed skipping transaction at LSN``,
  and a non-conflicting row arrives;
* no prepared transaction is left on the subscriber.

Added (behaviour 100, which the TAP file does not exercise): a mistaken skip-LSN, one no transaction finishes at,
is cleared with PostgreSQL's WARNING by the next transaction that applies something, and that transaction is
applied, not skipped.

Differences: our worker logs to ``applier run``'s output, not the server log; the origin in the CONTEXT line is
``applier_<subid>`` rather than ``pg_<subid>``; ``ALTER SUBSCRIPTION ... ENABLE`` restarts the native worker by
itself, while a disabled subscription ends our ``run``, which is started again after ``applier alter --enable``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from applier.testing import PostgresCluster, wait_until
from applier.testing.pytest_plugin import ReplicationPair
from tests.support.cli import applier, ok, status
from tests.support.tap import (
    TIMEOUT,
    CliApplier,
    catchup,
    module_pair,
    prepared_count,
    psql,
    set_decoding_work_mem,
)

pytestmark = [pytest.mark.core, pytest.mark.spark]

SUB = "sub"


class Node:
    """The TAP file's two nodes, the subscription ``sub`` and its ``applier run`` process."""

    def __init__(self, pair: ReplicationPair) -> None:
        self.publisher = pair.publisher
        self.subscriber = pair.target
        self.run = CliApplier(pair.target, SUB)
        self.offset = 0  # how much of the run log earlier sections consumed (the TAP file's $offset)

    def enabled(self) -> bool:
        return bool(
            self.subscriber.scalar("SELECT subenabled FROM applier.subscription WHERE subname = %s", (SUB,))
        )

    def wait_disabled(self) -> None:
        """``poll_query_until(... subenabled = false ...)``; our worker then stops and ``run`` exits 0."""
        wait_until(lambda: not self.enabled(), timeout=TIMEOUT * 2, what="the subscription to be disabled")
        assert self.run.wait_exit() == 0, self.run.log_tail()

    def log(self) -> str:
        return self.run.log.read_text(errors="replace")

    def wait_for_log(self, pattern: str) -> None:
        """``wait_for_log(qr/.../, $offset)``; advances the offset past the match."""
        regex = re.compile(pattern)

        def found() -> bool:
            m = regex.search(self.log(), self.offset)
            if m:
                self.offset = m.end()
            return m is not None

        wait_until(found, timeout=TIMEOUT, what=f"the log to say {pattern!r}")

    def skip_lsn(self) -> str | None:
        return self.subscriber.scalar(
            "SELECT subskiplsn::text FROM applier.subscription WHERE subname = %s", (SUB,)
        )


@pytest.fixture(scope="module")
def node(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Node]:
    with module_pair(publisher_cluster, target_cluster, "tap029") as pair:
        set_decoding_work_mem(pair.publisher, "64kB")
        # Initial table setup on both publisher and subscriber. On the subscriber, we create the same tables but
        # with a primary key. Also, insert some data that will conflict with the data replicated from publisher
        # later.
        psql(pair.publisher, "CREATE TABLE tbl (i INT, t TEXT); INSERT INTO tbl VALUES (1, NULL);")
        psql(pair.target, "CREATE TABLE tbl (i INT PRIMARY KEY, t TEXT); INSERT INTO tbl VALUES (1, NULL);")
        pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE tbl")
        n = Node(pair)
        try:
            yield n
        finally:
            n.run.close()
            if n.subscriber.scalar("SELECT to_regclass('applier.subscription') IS NOT NULL"):
                applier(n.subscriber, "drop", SUB, "--force")


def _create(n: Node) -> None:
    ok(n.subscriber, "create", SUB, "--publisher", n.publisher.dsn, "--publication", "pub",
       "--disable-on-error", "--streaming", "on", "--two-phase")  # fmt: skip


def test_initial_sync_failure_disables_the_subscription(node: Node) -> None:
    """This tests that the uniqueness violation will cause the subscription to fail during initial
    synchronization and make it disabled."""
    n = node
    _create(n)
    n.run.start()
    # Initial synchronization failure causes the subscription to be disabled.
    n.wait_disabled()
    assert "duplicate key value violates unique constraint" in n.log()
    # Truncate the table on the subscriber which caused the subscription to be disabled.
    n.subscriber.execute("TRUNCATE tbl")
    # Re-enable the subscription "sub".
    ok(n.subscriber, "alter", SUB, "--enable")
    n.run.start()
    # Wait for the data to replicate.
    wait_until(
        lambda: n.subscriber.scalar("SELECT bool_and(srsubstate = 'r') FROM applier.subscription_rel"),
        timeout=TIMEOUT * 2,
        what="the table sync",
    )
    catchup(n.publisher, SUB)
    # Confirm that we have finished the table sync.
    assert n.subscriber.scalar("SELECT COUNT(*) FROM tbl") == 1, "subscription sub replicated data"


def _test_skip_lsn(n: Node, nonconflict_data: str, expected: int, gid: str | None = None) -> None:
    """The TAP file's ``test_skip_lsn``: called after the caller has inserted data that conflicts with the
    subscriber. The finish LSN of the error transaction is taken from the log; after the skip, logical
    replication must go on with ``nonconflict_data``."""
    # Wait until a conflict occurs on the subscriber.
    n.wait_disabled()
    # Get the finish LSN of the error transaction.
    m = re.compile(
        r'processing remote data for replication origin "applier_\d+" during message type "INSERT" for '
        r'replication target relation "public.tbl" in transaction \d+, finished at ([0-9A-F]+/[0-9A-F]+)'
    ).search(n.log(), n.offset)
    assert m, f"could not get error-LSN:\n{n.run.log_tail()}"
    lsn = m.group(1)
    # status says the same, with the command to run
    status_text = ok(n.subscriber, "status", SUB)
    assert f"applier alter {SUB} --skip-lsn {lsn}" in status_text, status_text
    error = status(n.subscriber, SUB)["last_error"]
    assert (error["finish_lsn"], error["sqlstate"], error["gid"]) == (lsn, "23505", gid)
    assert error["next_retry_at"] is None  # disabled: no retry comes
    # Set skip lsn.
    ok(n.subscriber, "alter", SUB, "--skip-lsn", lsn)
    # Re-enable the subscription.
    ok(n.subscriber, "alter", SUB, "--enable")
    n.run.start()
    # Wait for the failed transaction to be skipped
    wait_until(lambda: n.skip_lsn() is None, timeout=TIMEOUT, what="the skip-LSN to be cleared")
    # Check the log to ensure that the transaction is skipped, and advance the offset of the log file for the
    # next test.
    n.wait_for_log(rf"logical replication completed skipping transaction at LSN {re.escape(lsn)}")
    # Insert non-conflict data
    n.publisher.execute(f"INSERT INTO tbl VALUES {nonconflict_data}")  # noqa: S608 - the TAP file's literal data
    catchup(n.publisher, SUB)
    # Check replicated data
    assert n.subscriber.scalar("SELECT count(*) FROM tbl") == expected


def test_skipping_transaction(node: Node) -> None:
    """Insert data to tbl, raising an error on the subscriber due to violation of the unique constraint on tbl.
    Then skip the transaction."""
    psql(node.publisher, "BEGIN; INSERT INTO tbl VALUES (1, NULL); COMMIT;")
    _test_skip_lsn(node, "(2, NULL)", 2)


def test_skipping_prepare_and_commit_prepared(node: Node) -> None:
    """Test for PREPARE and COMMIT PREPARED. Insert the same data to tbl and PREPARE the transaction, raising an
    error. Then skip the transaction."""
    psql(
        node.publisher,
        "BEGIN; INSERT INTO tbl VALUES (1, NULL); PREPARE TRANSACTION 'gtx'; COMMIT PREPARED 'gtx';",
    )
    _test_skip_lsn(node, "(3, NULL)", 3, gid="gtx")


def test_skipping_stream_commit(node: Node) -> None:
    """Test for STREAM COMMIT. Insert enough rows to tbl to exceed the 64kB limit, also raising an error on the
    subscriber during applying spooled changes for the same reason. Then skip the transaction."""
    psql(
        node.publisher,
        "BEGIN; INSERT INTO tbl SELECT i, md5(i::text) FROM generate_series(1, 10000) s(i); COMMIT;",
    )
    _test_skip_lsn(node, "(4, md5(4::text))", 4)
    assert (
        node.publisher.scalar(
            "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE slot_name = %s",
            (
                node.subscriber.scalar(
                    "SELECT subslotname FROM applier.subscription WHERE subname = %s", (SUB,)
                ),
            ),
        )
        >= 1
    ), "the transaction was streamed"


def test_all_prepared_transactions_are_resolved(node: Node) -> None:
    assert prepared_count(node.subscriber) == 0, (
        "check all prepared transactions are resolved on the subscriber"
    )


def test_mistaken_skip_lsn_is_cleared(node: Node) -> None:
    """(Behaviour 100.) A skip-LSN that no transaction finishes at is cleared, with PostgreSQL's WARNING, by the
    next transaction that applies something; that transaction is applied."""
    n = node
    # stopped while the skip-LSN is set, so that the worker surely reads it before the transaction arrives
    assert n.run.stop() == 0
    wrong = n.publisher.scalar("SELECT (pg_current_wal_lsn() + 1)::text")
    ok(n.subscriber, "alter", SUB, "--skip-lsn", wrong)
    n.publisher.execute("INSERT INTO tbl VALUES (5, NULL)")
    n.run.start()
    wait_until(lambda: n.skip_lsn() is None, timeout=TIMEOUT, what="the mistaken skip-LSN to be cleared")
    n.wait_for_log(rf'skip-LSN of subscription "{SUB}" cleared')
    catchup(n.publisher, SUB)
    assert n.subscriber.scalar("SELECT count(*) FROM tbl") == 5
    assert n.run.alive
