"""``applier migrate plan`` against real servers: a clean source passes and is described (tables, indexes,
constraints, sequences, large objects, extensions, publications), each blocker is found, and the plan changes
nothing on either server."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from applier.testing import Database, PostgresBinaries, PostgresCluster
from tests.support.cli import APPLIER
from tests.support.migrate import blocker_codes, plan

pytestmark = pytest.mark.core


def flush_stats(db: Database, *statements: str) -> None:
    """Run ``statements`` and flush this session's statistics, so pg_stat_user_tables shows them at once."""
    with db.connect() as conn:
        for s in statements:
            conn.execute(s)
        conn.execute("SELECT pg_stat_force_next_flush()")


def catalog_picture(db: Database) -> list[Any]:
    """What a plan must not change: relations, schemas, slots, publications, roles, prepared transactions."""
    return [
        db.query("SELECT c.oid, c.relname, c.relkind FROM pg_class c ORDER BY 1"),
        db.query("SELECT nspname FROM pg_namespace ORDER BY 1"),
        db.query("SELECT slot_name FROM pg_replication_slots ORDER BY 1"),
        db.query("SELECT pubname FROM pg_publication ORDER BY 1"),
        db.query("SELECT rolname FROM pg_roles ORDER BY 1"),
        db.query("SELECT gid FROM pg_prepared_xacts ORDER BY 1"),
        db.query("SELECT roname FROM pg_replication_origin ORDER BY 1"),
    ]


