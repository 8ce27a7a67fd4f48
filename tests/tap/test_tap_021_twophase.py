"""Port of PostgreSQL's ``src/test/subscription/t/021_twophase.pl`` ("logical replication of 2PC") to our applier.

The applier runs as the command users run, ``python -m applier.cli run NAME``, in its own process group for the
whole module, so every section below also exercises the CLI's reconnects through server crashes, and one section
can ``kill -9`` it.

Ported, in the TAP file's order, with its workloads, expected rows and ``pg_prepared_xacts`` counts:

* set-up: ``two_phase = on`` starts pending (``p``) and the worker enables it (``e``) at start because every table
  is ready (the TAP file's ``$twophase_query`` wait);
* the PostgreSQL 18 version's first section: the subscriber has ``max_prepared_transactions = 0``, the apply
  fails with "prepared transactions are disabled", is fixed by a restart with a non-zero setting and catches up
  (here as its own section, after the plain one, because it restarts the shared target cluster);
* PREPARE → COMMIT PREPARED; PREPARE → ROLLBACK PREPARED;
* ROLLBACK PREPARED and COMMIT PREPARED decoded properly after an immediate stop of both nodes, COMMIT PREPARED
  after a crash of the subscriber only and of the publisher only;
* and ours on top: ``kill -9`` of the applier process between PREPARE and COMMIT PREPARED; while it is down the
  transaction is committed and another one prepared and rolled back; a cold start applies both exactly once;
* nested transaction (a savepoint rolled back inside the prepared transaction); the empty GID;
* master's "empty prepared transaction is not replicated" (a transaction with an XID but no decoded change, via a
  row lock, committed and rolled back as prepared): replication goes on and nothing stays prepared (PostgreSQL
  ≥ 18 publishers only: 15 and 16 send a COMMIT PREPARED for such a transaction without its PREPARE, and a native
  subscriber stalls on it exactly like ours, "prepared transaction ... does not exist");
* ours: a prepared transaction that only touches a table outside the publication still prepares (an empty local
  prepared transaction, behaviour 61) and COMMIT PREPARED finishes it;
* ``copy_data = false`` with two-phase: a second subscription, made with ``applier create --two-phase
  --no-copy-data``, starts ``e`` at once; one prepared transaction is prepared once per subscription (2);
* the PostgreSQL 18 version's ``ALTER SUBSCRIPTION ... SET (two_phase = false / true)`` section, through
  ``applier alter --disable / --set two_phase=... / --enable`` (needs a PostgreSQL ≥ 17 publisher for
  ``ALTER_REPLICATION_SLOT``); the TAP file has dropped ``tap_sub`` by then, ours still runs, so the counts there
  are of ``tap_sub_copy``'s prepared transactions only;
* "check all the cleanup", through ``applier drop``: catalog rows, slots and origins are gone.

Not ported: the initial table synchronisation (``wait_for_subscription_sync``): the tables start ready with the
same rows on both sides (the Spark copy has its own tests in ``test_tablesync_*``), and the TAP file's
``failover = true`` (a PostgreSQL 17 slot-synchronisation option our applier has no equivalent for).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from applier.apply.testing import ApplySetup, setup_subscription
from applier.testing import Database, PostgresCluster, wait_until
from tests.support.tap import (
    TIMEOUT,
    CliApplier,
    catchup,
    module_pair,
    prepared_count,
    psql,
    restart_if_down,
    rollback_prepared,
)


@dataclass
class Nodes:
    """The TAP file's ``$node_publisher`` / ``$node_subscriber`` and the running applier."""

    publisher: Database
    subscriber: Database
    appname: str
    setup: ApplySetup
    applier: CliApplier
    dropped: bool = False  # set by the cleanup section, which stops the applier and drops the subscription

    def count(self, query: str, params: object = None) -> int:
        return int(self.subscriber.scalar(query, params))


