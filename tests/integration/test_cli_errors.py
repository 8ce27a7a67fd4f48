"""Every refusal of the command line, through the real command: each says what is wrong and what to do, never shows a
password, and leaves nothing half-made behind."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

from applier.subscriptions import LOCK_NAMESPACE
from applier.testing import PostgresBinaries, PostgresCluster, find_binaries, wait_until
from tests.support.cli import (
    APPLIER,
    NOTHING,
    applier,
    catalog_row,
    catalog_tables,
    create,
    fails,
    leftovers,
    make_tables,
    ok,
    status,
)

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def odd_cluster(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    """A cluster set up wrongly on purpose: wal_level=replica (a bad publisher) and max_prepared_transactions=0
    (a bad target for two-phase)."""
    with PostgresCluster(
        pg_binaries, name="odd", settings={"wal_level": "replica", "max_prepared_transactions": "0"}
    ) as cluster:
        yield cluster


def _subid(pair, name: str) -> int:
    return pair.target.scalar("SELECT subid FROM applier.subscription WHERE subname = %s", (name,))


# --- create ------------------------------------------------------------------------------------------------------


@pytest.mark.anyversion  # our conninfo parsing and password scrubbing
def test_bad_publisher_conninfo_is_refused_without_echoing_the_password(pair) -> None:
    make_tables(pair, "t1")
    err = fails(
        pair.target, "create", "s", "--publisher", "host=x password=s3cr3t pw", "--publication", pair.name
    )
    assert "invalid publisher connection string" in err
    assert "s3cr3t" not in err
    err = fails(pair.target, "create", "s", "--publisher", "host=127.0.0.1 port=1 password=s3cr3t",
                "--publication", pair.name)  # fmt: skip
    assert "could not connect to the publisher" in err and "REPLICATION attribute" in err
    assert "s3cr3t" not in err
    assert pair.target.scalar("SELECT to_regnamespace('applier')") is None  # not even the catalog


@pytest.mark.anyversion  # our scrubbing of the stored conninfo
def test_the_password_is_never_stored(pair) -> None:
    make_tables(pair, "t1")
    res = applier(pair.target, "create", "s", "--publisher", pair.publisher.dsn + " password=s3cr3t",
                  "--publication", pair.name)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "password is not stored" in res.stderr
    stored = pair.target.scalar("SELECT subconninfo FROM applier.subscription")
    assert "s3cr3t" not in stored and "password=" not in stored
    assert f"dbname={pair.publisher.name}" in stored
    assert "s3cr3t" not in ok(pair.target, "status", "--json")


def test_missing_publication(pair) -> None:
    make_tables(pair, "t1")
    err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn,
                "--publication", pair.name, "--publication", "nope")  # fmt: skip
    assert f'publication "nope" does not exist on the publisher (database {pair.publisher.name})' in err
    assert "CREATE PUBLICATION" in err


def test_slot_that_already_exists(pair) -> None:
    make_tables(pair, "t1")
    pair.publisher.execute("SELECT pg_create_logical_replication_slot('taken', 'pgoutput')")
    err = fails(pair.target, "create", "taken", "--publisher", pair.publisher.dsn, "--publication", pair.name)
    assert 'replication slot "taken" already exists on the publisher' in err
    assert "--slot-name" in err and "--no-create-slot" in err
    assert pair.target.scalar("SELECT to_regnamespace('applier')") is None  # not even the catalog
    # and the advice works: reuse it
    create(pair, "taken", "--no-create-slot")
    assert catalog_row(pair.target, "taken")["subslotname"] == "taken"


def test_no_create_slot_needs_the_slot(pair) -> None:
    make_tables(pair, "t1")
    err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name,
                "--no-create-slot")  # fmt: skip
    assert 'replication slot "s" does not exist on the publisher' in err
    pair.publisher.execute("SELECT pg_create_physical_replication_slot('physical')")
    try:
        err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name,
                    "--no-create-slot", "--slot-name", "physical")  # fmt: skip
        assert (
            f"it is a physical slot of database (none), not a pgoutput slot of {pair.publisher.name}" in err
        )
    finally:  # physical slots belong to no database: dropping the database would not drop it
        pair.publisher.execute("SELECT pg_drop_replication_slot('physical')")


@pytest.mark.anyversion  # our check of the name, before the server is asked
def test_invalid_slot_name(pair) -> None:
    make_tables(pair, "t1")
    err = fails(
        pair.target, "create", "My-Sub", "--publisher", pair.publisher.dsn, "--publication", pair.name
    )
    assert 'replication slot name "My-Sub" is not valid' in err and "--slot-name" in err
    create(pair, "My-Sub", "--slot-name", "my_sub")


def test_published_table_missing_on_the_target(pair) -> None:
    make_tables(pair, "t1")
    pair.publisher.execute("CREATE TABLE only_there (id int primary key)")
    pair.publisher.execute(f"ALTER PUBLICATION {pair.name} ADD TABLE only_there")
    err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name)
    assert "published table(s) missing on the target: public.only_there" in err
    assert "pg_dump --schema-only" in err
    assert pair.publisher.query("SELECT * FROM pg_replication_slots") == []


def test_two_phase_needs_prepared_transactions_on_the_target(pair, odd_cluster: PostgresCluster) -> None:
    make_tables(pair, "t1")
    target = odd_cluster.create_database(pair.name)
    try:
        target.execute("CREATE TABLE t1 (id int PRIMARY KEY, v text)")
        err = fails(target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name,
                    "--two-phase")  # fmt: skip
        assert "max_prepared_transactions is 0" in err and "without --two-phase" in err
        # without two-phase the same target is fine
        ok(target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name)
        ok(target, "drop", "s")
    finally:
        odd_cluster.drop_database(pair.name)


def test_publisher_without_logical_wal(pair, odd_cluster: PostgresCluster) -> None:
    publisher = odd_cluster.create_database(pair.name)
    try:
        publisher.execute("CREATE TABLE t1 (id int PRIMARY KEY)")
        publisher.execute("CREATE PUBLICATION p FOR TABLE t1")
        err = fails(pair.target, "create", "s", "--publisher", publisher.dsn, "--publication", "p")
        assert 'wal_level on the publisher is "replica"; logical replication needs "logical"' in err
        assert "ALTER SYSTEM SET wal_level = logical" in err
    finally:
        odd_cluster.drop_database(pair.name)


def test_no_privilege_to_create_an_origin(pair) -> None:
    make_tables(pair, "t1")
    role = f"r_{pair.name}"[:60]
    pair.target.execute(f"CREATE ROLE {role} LOGIN")
    try:
        as_role = pair.target.dsn + f" user={role}"
        err = fails(as_role, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name)
        assert (
            f"role {role} lacks privileges on the target that a subscription needs; nothing was written"
            in err
        )
        assert f"GRANT EXECUTE ON FUNCTION pg_catalog.pg_replication_origin_create(text) TO {role};" in err
        assert "docs/security.md" in err
    finally:
        pair.target.execute(f"DROP ROLE {role}")


def test_a_failed_slot_creation_leaves_nothing_behind(pair) -> None:
    """Slot creation waits for open transactions; kill the walsender while it waits: the catalog row and the origin
    that were already written must go again."""
    make_tables(pair, "t1")
    with pair.publisher.connect(autocommit=False) as blocker:
        blocker.execute("INSERT INTO t1 VALUES (1, 'x')")  # an open transaction with an xid
        proc = subprocess.Popen(
            [*_WITH_SIGINT, *APPLIER, "--target", pair.target.dsn, "create", "s", "--publisher", pair.publisher.dsn,
             "--publication", pair.name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            walsender = wait_until(
                lambda: pair.publisher.scalar(
                    "SELECT pid FROM pg_stat_activity WHERE query LIKE 'CREATE_REPLICATION_SLOT%'"
                ),
                what="create to wait in CREATE_REPLICATION_SLOT",
            )
            assert (
                pair.target.scalar("SELECT count(*) FROM applier.subscription") == 1
            )  # the row exists by now
            pair.publisher.execute("SELECT pg_terminate_backend(%s)", (walsender,))
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 1, err
    assert 'could not create replication slot "s"' in err
    assert pair.target.query("SELECT * FROM applier.subscription") == []
    assert pair.target.query("SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%'") == []
    assert pair.publisher.query("SELECT slot_name FROM pg_replication_slots") == []


#: A known flake: under CI's two side-by-side core runs, ``create`` once did not exit within 60 s of the SIGINT,
#: on 15 and 16 (it passed in every run alone and in an earlier side-by-side run). Its stderr then ended with the
#: 5-second "still creating" notice and nothing after it: create waited in CREATE_REPLICATION_SLOT with no signal
#: seen. The wait below used to match any session whose *last* query was a CREATE_REPLICATION_SLOT (an idle
#: walsender of another database or test), so the SIGINT could come before create was in it; it now waits for this
#: database's active walsender. If create still hangs, it is made to dump its threads (faulthandler, SIGABRT) so
#: that the failure says where. Runs only in the PostgreSQL 18 suite until it has passed side by side again.
#: Runs the command after it with SIGINT at its default: a shell without job control starts its background
#: commands (``cmd &``, as .ci/run starts the side-by-side runs, or a CI launched with ``&``) with SIGINT
#: ignored, every process below inherits that, and a Python started so keeps ignoring it: that, not create, was the
#: "create did not exit within 60 s of SIGINT" seen in some CI runs (the faulthandler stacks showed create in its
#: 0.1 s waits, which check for signals).
_WITH_SIGINT = [
    sys.executable, "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]  # fmt: skip


@pytest.mark.alone
def test_interrupting_create_leaves_nothing_behind(pair) -> None:
    make_tables(pair, "t1")
    with pair.publisher.connect(autocommit=False) as blocker:
        blocker.execute("INSERT INTO t1 VALUES (1, 'x')")
        proc = subprocess.Popen(
            [*_WITH_SIGINT, *APPLIER, "--target", pair.target.dsn, "create", "s", "--publisher", pair.publisher.dsn,
             "--publication", pair.name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip
        try:
            wait_until(
                lambda: pair.publisher.scalar(
                    "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender' AND state = 'active'"
                    " AND datname = current_database() AND query LIKE 'CREATE_REPLICATION_SLOT%'"
                ),
                what="create to wait in CREATE_REPLICATION_SLOT",
            )
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack to stderr
                _, err = proc.communicate(timeout=30)
                pytest.fail(f"create did not exit within 60 s of SIGINT; its stacks:\n{err}")
        finally:
            proc.kill()
    assert proc.returncode == 130
    assert pair.target.query("SELECT * FROM applier.subscription") == []
    assert pair.target.query("SELECT roname FROM pg_replication_origin WHERE roname LIKE 'applier%'") == []
    wait_until(lambda: pair.publisher.query("SELECT slot_name FROM pg_replication_slots") == [],
               what="the half-created slot to vanish")  # fmt: skip


@pytest.mark.anyversion  # our catalog's unique name
def test_duplicate_subscription_name(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name,
                "--slot-name", "other")  # fmt: skip
    assert 'subscription "s" already exists' in err


@pytest.mark.anyversion  # our catalog, read before the publisher
def test_an_existing_name_is_refused_before_the_publisher_is_asked(pair) -> None:
    """The existing subscription's slot has its name: checked at the publisher first, create said the slot exists
    and hinted to drop it, the slot a live subscription streams from."""
    make_tables(pair, "t1")
    create(pair, "s")
    before = catalog_row(pair.target, "s")
    err = fails(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name)
    assert 'subscription "s" already exists on this target' in err
    assert "choose another name" in err and "applier drop s" in err
    assert "replication slot" not in err and "pg_drop_replication_slot" not in err
    # refused before the publisher is asked anything: an unreachable one makes no difference
    err = fails(pair.target, "create", "s", "--publisher", "host=127.0.0.1 port=1",
                "--publication", pair.name)  # fmt: skip
    assert 'subscription "s" already exists on this target' in err
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's'") == 1
    assert catalog_row(pair.target, "s") == before


@pytest.mark.anyversion  # our conninfo checks and messages
def test_a_garbage_publisher_conninfo_says_what_is_wrong(pair) -> None:
    make_tables(pair, "t1")
    err = fails(pair.target, "create", "s", "--publisher", "host=/nonexistent port=abc password=s3cr3t",
                "--publication", pair.name)  # fmt: skip
    assert 'invalid publisher connection string (host=/nonexistent port=abc): invalid integer value "abc" for ' \
           'connection option "port"' in err  # fmt: skip
    assert "connection is bad" not in err and "s3cr3t" not in err
    err = fails(pair.target, "create", "s", "--publisher", "host=/nonexistent password=s3cr3t",
                "--publication", pair.name)  # fmt: skip
    assert "could not connect to the publisher (host=/nonexistent): connection to server on socket" in err
    assert "No such file or directory" in err and "REPLICATION attribute" in err
    assert "connection is bad" not in err and "s3cr3t" not in err
    assert pair.target.scalar("SELECT to_regnamespace('applier')") is None  # nothing written
    create(pair, "s")
    err = fails(pair.target, "alter", "s", "--connection", "host=/nonexistent port=abc")
    assert "invalid publisher connection string (host=/nonexistent port=abc): invalid integer value" in err
    assert "connection is bad" not in err


@pytest.mark.anyversion  # our conninfo checks and messages
def test_a_garbage_target_conninfo_says_what_is_wrong(pair) -> None:
    make_tables(pair, "t1")
    for verb in (("status",), ("run", "s"), ("drop", "s"), ("alter", "s", "--enable"),
                 ("create", "s", "--publisher", pair.publisher.dsn, "--publication", pair.name)):  # fmt: skip
        err = fails("this is not a conninfo password=s3cr3t", *verb)
        assert 'invalid target connection string: missing "=" after "this"' in err, verb
        assert "the target failed" not in err and "s3cr3t" not in err, verb
    err = fails("host=/nonexistent port=abc password=s3cr3t", "status")
    assert 'invalid target connection string (host=/nonexistent port=abc): invalid integer value "abc" for ' \
           'connection option "port"' in err  # fmt: skip
    assert "--target" in err and "connection is bad" not in err and "s3cr3t" not in err
    err = fails("host=/nonexistent password=s3cr3t", "status")
    assert "could not connect to the target (host=/nonexistent): connection to server on socket" in err
    assert "PGHOST" in err and "connection is bad" not in err and "s3cr3t" not in err
    assert pair.publisher.query("SELECT slot_name FROM pg_replication_slots") == []


# --- alter -------------------------------------------------------------------------------------------------------


@pytest.mark.anyversion  # our catalog's rule
def test_two_phase_can_only_change_while_disabled(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase")
    err = fails(pair.target, "alter", "s", "--set", "two_phase=off")
    assert 'cannot set option "two_phase" for enabled subscription "s"' in err
    assert "applier alter s --disable" in err


@pytest.mark.anyversion  # our advisory lock
def test_two_phase_cannot_change_while_a_worker_holds_the_subscription(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase", "--disabled")
    with _hold_lock(pair, _subid(pair, "s")):
        err = fails(pair.target, "alter", "s", "--set", "two_phase=off")
    assert "cannot alter two_phase when the apply worker" in err
    ok(pair.target, "alter", "s", "--set", "two_phase=off")
    assert catalog_row(pair.target, "s")["subtwophasestate"] == "d"


@pytest.mark.anyversion  # our GIDs in pg_prepared_xacts; the slot is not touched in p
def test_two_phase_off_refused_while_prepared_transactions_exist_unless_forced(pair) -> None:
    """Checked in ``p`` as well as ``e`` (the slot is not two-phase yet in ``p``, so this runs on any publisher; the
    slot's ALTER is in the lifecycle test)."""
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase", "--disabled")
    assert catalog_row(pair.target, "s")["subtwophasestate"] == "p"
    gid = _prepare_on_target(pair, _subid(pair, "s"))
    err = fails(pair.target, "alter", "s", "--set", "two_phase=false")
    assert "cannot disable two_phase when prepared transactions are present" in err and "--force" in err
    out = ok(pair.target, "alter", "s", "--set", "two_phase=false", "--force")
    assert f"rolled back prepared transaction {gid}" in out
    assert pair.target.query("SELECT gid FROM pg_prepared_xacts") == []
    assert catalog_row(pair.target, "s")["subtwophasestate"] == "d"
    # two-phase back on: pending again until every table is ready
    ok(pair.target, "alter", "s", "--set", "two_phase=on")
    assert catalog_row(pair.target, "s")["subtwophasestate"] == "p"


def test_two_phase_off_needs_a_publisher_that_can_alter_the_slot(pair, target_cluster) -> None:
    """ALTER_REPLICATION_SLOT ... TWO_PHASE exists from PostgreSQL 18: older publishers get an explanation."""
    if pair.publisher.cluster.binaries.major < 18:
        old_publisher, cluster = pair.publisher, None
    else:
        cluster = PostgresCluster(find_binaries(16), name="publisher16").start()
        old_publisher = cluster.create_database(pair.name)
    try:
        for db in (old_publisher, pair.target):
            db.execute("CREATE TABLE t16 (id int PRIMARY KEY)")
        old_publisher.execute("CREATE PUBLICATION p16 FOR TABLE t16")
        ok(pair.target, "create", "s", "--publisher", old_publisher.dsn, "--publication", "p16", "--two-phase",
           "--no-copy-data", "--disabled")  # fmt: skip
        err = fails(pair.target, "alter", "s", "--set", "two_phase=off")
        assert "ALTER_REPLICATION_SLOT ... TWO_PHASE needs PostgreSQL 18" in err
        assert "applier drop s" in err
        assert catalog_row(pair.target, "s")["subtwophasestate"] == "e"
        ok(pair.target, "drop", "s")
    finally:
        if cluster is not None:
            cluster.destroy()


def test_set_validates_every_option_first(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    assert 'unrecognized subscription option "colour"' in fails(
        pair.target, "alter", "s", "--set", "colour=red"
    )
    assert "binary requires a Boolean value" in fails(
        pair.target, "alter", "s", "--set", "streaming=on", "binary=maybe"
    )
    assert catalog_row(pair.target, "s")["substream"] == "off"  # nothing changed
    assert 'unrecognized origin value: "some"' in fails(pair.target, "alter", "s", "--set", "origin=some")
    assert "cannot set slot_name = NONE for enabled" in fails(
        pair.target, "alter", "s", "--set", "slot_name=NONE"
    )
    # origin = none needs a publisher of 16 (issue 31): refused before anything changes on 15
    origin = (
        "none"
        if pair.publisher.scalar("SELECT current_setting('server_version_num')::int") >= 160000
        else "any"
    )
    if origin == "any":
        assert "origin = none needs a publisher of PostgreSQL 16" in fails(
            pair.target, "alter", "s", "--set", "binary=on", "origin=none"
        )
        assert catalog_row(pair.target, "s")["subbinary"] is False
    ok(
        pair.target,
        "alter",
        "s",
        "--set",
        "streaming=parallel",
        "binary=on",
        "disable_on_error=true",
        f"origin={origin}",
    )
    s = catalog_row(pair.target, "s")
    assert (s["substream"], s["subbinary"], s["subdisableonerr"], s["suborigin"]) == (
        "parallel",
        True,
        True,
        origin,
    )


@pytest.mark.anyversion  # our parser
def test_an_unknown_alter_option_is_a_usage_error(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    res = applier(pair.target, "alter", "s", "--bogus")
    assert res.returncode == 2, res.stderr
    assert "applier alter: error: unrecognized arguments: --bogus" in res.stderr
    assert "is required" not in res.stderr
    res = applier(pair.target, "alter", "s", "--enable", "--bogus")
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.stderr
    assert applier(pair.target, "alter", "s").returncode == 2  # no action at all: still argparse's error


@pytest.mark.anyversion  # our option parsing
def test_a_wrong_set_value_lists_the_valid_ones(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    expected = {
        "streaming": "valid values of streaming: off, on, parallel",
        "binary": "valid values of binary: true, false",
        "origin": "valid values of origin: any, none",
        "gid_format": "valid values of gid_format: subscription, original",
        "slot_name": "valid values of slot_name: a slot name",
    }
    for option, hint in expected.items():
        err = fails(pair.target, "alter", "s", "--set", f"{option}=Bogus")
        assert f"HINT: {hint}" in err, err
    assert 'streaming requires a Boolean value or "parallel", not "Bogus"' in fails(
        pair.target, "alter", "s", "--set", "streaming=Bogus"
    )
    assert catalog_row(pair.target, "s")["substream"] == "off"


def test_refresh_with_copy_refused_while_two_phase_is_enabled(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase", "--no-copy-data")
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t2 (id int PRIMARY KEY)")
    pair.publisher.execute(f"ALTER PUBLICATION {pair.name} ADD TABLE t2")
    err = fails(pair.target, "alter", "s", "--refresh-publication")
    assert "with copy_data is not allowed when two_phase is enabled" in err
    assert "--refresh-publication --no-copy-data" in err
    out = ok(pair.target, "alter", "s", "--refresh-publication", "--no-copy-data")
    assert "added public.t2 (state r)" in out
    pair.publisher.execute(f"ALTER PUBLICATION {pair.name} DROP TABLE t1")
    assert "removed public.t1" in ok(pair.target, "alter", "s", "--refresh-publication", "--no-copy-data")
    assert catalog_tables(pair.target, "s") == [("t2", "r")]


def test_refresh_adds_tables_to_copy_while_two_phase_is_pending(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase")
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t2 (id int PRIMARY KEY)")
    pair.publisher.execute("CREATE TABLE t3 (id int PRIMARY KEY)")
    pair.publisher.execute(f"ALTER PUBLICATION {pair.name} ADD TABLE t2, t3")
    assert "missing on the target: public.t3" in fails(pair.target, "alter", "s", "--refresh-publication")
    pair.target.execute("CREATE TABLE t3 (id int PRIMARY KEY)")
    out = ok(pair.target, "alter", "s", "--refresh-publication")
    assert "the new tables are copied when applier run next starts this subscription" in out
    assert catalog_tables(pair.target, "s") == [("t1", "i"), ("t2", "i"), ("t3", "i")]


@pytest.mark.anyversion  # our check against the origin's position
def test_skip_lsn_must_not_be_behind_the_origin(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    subid = _subid(pair, "s")
    pair.target.execute("SELECT pg_replication_origin_advance(%s, '0/5000000')", (f"applier_{subid}",))
    err = fails(pair.target, "alter", "s", "--skip-lsn", "0/4000000")
    assert "skip WAL location (LSN 0/4000000) must be greater than origin LSN 0/5000000" in err
    assert "invalid LSN 'zz'" in fails(pair.target, "alter", "s", "--skip-lsn", "zz")
    ok(pair.target, "alter", "s", "--skip-lsn", "0/6000000")
    assert catalog_row(pair.target, "s")["skip"] == "0/6000000"
    ok(pair.target, "alter", "s", "--skip-lsn", "NONE")
    assert catalog_row(pair.target, "s")["skip"] is None


@pytest.mark.anyversion  # our catalog's rule
def test_enable_needs_a_slot_name(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--disabled")
    ok(pair.target, "alter", "s", "--set", "slot_name=NONE")
    err = fails(pair.target, "alter", "s", "--enable")
    assert 'cannot enable subscription "s": it has no slot name' in err


@pytest.mark.anyversion  # our catalog lookup
def test_unknown_subscription(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    for args in (("alter", "nope", "--enable"), ("drop", "nope"), ("status", "nope"), ("run", "nope")):
        assert 'subscription "nope" does not exist' in fails(pair.target, *args)


# --- run -----------------------------------------------------------------------------------------------------------


@pytest.mark.anyversion  # our advisory lock
def test_run_refuses_a_subscription_another_process_runs(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    with _hold_lock(pair, _subid(pair, "s"), "applier[4242@elsewhere] run s"):
        err = fails(pair.target, "run", "s")
    assert 'subscription "s" is in use by another applier process: applier[4242@elsewhere] run s' in err


@pytest.mark.anyversion  # our catalog's enabled flag
def test_run_says_when_there_is_nothing_to_run(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--disabled")
    assert "nothing to run: the target has no enabled subscription" in fails(pair.target, "run")
    err = fails(pair.target, "run", "s")
    assert "subscription s is disabled" in err and "applier alter s --enable" in err


@pytest.mark.anyversion  # our catalog lookup
def test_run_of_an_unknown_subscription_creates_nothing(pair) -> None:
    err = fails(pair.target, "run", "nosuch")
    assert 'subscription "nosuch" does not exist' in err
    assert "applier create" in err and "applier status" in err
    assert "nothing to run" in fails(pair.target, "run")
    assert pair.target.scalar("SELECT to_regnamespace('applier')") is None  # not even the catalog's schema


@pytest.mark.anyversion  # our environment variable
def test_run_refuses_a_bad_receive_buffer_setting(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    err = fails(pair.target, "run", "s", env={**os.environ, "APPLIER_RECEIVE_BUFFER": "lots"})
    assert "APPLIER_RECEIVE_BUFFER must be a number of bytes (0: the kernel's autotuning), not 'lots'" in err


# --- drop --------------------------------------------------------------------------------------------------------


@pytest.mark.anyversion  # our advisory lock
def test_drop_refused_while_a_worker_runs(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    with _hold_lock(pair, _subid(pair, "s"), "applier[777@host] run s"):
        err = fails(pair.target, "drop", "s")
    assert "in use by another applier process: applier[777@host] run s" in err
    assert "SIGTERM" in err
    ok(pair.target, "drop", "s")


@pytest.mark.anyversion  # our GIDs in pg_prepared_xacts
def test_drop_refused_while_prepared_transactions_exist_unless_forced(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase")
    subid = _subid(pair, "s")
    gid = _prepare_on_target(pair, subid)
    err = fails(pair.target, "drop", "s")
    assert f'subscription "s" has 1 prepared transaction(s) on the target: {gid}' in err and "--force" in err
    assert status(pair.target, "s")["prepared"][0]["gid"] == gid
    ok(pair.target, "drop", "s", "--force")
    assert pair.target.query("SELECT gid FROM pg_prepared_xacts") == []
    assert leftovers(pair, subid, "s") == NOTHING


@pytest.mark.anyversion  # our handling of a failed connection
def test_drop_with_the_publisher_unreachable(pair) -> None:
    make_tables(pair, "t1")
    create(pair, "s")
    subid = _subid(pair, "s")
    pair.target.execute("UPDATE applier.subscription SET subconninfo = 'host=127.0.0.1 port=1 dbname=x'")
    rep = status(pair.target, "s")["replication"]  # status still answers, from the target's side
    assert rep["publisher_reachable"] is False and "127.0.0.1" in rep["publisher_error"]
    err = fails(pair.target, "drop", "s")
    assert "could not connect to the publisher" in err and "nothing was dropped" in err
    assert "--force" in err
    res = applier(pair.target, "drop", "s", "--force")
    assert res.returncode == 0, res.stderr
    assert "SELECT pg_drop_replication_slot('s') on the publisher" in res.stderr
    assert pair.target.scalar("SELECT count(*) FROM applier.subscription") == 0
    assert (
        pair.target.query("SELECT 1 FROM pg_replication_origin WHERE roname = %s", (f"applier_{subid}",))
        == []
    )
    # the slot is left, as announced
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's'") == 1


# --- any verb ----------------------------------------------------------------------------------------------------


@pytest.mark.anyversion  # no server at all
def test_version() -> None:
    res = applier(None, "--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"applier {importlib.metadata.version('applier')}\n"


def _with_closed_pipe(target, *args: str, stream: str = "stdout") -> subprocess.CompletedProcess[str]:
    """``applier ARGS`` with its stdout (or stderr) a pipe whose reader has already gone, as ``| head -1`` leaves
    it; the other stream is captured."""
    read, write = os.pipe()
    os.close(read)
    try:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write}
        return subprocess.run([*APPLIER, "--target", target.dsn, *args], text=True, timeout=120, **pipes)
    finally:
        os.close(write)


def _assert_quiet(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == 0, res.stderr
    for noise in ("Traceback", "BrokenPipe", "Exception ignored"):
        assert noise not in res.stderr, res.stderr


@pytest.mark.anyversion  # our standard streams
def test_a_closed_stdout_pipe_neither_stops_a_verb_nor_makes_a_traceback(pair) -> None:
    make_tables(pair, "t1")
    # a short document meets the closed pipe in the interpreter's flush at exit, a longer one in print itself
    _assert_quiet(_with_closed_pipe(pair.target, "status", "--json"))
    create(pair, "s")
    _assert_quiet(_with_closed_pipe(pair.target, "status", "--json"))
    subid = _subid(pair, "s")
    # drop prints a line per slot before it removes the origin and the catalog rows: it must go on to the end
    res = _with_closed_pipe(pair.target, "drop", "s")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
    assert leftovers(pair, subid, "s") == NOTHING
    assert applier(pair.target, "status", "nope").returncode == 1  # a refusal keeps its own status...
    assert _with_closed_pipe(pair.target, "status", "nope", stream="stderr").returncode == 1  # ...unheard


@pytest.mark.anyversion  # our standard streams
def test_a_closed_stderr_pipe_does_not_stop_create(pair) -> None:
    """create warns on stderr (the password it will not store) before its last line on stdout."""
    make_tables(pair, "t1")
    res = _with_closed_pipe(pair.target, "create", "s", "--publisher", pair.publisher.dsn + " password=s3cr3t",
                            "--publication", pair.name, stream="stderr")  # fmt: skip
    assert res.returncode == 0
    assert 'created subscription "s"' in res.stdout
    assert catalog_row(pair.target, "s")["subenabled"] is True


# --- helpers -----------------------------------------------------------------------------------------------------


class _hold_lock:
    """Hold a subscription's lock from this test, as another ``applier run`` would."""

    def __init__(self, pair, subid: int, application_name: str = "another applier") -> None:
        self.conn = psycopg.connect(pair.target.dsn, autocommit=True, application_name=application_name)
        self.subid = subid

    def __enter__(self) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", (LOCK_NAMESPACE, self.subid))

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def _prepare_on_target(pair, subid: int) -> str:
    """A transaction prepared on the target under this subscription's GID scheme."""
    gid = f"pg_gid_{subid}_4711"
    with pair.target.connect(autocommit=False) as conn:
        conn.execute("INSERT INTO t1 VALUES (99, 'prepared')")
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
    return gid
