"""PostgreSQL 18's conflict kinds beyond the missing row (issue 40), side by side with PostgreSQL 18's own
subscriber fed the same rows from the same publication: ``update_origin_differs`` / ``delete_origin_differs`` (a row
last written by a local session; needs ``track_commit_timestamp`` on the target, so these targets have it on),
``update_exists`` and ``multiple_unique_conflicts`` (errors that stop the apply, each attempt counted), and
``insert_exists``, and the missing kinds' full DETAIL. For each: the counters equal native's, the log's words equal
native's (transaction ids and times aside: they are each server's own), what was applied equals; in plain, prepared,
streamed and streamed-prepared transactions and in a backlog (bulk and grouped apply). Then what has no native to
compare with: a duplicate key inside a COPY, ``--conflict-log table`` (``applier.conflict_log``), and the catalog's
upgrade to version 14."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg import sql

from applier.catalog.store import CATALOG_VERSION, Catalog
from applier.testing import Database, PostgresBinaries, PostgresCluster, wait_for_catchup, wait_until
from applier.testing.cluster import free_port
from applier.testing.pytest_plugin import ReplicationPair
from tests.support.cli import create, ok, run_log, status
from tests.support.native import drop_native_subscription, native_cluster

__all__ = ["native_cluster"]  # the fixture, for this module

#: targets 15, 16 and 18 alike; PostgreSQL 18's own subscriber is compared where the servers are 18
pytestmark = pytest.mark.core

KINDS = ("insert_exists", "update_origin_differs", "update_exists", "update_missing", "delete_origin_differs",
         "delete_missing", "multiple_unique_conflicts")  # fmt: skip
#: what differs between two servers in the same report: the local row's transaction id and commit time
_WHO_WHEN = re.compile(r"transaction \d+( at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?[+-]\d\d(:\d\d)?)?")


@pytest.fixture(scope="module")
def ts_clusters(pg_binaries: PostgresBinaries) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A target and a native subscriber with ``track_commit_timestamp = on`` (a restart setting: clusters of
    their own), the native one logging its conflicts (LOG and ERROR: "info")."""
    on = {"track_commit_timestamp": "on"}
    target = PostgresCluster(pg_binaries, name="ts_target", settings=on).start()
    native = PostgresCluster(pg_binaries, name="ts_native", settings={
        **on, "wal_retrieve_retry_interval": "200ms", "log_min_messages": "info"}).start()  # fmt: skip
    try:
        yield target, native
    finally:
        target.destroy()
        native.destroy()


@pytest.fixture
def ts_pair(pair: ReplicationPair, ts_clusters: tuple[PostgresCluster, PostgresCluster]) -> Iterator[Any]:
    """The test's publisher database, a target database on the commit-timestamp target, and a native database
    (None when the server is older than 18: there is no native report to compare with)."""
    target_cluster, native_side = ts_clusters
    target = target_cluster.create_database(pair.name)
    native = None
    if native_side.scalar("SELECT current_setting('server_version_num')::int") >= 180000:
        native = native_side.create_database(pair.name)
    try:
        yield ReplicationPair(pair.publisher, target, pair.name), native
    finally:
        if native is not None:
            drop_native_subscription(native, "n_" + pair.name[-20:])
            native_side.drop_database(native.name)
        with target.connect() as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE datname = current_database() AND pid <> pg_backend_pid()")  # fmt: skip
        for (subid,) in target.query("SELECT subid FROM applier.subscription"):
            target.execute("SELECT pg_replication_origin_drop(%s)", (f"applier_{subid}",))
        target_cluster.drop_database(target.name)


def _subscribe(p: ReplicationPair, native: Database | None, ddl: str, *extra: str) -> list[Database]:
    """``ddl`` on every side, a publication of its tables, our subscription "s" and the native one."""
    for db in (p.publisher, p.target, *([native] if native else [])):
        db.execute(ddl)
    p.publisher.execute(f"CREATE PUBLICATION {p.name} FOR ALL TABLES")
    create(p, "s", "--no-copy-data", *extra)
    if native is not None:
        options = ", two_phase = true" if "--two-phase" in extra else ""
        options += ", streaming = on" if "--streaming" in extra else ""
        native.execute(sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (copy_data = false{})").format(
            sql.Identifier(_native_name(p)), sql.Literal(p.publisher.dsn), sql.Identifier(p.name),
            sql.SQL(options)))  # fmt: skip
    return [p.target, *([native] if native else [])]