def cli(target: Database, *args: str) -> subprocess.CompletedProcess[str]:
    """One ``applier`` command (create / alter / drop / status) against ``target``."""
    return subprocess.run(
        [sys.executable, "-m", "applier.cli", "--target", target.dsn, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def nodes(publisher_cluster: PostgresCluster, target_cluster: PostgresCluster) -> Iterator[Nodes]:
    with module_pair(publisher_cluster, target_cluster, "tap021") as pair:
        pub, sub = pair.publisher, pair.target
        # Create some pre-existing content on publisher (through a prepared transaction, as the TAP file does)
        pub.execute("CREATE TABLE tab_full (a int PRIMARY KEY)")
        psql(pub, """BEGIN;
            INSERT INTO tab_full SELECT generate_series(1,10);
            PREPARE TRANSACTION 'some_initial_data';
            COMMIT PREPARED 'some_initial_data';""")  # fmt: skip
        pub.execute("CREATE TABLE tab_unpublished (a int)")
        sub.execute("CREATE TABLE tab_full (a int PRIMARY KEY)")
        sub.execute("INSERT INTO tab_full SELECT generate_series(1,10)")  # what the initial copy would bring
        setup = setup_subscription(pub, sub, pair.name, ["public.tab_full"], two_phase_state="p")
        with CliApplier(sub, pair.name) as applier:
            applier.start()
            n = Nodes(pub, sub, pair.name, setup, applier)
            # Also wait for two-phase to be enabled
            wait_until(
                lambda: n.count("SELECT count(1) = 0 FROM applier.subscription WHERE subtwophasestate NOT IN ('e')"),
                timeout=TIMEOUT, what="two-phase to be enabled",
            )  # fmt: skip
            yield n
            if not applier.alive and applier.starts:
                print(applier.log_tail())


@pytest.fixture
def node(nodes: Nodes) -> Iterator[Nodes]:
    """Each section starts with the applier running and must leave it running: ``applier run`` exiting by itself
    is a failure of that section (its log tail is printed), and the next section starts it again."""
    if not nodes.applier.alive and not nodes.dropped:
        nodes.applier.start()
    yield nodes
    rollback_prepared(nodes.publisher)  # a failed section must not leave row locks that hang the next one
    if not nodes.applier.alive and not nodes.dropped:
        pytest.fail(f"applier run exited; its log ends with:\n{nodes.applier.log_tail()}")


def crash(*clusters: PostgresCluster) -> None:
    """``$node->stop('immediate')`` for each, then start them again in the TAP file's order (publisher first)."""
    for c in clusters:
        c.crash()
    for c in sorted(clusters, key=lambda c: c.name != "publisher"):
        c.start()


@pytest.mark.core
def test_prepare_then_commit_prepared(node: Nodes) -> None:
    """check that 2PC gets replicated to subscriber then COMMIT PREPARED"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (11);
        PREPARE TRANSACTION 'test_prepared_tab_full';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "transaction is prepared on subscriber"

    node.publisher.execute("COMMIT PREPARED 'test_prepared_tab_full'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a = 11") == 1, (
        "Row inserted via 2PC has committed on subscriber"
    )
    assert prepared_count(node.subscriber) == 0, "transaction is committed on subscriber"


@pytest.mark.core
def test_prepare_then_rollback_prepared(node: Nodes) -> None:
    """check that 2PC gets replicated to subscriber then ROLLBACK PREPARED"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (12);
        PREPARE TRANSACTION 'test_prepared_tab_full';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "transaction is prepared on subscriber"

    node.publisher.execute("ROLLBACK PREPARED 'test_prepared_tab_full'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a = 12") == 0, (
        "Row inserted via 2PC is not present on subscriber"
    )
    assert prepared_count(node.subscriber) == 0, "transaction is aborted on subscriber"


def test_max_prepared_transactions_zero_then_fixed(node: Nodes) -> None:
    """PostgreSQL 18's first section: with ``max_prepared_transactions = 0`` on the subscriber the PREPARE fails
    ("prepared transactions are disabled") and is retried; after a restart with a usable setting it applies.

    The target cluster is shared by the session: it is restarted with the setting and restored in ``finally``.
    A cluster that holds prepared transactions cannot start with the setting at 0, so this needs none anywhere.

    Regression guard: PostgreSQL 16+ abort records carry the session's origin progress, so the failed PREPARE
    used to advance the origin past the transaction, which was then lost (fixed in 23e22d2).
    """
    cluster = node.subscriber.cluster
    if int(cluster.scalar("SELECT count(*) FROM pg_prepared_xacts")):
        pytest.skip("another database of the shared target cluster holds prepared transactions")
    cluster.execute("ALTER SYSTEM SET max_prepared_transactions = 0")
    try:
        cluster.restart()
        psql(node.publisher, """BEGIN;
            INSERT INTO tab_full VALUES (61);
            PREPARE TRANSACTION 'test_prepared_mpt';""")  # fmt: skip
        # Confirm the ERROR is reported because max_prepared_transactions is zero
        subid = node.setup.sub.subid
        wait_until(
            lambda: "prepared transactions are disabled"
            in str((node.setup.catalog.last_error(subid) or {}).get("message", "")),
            timeout=TIMEOUT, what="the apply error about disabled prepared transactions",
        )  # fmt: skip
    finally:
        restart_if_down(cluster)
        cluster.execute("ALTER SYSTEM RESET max_prepared_transactions")
        cluster.restart()
    try:
        catchup(node.publisher, node.appname)
        assert prepared_count(node.subscriber) == 1, "transaction is prepared on subscriber"
    finally:
        node.publisher.execute("COMMIT PREPARED 'test_prepared_mpt'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a = 61") == 1, (
        "Row inserted via 2PC has committed on subscriber"
    )
    assert prepared_count(node.subscriber) == 0, "transaction is committed on subscriber"


def test_rollback_prepared_after_crash_of_both(node: Nodes) -> None:
    """Check that ROLLBACK PREPARED is decoded properly on crash restart (publisher and subscriber crash)"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (12);
        INSERT INTO tab_full VALUES (13);
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    crash(node.subscriber.cluster, node.publisher.cluster)
    node.publisher.execute("ROLLBACK PREPARED 'test_prepared_tab'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a IN (12,13)") == 0, (
        "Rows rolled back are not on the subscriber"
    )
    assert prepared_count(node.subscriber) == 0


def test_commit_prepared_after_crash_of_both(node: Nodes) -> None:
    """Check that COMMIT PREPARED is decoded properly on crash restart (publisher and subscriber crash)"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (12);
        INSERT INTO tab_full VALUES (13);
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    crash(node.subscriber.cluster, node.publisher.cluster)
    node.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a IN (12,13)") == 2, (
        "Rows inserted via 2PC are visible on the subscriber"
    )
    assert prepared_count(node.subscriber) == 0


def test_commit_prepared_after_subscriber_crash(node: Nodes) -> None:
    """Check that COMMIT PREPARED is decoded properly on crash restart (subscriber only crash)"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (14);
        INSERT INTO tab_full VALUES (15);
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    crash(node.subscriber.cluster)
    node.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a IN (14,15)") == 2, (
        "Rows inserted via 2PC are visible on the subscriber"
    )
    assert prepared_count(node.subscriber) == 0


def test_commit_prepared_after_publisher_crash(node: Nodes) -> None:
    """Check that COMMIT PREPARED is decoded properly on crash restart (publisher only crash)"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (16);
        INSERT INTO tab_full VALUES (17);
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    crash(node.publisher.cluster)
    node.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a IN (16,17)") == 2, (
        "Rows inserted via 2PC are visible on the subscriber"
    )
    assert prepared_count(node.subscriber) == 0


