"""The capture's messages replayed by the apply worker on real servers (applier.apply.ddl_replay): each DDL at its
place in its transaction, prepared with it, never when rolled back, applied when a streamed transaction commits,
once after a restart; a created table joins with its rows.

The messages are emitted here as the source's capture emits them (applier.ddl.payload), in the same transaction as
the DDL, so that the apply side is tested on its own; tests/integration/test_ddl_capture.py tests the capture, and
the migration tests both together."""

from __future__ import annotations

import pytest
from psycopg import sql

from applier.apply.testing import setup_subscription
from applier.ddl import capture
from applier.ddl.payload import PREFIX, DdlEvent, DdlObject, encode_payload, sign
from applier.migrate.selection import Selection
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until

pytestmark = pytest.mark.core


def ddl(conn, statement: str, tag: str, *objects: DdlObject, slot: str, n: int = 1) -> None:
    """Run ``statement`` and emit its capture message in the same transaction, signed with the capture's key, as
    the capture does."""
    conn.execute(statement)
    ev = DdlEvent(slot, tag, n, "ts", statement, "public", tuple(objects))
    key = conn.execute(capture.key_query(slot)).fetchone()[0].encode()
    conn.execute(
        "SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, sign(key, encode_payload(ev)))
    )


def with_key(publisher, slot: str) -> None:
    """The capture of ``slot``, installed for a schema no test uses: its key signs the messages emitted here."""
    with publisher.connect() as conn:
        capture.install(conn, slot, Selection(schemas=("no_such_schema",)))


def table(name: str, *, dropped: bool = False) -> DdlObject:
    return DdlObject("table", "public", f"public.{name}", f"public.{name}", dropped)


def columns(db, name: str) -> list[str]:
    return [r[0] for r in db.query(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
        " ORDER BY attnum", (name,))]  # fmt: skip


@pytest.fixture
def replica(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        db.execute("CREATE TABLE u (id int PRIMARY KEY)")
    with_key(pair.publisher, pair.name)
    s = setup_subscription(
        pair.publisher, pair.target, pair.name, ["public.t", "public.u"], two_phase_state="e", ddl=True
    )
    s.thread = s.start()
    yield s
    s.thread.stop()


def test_ddl_is_replayed_before_the_rows_that_need_it(pair, replica):
    with pair.publisher.connect(autocommit=False) as conn:
        conn.execute("INSERT INTO t VALUES (1, 'before')")
        ddl(conn, "ALTER TABLE t ADD COLUMN c int DEFAULT 7, ALTER COLUMN v TYPE varchar(20)", "ALTER TABLE",
            table("t"), slot=pair.name)  # fmt: skip
        conn.execute("INSERT INTO t VALUES (2, 'after', 42)")
        conn.commit()
    with pair.publisher.connect(autocommit=False) as conn:
        ddl(conn, "ALTER TABLE t DROP COLUMN v", "ALTER TABLE", table("t"), slot=pair.name)
        conn.execute("UPDATE t SET c = c + 1")
        conn.commit()
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert columns(pair.target, "t") == ["id", "c"]
    assert_tables_equal(pair.publisher, pair.target, "t")


def test_ddl_in_a_prepared_transaction_is_prepared_with_it(pair, replica):
    for gid, decision, i in (("keep", "COMMIT", 1), ("undo", "ROLLBACK", 2)):
        with pair.publisher.connect() as conn:
            conn.execute("BEGIN")
            ddl(conn, f"ALTER TABLE t ADD COLUMN {gid} int", "ALTER TABLE", table("t"), slot=pair.name)
            conn.execute(sql.SQL("INSERT INTO t (id, {}) VALUES (%s, 1)").format(sql.Identifier(gid)), (i,))
            conn.execute(f"PREPARE TRANSACTION '{gid}'")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts"), timeout=30,
                   what="the transaction prepared on the target")  # fmt: skip
        # the prepared ALTER's lock on t blocks nothing the apply needs for the next table's changes (its catalog
        # reads, the trust check, the preload's stamp check)
        pair.publisher.execute("INSERT INTO u VALUES (%s)", (i,))
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        pair.publisher.execute(f"{decision} PREPARED '{gid}'")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert columns(pair.target, "t") == ["id", "v", "keep"]
    assert pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts") == 0
    assert_tables_equal(pair.publisher, pair.target, "t")
    assert_tables_equal(pair.publisher, pair.target, "u")