def test_a_clean_source_passes_is_described_and_nothing_changes(pair) -> None:
    pub, tgt = pair.publisher, pair.target
    pub.execute(
        "CREATE SCHEMA app;"
        "CREATE TABLE app.customers (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, email text UNIQUE);"
        "CREATE TABLE app.orders (id serial PRIMARY KEY, customer bigint REFERENCES app.customers,"
        "  total numeric CHECK (total >= 0), doc jsonb);"
        "CREATE INDEX orders_doc ON app.orders USING gin (doc);"
        "CREATE UNLOGGED TABLE app.scratch (id int PRIMARY KEY);"
        "CREATE TABLE public.logs (line text);"
        "INSERT INTO app.customers (email) SELECT 'c' || g FROM generate_series(1, 500) g;"
        "INSERT INTO app.orders (customer, total) SELECT 1 + g % 500, g FROM generate_series(1, 2000) g;"
        "CREATE MATERIALIZED VIEW app.totals AS SELECT customer, sum(total) FROM app.orders GROUP BY 1;"
        "CREATE PUBLICATION existing FOR TABLE app.orders;"
        "SELECT lo_from_bytea(0, 'large');"
        "ANALYZE"
    )
    flush_stats(pub, "UPDATE app.orders SET total = total + 1 WHERE id <= 10")
    before = catalog_picture(pub), catalog_picture(tgt)
    status, doc, _ = plan(pub, tgt, "--schema", "app")
    assert (catalog_picture(pub), catalog_picture(tgt)) == before
    assert tgt.scalar("SELECT to_regnamespace('applier')") is None

    assert status == 0 and doc["ok"] is True and doc["blockers"] == []
    assert doc["schemas"] == ["app"]
    tables = {t["name"]: t for t in doc["tables"]}
    assert sorted(tables) == ["customers", "orders", "scratch"]  # public.logs is not in the selection
    assert tables["orders"]["rows_estimate"] == 2000 and tables["orders"]["updates_deletes"] == 10
    assert (
        tables["orders"]["heap_bytes"] > 0
        and tables["orders"]["total_bytes"] > tables["orders"]["heap_bytes"]
    )
    assert {(i["name"], i["method"]) for i in doc["indexes"]} >= {
        ("orders_doc", "gin"),
        ("orders_pkey", "btree"),
    }
    assert doc["constraints"] == {"primary_key": 3, "unique": 1, "foreign_key": 1, "check": 1, "exclusion": 0}
    assert doc["sequences"] == ["app.customers_id_seq", "app.orders_id_seq"]
    assert doc["large_objects"] == 1 and doc["publications"] == ["existing"]
    assert doc["materialized_views"] == ["app.totals"] and "plpgsql" in doc["extensions"]
    assert doc["pg_dump"]["major"] >= pub.scalar("SELECT current_setting('server_version_num')::int / 10000")
    assert doc["estimate"]["copy_seconds"] >= 0 and "MB/s" in doc["estimate"]["how"]
    warnings = {w["code"] for w in doc["warnings"]}
    assert warnings == {"unlogged", "materialized_view", "large_objects"}  # a superuser source: DDL captured

    # the text form says the same, and the exit status is the same
    res = subprocess.run([*APPLIER, "migrate", "plan", "--source", pub.dsn, "--target", tgt.dsn, "--schema", "app"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "app.orders:" in res.stdout and "0 blocker(s), 3 warning(s)" in res.stdout
    assert (catalog_picture(pub), catalog_picture(tgt)) == before


def test_plan_covers_the_tables_start_migrates_a_partition_following_its_root(pair) -> None:
    """Where plan (each table's own name) and start (the partition tree's root) used to disagree: ``--table ev``
    now describes the partitions too, and ``--exclude-table 'ev_*'`` no longer hides them; both are what
    :func:`applier.migrate.survey.source_tables`, start's selection, covers."""
    from applier.migrate.selection import Selection
    from applier.migrate.survey import source_tables

    pub, tgt = pair.publisher, pair.target
    pub.execute(
        "CREATE TABLE ev (id int, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);"
        "CREATE TABLE ev_2024 PARTITION OF ev FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');"
        "CREATE TABLE ev_2025 PARTITION OF ev FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');"
        "CREATE TABLE other (id int PRIMARY KEY)"
    )
    for extra, expected in [
        (["--table", "ev"], ["ev", "ev_2024", "ev_2025"]),
        (["--exclude-table", "ev_*"], ["ev", "ev_2024", "ev_2025", "other"]),
        (["--exclude-table", "ev"], ["other"]),
    ]:
        status, doc, _ = plan(pub, tgt, *extra)
        assert status == 0, doc["blockers"]
        assert sorted(t["name"] for t in doc["tables"]) == expected, extra
        selection = Selection.of(None, extra[1:] if extra[0] == "--table" else None,
                                 extra[1:] if extra[0] == "--exclude-table" else None)  # fmt: skip
        with pub.connect() as conn:
            covered = source_tables(conn, selection).covered
        assert sorted(t for s, t in covered if s == "public") == expected, extra
    indexes = plan(pub, tgt, "--table", "ev")[1]["indexes"]
    assert {i["table"] for i in indexes} == {"ev", "ev_2024", "ev_2025"}


def test_a_keyless_table_that_gets_updates_blocks_until_it_has_an_identity_or_is_excluded(pair) -> None:
    pub, tgt = pair.publisher, pair.target
    pub.execute(
        "CREATE TABLE k (id int PRIMARY KEY); CREATE TABLE nokey (v text); INSERT INTO nokey VALUES ('a')"
    )
    status, doc, _ = plan(pub, tgt)
    assert status == 0 and "no_identity_yet" in {w["code"] for w in doc["warnings"]}

    flush_stats(pub, "DELETE FROM nokey")
    status, doc, _ = plan(pub, tgt)
    assert status == 1 and blocker_codes(doc) == ["no_identity"]
    assert (
        "public.nokey" in doc["blockers"][0]["message"]
        and "REPLICA IDENTITY FULL" in doc["blockers"][0]["hint"]
    )

    assert plan(pub, tgt, "--exclude-table", "nokey")[0] == 0
    assert plan(pub, tgt, "--table", "public.k")[0] == 0
    pub.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
    assert plan(pub, tgt)[0] == 0


@pytest.mark.anyversion  # our comparison of the two servers' tables and roles
def test_a_table_already_on_the_target_and_a_missing_role_block(pair) -> None:
    pub, tgt = pair.publisher, pair.target
    role = f"owner_{pair.name}"[:60]
    pub.cluster.execute(f'CREATE ROLE "{role}"')
    try:
        pub.execute(
            f'CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE u (id int PRIMARY KEY); ALTER TABLE u OWNER TO "{role}";'
            " CREATE TABLE v (id int PRIMARY KEY)"  # left when t and u are excluded: no table at all would block
        )
        tgt.execute("CREATE TABLE t (id int PRIMARY KEY)")
        status, doc, _ = plan(pub, tgt)
        assert status == 1 and blocker_codes(doc) == ["role", "target_table"]
        assert role in next(b["message"] for b in doc["blockers"] if b["code"] == "role")
        assert "public.t" in next(b["message"] for b in doc["blockers"] if b["code"] == "target_table")
        # plan's text output names them as BLOCKERs and exits 1
        res = subprocess.run([*APPLIER, "migrate", "plan", "--source", pub.dsn, "--target", tgt.dsn],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert res.returncode == 1 and res.stdout.count("BLOCKER: ") == 2
        assert plan(pub, tgt, "--exclude-table", "t", "--exclude-table", "u")[0] == 0
        status, doc, _ = plan(pub, tgt, "--exclude-table", "*")
        assert status == 1 and blocker_codes(doc) == ["no_tables"]  # start would refuse it: so does plan
    finally:
        pub.execute(f'DROP TABLE IF EXISTS u; DROP ROLE IF EXISTS "{role}"')


@pytest.fixture(scope="module")
def odd_cluster(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    """Wrong for a migration on purpose: no logical WAL, one slot and one WAL sender (a bad source), and no prepared
    transactions (a bad target)."""
    settings = {"wal_level": "replica", "max_prepared_transactions": "0", "max_replication_slots": "1",
                "max_wal_senders": "1"}  # fmt: skip
    with PostgresCluster(pg_binaries, name="odd", settings=settings) as cluster:
        yield cluster


def test_server_settings_block(pair, odd_cluster: PostgresCluster) -> None:
    odd = odd_cluster.create_database(pair.name)
    try:
        odd.execute("CREATE TABLE t (id int PRIMARY KEY)")
        pair.publisher.execute("CREATE TABLE t (id int PRIMARY KEY)")
        status, doc, _ = plan(odd, pair.target)
        assert status == 1 and blocker_codes(doc) == ["replication_slots", "wal_level", "wal_senders"]
        hints = {b["code"]: b["hint"] for b in doc["blockers"]}
        assert "ALTER SYSTEM SET wal_level = logical" in hints["wal_level"]
        status, doc, _ = plan(pair.publisher, odd)
        assert status == 1 and blocker_codes(doc) == ["max_prepared_transactions", "target_table"]
    finally:
        odd_cluster.drop_database(pair.name)


@pytest.mark.anyversion  # our message for a failed connection
def test_unreachable_source_is_a_clear_error(pair) -> None:
    res = subprocess.run([*APPLIER, "migrate", "plan", "--source", "host=127.0.0.1 port=1 password=s3cret",
                          "--target", pair.target.dsn], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 1 and "cannot connect to the source" in res.stderr
    assert "s3cret" not in res.stderr and "Traceback" not in res.stderr


def test_a_pg15_source_with_an_extension_the_target_lacks(pair, pg15: PostgresCluster) -> None:
    """The major-version upgrade case: PostgreSQL 15's contrib has pgcrypto, the embedded 18 does not."""
    if "pgcrypto" in {r[0] for r in pair.target.query("SELECT name FROM pg_available_extensions")}:
        pytest.skip("the target offers pgcrypto")
    src = pg15.create_database(pair.name)
    try:
        src.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        status, doc, _ = plan(src, pair.target)
        assert status == 0 and doc["source"]["server_version_num"] // 10000 == 15
        assert doc["pg_dump"]["major"] >= 15
        src.execute("CREATE EXTENSION pgcrypto")
        status, doc, _ = plan(src, pair.target)
        assert status == 1 and blocker_codes(doc) == ["extension"]
        assert "pgcrypto" in doc["blockers"][0]["message"]
    finally:
        pg15.drop_database(pair.name)
