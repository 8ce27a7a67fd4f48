"""Shared helpers for the ports of PostgreSQL's subscription TAP tests (``tests/tap/test_tap_0NN_*.py``), the property
test (``test_apply_property.py``) and the crash test (``test_apply_crash.py``); other test modules use them too.

It exists so that every
port reads like the Perl file it comes from: :func:`psql` runs a script the way ``safe_psql`` does,
:func:`prepared_count` is the TAP tests' ``SELECT count(*) FROM pg_prepared_xacts``, :func:`catchup` is
``wait_for_catchup``, :func:`alter_subscription` is ``ALTER SUBSCRIPTION ... SET`` plus the wait for the worker's
restart, and :class:`CliApplier` is the applier as a separate OS process (``python -m applier.cli run``) for the
scenarios that ``kill -9`` it. :func:`fresh_subscription` and :func:`assert_replica` serve the randomized tests:
a new subscription per hypothesis example, and the check that the target equals the publisher.

Why a module-scoped database pair (:func:`module_pair`) rather than the per-test ``pair`` fixture: a TAP file is
one long scenario on one pair of nodes, and most of its sections only look at their own keys. Sharing the
databases, the subscription and the running worker across the sections of one file keeps the port faithful (later
sections run against a worker that went through the earlier ones, crashes included) and saves the per-test setup.

The clusters are shared by the whole test session, so ``pg_prepared_xacts`` is counted for the current database
only (the TAP nodes hold one database each, so this is the same number), and ``logical_decoding_work_mem`` is set
per publisher database (``ALTER DATABASE``: walsenders read it at connection) instead of server-wide, so nothing
has to be restored afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from applier.apply.testing import ApplySetup, setup_subscription
from applier.apply.worker import WorkerThread
from applier.subscriptions import LOCK_NAMESPACE
from applier.testing import Database, PostgresCluster, assert_tables_equal, wait_for_catchup, wait_until
from applier.testing.pytest_plugin import ReplicationPair, drop_our_origins
from applier.testing.workloads import KEY_COLUMNS, TABLES, Workload

__all__ = [
    "TIMEOUT",
    "alter_subscription",
    "assert_replica",
    "both",
    "catchup",
    "CliApplier",
    "drop_slot",
    "extra_database",
    "fresh_subscription",
    "module_pair",
    "Nodes",
    "prepared_count",
    "psql",
    "restart_if_down",
    "rollback_prepared",
    "set_decoding_work_mem",
    "stream_txns",
    "subscribed_nodes",
    "wait_for_new_walsender",
    "walsender_pid",
]

_counter = itertools.count(1)

#: Generous, because the 2-core CI machine is shared and crash recovery of a cluster can take seconds.
TIMEOUT = 90.0


def psql(db: Database, script: str) -> None:
    """Run ``script`` statement by statement on one autocommit connection, as ``safe_psql`` does:
    ``BEGIN; ...; PREPARE TRANSACTION 'x'; COMMIT PREPARED 'x';`` works (sent as one query string it would be an
    implicit transaction block, where COMMIT PREPARED is refused). Statements are split at ``;``, which the
    scripts of these tests never contain inside a literal."""
    with db.connect() as conn:
        for statement in script.split(";"):
            if statement.strip():
                conn.execute(statement)  # type: ignore[arg-type]  # literal test SQL


def both(pair: ReplicationPair, *statements: str) -> None:
    """Run ``statements`` on the publisher and then on the target (the same schema on both sides)."""
    for db in (pair.publisher, pair.target):
        for s in statements:
            db.execute(s)


def prepared_count(db: Database) -> int:
    """``SELECT count(*) FROM pg_prepared_xacts`` restricted to ``db`` (the clusters are shared)."""
    return int(db.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"))


def catchup(publisher: Database, application_name: str) -> str:
    """``$node_publisher->wait_for_catchup($appname)``."""
    return wait_for_catchup(publisher, application_name, timeout=TIMEOUT)


def walsender_pid(publisher: Database, application_name: str) -> int | None:
    """The pid of the streaming walsender serving ``application_name`` (TAP tests compare it to see a restart)."""
    pid = publisher.cluster.scalar(
        "SELECT pid FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'",
        (application_name,),
    )
    return int(pid) if pid is not None else None


def wait_for_new_walsender(publisher: Database, application_name: str, old_pid: int | None) -> None:
    """``poll_query_until(... pid != $oldpid ...)``: the subscriber reconnected after an option change."""
    wait_until(
        lambda: (pid := walsender_pid(publisher, application_name)) is not None and pid != old_pid,
        timeout=TIMEOUT,
        what=f"{application_name} to restart streaming",
    )


def alter_subscription(setup: ApplySetup, **values: Any) -> None:
    """``ALTER SUBSCRIPTION ... SET (...)`` + waiting for the worker to restart: update the catalog row (column
    names, e.g. ``substream="parallel"``); the running worker re-reads it within a second and restarts, which the
    publisher shows as a new walsender."""
    old = walsender_pid(setup.publisher, setup.name)
    setup.catalog.update_subscription(setup.sub.subid, **values)
    wait_for_new_walsender(setup.publisher, setup.name, old)
    setup.refresh()


def stream_txns(publisher: Database, slot_name: str) -> int:
    """How many transactions the slot has streamed so far (proves a workload really streamed)."""
    return int(
        publisher.scalar(
            "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE slot_name = %s",
            (slot_name,),
        )
    )


def set_decoding_work_mem(publisher: Database, value: str = "64kB") -> None:
    """``logical_decoding_work_mem = 64kB`` for walsenders of this database only; set it before they start."""
    publisher.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = {}").format(
            sql.Identifier(publisher.name), sql.Literal(value)
        )
    )


def restart_if_down(cluster: PostgresCluster) -> None:
    """A test that crashed a server and failed before restarting it must not break the tests after it."""
    try:
        cluster.scalar("SELECT 1")
    except psycopg.Error:
        cluster.start()


def _drop(cluster: PostgresCluster, db: Database) -> None:
    restart_if_down(cluster)
    with contextlib.suppress(psycopg.Error):
        drop_our_origins(db)
    cluster.drop_database(db.name)


@contextlib.contextmanager
def module_pair(
    publisher_cluster: PostgresCluster, target_cluster: PostgresCluster, label: str
) -> Iterator[ReplicationPair]:
    """Fresh publisher and target databases named after ``label``, dropped afterwards together with their
    slots, prepared transactions and our replication origins (what the ``pair`` fixture does per test)."""
    name = f"m{os.getpid() % 10000}_{next(_counter)}_{label}"[:60]
    pub = publisher_cluster.create_database(name)
    try:
        tgt = target_cluster.create_database(name)
    except BaseException:
        publisher_cluster.drop_database(name)
        raise
    try:
        yield ReplicationPair(pub, tgt, name)
    finally:
        try:
            _drop(target_cluster, tgt)
        finally:
            _drop(publisher_cluster, pub)


@contextlib.contextmanager
def extra_database(cluster: PostgresCluster, label: str) -> Iterator[Database]:
    """One more throwaway database (node C of a cascade), dropped with its slots, prepared transactions and
    our replication origins."""
    db = cluster.create_database(f"x{os.getpid() % 10000}_{next(_counter)}_{label}"[:60])
    try:
        yield db
    finally:
        _drop(cluster, db)


@dataclass
class Nodes:
    """A TAP file's ``$node_publisher`` and ``$node_subscriber`` with the subscription and its running worker."""

    publisher: Database
    subscriber: Database
    setup: ApplySetup
    worker: WorkerThread

    @property
    def appname(self) -> str:
        return self.setup.name

    def result(self, query: str) -> tuple[Any, ...]:
        """The first row of ``query`` on the subscriber: what ``safe_psql`` prints as ``a|b|c``."""
        return tuple(self.subscriber.query(query)[0])

    def catchup(self) -> str:
        return catchup(self.publisher, self.appname)

    def restart_worker(self) -> None:
        """Stop the worker and start a new one (a new walsender reads new database-level settings)."""
        self.worker.stop()
        self.worker = self.setup.start()


