"""A target whose OID counter is past 2^31 (a database that went through OID wrap-around, or a long-lived one that
created many objects): the local column types and their array types have OIDs above 2^31, and they are sent to
libpq as statement parameter types. Read through an ``oid::int`` cast they came back negative, which libpq cannot
take; the target here is made so with ``pg_resetwal -o`` before its first start, and both the message-by-message
path and bulk apply (values as arrays of the columns' array types) must still give the publisher's rows."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from applier.apply.testing import ApplySetup, setup_subscription
from applier.apply.worker import WorkerThread
from applier.testing import PostgresBinaries, PostgresCluster, assert_tables_equal, wait_until
from applier.testing.pytest_plugin import ReplicationPair, drop_our_origins

pytestmark = pytest.mark.core

#: where the target's OID counter is set: every object created afterwards has an OID above 2^31
NEXT_OID = 3_000_000_000
_names = itertools.count(1)

#: on both sides: a domain (every table's key), an enum, a composite of the two (and a domain over it), and an
#: array of the enum; the table ``r`` can be applied in bulk (every column has an array type), ``a``, ``c`` and
#: ``d`` cannot (an array column has no array type, and a composite one would be expanded into its fields by the bulk
#: statements' ``ROWS FROM (unnest(...))``)
SCHEMA = (
    "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE TYPE reading AS (n posint, m mood)",
    "CREATE DOMAIN dreading AS reading",
    "CREATE TABLE r (id posint PRIMARY KEY, m mood, note text)",
    "CREATE TABLE a (id posint PRIMARY KEY, moods mood[])",
    "CREATE TABLE c (id posint PRIMARY KEY, rd reading)",
    "CREATE TABLE d (id posint PRIMARY KEY, dr dreading)",
)
TABLES = ("public.r", "public.a", "public.c", "public.d")


@pytest.fixture(scope="module")
def wrapped_target(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    """A target cluster whose next OID is :data:`NEXT_OID` (set between initdb and the first start)."""
    cluster = PostgresCluster(pg_binaries, name="bigoid").init()
    try:
        res = cluster.run_tool("pg_resetwal", "-o", str(NEXT_OID), "-D", str(cluster.datadir))
        assert res.returncode == 0, f"pg_resetwal failed:\n{res.stdout}\n{res.stderr}"
        yield cluster.start()
    finally:
        cluster.destroy()


@pytest.fixture
def big_pair(
    publisher_cluster: PostgresCluster, wrapped_target: PostgresCluster
) -> Iterator[ReplicationPair]:
    """Fresh databases on the shared publisher and on the wrapped target, with :data:`SCHEMA` on both."""
    name = f"bigoid_{os.getpid() % 10000}_{next(_names)}"
    p = publisher_cluster.create_database(name)
    t = wrapped_target.create_database(name)
    try:
        for db in (p, t):
            for statement in SCHEMA:
                db.execute(statement)
        yield ReplicationPair(p, t, name)
    finally:
        drop_our_origins(t)
        wrapped_target.drop_database(name)
        publisher_cluster.drop_database(name)


def _assert_oids_are_big(pair: ReplicationPair) -> None:
    """The test means something only if the target's types really have OIDs (and array types) above 2^31."""
    rows = pair.target.query(
        "SELECT typname::text, oid::int8, typarray::int8 FROM pg_type"
        " WHERE typname IN ('posint', 'mood', 'reading', 'dreading') AND typnamespace = 'public'::regnamespace"
    )
    assert len(rows) == 4 and all(oid > 2**31 and array > 2**31 for _name, oid, array in rows), rows
    attrs = pair.target.query(
        "SELECT attrelid::regclass::text, attname::text, atttypid::int8 FROM pg_attribute"
        " WHERE attrelid IN ('public.r'::regclass, 'public.a'::regclass, 'public.c'::regclass, 'public.d'::regclass)"
        " AND attname IN ('id', 'm', 'rd', 'dr', 'moods')"
    )
    assert len(attrs) == 8 and all(typ > 2**31 for _rel, _att, typ in attrs), attrs


def _caught_up(pair: ReplicationPair, lsn: str) -> bool:
    return bool(
        pair.publisher.cluster.scalar(
            "SELECT replay_lsn >= %s::pg_lsn FROM pg_stat_replication WHERE application_name = %s"
            " AND state = 'streaming'",
            (lsn, pair.name),
        )
    )


def _apply_until_caught_up(pair: ReplicationPair, w: WorkerThread) -> None:
    """Wait until the worker has replayed everything the publisher holds; a worker that died ends the wait (and
    ``stop()`` raises its error) rather than running the clock out."""
    lsn = pair.publisher.cluster.scalar("SELECT pg_current_wal_lsn()::text")
    wait_until(
        lambda: not w.alive or _caught_up(pair, lsn), timeout=60, what=f"{pair.name} to replay to {lsn}"
    )
    assert w.alive, "the apply worker stopped"