def test_a_created_table_joins_with_its_rows_and_a_dropped_one_leaves(pair, replica):
    with pair.publisher.connect(autocommit=False) as conn:
        ddl(conn, "CREATE TABLE n (id int PRIMARY KEY, w text)", "CREATE TABLE", table("n"), slot=pair.name)
        conn.execute(f'ALTER PUBLICATION "{pair.name}" ADD TABLE n')  # the capture does this at the source
        conn.execute("INSERT INTO n SELECT g, 'w' || g FROM generate_series(1, 50) g")
        conn.commit()
    pair.publisher.execute("UPDATE n SET w = 'x' WHERE id <= 10")
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert_tables_equal(pair.publisher, pair.target, "n")
    states = pair.target.query("SELECT srrelid::text, srsubstate FROM applier.subscription_rel ORDER BY 1")
    assert states == [("n", "r"), ("t", "r"), ("u", "r")]
    with pair.publisher.connect(autocommit=False) as conn:
        ddl(conn, "DROP TABLE n", "DROP TABLE", table("n", dropped=True), slot=pair.name)
        conn.commit()
    pair.publisher.execute("INSERT INTO t VALUES (5, 'e')")
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert pair.target.scalar("SELECT to_regclass('public.n')") is None
    assert pair.target.query("SELECT srrelid::text FROM applier.subscription_rel ORDER BY 1") == [
        ("t",),
        ("u",),
    ]


def test_a_streamed_transactions_ddl_applies_at_its_place_when_it_commits(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    with_key(pair.publisher, pair.name)
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], streaming="on", ddl=True)
    # the walsender reads it when it starts (a SET in the writing session would not reach it)
    pair.publisher.execute(f"ALTER DATABASE {pair.name} SET logical_decoding_work_mem = '64kB'")
    w = s.start()
    try:
        with pair.publisher.connect(autocommit=False) as conn:
            conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
            ddl(conn, "ALTER TABLE t ADD COLUMN c bigint", "ALTER TABLE", table("t"), slot=pair.name)
            conn.execute("INSERT INTO t SELECT g, 'y', g * 2 FROM generate_series(3001, 6000) g")
            conn.commit()
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        assert_tables_equal(pair.publisher, pair.target, "t")
        wait_until(lambda: pair.publisher.scalar("SELECT stream_txns FROM pg_stat_replication_slots"
                                                 " WHERE slot_name = %s", (pair.name,)), timeout=30,
                   what="the transaction streamed")  # fmt: skip
    finally:
        w.stop()


def test_after_a_restart_each_ddl_is_applied_once(pair, replica):
    with pair.publisher.connect(autocommit=False) as conn:
        ddl(conn, "ALTER TABLE t ADD COLUMN c int", "ALTER TABLE", table("t"), slot=pair.name)
        conn.execute("INSERT INTO t VALUES (1, 'a', 1)")
        conn.commit()
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    replica.thread.stop()
    with pair.publisher.connect(
        autocommit=False
    ) as conn:  # applied by the next worker, from where this one was
        ddl(conn, "ALTER TABLE t ADD COLUMN d int", "ALTER TABLE", table("t"), slot=pair.name)
        conn.commit()
    for i in (2, 3):
        replica.thread = replica.start()
        pair.publisher.execute("INSERT INTO t VALUES (%s, 'b', 2, 3)", (i,))
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        replica.thread.stop()
    replica.thread = replica.start()
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert columns(pair.target, "t") == ["id", "v", "c", "d"]
    assert_tables_equal(pair.publisher, pair.target, "t")


