"""``applier alter NAME --connection CONNINFO`` (ALTER SUBSCRIPTION ... CONNECTION; issue 30): the new address is
checked before it is stored (it answers, has the publications and the slot), a password in it is used and never
stored, and a running worker reconnects by itself."""

from __future__ import annotations

import pytest

from applier.testing import Database, wait_until
from tests.support.cli import StartRun, catalog_row, create, fails, make_tables, ok, run_log

pytestmark = pytest.mark.core


def walsender_pid(publisher: Database, name: str) -> int | None:
    return publisher.cluster.scalar(
        "SELECT pid FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'", (name,)
    )


@pytest.mark.anyversion  # our checks (the publication and slot look-ups create's tests run on every version) and our worker's reconnect
def test_alter_connection_checks_the_new_publisher_then_the_worker_reconnects(
    pair, start_run: StartRun
) -> None:
    make_tables(pair, "t", rows=10)
    create(pair, "s")
    proc = start_run(pair.target, "s")
    wait_until(
        lambda: pair.target.scalar("SELECT count(*) FROM t") == 10, timeout=90, what="the initial copy"
    )
    old_pid = wait_until(lambda: walsender_pid(pair.publisher, "s"), timeout=60, what="streaming")
    stored = catalog_row(pair.target, "s")["subconninfo"]

    other = pair.publisher.cluster.create_database(pair.name + "_o")
    try:
        err = fails(pair.target, "alter", "s", "--connection", other.dsn)
        assert f'has no publication "{pair.name}"' in err and "the connection is unchanged" in err, err
        other.execute(f"CREATE PUBLICATION {pair.name} FOR ALL TABLES")
        err = fails(pair.target, "alter", "s", "--connection", other.dsn)  # slots are the cluster's
        assert f"is a pgoutput slot of database {pair.name}, not a pgoutput slot of {other.name}" in err, err
    finally:
        pair.publisher.cluster.drop_database(other.name)
    elsewhere = pair.target.cluster.create_database(pair.name + "_e")  # another server: no slot "s" there
    try:
        elsewhere.execute(f"CREATE PUBLICATION {pair.name} FOR ALL TABLES")
        err = fails(pair.target, "alter", "s", "--connection", elsewhere.dsn)
        assert 'replication slot "s" does not exist on the publisher at the new connection' in err, err
    finally:
        pair.target.cluster.drop_database(elsewhere.name)
    err = fails(
        pair.target, "alter", "s", "--connection", "host=127.0.0.1 port=1 user=x dbname=x password=hunter2"
    )
    assert "needed to check the new connection" in err and "hunter2" not in err, err
    assert catalog_row(pair.target, "s")["subconninfo"] == stored

    out = ok(
        pair.target, "alter", "s", "--connection", pair.publisher.dsn + " connect_timeout=9 password=hunter2"
    )
    assert "altered: connection" in out and "reconnects" in out, out
    now = catalog_row(pair.target, "s")["subconninfo"]
    assert "connect_timeout" in now and "hunter2" not in now, now
    wait_until(lambda: walsender_pid(pair.publisher, "s") not in (None, old_pid), timeout=60,
               what="the worker's new walsender")  # fmt: skip
    pair.publisher.execute("INSERT INTO t VALUES (100, 'after the new connection')")
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") == 11, timeout=60, what="the change")
    assert proc.poll() is None and "hunter2" not in run_log(proc)