def _subscribe(pair: ReplicationPair) -> ApplySetup:
    _assert_oids_are_big(pair)
    return setup_subscription(pair.publisher, pair.target, pair.name, list(TABLES))


def test_changes_one_by_one_with_types_above_2_31(big_pair: ReplicationPair) -> None:
    """INSERT, UPDATE (of the key too) and DELETE, each its own transaction, applied message by message: every
    parameter is typed with a local type OID above 2^31."""
    pair = big_pair
    s = _subscribe(pair)
    w = s.start()
    try:
        pub = pair.publisher
        for statement in (
            "INSERT INTO r VALUES (1, 'ok', 'first')",
            "INSERT INTO r VALUES (2, 'sad', NULL)",
            "INSERT INTO r VALUES (3, NULL, 'third')",
            "INSERT INTO a VALUES (1, ARRAY['ok', 'happy']::mood[])",
            "INSERT INTO a VALUES (2, '{}')",
            "INSERT INTO c VALUES (1, ROW(1, 'sad')), (2, NULL)",
            "INSERT INTO d VALUES (1, ROW(2, 'ok'))",
            "UPDATE r SET m = 'happy' WHERE id = 1",
            "UPDATE r SET id = 20, note = 'moved' WHERE id = 2",
            "UPDATE a SET moods = ARRAY['sad', NULL]::mood[] WHERE id = 1",
            "UPDATE c SET rd = ROW(10, 'ok') WHERE id = 1",
            "DELETE FROM r WHERE id = 3",
            "DELETE FROM a WHERE id = 2",
            "DELETE FROM c WHERE id = 2",
        ):
            pub.execute(statement)
        _apply_until_caught_up(pair, w)
    finally:
        w.stop()
    assert w.worker.stats.errors == 0 and w.worker.stats.sessions == 1, w.worker.stats
    assert_tables_equal(pair.publisher, pair.target, *TABLES)
    assert pair.target.query("SELECT id, m::text, note FROM r ORDER BY id") == [
        (1, "happy", "first"),
        (20, "sad", "moved"),
    ]
    assert pair.target.query("SELECT id, rd::text FROM c") == [(1, "(10,ok)")]
    assert pair.target.query("SELECT id, dr::text FROM d") == [(1, "(2,ok)")]


@pytest.mark.anyversion  # our bulk path's array types; the high OIDs' reading is the one-by-one test's
def test_backlog_in_bulk_with_types_above_2_31(big_pair: ReplicationPair) -> None:
    """A backlog of small transactions committed before the worker starts is applied in bulk: inserts, updates
    and deletes of ``r`` travel as arrays of the local array types (OIDs above 2^31); the transactions that also
    change ``a``, ``c`` or ``d``, which cannot travel so, go message by message between them."""
    pair = big_pair
    s = _subscribe(pair)
    pair.publisher.execute(
        """
        CREATE PROCEDURE work(cnt int) LANGUAGE plpgsql AS $$
        DECLARE moods mood[] := enum_range(NULL::mood);
        BEGIN
          FOR i IN 1..cnt LOOP
            INSERT INTO r VALUES (i, moods[1 + i % 3], 'n' || i);
            IF i > 10 THEN
              UPDATE r SET m = moods[1 + (i + 2) % 3], note = NULL WHERE id = i - 10;
            END IF;
            IF i % 7 = 0 THEN
              DELETE FROM r WHERE id = i - 3;
            END IF;
            IF i % 25 = 0 THEN
              INSERT INTO a VALUES (i, moods[1:1 + i % 3]);
            END IF;
            IF i % 20 = 0 THEN
              INSERT INTO c VALUES (i, ROW(i, moods[1 + i % 3]));
              UPDATE c SET rd = ROW(i * 2, 'happy') WHERE id = i - 20;
              DELETE FROM c WHERE id = i - 60;
            END IF;
            IF i % 30 = 0 THEN
              INSERT INTO d VALUES (i, ROW(i + 1, NULL));
              UPDATE d SET dr = ROW(i, 'sad') WHERE id = i - 30;
            END IF;
            COMMIT;
          END LOOP;
        END $$
        """
    )
    pair.publisher.execute("CALL work(400)")
    w = s.start()
    try:
        _apply_until_caught_up(pair, w)
    finally:
        w.stop()
    stats = w.worker.stats
    # one session: a bulk statement that failed would have made the worker retry the batch message by message
    assert stats.errors == 0 and stats.sessions == 1, stats
    assert stats.bulk_transactions > 0, stats
    assert_tables_equal(pair.publisher, pair.target, *TABLES)
    assert pair.target.scalar("SELECT count(*) FROM r") == 400 - 400 // 7