@pytest.mark.core
def test_commit_prepared_after_kill9_of_the_applier(node: Nodes) -> None:
    """Ours, in the spirit of the crash sections: ``kill -9`` of the applier process once two transactions are
    prepared on the subscriber; while it is down one is committed, the other rolled back, and a third is prepared
    and rolled back; then a cold start of ``applier run``. The local prepared transactions (and the origin's
    progress recorded with them) survive; the ROLLBACK PREPARED of one prepared before the kill still finds it
    (its LookupGXact data must outlive the process)."""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (18);
        INSERT INTO tab_full VALUES (19);
        PREPARE TRANSACTION 'test_prepared_tab';""")  # fmt: skip
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (20);
        PREPARE TRANSACTION 'test_prepared_rb';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 2, "transactions are prepared on subscriber"
    node.applier.kill9()
    node.publisher.execute("COMMIT PREPARED 'test_prepared_tab'")
    node.publisher.execute("ROLLBACK PREPARED 'test_prepared_rb'")
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (23);
        PREPARE TRANSACTION 'while_down';
        ROLLBACK PREPARED 'while_down';""")  # fmt: skip
    node.applier.start()
    catchup(node.publisher, node.appname)
    assert node.count("SELECT count(*) FROM tab_full where a IN (18,19)") == 2, (
        "Rows inserted via 2PC are visible on the subscriber"
    )
    assert node.count("SELECT count(*) FROM tab_full where a IN (20,23)") == 0, (
        "Rows rolled back are not there"
    )
    assert prepared_count(node.subscriber) == 0