def _native_name(p: ReplicationPair) -> str:
    return "n_" + p.name[-20:]


def _stats(p: ReplicationPair) -> dict[str, int]:
    st = status(p.target, "s")["stats"]
    return {k: st[f"confl_{k}"] for k in KINDS} | {"apply_error_count": st["apply_error_count"]}


def _native_stats(native: Database, subname: str) -> dict[str, int]:
    with native.connect() as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        columns = sql.SQL(", ").join(sql.Identifier(f"confl_{k}") for k in KINDS)
        row = conn.execute(sql.SQL("SELECT apply_error_count, {} FROM pg_stat_subscription_stats WHERE subname = %s")
                           .format(columns), (subname,)).fetchone()  # fmt: skip
    assert row is not None
    return dict(zip(KINDS, row[1:], strict=True)) | {"apply_error_count": row[0]}


def _reports(text: str, kind: str) -> list[str]:
    """Each report of ``kind`` in a log (ours, or a server's with its line prefixes and tabs): its first line and
    DETAIL, transaction ids and times replaced by ``transaction X``."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        at = line.find('conflict detected on relation "')
        if at < 0 or f"conflict={kind}" not in line:
            continue
        report = [line[at:]]
        for more in lines[i + 1 :]:
            if "DETAIL:  " in more and len(report) == 1:
                report.append("DETAIL:  " + more.split("DETAIL:  ", 1)[1])
            elif len(report) > 1 and not re.search(r"(CONTEXT|LOG|ERROR|STATEMENT):  ", more):
                report.append(more.lstrip("\t"))
            else:
                break
        found.append(_WHO_WHEN.sub("transaction X", "\n".join(report)))
    return found


def _native_log(native: Database) -> str:
    return native.cluster.logfile.read_text(errors="replace")


@pytest.mark.parametrize(
    ("two_phase", "streamed"), [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "prepared", "streamed", "streamed-prepared"],
)  # fmt: skip
def test_origin_differs_is_logged_counted_and_applied_as_native(
    ts_pair: Any, start_run: Callable[..., subprocess.Popen[str]], two_phase: bool, streamed: bool
) -> None:
    """A row changed by a local session, then by the publisher: the UPDATE and the DELETE are applied anyway, each
    logged as ``update_origin_differs`` / ``delete_origin_differs`` with the local row, its origin ("locally") and
    time, and counted; rows our own subscription wrote last are no conflict; rows deleted locally are
    ``update_missing`` / ``delete_missing``, in native's words too. Plain and prepared transactions."""
    p, native = ts_pair
    extra = (("--two-phase",) if two_phase else ()) + (("--streaming", "on") if streamed else ())
    if streamed:  # the publisher decodes with 64kB: the transaction below streams
        p.publisher.execute(sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'").format(
            sql.Identifier(p.name)))  # fmt: skip
    subscribers = _subscribe(p, native, "CREATE TABLE t (id int PRIMARY KEY, v text)", *extra)
    proc = start_run(p.target)
    try:
        p.publisher.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 6) g")
        for db in subscribers:
            wait_until(lambda db=db: db.scalar("SELECT count(*) FROM t") == 6, timeout=60, what="6 rows")
            db.execute("UPDATE t SET v = 'local' WHERE id IN (1, 2)")
            db.execute("DELETE FROM t WHERE id IN (5, 6)")
        with p.publisher.connect() as conn:
            conn.execute("BEGIN")
            conn.execute("UPDATE t SET v = 'remote' WHERE id = 1")
            conn.execute("DELETE FROM t WHERE id = 2")
            conn.execute("UPDATE t SET v = 'remote' WHERE id = 3")  # last written by us: no conflict
            conn.execute("UPDATE t SET v = 'again' WHERE id = 1")  # written by this transaction: no conflict
            conn.execute("UPDATE t SET v = 'gone' WHERE id = 5")
            conn.execute("DELETE FROM t WHERE id = 6")
            if streamed:
                conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(100, 3000) g")
                conn.execute("DELETE FROM t WHERE id >= 100")
            if two_phase:
                conn.execute("PREPARE TRANSACTION 'ts_gid'")
                conn.execute("COMMIT PREPARED 'ts_gid'")
            else:
                conn.execute("COMMIT")
        wait_for_catchup(p.publisher, "s", timeout=60)
        if streamed:
            wait_until(lambda: p.publisher.scalar("SELECT coalesce(sum(stream_txns), 0) FROM"
                                                  " pg_stat_replication_slots WHERE slot_name = 's'") > 0,
                       timeout=30, what="the transaction streamed")  # fmt: skip
        expected = dict.fromkeys(KINDS, 0) | {"update_origin_differs": 1, "delete_origin_differs": 1,
                                              "update_missing": 1, "delete_missing": 1}  # fmt: skip
        wait_until(
            lambda: _stats(p) == expected | {"apply_error_count": 0}, timeout=10, what=f"{expected} stored"
        )
        rows = [(1, "again"), (3, "remote"), (4, "row 4")]
        assert p.target.query("SELECT id, v FROM t ORDER BY id") == rows
        ours = run_log(proc)
        assert (
            len(_reports(ours, "update_origin_differs")) == len(_reports(ours, "delete_origin_differs")) == 1
        )
        assert _reports(ours, "update_origin_differs")[0] == (
            'conflict detected on relation "public.t": conflict=update_origin_differs\n'
            "DETAIL:  Updating the row that was modified locally in transaction X.\n"
            "Existing local row (1, local); remote row (1, remote); replica identity (id)=(1)."
        ), ours
        if native is not None:
            name = _native_name(p)
            wait_until(lambda: _native_stats(native, name)["delete_origin_differs"] == 1, timeout=30,
                       what="PostgreSQL 18 counting delete_origin_differs")  # fmt: skip
            assert _native_stats(native, name) == expected | {"apply_error_count": 0}
            assert native.query("SELECT id, v FROM t ORDER BY id") == rows
            theirs = _native_log(native)
            for kind in (
                "update_origin_differs",
                "delete_origin_differs",
                "update_missing",
                "delete_missing",
            ):
                assert len(_reports(ours, kind)) == 1, (kind, ours)
                assert _reports(theirs, kind)[-1:] == _reports(ours, kind), (kind, theirs[-3000:])
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)


