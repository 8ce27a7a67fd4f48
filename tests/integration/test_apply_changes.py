"""Row changes end to end: a real publisher, our apply worker in a thread, a real target (no mocks)."""

from __future__ import annotations

import pytest

from applier.apply.testing import setup_subscription
from applier.apply.worker import start_worker
from applier.catalog.store import Catalog
from applier.testing import assert_tables_equal, wait_for_catchup, wait_until

pytestmark = pytest.mark.core


def both(pair, *statements: str) -> None:
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def test_changes_with_each_replica_identity_and_toast(pair):
    """INSERT (row-by-row and COPY runs), UPDATE incl. key change, DELETE, with replica identity default, index and
    full (no key on the target, duplicate rows, NULLs), and unchanged TOAST values kept on the target."""
    both(
        pair,
        "CREATE TABLE rd (id int PRIMARY KEY, v text, big text)",
        "ALTER TABLE rd ALTER COLUMN big SET STORAGE EXTERNAL",
        "CREATE TABLE ri (k int NOT NULL, v text, other int)",
        "CREATE UNIQUE INDEX ri_k ON ri (k)",
        "ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_k",
        "CREATE TABLE rf (a int, b text)",
        "ALTER TABLE rf REPLICA IDENTITY FULL",
    )
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.rd", "public.ri", "public.rf"])
    w = s.start()
    try:
        pub = pair.publisher
        pub.execute(
            "INSERT INTO rd SELECT g, 'v' || g, repeat(md5(g::text), 200) FROM generate_series(1, 600) g"
        )
        pub.execute("INSERT INTO rd VALUES (1001, E'tab\\there\\nnewline \\\\ back', NULL)")
        pub.execute("UPDATE rd SET v = 'changed' WHERE id % 3 = 0")  # big unchanged: sent as 'u'
        pub.execute("UPDATE rd SET id = id + 10000 WHERE id % 7 = 0")  # key change: old key sent
        pub.execute("DELETE FROM rd WHERE id % 5 = 0")
        pub.execute("INSERT INTO ri SELECT g, 'v' || g, g FROM generate_series(1, 50) g")
        pub.execute("UPDATE ri SET v = NULL, k = k + 100 WHERE k % 2 = 0")
        pub.execute("DELETE FROM ri WHERE k % 3 = 0")
        pub.execute("INSERT INTO rf VALUES (1, 'a'), (1, 'a'), (2, NULL), (3, 'c')")
        pub.execute("UPDATE rf SET b = 'one' WHERE ctid = (SELECT ctid FROM rf WHERE a = 1 LIMIT 1)")
        pub.execute("UPDATE rf SET a = 20 WHERE b IS NULL")
        pub.execute("DELETE FROM rf WHERE a = 3")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert_tables_equal(pub, pair.target, "public.rd", "public.ri", "public.rf")
        assert (
            pair.target.scalar("SELECT count(*) FROM rd WHERE big IS NOT NULL AND length(big) = 6400") > 300
        )
    finally:
        w.stop()


def test_truncate_restart_identity_and_column_mapping_by_name(pair):
    """TRUNCATE ... RESTART IDENTITY resets the target's own sequence; a CASCADE on the publisher truncates the
    published tables it lists, never more. Columns map by name: the target has its columns in another order and an
    extra one that takes its default."""
    pair.publisher.execute("CREATE TABLE parent (id int PRIMARY KEY, a text, b int)")
    pair.target.execute(
        "CREATE TABLE parent (b int, extra text DEFAULT 'dflt', id serial PRIMARY KEY, a text)"
    )
    both(pair, "CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.parent", "public.child"])
    w = s.start()
    try:
        pub = pair.publisher
        pub.execute("INSERT INTO parent SELECT g, 'a' || g, g * 2 FROM generate_series(1, 20) g")
        pub.execute("INSERT INTO child SELECT g, g FROM generate_series(1, 20) g")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert_tables_equal(pub, pair.target, "public.parent", columns=["id", "a", "b"])
        assert pair.target.scalar("SELECT count(*) FROM parent WHERE extra = 'dflt'") == 20
        pair.target.execute("SELECT nextval('parent_id_seq')")
        pub.execute("TRUNCATE parent CASCADE")  # sends both relations with the CASCADE flag
        pub.execute("INSERT INTO parent VALUES (7, 'again', 1)")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert pair.target.query("SELECT id, a, extra FROM parent") == [(7, "again", "dflt")]
        assert pair.target.scalar("SELECT count(*) FROM child") == 0
        pair.target.execute("SELECT nextval('parent_id_seq')")
        pub.execute("TRUNCATE parent, child RESTART IDENTITY")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert pair.target.scalar("SELECT count(*) FROM parent") == 0
        assert pair.target.scalar("SELECT nextval('parent_id_seq')") == 1
    finally:
        w.stop()


