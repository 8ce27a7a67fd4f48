"""PostgreSQL's own subscriber beside ours, for the differential tests (``tests/differential/``): its cluster, the
databases of one example on the three clusters, dropping its subscription, and whether a subscriber has replayed
up to an LSN. ``tests/differential/conftest.py`` offers :func:`native_cluster` to the modules there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, PostgresBinaries, PostgresCluster


@pytest.fixture(scope="module")
def native_cluster(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    """A third cluster for PostgreSQL's own subscriber (module-scoped: starting one takes a second or two)."""
    cluster = PostgresCluster(
        pg_binaries, name="native", settings={"wal_retrieve_retry_interval": "200ms"}
    ).start()
    try:
        yield cluster
    finally:
        cluster.destroy()


def create_databases(clusters: list[PostgresCluster], name: str) -> list[Database]:
    made: list[Database] = []
    try:
        for c in clusters:
            made.append(c.create_database(name))
    except BaseException:
        for db in made:
            db.cluster.drop_database(db.name)
        raise
    return made


def drop_native_subscription(native: Database, subname: str) -> None:
    """DROP SUBSCRIPTION (it drops its slot on the publisher); tolerate a publisher that is gone."""
    with contextlib.suppress(psycopg.Error), native.connect() as conn:
        exists = conn.execute("SELECT 1 FROM pg_subscription WHERE subname = %s", (subname,)).fetchone()
        if not exists:
            return
        conn.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(subname)))
        try:
            conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(subname)))
        except psycopg.Error:
            conn.execute(
                sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(sql.Identifier(subname))
            )
            conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(subname)))


def caught_up(publisher: Database, application_name: str, lsn: str) -> bool:
    return bool(
        publisher.cluster.scalar(
            "SELECT replay_lsn >= %s::pg_lsn FROM pg_stat_replication"
            " WHERE application_name = %s AND state = 'streaming'",
            (lsn, application_name),
        )
    )