def _metric(port: int, name: str) -> float:
    """A counter of subscription s, as the metrics endpoint serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + '{subscription="s"'))


def test_origin_differs_in_a_backlog_applied_in_bulk_as_native(
    ts_pair: Any, start_run: Callable[..., subprocess.Popen[str]]
) -> None:
    """A backlog of 400 small transactions, applied in bulk and grouped (checked: the bulk counter grows): each
    locally changed row's first remote UPDATE or DELETE is one ``update_origin_differs`` / ``delete_origin_differs``
    with its own transaction and DETAIL, the later ones found our own origin; as native counts and words them."""
    p, native = ts_pair
    subscribers = _subscribe(p, native, "CREATE TABLE k (id int PRIMARY KEY, n int); CREATE TABLE d (id int PRIMARY KEY,"
                             " n int); CREATE TABLE h (id int PRIMARY KEY)")  # fmt: skip
    p.publisher.execute(
        "CREATE PROCEDURE work(m int) LANGUAGE plpgsql AS $$ BEGIN FOR i IN 1..m LOOP"
        " UPDATE k SET n = n + 1 WHERE id = 1 + i % 50; DELETE FROM d WHERE id = i % 200;"
        " INSERT INTO h VALUES (i); COMMIT; END LOOP; END $$"
    )
    port = free_port()
    proc = start_run(p.target, "--metrics-port", str(port))
    p.publisher.execute("INSERT INTO k SELECT g, 0 FROM generate_series(1, 50) g")
    p.publisher.execute("INSERT INTO d SELECT g, 0 FROM generate_series(1, 20) g")
    for db in subscribers:
        wait_until(lambda db=db: db.scalar("SELECT count(*) FROM d") == 20, timeout=60, what="20 rows")
        db.execute("UPDATE k SET n = -1000 WHERE id <= 5")
        db.execute("UPDATE d SET n = -1000 WHERE id > 15")
    proc.terminate()
    assert proc.wait(timeout=60) == 0, run_log(proc)
    p.publisher.execute("CALL work(400)")
    proc = start_run(p.target, "--metrics-port", str(port))
    try:
        wait_for_catchup(p.publisher, "s", timeout=120)
        expected = dict.fromkeys(KINDS, 0) | {"update_origin_differs": 5, "delete_origin_differs": 5}
        wait_until(
            lambda: _stats(p) == expected | {"apply_error_count": 0}, timeout=10, what=f"{expected} stored"
        )
        assert _metric(port, "applier_bulk_transactions_total") > 100  # most of the backlog went in bulk
        assert p.target.scalar("SELECT count(*) FROM h") == 400
        assert p.target.scalar("SELECT sum(n) FROM k") == 400  # the remote rows won
        assert p.target.scalar("SELECT count(*) FROM d") == 0
        ours = {
            k: sorted(_reports(run_log(proc), k)) for k in ("update_origin_differs", "delete_origin_differs")
        }
        assert [len(v) for v in ours.values()] == [5, 5], ours
        if native is not None:
            wait_for_catchup(p.publisher, _native_name(p), timeout=120)
            assert _native_stats(native, _native_name(p)) == expected | {"apply_error_count": 0}
            for kind, reports in ours.items():
                theirs = [
                    r for r in _reports(_native_log(native), kind) if '"public.k"' in r or '"public.d"' in r
                ]
                assert sorted(theirs) == reports, (kind, theirs, reports)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)


#: each exists kind: the local rows put in the way on every subscriber, the publisher's change that meets them
_EXISTS = {
    "insert_exists": ("INSERT INTO u VALUES (10, 10, 10)", "INSERT INTO u VALUES (10, 100, 100)"),
    "update_exists": ("INSERT INTO u VALUES (20, 20, 20)", "UPDATE u SET a = 20 WHERE id = 1"),
    "multiple_unique_conflicts": (
        "INSERT INTO u VALUES (30, 300, 301), (31, 310, 311)", "INSERT INTO u VALUES (30, 310, 999)"),
    "multiple_unique_conflicts-update": (
        "INSERT INTO u VALUES (40, 400, 401), (41, 410, 411)", "UPDATE u SET a = 400, b = 411 WHERE id = 1"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(_EXISTS))
def test_exists_kinds_stop_the_apply_and_count_each_attempt_as_native(
    ts_pair: Any, start_run: Callable[..., subprocess.Popen[str]], kind: str
) -> None:
    """A remote INSERT or UPDATE that meets local rows on unique indexes: an error naming each conflicting row
    (``multiple_unique_conflicts`` when several indexes meet one), in native's words, every attempt counted as
    that kind, and nothing applied until the local rows go; then the remote change is applied."""
    p, native = ts_pair
    subscribers = _subscribe(p, native, "CREATE TABLE u (id int PRIMARY KEY, a int UNIQUE, b int UNIQUE)")
    proc = start_run(p.target, "--max-retry-interval", "0.5")
    try:
        p.publisher.execute("INSERT INTO u VALUES (1, 1, 1)")
        local, remote = _EXISTS[kind]
        kind = kind.split("-")[0]
        for db in subscribers:
            wait_until(lambda db=db: db.scalar("SELECT count(*) FROM u") == 1, timeout=60, what="1 row")
            db.execute(local)
        p.publisher.execute(remote)
        wait_until(lambda: _stats(p)[kind] >= 2, timeout=60, what=f"2 attempts counted as {kind}")
        ours = _reports(run_log(proc), kind)
        assert ours, run_log(proc)[-3000:]
        if native is not None:
            name = _native_name(p)
            wait_until(lambda: _native_stats(native, name)[kind] >= 2, timeout=60, what=f"native: 2 {kind}")
            theirs = _reports(_native_log(native), kind)
            assert theirs and theirs[-1] == ours[-1], (ours[-1], _native_log(native)[-3000:])
        for db in subscribers:
            db.execute("DELETE FROM u WHERE id >= 10")
        wait_for_catchup(p.publisher, "s", timeout=60)
        st = _stats(p)
        assert st[kind] >= 2 and st["apply_error_count"] >= st[kind]
        assert all(n == 0 for k, n in st.items() if k not in (kind, "apply_error_count")), st
        want = p.publisher.query("SELECT * FROM u ORDER BY id")
        assert p.target.query("SELECT * FROM u ORDER BY id") == want
        if native is not None:
            wait_for_catchup(p.publisher, _native_name(p), timeout=60)
            n = _native_stats(native, _native_name(p))
            assert all(v == 0 for k, v in n.items() if k not in (kind, "apply_error_count")), n
            assert native.query("SELECT * FROM u ORDER BY id") == want
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)


def test_without_commit_timestamps_no_origin_is_checked_and_exists_says_so(
    pair: ReplicationPair, start_run: Callable[..., subprocess.Popen[str]], native_cluster: PostgresCluster
) -> None:
    """``track_commit_timestamp`` off (the default): a locally changed row is updated with no report (PostgreSQL
    cannot tell either), and a duplicate key's report says "modified in transaction N", no origin, no time; as
    PostgreSQL 18's own subscriber words it where the server is 18."""
    native = None
    if native_cluster.scalar("SELECT current_setting('server_version_num')::int") >= 180000:
        native = native_cluster.create_database(pair.name)
    try:
        subscribers = _subscribe(
            pair, native, "CREATE TABLE u (id int PRIMARY KEY, a int UNIQUE, b int UNIQUE)"
        )
        proc = start_run(pair.target, "--max-retry-interval", "0.5")
        pair.publisher.execute("INSERT INTO u VALUES (1, 1, 1)")
        for db in subscribers:
            wait_until(lambda db=db: db.scalar("SELECT count(*) FROM u") == 1, timeout=60, what="1 row")
            db.execute("UPDATE u SET b = -1 WHERE id = 1")
            db.execute("INSERT INTO u VALUES (20, 20, 20)")
        pair.publisher.execute("UPDATE u SET b = 2 WHERE id = 1")
        pair.publisher.execute("UPDATE u SET a = 20 WHERE id = 1")
        wait_until(lambda: _stats(pair)["update_exists"] >= 2, timeout=60, what="2 attempts: update_exists")
        ours = _reports(run_log(proc), "update_exists")
        assert ours[-1] == (
            'conflict detected on relation "public.u": conflict=update_exists\n'
            'DETAIL:  Key already exists in unique index "u_a_key", modified in transaction X.\n'
            "Key (a)=(20); existing local row (20, 20, 20); remote row (1, 20, 2); replica identity (id)=(1)."
        ), ours
        if native is not None:
            name = _native_name(pair)
            wait_until(lambda: _native_stats(native, name)["update_exists"] >= 2, timeout=60, what="native")
            assert _reports(_native_log(native), "update_exists")[-1] == ours[-1]
            assert _native_stats(native, name)["update_origin_differs"] == 0
        st = _stats(pair)
        assert st["update_origin_differs"] == 0 and st["insert_exists"] == 0, st
        for db in subscribers:
            db.execute("DELETE FROM u WHERE id = 20")
        wait_for_catchup(pair.publisher, "s", timeout=60)
        assert pair.target.query("SELECT * FROM u") == [(1, 20, 2)]
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)
    finally:
        if native is not None:
            drop_native_subscription(native, _native_name(pair))
            native_cluster.drop_database(native.name)