@contextlib.contextmanager
def subscribed_nodes(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    label: str,
    *,
    publisher_sql: str,
    subscriber_sql: str,
    tables: list[str],
    streaming: str = "on",
    two_phase_state: str = "d",
    decoding_work_mem: str | None = "64kB",
) -> Iterator[Nodes]:
    """A module's nodes: ``publisher_sql`` (schema and pre-existing rows) on the publisher, ``subscriber_sql`` on
    the subscriber (its schema and the rows the initial copy would bring), a subscription with every table ready,
    and its worker running (in a thread: quick to restart, and it reconnects within a second after a crash)."""
    with module_pair(publisher_cluster, target_cluster, label) as pair:
        if decoding_work_mem is not None:
            set_decoding_work_mem(pair.publisher, decoding_work_mem)
        psql(pair.publisher, publisher_sql)
        psql(pair.target, subscriber_sql)
        setup = setup_subscription(
            pair.publisher,
            pair.target,
            pair.name,
            tables,
            streaming=streaming,
            two_phase_state=two_phase_state,
        )
        nodes = Nodes(pair.publisher, pair.target, setup, setup.start())
        try:
            yield nodes
        finally:
            nodes.worker.stop()


def rollback_prepared(db: Database) -> None:
    """ROLLBACK PREPARED every prepared transaction of ``db`` (what a failed example leaves behind)."""
    with db.connect() as conn:
        for (gid,) in conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def drop_slot(publisher: Database, slot: str) -> None:
    """Drop a slot, terminating the walsender that may still hold it (an applier that was just stopped)."""
    with publisher.connect() as conn:

        def dropped() -> bool:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s AND active_pid IS NOT NULL",
                (slot,),
            )
            try:
                conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                    (slot,),
                )
            except psycopg.errors.ObjectInUse:
                return False
            return True

        wait_until(dropped, timeout=TIMEOUT, what=f"slot {slot} to be dropped")


