"""A subscription's schema changes through the real command line (issue 39; docs/reference.md ``create --ddl``):
``create --ddl`` installs the DDL capture on the publisher for the subscription's slot and ``run`` replays what it
captures; ``alter --set ddl`` takes it off and puts it back, and the running worker follows; ``drop`` leaves
nothing of it; a publisher role that may not create event triggers is refused with nothing left behind.

Every subscription here is ``--no-copy-data`` (no Spark): the rows that matter are written after ``create``.
What the capture emits is tests/integration/test_ddl_capture.py's subject, the replay's tests/integration/
test_ddl_replay.py's."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from psycopg import sql

from applier.ddl import capture
from applier.ddl.capture_sql import SCHEMA
from applier.testing import Database, PostgresCluster, assert_tables_equal, wait_until
from applier.testing.pytest_plugin import ReplicationPair, drop_our_origins
from applier.testing.roles import drop_role
from tests.support.cli import (
    StartRun,
    alive,
    applier,
    catalog_tables,
    create,
    fails,
    ok,
    run_log,
    status,
    stop,
)

pytestmark = pytest.mark.core  # the capture and the messages on every publisher version CI runs


def _ours(db: Database) -> dict[str, int]:
    """What of a capture the publisher holds: our schema, our event triggers, functions named like ours."""
    return {
        "schema": db.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (SCHEMA,)),
        "event_triggers": db.scalar("SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE 'applier\\_ddl\\_%%'"),
        "functions": db.scalar("SELECT count(*) FROM pg_proc WHERE proname LIKE 'ddl\\_%%'"),
    }  # fmt: skip


NOTHING = {"schema": 0, "event_triggers": 0, "functions": 0}


def _columns(db: Database, table: str) -> list[str]:
    return [r[0] for r in db.query(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
        " ORDER BY attnum", (table,))]  # fmt: skip


def _both(pair: Any, *statements: str) -> None:
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def _a_new_column_arrives_then_drop_leaves_nothing(pair: Any, run: subprocess.Popen[str]) -> None:
    """An ALTER TABLE ADD COLUMN and a row that needs it, in one transaction, reach the target; then ``run``
    stops cleanly and ``drop`` leaves nothing of ours on the publisher."""
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute("ALTER TABLE t ADD COLUMN c int")
        conn.execute("INSERT INTO t VALUES (1, 'a', 3)")
        conn.commit()
    wait_until(lambda: alive(run)() and pair.target.scalar("SELECT count(*) FROM t") == 1, timeout=60,
               what="the row that needs the new column")  # fmt: skip
    assert_tables_equal(pair.publisher, pair.target, "t")
    assert stop(run) == 0
    ok(pair.target, "drop", "s")
    assert _ours(pair.publisher) == NOTHING


def _streaming(run: subprocess.Popen[str], times: int = 1) -> None:
    """Wait until the worker has started streaming ``times`` times (a restart after an alter is the second)."""
    wait_until(lambda: alive(run)() and run_log(run).count("has started streaming") >= times, timeout=60,
               what=f"the worker to start streaming ({times})")  # fmt: skip


def test_create_ddl_on_all_tables_replays_an_added_column_and_a_new_table_then_drop_removes_it(
    pair: Any, start_run: StartRun
) -> None:
    _both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.publisher.execute(f"CREATE PUBLICATION {pair.name} FOR ALL TABLES")
    out = create(pair, "s", "--ddl", "--no-copy-data")
    assert 'DDL capture of slot "s" installed' in out
    with pair.publisher.connect() as conn:
        assert len(capture.installed(conn, "s")) == 4
    assert status(pair.target, "s")["ddl"] is True
    assert "ddl true" in ok(pair.target, "status", "s")

    run = start_run(pair.target, "s")
    _streaming(run)
    pair.publisher.execute("INSERT INTO t VALUES (1, 'before')")
    with pair.publisher.connect(autocommit=False) as conn:  # the column and the row that needs it, together
        conn.execute("ALTER TABLE t ADD COLUMN c int DEFAULT 7")
        conn.execute("INSERT INTO t VALUES (2, 'after', 42)")
        conn.commit()
    # a table created on the publisher joins without --refresh-publication, rows and all
    pair.publisher.execute("CREATE TABLE n (id int PRIMARY KEY, w text)")
    pair.publisher.execute("INSERT INTO n SELECT g, 'n' || g FROM generate_series(1, 20) g")
    wait_until(lambda: alive(run)() and pair.target.scalar("SELECT to_regclass('public.n') IS NOT NULL")
               and pair.target.scalar("SELECT count(*) FROM n") == 20, timeout=60, what="table n and its rows")  # fmt: skip
    assert _columns(pair.target, "t") == ["id", "v", "c"]
    assert_tables_equal(pair.publisher, pair.target, "t")
    assert_tables_equal(pair.publisher, pair.target, "n")
    assert ("n", "r") in catalog_tables(pair.target, "s")

    assert stop(run) == 0
    out = ok(pair.target, "drop", "s")
    assert 'DDL capture of slot "s" removed' in out
    assert _ours(pair.publisher) == NOTHING
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0


def test_on_a_for_table_publication_ddl_on_an_unlisted_table_is_not_replayed(
    pair: Any, start_run: StartRun
) -> None:
    """The listed table's name holds a shell wildcard: the capture matches it exactly, not as a pattern (``tx``
    would match ``t*``); renamed, it is still matched (by OID)."""
    _both(pair, 'CREATE TABLE "t*" (id int PRIMARY KEY, v text)', "CREATE TABLE tx (id int PRIMARY KEY)")
    pair.publisher.execute(f'CREATE PUBLICATION {pair.name} FOR TABLE "t*"')
    create(pair, "s", "--ddl", "--no-copy-data")
    run = start_run(pair.target, "s")
    _streaming(run)
    pair.publisher.execute("ALTER TABLE tx ADD COLUMN x int")
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute('ALTER TABLE "t*" ADD COLUMN c int')
        conn.execute("INSERT INTO \"t*\" VALUES (1, 'a', 5)")
        conn.commit()
    wait_until(lambda: alive(run)() and pair.target.scalar('SELECT count(*) FROM "t*"') == 1, timeout=60,
               what="the listed table's row")  # fmt: skip
    assert _columns(pair.target, '"t*"') == ["id", "v", "c"]
    assert _columns(pair.target, "tx") == ["id"]  # the unlisted table's DDL stayed on the publisher
    assert "could not replay" not in run_log(run)
    # a listed table is found by OID too: renamed, it is still the publication's, and its DDL still follows
    pair.publisher.execute('ALTER TABLE "t*" RENAME TO renamed')
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute("ALTER TABLE renamed ADD COLUMN d text")
        conn.execute("INSERT INTO renamed VALUES (2, 'b', 6, 'new')")
        conn.commit()
    wait_until(lambda: alive(run)() and pair.target.scalar("SELECT to_regclass('public.renamed') IS NOT NULL")
               and pair.target.scalar("SELECT count(*) FROM renamed") == 2, timeout=60,
               what="the renamed table's row")  # fmt: skip
    assert_tables_equal(pair.publisher, pair.target, "renamed")


def test_on_a_tables_in_schema_publication_a_new_table_of_the_schema_joins_and_other_schemas_stay(
    pair: Any, start_run: StartRun
) -> None:
    _both(
        pair,
        'CREATE SCHEMA "a.b"',
        'CREATE TABLE "a.b".t (id int PRIMARY KEY)',
        "CREATE TABLE other (id int)",
    )
    pair.publisher.execute(f'CREATE PUBLICATION {pair.name} FOR TABLES IN SCHEMA "a.b"')
    create(pair, "s", "--ddl", "--no-copy-data")
    run = start_run(pair.target, "s")
    _streaming(run)
    pair.publisher.execute("ALTER TABLE other ADD COLUMN x int")
    pair.publisher.execute('CREATE TABLE "a.b".n (id int PRIMARY KEY, w text)')
    pair.publisher.execute("""INSERT INTO "a.b".n VALUES (1, 'one'), (2, 'two')""")
    wait_until(lambda: alive(run)() and pair.target.scalar("""SELECT to_regclass('"a.b".n') IS NOT NULL""")
               and pair.target.scalar('SELECT count(*) FROM "a.b".n') == 2, timeout=60,
               what="the new table of the schema and its rows")  # fmt: skip
    assert _columns(pair.target, "other") == ["id"]


def test_alter_set_ddl_false_removes_the_capture_and_true_puts_it_back_for_the_running_worker(
    pair: Any, start_run: StartRun
) -> None:
    _both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.publisher.execute(f"CREATE PUBLICATION {pair.name} FOR ALL TABLES")
    create(pair, "s", "--ddl", "--no-copy-data")
    run = start_run(pair.target, "s")
    _streaming(run)

    out = ok(pair.target, "alter", "s", "--set", "ddl=false")
    assert 'DDL capture of slot "s" removed' in out
    assert _ours(pair.publisher) == NOTHING
    assert status(pair.target, "s")["ddl"] is False
    _streaming(run, 2)  # the worker restarted its stream without the messages

    out = ok(pair.target, "alter", "s", "--set", "ddl=true")
    assert 'DDL capture of slot "s" installed' in out
    with pair.publisher.connect() as conn:
        assert len(capture.installed(conn, "s")) == 4
    assert status(pair.target, "s")["ddl"] is True
    _streaming(run, 3)  # and again with them
    _a_new_column_arrives_then_drop_leaves_nothing(pair, run)


def test_a_publisher_role_that_may_not_create_event_triggers_is_refused_with_nothing_left(pair: Any) -> None:
    """A replication role with CREATE on the database but no superuser: ``create --ddl`` says which right is
    missing, with a hint, and leaves no slot, no catalog row and no capture; without ``--ddl`` the same role may
    create the subscription."""
    _both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.publisher.execute(f"CREATE PUBLICATION {pair.name} FOR TABLE t")
    role = f"ddl_{pair.name}"[:63]
    pair.publisher.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION").format(sql.Identifier(role)))
    try:
        pair.publisher.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(pair.name), sql.Identifier(role)
            )
        )
        publisher = pair.publisher.as_user(role).dsn
        err = fails(pair.target, "create", "s", "--publisher", publisher, "--publication", pair.name, "--ddl",
                    "--no-copy-data")  # fmt: skip
        (first,) = [line for line in err.splitlines() if line.startswith("ERROR:")]
        rest = err.splitlines()[err.splitlines().index(first) + 1 :]
        assert "--ddl cannot install its DDL capture on the publisher" in first, err
        assert f"role {role} may not create event triggers there" in first, err
        assert rest and rest[0].startswith("HINT:") and "superuser" in rest[0], err
        assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0
        assert _ours(pair.publisher) == NOTHING
        assert pair.target.query("SELECT subname FROM applier.subscription") == []
        # the refusal is --ddl's alone
        ok(pair.target, "create", "s", "--publisher", publisher, "--publication", pair.name, "--no-copy-data")
        assert status(pair.target, "s")["ddl"] is False
        err = fails(pair.target, "alter", "s", "--set", "ddl=true")
        assert "may not create event triggers" in err and _ours(pair.publisher) == NOTHING
        assert status(pair.target, "s")["ddl"] is False
        ok(pair.target, "drop", "s")
    finally:
        drop_role(pair.publisher, role)


def test_drop_force_without_the_publisher_says_how_to_remove_the_capture_by_hand(pair: Any) -> None:
    """As for the slot: the statements printed are the ones that remove the capture (run here, they leave
    nothing)."""
    _both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.publisher.execute(f"CREATE PUBLICATION {pair.name} FOR ALL TABLES")
    create(pair, "s", "--ddl", "--no-copy-data")
    pair.target.execute(
        "UPDATE applier.subscription SET subconninfo = 'host=127.0.0.1 port=1 dbname=x' WHERE subname = 's'"
    )
    err = fails(pair.target, "drop", "s")
    assert "nothing was dropped" in err and "DROP EVENT TRIGGER" in err
    res = applier(pair.target, "drop", "s", "--force")
    assert res.returncode == 0, res.stderr
    said = res.stdout + res.stderr
    manual = said.split("remove the DDL capture there: ", 1)[1].split(" then DROP SCHEMA", 1)[0]
    assert _ours(pair.publisher) != NOTHING  # left behind, as said
    for statement in manual.split(";"):
        if statement.strip():
            pair.publisher.execute(statement)
    pair.publisher.execute(f"DROP SCHEMA {SCHEMA}")
    pair.publisher.execute("SELECT pg_drop_replication_slot('s')")
    assert _ours(pair.publisher) == NOTHING


@pytest.mark.anyversion  # the publisher is 14 in every run
def test_a_postgresql_14_publisher_sends_the_messages_too(
    pg14: PostgresCluster, target_cluster: PostgresCluster, start_run: StartRun
) -> None:
    """The oldest publisher applier takes: pgoutput's ``messages`` option (14+) and no ``TABLES IN SCHEMA``
    catalog (15+) for the scope to read."""
    name = "p14_subscription_ddl"
    pair = ReplicationPair(pg14.create_database(name), target_cluster.create_database(name), name)
    try:
        _both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
        pair.publisher.execute(f"CREATE PUBLICATION {name} FOR TABLE t")
        create(pair, "s", "--ddl", "--no-copy-data")
        run = start_run(pair.target, "s")
        _streaming(run)
        _a_new_column_arrives_then_drop_leaves_nothing(pair, run)
    finally:
        drop_our_origins(pair.target)
        target_cluster.drop_database(name)
        pg14.drop_database(name)