def test_conflict_log_table_holds_a_row_per_conflict_of_committed_attempts(
    ts_pair: Any, start_run: Callable[..., subprocess.Popen[str]]
) -> None:
    """``--conflict-log table``: each conflict is a row of ``applier.conflict_log`` (its kind, relation, remote
    transaction and commit LSN, replica identity, remote row, local row with origin and time) and no log line;
    an attempt that failed (a duplicate key) leaves no row of its conflicts, the one that commits does;
    ``alter --set conflict_log=all`` logs them too; ``status --json`` says which."""
    p, _native = ts_pair
    _subscribe(p, None, "CREATE TABLE t (id int PRIMARY KEY, v text)", "--conflict-log", "table")
    assert status(p.target, "s")["conflict_log"] == "table"
    proc = start_run(p.target, "--max-retry-interval", "0.5")
    try:
        p.publisher.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 4) g")
        wait_until(lambda: p.target.scalar("SELECT count(*) FROM t") == 4, timeout=60, what="4 rows")
        p.target.execute("UPDATE t SET v = 'local' WHERE id IN (1, 2)")
        p.target.execute("DELETE FROM t WHERE id IN (3, 4)")
        p.target.execute("INSERT INTO t VALUES (10, 'in the way')")
        with p.publisher.connect() as conn:
            conn.execute("BEGIN")
            xid = conn.execute("SELECT txid_current()").fetchone()[0]  # type: ignore[index]
            for stmt in ("UPDATE t SET v = 'remote' WHERE id = 1", "DELETE FROM t WHERE id = 2",
                         "UPDATE t SET v = 'remote' WHERE id = 3", "DELETE FROM t WHERE id = 4",
                         "INSERT INTO t VALUES (10, 'remote')"):  # fmt: skip
                conn.execute(stmt)
            conn.execute("COMMIT")
        wait_until(lambda: _stats(p)["insert_exists"] >= 2, timeout=60, what="2 failed attempts")
        assert p.target.scalar("SELECT count(*) FROM applier.conflict_log") == 0  # rolled back with them
        p.target.execute("DELETE FROM t WHERE id = 10")
        wait_for_catchup(p.publisher, "s", timeout=60)
        rows = p.target.query(
            "SELECT conflict_type, schemaname, relname, remote_xid::text::bigint, remote_commit_lsn IS NOT NULL,"
            " remote_commit_ts IS NOT NULL, replica_identity::text, remote_tuple::text,"
            " local_conflicts[1]->>'tuple', local_conflicts[1]->>'commit_ts' IS NOT NULL, logged_at IS NOT NULL"
            " FROM applier.conflict_log ORDER BY conflict_type"
        )
        common = ("public", "t", xid, True, True)
        assert rows == [
            ("delete_missing", *common, '{"id": "4"}', None, None, False, True),
            ("delete_origin_differs", *common, '{"id": "2"}', None, '{"id": "2", "v": "local"}', True, True),
            ("update_missing", *common, '{"id": "3"}', '{"id": "3", "v": "remote"}', None, False, True),
            ("update_origin_differs", *common, '{"id": "1"}', '{"id": "1", "v": "remote"}',
             '{"id": "1", "v": "local"}', True, True),
        ], rows  # fmt: skip
        assert not _reports(run_log(proc), "update_origin_differs")  # table only: no log line
        assert p.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "remote"), (10, "remote")]
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)
    assert "conflict_log=all" in ok(p.target, "alter", "s", "--set", "conflict_log=all")
    assert status(p.target, "s")["conflict_log"] == "all"