@contextlib.contextmanager
def fresh_subscription(
    pair: ReplicationPair, name: str, tables: Sequence[str], **options: Any
) -> Iterator[ApplySetup]:
    """A new subscription ``name`` (publication, slot, catalog rows, origin) over ``tables``, which exist on both
    sides and are emptied first on both (on the publisher before the slot exists, so that is not replicated).
    Afterwards everything is dropped again and leftover prepared transactions are rolled back, so the next
    hypothesis example on the same pair of databases starts from nothing, whatever this one left behind."""
    idents = sql.SQL(", ").join(sql.Identifier(*t.split(".", 1)) for t in tables)
    for db in (pair.publisher, pair.target):
        rollback_prepared(db)
        db.execute(sql.SQL("TRUNCATE {}").format(idents))
    setup = setup_subscription(pair.publisher, pair.target, name, tables, **options)
    try:
        yield setup
    finally:
        for cluster in (pair.publisher.cluster, pair.target.cluster):
            restart_if_down(cluster)
        rollback_prepared(pair.publisher)
        drop_slot(pair.publisher, name)
        pair.publisher.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(name)))
        pair.target.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name LIKE 'applier%%'"
        )
        rollback_prepared(pair.target)
        setup.catalog.delete_subscription(setup.sub.subid)
        setup.catalog.engine.dispose()


def assert_replica(pair: ReplicationPair, workload: Workload) -> None:
    """The target equals the publisher row by row over the workload tables, holds exactly the keys the
    workload's model predicts (nothing lost), each once (nothing applied twice: the REPLICA IDENTITY FULL table
    has no key to refuse a duplicate), and no prepared transaction is left on it."""
    assert_tables_equal(pair.publisher, pair.target, *TABLES)
    for table in TABLES:
        keys = [r[0] for r in pair.target.query(f"SELECT {KEY_COLUMNS[table]} FROM {table}")]  # noqa: S608
        assert len(keys) == len(set(keys)), f"{table}: a row was applied twice"
        assert set(keys) == workload.expected_keys[table], f"{table}: keys differ from the model's"
    prepared = pair.target.query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
    assert prepared == [], f"prepared transactions left on the target: {prepared}"


class CliApplier:
    """``applier --target DSN run NAME`` as its own process group, so that :meth:`kill9` is a real ``kill -9`` of
    the applier (parent and worker process alike) and :meth:`start` a cold restart of the command users run."""

    def __init__(self, target: Database, subname: str, *, env: dict[str, str] | None = None) -> None:
        self.target = target
        self.subname = subname
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix=f"applier-{subname[:20]}-", suffix=".log")[1])
        self.starts = 0

    def start(self) -> CliApplier:
        """Start ``run`` once the previous process's sessions are gone (its advisory lock on the target would
        make the new one refuse to start, which is right, but not what these tests are about)."""
        self.wait_sessions_gone()
        self.starts += 1
        with self.log.open("ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "applier.cli", "--target", self.target.dsn, "run", self.subname],
                stdout=log, stderr=log, start_new_session=True, env=self.env, cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL the whole process group: the ``run`` parent and its spawned worker die at once, mid-whatever."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> int | None:
        """SIGTERM (a clean stop), escalating to SIGKILL; returns the exit status."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=30)

    def wait_exit(self, timeout: float = TIMEOUT) -> int:
        """Wait for the process to end by itself (e.g. its subscription was disabled); its exit status."""
        assert self.proc is not None, "not running"
        proc, self.proc = self.proc, None
        return proc.wait(timeout=timeout)

    def wait_sessions_gone(self) -> None:
        """No target session of an earlier process of this subscription left: neither its apply session nor
        the one holding its advisory lock (a killed client's backend exits only when it notices)."""
        wait_until(
            lambda: self.target.scalar(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                "                   AND application_name = 'applier ' || %(name)s)"
                " AND NOT EXISTS (SELECT 1 FROM pg_locks l JOIN applier.subscription s ON l.objid = s.subid::oid"
                "                 WHERE l.locktype = 'advisory' AND l.classid = %(ns)s::oid AND l.objsubid = 2"
                "                   AND s.subname = %(name)s)",
                {"name": self.subname, "ns": LOCK_NAMESPACE},
            ),
            timeout=TIMEOUT,
            what=f"the target sessions of the previous applier process of {self.subname} to end",
        )

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self.log.unlink()

    def __enter__(self) -> CliApplier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
