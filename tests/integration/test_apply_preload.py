"""The local tables preloaded when an apply session starts (``Target.preload_local_tables``), on real servers.

The preload reads every subscribed table in one query before streaming, so that the first change of each needs no
catalog lookup that drains the pipeline. A preloaded table is used only if its catalog rows are still those it was
read from (the stamp, checked at first use), which is where the native worker would see the change through a
relcache invalidation: a table altered between the start and its first change is read again, and applies exactly
as it did when it was always read at first use.
"""

from __future__ import annotations

import pytest

from applier.apply import target as target_module
from applier.apply.relmap import LocalColumn, LocalTable
from applier.apply.target import Target
from applier.apply.testing import setup_subscription
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until
from state.tables import SyncState

pytestmark = pytest.mark.core


def both(pair, *statements: str) -> None:
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def oid(db, table: str) -> int:
    return int(db.scalar("SELECT %s::regclass::oid", (table,)))


def _side_sessions(db) -> int:
    return int(
        db.scalar(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'applier% catalog check'"
        )
    )


def test_preload_reads_each_shape_as_the_lookup_and_rereads_an_altered_table(pair, monkeypatch):
    """One query reads tables with a replica identity index, a primary key, none (FULL), a generated and an
    identity column and a trigger enabled ALWAYS, with the same columns, keys and bulk fitness as the per-table
    lookup; an unchanged table is then taken as preloaded (the same object), an altered or dropped one read again,
    and the second connection is closed once no preloaded table is left."""
    db = pair.target
    db.execute("CREATE TABLE ri (k int NOT NULL, v text, pk int PRIMARY KEY)")
    db.execute("CREATE UNIQUE INDEX ri_k ON ri (k)")
    db.execute("ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_k")
    db.execute(
        "CREATE TABLE gen (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, a int, b int GENERATED ALWAYS AS"
        " (a * 2) STORED)"
    )
    db.execute("CREATE TABLE nokey (a int, b text)")
    db.execute("CREATE FUNCTION noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END'")
    db.execute("CREATE TABLE trig (id int PRIMARY KEY, v text)")
    db.execute("CREATE TRIGGER t BEFORE INSERT ON trig FOR EACH ROW EXECUTE FUNCTION noop()")
    db.execute("ALTER TABLE trig ENABLE ALWAYS TRIGGER t")
    db.execute("CREATE TABLE altered (id int PRIMARY KEY, v int)")
    db.execute("CREATE TABLE dropped (id int PRIMARY KEY)")
    db.execute("SELECT pg_replication_origin_create('preload_test')")
    db.execute("SELECT pg_replication_origin_create('preload_test_2')")
    names = ("ri", "gen", "nokey", "trig", "altered", "dropped")
    target = Target.connect(db.dsn, origin="preload_test")
    try:
        assert target.preload_local_tables([oid(db, f"public.{n}") for n in names], db.dsn) == len(names)
        preloaded = {name: table for (_schema, name), (table, _stamp) in target.preloaded.items()}
        assert sorted(preloaded) == sorted(names)
        int4, text = 23, 25
        assert preloaded["ri"] == LocalTable(
            oid(db, "public.ri"), "public", "ri", "r",
            (LocalColumn("k", int4, "", 1007), LocalColumn("v", text, "", 1009), LocalColumn("pk", int4, "", 1007)),
            ("k",), True,
        )  # fmt: skip
        assert [(c.name, c.generated, c.identity) for c in preloaded["gen"].columns] == [
            ("id", "", "a"), ("a", "", ""), ("b", "s", ""),
        ]  # fmt: skip
        assert preloaded["gen"].key == ("id",) and preloaded["nokey"].key is None
        assert preloaded["nokey"].bulk and not preloaded["trig"].bulk
        assert _side_sessions(db) == 1
        # the per-table lookup, on tables not preloaded any more, reads the same
        fresh = Target.connect(db.dsn, origin="preload_test_2")
        try:
            for name in ("ri", "gen", "nokey", "trig"):
                assert fresh.load_local_table("public", name) == preloaded[name], name
        finally:
            fresh.close()

        db.execute("ALTER TABLE altered ALTER COLUMN v TYPE numeric, ADD COLUMN w text")
        db.execute("DROP TABLE dropped")
        # a check answers for the first uses of the next CHECK_FRESH_S: here every first use asks again, so the
        # answer cannot come from the check made before this DDL (instead of sleeping past the window)
        monkeypatch.setattr(target_module, "CHECK_FRESH_S", 0.0)
        assert target.load_local_table("public", "ri") is preloaded["ri"]
        again = target.load_local_table("public", "altered")
        assert again is not None and again is not preloaded["altered"]
        assert [(c.name, c.type_oid) for c in again.columns] == [("id", int4), ("v", 1700), ("w", text)]
        assert target.load_local_table("public", "dropped") is None
        # used once: the next lookup (after a Relation message) reads the catalogs again
        assert target.load_local_table("public", "ri") == preloaded["ri"]
        assert target.load_local_table("public", "ri") is not preloaded["ri"]
        for name in ("gen", "nokey", "trig"):
            assert target.load_local_table("public", name) is preloaded[name]
        assert target.preloaded == {}
        wait_until(lambda: _side_sessions(db) == 0, timeout=10, what="the second connection closed")
    finally:
        target.close()
        db.drop_origin("preload_test")
        db.drop_origin("preload_test_2")