def test_a_catalog_of_version_13_reads_as_log_and_upgrades(pair: ReplicationPair) -> None:
    """Catalog version 14 adds ``subscription.subconflictlog`` and ``applier.conflict_log``: an older catalog
    reads as ``log`` (no table) and ``ensure`` (run, create) adds both."""
    _subscribe(pair, None, "CREATE TABLE t (id int PRIMARY KEY)")
    pair.target.execute("DROP TABLE applier.conflict_log")
    pair.target.execute("ALTER TABLE applier.subscription DROP COLUMN subconflictlog")
    pair.target.execute("DELETE FROM applier.catalog_version WHERE version > 13")
    assert status(pair.target, "s")["conflict_log"] == "log"
    assert Catalog.connect(pair.target.dsn).ensure() == CATALOG_VERSION == 14
    assert pair.target.scalar("SELECT subconflictlog FROM applier.subscription") == "log"
    assert pair.target.scalar("SELECT to_regclass('applier.conflict_log') IS NOT NULL")


def test_a_duplicate_key_inside_a_copied_run_is_an_insert_exists_with_its_key(
    ts_pair: Any, start_run: Callable[..., subprocess.Popen[str]]
) -> None:
    """A long run of Inserts goes in a COPY: the row that meets a local key has no statement of its own, so the
    report searches the index the target named for the key it gave: an ``insert_exists`` with the local row, its
    origin and time (no remote row: what differs from PostgreSQL here), every attempt counted as native counts."""
    p, native = ts_pair
    subscribers = _subscribe(p, native, "CREATE TABLE u (id int PRIMARY KEY, a int UNIQUE, b int UNIQUE)")
    proc = start_run(p.target, "--max-retry-interval", "0.5")
    try:
        for db in subscribers:
            db.execute("INSERT INTO u VALUES (250, -250, -250)")
        p.publisher.execute("INSERT INTO u SELECT g, g, g FROM generate_series(100, 399) g")
        wait_until(lambda: _stats(p)["insert_exists"] >= 2, timeout=60, what="2 attempts counted")
        assert _reports(run_log(proc), "insert_exists")[-1] == (
            'conflict detected on relation "public.u": conflict=insert_exists\n'
            'DETAIL:  Key already exists in unique index "u_pkey", modified locally in transaction X.\n'
            "Key (id)=(250); existing local row (250, -250, -250)."
        )
        if native is not None:
            wait_until(lambda: _native_stats(native, _native_name(p))["insert_exists"] >= 2, timeout=60,
                       what="native: 2 attempts")  # fmt: skip
        for db in subscribers:
            db.execute("DELETE FROM u WHERE id = 250")
        wait_for_catchup(p.publisher, "s", timeout=60)
        assert p.target.scalar("SELECT count(*) FROM u") == 300
        st = _stats(p)
        assert all(n == 0 for k, n in st.items() if k not in ("insert_exists", "apply_error_count")), st
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, run_log(proc)