@pytest.mark.core
def test_nested_transaction(node: Nodes) -> None:
    """Test nested transaction with 2PC"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (21);
        SAVEPOINT sp_inner;
        INSERT INTO tab_full VALUES (22);
        ROLLBACK TO SAVEPOINT sp_inner;
        PREPARE TRANSACTION 'outer';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "transaction is prepared on subscriber"

    node.publisher.execute("COMMIT PREPARED 'outer'")
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 0, "transaction is ended on subscriber"
    # check inserts are visible. 22 should be rolled back. 21 should be committed.
    assert node.subscriber.query("SELECT a FROM tab_full where a IN (21,22)") == [(21,)], (
        "Rows committed are on the subscriber"
    )


def test_empty_gid(node: Nodes) -> None:
    """Test using empty GID"""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_full VALUES (51);
        PREPARE TRANSACTION '';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "transaction is prepared on subscriber"

    node.publisher.execute("ROLLBACK PREPARED ''")
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 0, "transaction is aborted on subscriber"
    assert node.count("SELECT count(*) FROM tab_full where a = 51") == 0


def test_empty_prepared_transaction_is_not_replicated(node: Nodes) -> None:
    """Test that an empty prepared transaction (an XID from a row lock, no decoded change) does not stall the
    apply and leaves nothing prepared: a later change still replicates."""
    if node.publisher.cluster.binaries.major < 18:
        pytest.skip(
            "this publisher sends COMMIT PREPARED for an empty prepared transaction whose PREPARE it never sent; "
            "the native subscriber stalls on it too"
        )
    psql(node.publisher, """BEGIN;
        SELECT a FROM tab_full WHERE a = 1 FOR SHARE;
        PREPARE TRANSACTION 'test_empty_prepared';
        COMMIT PREPARED 'test_empty_prepared';""")  # fmt: skip
    psql(node.publisher, """BEGIN;
        SELECT a FROM tab_full WHERE a = 1 FOR SHARE;
        PREPARE TRANSACTION 'test_empty_prepared';
        ROLLBACK PREPARED 'test_empty_prepared';""")  # fmt: skip
    # A subsequent normal change must still replicate.
    node.publisher.execute("INSERT INTO tab_full VALUES (31)")
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 0, "empty prepared transaction is not replicated"
    assert node.count("SELECT count(*) FROM tab_full WHERE a = 31") == 1, (
        "replication continues after an empty prepared transaction"
    )


def test_prepared_transaction_on_an_unpublished_table(node: Nodes) -> None:
    """Ours: Begin Prepare / Prepare are sent even when nothing in the transaction is published (behaviour 36),
    and the subscriber prepares it anyway, empty (61), because at COMMIT PREPARED it could not tell."""
    psql(node.publisher, """BEGIN;
        INSERT INTO tab_unpublished VALUES (1);
        PREPARE TRANSACTION 'test_unpublished';""")  # fmt: skip
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "an empty transaction is prepared on subscriber"
    node.publisher.execute("COMMIT PREPARED 'test_unpublished'")
    psql(node.publisher, "BEGIN; INSERT INTO tab_unpublished VALUES (2); PREPARE TRANSACTION 'unpub_rb';")
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 1, "the first is committed, the second prepared"
    node.publisher.execute("ROLLBACK PREPARED 'unpub_rb'")
    catchup(node.publisher, node.appname)
    assert prepared_count(node.subscriber) == 0


@pytest.fixture(scope="module")
def copy_sub(nodes: Nodes) -> Iterator[tuple[str, CliApplier]]:
    """``tap_sub_copy``: made by ``applier create --two-phase --no-copy-data``, run by its own process."""
    pub, sub = nodes.publisher, nodes.subscriber
    pub.execute("CREATE TABLE tab_copy (a int PRIMARY KEY)")
    pub.execute("INSERT INTO tab_copy SELECT generate_series(1,5)")
    sub.execute("CREATE TABLE tab_copy (a int PRIMARY KEY)")
    sub.execute("INSERT INTO tab_copy VALUES (88)")
    assert nodes.count("SELECT count(*) FROM tab_copy") == 1, "initial data in subscriber table"
    pub.execute("CREATE PUBLICATION tap_pub_copy FOR TABLE tab_copy")
    name = f"{nodes.appname}_copy"[:63]
    res = cli(sub, "create", name, "--publisher", pub.dsn, "--publication", "tap_pub_copy", "--two-phase",
              "--no-copy-data")  # fmt: skip
    assert res.returncode == 0, res.stderr
    with CliApplier(sub, name) as applier:
        yield name, applier.start()


def test_copy_data_false_and_two_phase(node: Nodes, copy_sub: tuple[str, CliApplier]) -> None:
    """copy_data=false and two_phase: one prepared transaction on ``tab_copy`` is prepared by both
    subscriptions (empty for ``tap_sub``, which does not publish ``tab_copy``)."""
    name, _ = copy_sub
    pub = node.publisher
    wait_until(
        lambda: node.count(
            "SELECT count(*) FROM applier.subscription WHERE subname = %s AND subtwophasestate = 'e'", (name,)
        ),
        timeout=TIMEOUT,
        what="two-phase enabled",
    )
    assert node.count("SELECT count(*) FROM tab_copy") == 1, "initial data in subscriber table"

    psql(pub, """BEGIN;
        INSERT INTO tab_copy VALUES (99);
        PREPARE TRANSACTION 'mygid';""")  # fmt: skip
    catchup(pub, name)
    catchup(pub, node.appname)
    assert prepared_count(node.subscriber) == 2, "transaction is prepared on subscriber"

    pub.execute("COMMIT PREPARED 'mygid'")
    assert int(pub.scalar("SELECT count(*) FROM tab_copy")) == 6, "publisher inserted data"
    catchup(pub, name)
    catchup(pub, node.appname)
    assert prepared_count(node.subscriber) == 0, "should be no prepared transactions on subscriber"
    assert node.count("SELECT count(*) FROM tab_copy") == 2, "replicated data in subscriber table"


def test_alter_two_phase_off_and_on(node: Nodes, copy_sub: tuple[str, CliApplier]) -> None:
    """PostgreSQL 18's ``ALTER SUBSCRIPTION tap_sub_copy SET (two_phase = false)`` then ``true`` before the
    COMMIT PREPARED of a transaction prepared while it was off: that one arrives whole at COMMIT PREPARED."""
    if node.publisher.cluster.binaries.major < 17:
        pytest.skip("turning a slot's two_phase off needs ALTER_REPLICATION_SLOT (PostgreSQL 17)")
    name, applier = copy_sub
    pub, sub = node.publisher, node.subscriber

    def slot_two_phase() -> bool:
        return bool(pub.scalar("SELECT two_phase FROM pg_replication_slots WHERE slot_name = %s", (name,)))

    def state() -> str:
        return str(
            sub.scalar("SELECT subtwophasestate FROM applier.subscription WHERE subname = %s", (name,))
        )

    def prepared_by_copy_sub() -> int:
        """The TAP file has dropped ``tap_sub`` by now; ours still runs (and prepares its empty twin of every
        prepared transaction), so count ``tap_sub_copy``'s GIDs only."""
        return int(sub.scalar(
            "SELECT count(*) FROM pg_prepared_xacts p JOIN applier.subscription s"
            " ON p.gid LIKE 'pg\\_gid\\_' || s.subid || '\\_%%' WHERE s.subname = %s", (name,)))  # fmt: skip

    def alter_two_phase(value: str) -> None:
        """DISABLE; wait for the worker to exit; SET (two_phase = value); ENABLE."""
        res = cli(sub, "alter", name, "--disable")
        assert res.returncode == 0, res.stderr
        assert applier.wait_exit() == 0, applier.log_tail()  # `run` ends when its subscription is disabled
        for args in (("--set", f"two_phase={value}"), ("--enable",)):
            res = cli(sub, "alter", name, *args)
            assert res.returncode == 0, res.stderr
        applier.start()

    assert slot_two_phase(), "two-phase is enabled"
    alter_two_phase("off")
    catchup(pub, name)
    assert state() == "d", "two-phase subscription option should be disabled"
    assert not slot_two_phase(), "two-phase slot option should be disabled"

    # Now do a prepare on the publisher and verify that it is not replicated.
    psql(pub, "BEGIN; INSERT INTO tab_copy VALUES (100); PREPARE TRANSACTION 'newgid';")
    catchup(pub, name)
    assert prepared_by_copy_sub() == 0, "should be no prepared transactions on subscriber"

    # Set two_phase to "true" before the COMMIT PREPARED.
    alter_two_phase("on")
    pub.execute("COMMIT PREPARED 'newgid'")
    catchup(pub, name)
    assert node.count("SELECT count(*) FROM tab_copy") == 3, "replicated data in subscriber table"
    wait_until(lambda: state() == "e", timeout=TIMEOUT, what="two-phase to be enabled again")
    assert prepared_by_copy_sub() == 0


def test_cleanup(node: Nodes, copy_sub: tuple[str, CliApplier]) -> None:
    """check all the cleanup: ``applier drop`` removes the catalog rows, the slot and the origin."""
    name, applier = copy_sub
    pub, sub = node.publisher, node.subscriber
    subids = [int(r[0]) for r in sub.query("SELECT subid FROM applier.subscription")]
    node.dropped = True
    for n, proc in ((name, applier), (node.appname, node.applier)):
        assert proc.stop() == 0, proc.log_tail()
        res = cli(sub, "drop", n)
        assert res.returncode == 0, res.stderr
    assert node.count("SELECT count(*) FROM applier.subscription") == 0, "check subscription was dropped"
    assert (
        int(pub.scalar("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")) == 0
    ), "check replication slot was dropped on publisher"
    assert node.count("SELECT count(*) FROM applier.subscription_rel") == 0, (
        "check subscription relation status was dropped on subscriber"
    )
    origins = [f"applier_{s}" for s in subids]
    assert node.count("SELECT count(*) FROM pg_replication_origin WHERE roname = ANY(%s)", (origins,)) == 0, (
        "check replication origin was dropped on subscriber"
    )