def test_a_grant_to_a_role_the_target_lacks_is_a_warning_not_a_stop(pair, replica):
    role = f"{pair.name}_r"[:60]
    pair.publisher.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        with pair.publisher.connect(autocommit=False) as conn:
            grant = sql.SQL("GRANT SELECT ON t TO {}").format(sql.Identifier(role)).as_string(conn)
            ddl(conn, grant, "GRANT", slot=pair.name)
            ddl(conn, "COMMENT ON TABLE t IS 'kept'", "COMMENT", table("t"), slot=pair.name)
            conn.execute("INSERT INTO t VALUES (1, 'a')")
            conn.commit()
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert_tables_equal(pair.publisher, pair.target, "t")
        assert pair.target.scalar("SELECT obj_description('t'::regclass, 'pg_class')") == "kept"
    finally:
        pair.publisher.execute(
            sql.SQL("DROP OWNED BY {}; DROP ROLE {}").format(sql.Identifier(role), sql.Identifier(role))
        )


def test_a_statement_the_target_cannot_run_stops_the_apply_naming_it_and_goes_on_once_fixed(pair, replica):
    pair.publisher.execute("CREATE SCHEMA extra")
    with pair.publisher.connect(autocommit=False) as conn:
        ddl(conn, "CREATE TABLE extra.x (id int PRIMARY KEY)", "CREATE TABLE", slot=pair.name)
        conn.execute("INSERT INTO t VALUES (1, 'after')")
        conn.commit()

    def error():
        err = replica.catalog.last_error(replica.sub.subid)
        return err if err and 'schema "extra" does not exist' in err["message"] else None

    err = wait_until(error, timeout=30, what="the apply stopped at the DDL")
    assert err["message_type"] == "MESSAGE"
    assert "replaying the source's DDL: CREATE TABLE extra.x (id int PRIMARY KEY)" in err["message"]
    pair.target.execute("CREATE SCHEMA extra")  # what the operator does; the retry goes on by itself
    wait_for_catchup(pair.publisher, pair.name, timeout=30)
    assert pair.target.scalar("SELECT to_regclass('extra.x') IS NOT NULL")
    assert_tables_equal(pair.publisher, pair.target, "t")


def test_a_message_any_role_can_emit_is_not_run(pair, replica):
    """pg_logical_emit_message is PUBLIC: a role with no right but LOGIN emits a well-formed message for our slot;
    the apply does not run it (its signature is not the capture's) and replication goes on."""
    role = f"{pair.name}_m"[:60]
    pair.publisher.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        ev = DdlEvent(pair.name, "CREATE TABLE", 1, "ts", "CREATE TABLE public.pwned (i int)", "public")
        with pair.publisher.as_user(role).connect(autocommit=False) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)",
                         (PREFIX, b"0" * 64 + encode_payload(ev)))  # fmt: skip
            conn.commit()
        pair.publisher.execute("INSERT INTO t VALUES (1, 'a')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert pair.target.scalar("SELECT to_regclass('public.pwned')") is None
        assert_tables_equal(pair.publisher, pair.target, "t")
    finally:
        pair.publisher.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_code_a_replayed_alter_runs_on_existing_rows_is_held_to_the_trust_rule(pair, replica):
    """A new column's default calls a function that another role owns on the target: the apply stops before the
    statement runs, naming the function and its owner; once the apply role (or a superuser) owns it, it goes on."""
    role = f"{pair.name}_o"[:60]
    pair.target.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    for db in (pair.publisher, pair.target):
        db.execute("CREATE FUNCTION seven(int) RETURNS int LANGUAGE sql AS 'SELECT 7'")
    pair.target.execute(sql.SQL("ALTER FUNCTION seven(int) OWNER TO {}").format(sql.Identifier(role)))
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'a')")
        with pair.publisher.connect(autocommit=False) as conn:
            ddl(
                conn,
                "ALTER TABLE t ADD COLUMN c int DEFAULT seven(1)",
                "ALTER TABLE",
                table("t"),
                slot=pair.name,
            )
            conn.commit()

        def error():
            err = replica.catalog.last_error(replica.sub.subid)
            return err if err and "would run seven(integer)" in err["message"] else None

        err = wait_until(error, timeout=30, what="the apply stopped before the untrusted default")
        assert f'owned by "{role}"' in err["message"] and columns(pair.target, "t") == ["id", "v"]
        pair.target.execute("ALTER FUNCTION seven(int) OWNER TO CURRENT_USER")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert_tables_equal(pair.publisher, pair.target, "t")
    finally:
        pair.target.execute(
            sql.SQL("DROP OWNED BY {}; DROP ROLE {}").format(sql.Identifier(role), sql.Identifier(role))
        )
