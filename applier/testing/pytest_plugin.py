"""pytest fixtures over :mod:`applier.testing`: one publisher and one target cluster per test session, and a fresh
pair of databases per test, so tests share servers (fast) without sharing data (independent).

Enable with ``pytest_plugins = ["applier.testing.pytest_plugin"]`` in a ``conftest.py``. ``APPLIER_TEST_PG=15|16|18``
chooses the server version (default 18).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from applier.catalog import sql as catalog_sql
from applier.testing.cluster import Database, PostgresBinaries, PostgresCluster, find_binaries

_counter = itertools.count(1)


@dataclass(frozen=True)
class ReplicationPair:
    """A publisher database and a target database, created for one test."""

    publisher: Database
    target: Database
    name: str  # unique per test: use it for subscription, slot and publication names


@pytest.fixture(scope="session")
def pg_binaries() -> PostgresBinaries:
    return find_binaries()


@pytest.fixture(scope="session")
def publisher_cluster(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    with PostgresCluster(pg_binaries, name="publisher") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def target_cluster(pg_binaries: PostgresBinaries) -> Iterator[PostgresCluster]:
    with PostgresCluster(pg_binaries, name="target") as cluster:
        yield cluster


def _unique_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:30].strip("_")
    return f"t{os.getpid() % 10000}_{next(_counter)}_{base}"


@pytest.fixture
def pair(
    request: pytest.FixtureRequest, publisher_cluster: PostgresCluster, target_cluster: PostgresCluster
) -> Iterator[ReplicationPair]:
    """Fresh databases named after the test on both clusters; dropped afterwards with their slots, prepared
    transactions and our replication origins, so a failing test leaves nothing behind for the next one."""
    name = _unique_name(request)
    if publisher_cluster.scalar("SELECT 1") != 1 or target_cluster.scalar("SELECT 1") != 1:
        pytest.fail("test clusters are not answering")
    p = publisher_cluster.create_database(name)
    t = target_cluster.create_database(name)
    try:
        yield ReplicationPair(p, t, name)
    finally:
        _restart_if_down(publisher_cluster)
        _restart_if_down(target_cluster)
        drop_our_origins(t)
        target_cluster.drop_database(name)
        publisher_cluster.drop_database(name)


def _restart_if_down(cluster: PostgresCluster) -> None:
    """A test that crashed a server and failed before restarting it must not break the tests after it."""
    try:
        cluster.scalar("SELECT 1")
    except Exception:  # noqa: BLE001
        cluster.start()


def drop_our_origins(target: Database) -> None:
    """Drop the replication origins of the subscriptions in ``target``'s catalog (origins are cluster-wide)."""
    exists = target.scalar(catalog_sql.CATALOG_EXISTS)
    if not exists:
        return
    with target.connect() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
        subids = [subid for (subid,) in conn.execute(catalog_sql.SUBSCRIPTION_IDS).fetchall()]
    for subid in subids:  # a terminated backend lets go of its origin when it has exited, a moment later
        if target.scalar("SELECT 1 FROM pg_replication_origin WHERE roname = %s", (f"applier_{subid}",)):
            target.drop_origin(f"applier_{subid}")