def test_missing_column_then_fixed_and_missing_table(pair):
    """A published column missing on the target is an error naming table and column; the worker retries and goes
    on once the column exists. A dropped target table is an error naming it."""
    pair.publisher.execute("CREATE TABLE t (id int PRIMARY KEY, c1 text, c2 int)")
    pair.target.execute("CREATE TABLE t (id int PRIMARY KEY, c1 text)")
    both(pair, "CREATE TABLE gone (id int PRIMARY KEY)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t", "public.gone"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one', 1)")

        def error_about(text: str):
            err = s.catalog.last_error(s.sub.subid)
            return err if err and text in err["message"] else None

        err = wait_until(lambda: error_about('is missing replicated column: "c2"'), timeout=30)
        assert 'logical replication target relation "public.t"' in err["message"]
        assert err["message_type"] == "INSERT" and err["relation"] == "public.t"
        assert err["finish_lsn"] and err["remote_xid"]
        # what the error says to run is what makes the apply go on
        statement = err["message"].split("the rows already there take it): ", 1)[1]
        assert statement == 'ALTER TABLE "public"."t" ADD COLUMN "c2" integer'
        pair.target.execute(statement)
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert_tables_equal(pair.publisher, pair.target, "public.t")

        pair.target.execute("DROP TABLE gone")
        pair.publisher.execute("INSERT INTO gone VALUES (1)")
        err = wait_until(lambda: error_about("does not exist"), timeout=30)
        assert err["message"] == 'logical replication target relation "public.gone" does not exist'
    finally:
        w.stop()


def test_conflict_disables_then_skip_lsn_skips_the_transaction(pair):
    """A unique violation with disable_on_error disables the subscription (the worker returns); SKIP with the
    finish LSN from the error then drops exactly that transaction and clears the skip-LSN."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute("INSERT INTO t VALUES (2, 'local')")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], disable_on_error=True)
    w = s.start()
    pair.publisher.execute("INSERT INTO t VALUES (1, 'remote')")
    pair.publisher.execute("INSERT INTO t VALUES (2, 'remote'), (3, 'remote')")
    w.thread.join(30)
    assert not w.alive
    assert not s.refresh().subenabled
    err = s.catalog.last_error(s.sub.subid)
    assert "duplicate key value violates unique constraint" in err["message"]
    assert err["relation"] == "public.t" and err["message_type"] == "INSERT"
    assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "remote"), (2, "local")]

    s.catalog.update_subscription(s.sub.subid, subskiplsn=err["finish_lsn"], subenabled=True)
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (4, 'after')")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [
            (1, "remote"),
            (2, "local"),
            (4, "after"),
        ]
        assert s.refresh().subskiplsn is None
    finally:
        w.stop()


def test_binary_subscription(pair):
    """binary=true: values arrive in the types' binary send format and go in through the local receive function."""
    both(pair, "CREATE TABLE t (id int PRIMARY KEY, n numeric, ts timestamptz, arr int[], j jsonb, b bytea)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], binary=True)
    w = s.start()
    try:
        pair.publisher.execute(
            "INSERT INTO t SELECT g, g / 7.0, now(), ARRAY[g, g + 1], jsonb_build_object('g', g), '\\x00ff'::bytea"
            " FROM generate_series(1, 300) g"
        )
        pair.publisher.execute("UPDATE t SET n = -n, arr = NULL WHERE id % 4 = 0")
        pair.publisher.execute("DELETE FROM t WHERE id % 9 = 0")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert_tables_equal(pair.publisher, pair.target, "public.t")
    finally:
        w.stop()


def test_partitioned_target_via_root_and_row_movement(pair):
    """publish_via_partition_root: changes name the root; the target's partitioned root routes them, an UPDATE
    of the partition key moves the row, TRUNCATE of the root empties the partitions."""
    both(
        pair,
        "CREATE TABLE p (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
        "CREATE TABLE p_eu PARTITION OF p FOR VALUES IN ('eu')",
        "CREATE TABLE p_us PARTITION OF p FOR VALUES IN ('us')",
    )
    pair.publisher.execute(
        f'CREATE PUBLICATION "{pair.name}" FOR TABLE p WITH (publish_via_partition_root = true)'
    )
    pair.publisher.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (pair.name,))
    catalog = Catalog.connect(pair.target.dsn)
    catalog.ensure()
    sub = catalog.create_subscription(
        subname=pair.name, conninfo=pair.publisher.dsn, publications=[pair.name], two_phase_state="d",
        streaming="off", binary=False, disable_on_error=False, origin="any", slot_name=pair.name, enabled=True,
        copy_data=False,
    )  # fmt: skip
    catalog.add_table(sub.subid, int(pair.target.scalar("SELECT 'public.p'::regclass::oid")), "public.p", "r")
    w = start_worker(pair.target.dsn, pair.name, retry_initial=0.1, retry_max=1.0)
    try:
        pub = pair.publisher
        pub.execute(
            "INSERT INTO p SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'v' FROM generate_series(1, 300) g"
        )
        pub.execute("UPDATE p SET region = 'us', v = 'moved' WHERE id <= 10 AND region = 'eu'")
        pub.execute("DELETE FROM p WHERE id > 290")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert_tables_equal(pub, pair.target, "public.p_eu", "public.p_us")
        assert pair.target.scalar("SELECT count(*) FROM p_us WHERE v = 'moved'") == 5
        pub.execute("TRUNCATE p")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert pair.target.scalar("SELECT count(*) FROM p") == 0
    finally:
        w.stop()


def test_long_insert_runs_are_converted_in_stretches(pair):
    """Thousands of inserts in one transaction arrive faster than they are applied, so the worker converts them
    into COPY text a stretch at a time: values COPY must escape, NULLs, and a few rows of another table in the
    middle (which end the stretch and the COPY) all land exactly as on the publisher."""
    both(
        pair,
        "CREATE TABLE la (id int PRIMARY KEY, v text, n numeric, note text)",
        "CREATE TABLE lb (id int PRIMARY KEY, v text)",
    )
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.la", "public.lb"])
    pub = pair.publisher
    # written before the worker starts, so the whole backlog is waiting in the stream
    pub.execute(
        """
        DO $$
        BEGIN
          FOR i IN 1..12000 LOOP
            INSERT INTO la VALUES (
              i,
              CASE i % 5 WHEN 0 THEN NULL WHEN 1 THEN E'tab\\there' WHEN 2 THEN E'back\\\\slash\\nnl\\rcr'
                         WHEN 3 THEN '\\N' ELSE 'plain ' || i END,
              CASE WHEN i % 7 = 0 THEN NULL ELSE i / 3.0 END,
              repeat('é', i % 4));
            IF i % 3000 = 0 THEN
              INSERT INTO lb SELECT i + g, E'b\\t' || g FROM generate_series(1, 3) g;
            END IF;
          END LOOP;
        END $$
        """
    )
    pub.execute("INSERT INTO lb SELECT g, NULL FROM generate_series(100000, 100500) g")
    w = s.start()
    try:
        wait_for_catchup(pub, pair.name, timeout=60)
        assert_tables_equal(pub, pair.target, "public.la", "public.lb")
    finally:
        w.stop()
    assert w.worker.stats.errors == 0
    assert w.worker.stats.converted_rows > 5000


def test_missing_rows_are_skipped_and_logged_as_conflicts(pair, caplog):
    """An UPDATE or DELETE whose row the target lacks is skipped, not an error (behaviour 47), and logged as
    PostgreSQL 18 logs it (behaviour 110): ``conflict detected on relation ...: conflict=update_missing`` with the
    error context, and counted by kind."""
    import logging

    both(pair, "CREATE TABLE mr (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO mr SELECT g, 'v' || g FROM generate_series(1, 5) g")
    pair.target.execute("INSERT INTO mr SELECT g, 'v' || g FROM generate_series(1, 3) g")  # 4 and 5 missing
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.mr"])
    caplog.set_level(logging.INFO, logger="applier.apply")
    w = s.start()
    try:
        pair.publisher.execute("UPDATE mr SET v = 'new' WHERE id IN (1, 4)")
        pair.publisher.execute("DELETE FROM mr WHERE id IN (2, 5)")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        wait_until(lambda: "conflict=delete_missing" in caplog.text, timeout=10)
    finally:
        w.stop()
    assert w.worker.stats.errors == 0
    assert pair.target.query("SELECT id, v FROM mr ORDER BY id") == [(1, "new"), (3, "v3")]
    lines = [r.getMessage() for r in caplog.records if "conflict detected" in r.getMessage()]
    assert len(lines) == 2
    update, delete = sorted(lines, key=lambda m: "delete" in m)
    assert update.startswith('conflict detected on relation "public.mr": conflict=update_missing')
    assert "Could not find the row to be updated." in update
    assert 'during message type "UPDATE" for replication target relation "public.mr" in transaction' in update
    assert delete.startswith('conflict detected on relation "public.mr": conflict=delete_missing')