def test_tables_altered_after_the_start_apply_as_before(pair):
    """Between the worker's start (the preload) and the first change: a published column added on the target, a
    column's type changed (the value must go through the new type's input: 1.5 is no integer) and a key changed
    apply with no error, as when tables were read at first use; an untouched table applies from the preload."""
    pair.publisher.execute("CREATE TABLE addcol (id int PRIMARY KEY, c1 text, c2 int)")
    pair.target.execute("CREATE TABLE addcol (id int PRIMARY KEY, c1 text)")
    pair.publisher.execute("CREATE TABLE retype (id int PRIMARY KEY, v numeric)")
    pair.target.execute("CREATE TABLE retype (id int PRIMARY KEY, v int)")
    both(
        pair,
        "CREATE TABLE rekey (k int NOT NULL, id int NOT NULL, v text)",
        "CREATE UNIQUE INDEX rekey_k ON rekey (k)",
        "ALTER TABLE rekey REPLICA IDENTITY USING INDEX rekey_k",
        "CREATE TABLE same (id int PRIMARY KEY, v text)",
    )
    pair.target.execute("CREATE UNIQUE INDEX rekey_id ON rekey (id)")
    pair.target.execute("ALTER TABLE rekey REPLICA IDENTITY USING INDEX rekey_id")
    tables = ["public.addcol", "public.retype", "public.rekey", "public.same"]
    s = setup_subscription(pair.publisher, pair.target, pair.name, tables)
    w = s.start()
    try:
        assert w.worker.stats.started_streaming.wait(30)
        wait_until(lambda: _side_sessions(pair.target) == 1, timeout=10, what="tables preloaded")
        pair.target.execute("ALTER TABLE addcol ADD COLUMN c2 int")
        pair.target.execute("ALTER TABLE retype ALTER COLUMN v TYPE numeric")
        # the target's key becomes k, the publisher's replica identity: with the stale key (id) the UPDATE
        # below could not be applied (the publisher does not send id as a key column)
        pair.target.execute("ALTER TABLE rekey REPLICA IDENTITY USING INDEX rekey_k")
        pair.publisher.execute("INSERT INTO addcol VALUES (1, 'one', 1)")
        pair.publisher.execute("INSERT INTO retype VALUES (1, 1.5)")
        pair.publisher.execute("INSERT INTO rekey VALUES (1, 10, 'a'), (2, 20, 'b')")
        pair.publisher.execute("UPDATE rekey SET v = 'changed' WHERE k = 1")
        pair.publisher.execute("INSERT INTO same VALUES (1, 'x')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert s.catalog.last_error(s.sub.subid) is None
        assert_tables_equal(pair.publisher, pair.target, *tables)
        assert w.worker.stats.sessions == 1
    finally:
        w.stop()


def test_table_added_while_running_is_read_at_first_use(pair):
    """A table subscribed after the start was not preloaded: its first change reads it (the per-table lookup)."""
    both(pair, "CREATE TABLE t1 (id int PRIMARY KEY, v text)", "CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t1"])
    w = s.start()
    try:
        assert w.worker.stats.started_streaming.wait(30)
        pair.publisher.execute("INSERT INTO t1 VALUES (1, 'one')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        pair.publisher.execute(f"ALTER PUBLICATION {pair.name} ADD TABLE t2")
        s.catalog.add_table(s.sub.subid, oid(pair.target, "public.t2"), "public.t2", SyncState.READY, None)
        pair.publisher.execute("INSERT INTO t2 VALUES (1, 'two')")
        pair.publisher.execute("INSERT INTO t1 VALUES (2, 'one more')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        wait_until(lambda: pair.target.query("SELECT v FROM t2") == [("two",)], timeout=30, what="t2 applied")
        assert_tables_equal(pair.publisher, pair.target, "public.t1", "public.t2")
        assert s.catalog.last_error(s.sub.subid) is None
    finally:
        w.stop()


def test_a_check_covers_at_most_a_batch_of_tables(pair, monkeypatch):
    """With one table a check (and its answer never too old), each first use checks its own table: an unchanged
    one is taken as preloaded, one altered after an earlier check is read again."""
    monkeypatch.setattr(target_module, "CHECK_BATCH", 1)
    monkeypatch.setattr(target_module, "CHECK_FRESH_S", 3600.0)
    db = pair.target
    for name in ("a", "b", "c"):
        db.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v int)")
    db.execute("SELECT pg_replication_origin_create('preload_batch')")
    target = Target.connect(db.dsn, origin="preload_batch")
    try:
        assert target.preload_local_tables([oid(db, f"public.{n}") for n in ("a", "b", "c")], db.dsn) == 3
        preloaded = {name: table for (_schema, name), (table, _stamp) in target.preloaded.items()}
        assert target.load_local_table("public", "a") is preloaded["a"]
        db.execute("ALTER TABLE b ADD COLUMN w text")
        again = target.load_local_table("public", "b")
        assert again is not None and [c.name for c in again.columns] == ["id", "v", "w"]
        assert target.load_local_table("public", "c") is preloaded["c"]
    finally:
        target.close()
        db.drop_origin("preload_batch")
