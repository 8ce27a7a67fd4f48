"""Differential tests: our applier against PostgreSQL's own subscriber, on the same stream of changes.

Why: a reimplementation of the apply worker is trustworthy only if it provably does what PostgreSQL does. So
hypothesis draws a workload (:func:`applier.testing.workloads.workloads`: interleaved sessions, inserts, updates
including key changes, deletes, truncates, savepoints rolled back, prepared transactions committed or rolled back,
some after other transactions committed in between, and bulk inserts large enough to stream), runs it on ONE
publisher database, and two subscribers consume the same publication:

* PostgreSQL's native subscriber (``CREATE SUBSCRIPTION ... WITH (two_phase = on, streaming = on, copy_data =
  false)``) on a third cluster started for this module, and
* our applier.

At every checkpoint (right after each PREPARE, COMMIT PREPARED and ROLLBACK PREPARED on the publisher) both are
waited for until they have replayed up to the publisher's current WAL position, then must show the same rows and
the same set of prepared transactions — compared by remote xid, because the GIDs are ``pg_gid_<subid>_<xid>``
(ours) and ``pg_gid_<suboid>_<xid>`` (native). At the end both equal the publisher. A failure shrinks to a
minimal workload and prints it as SQL (hypothesis' ``note``), ready to paste into psql.

The publisher's ``logical_decoding_work_mem`` is 64kB for these tests — set per publisher database (``ALTER
DATABASE``, read by each walsender at connection), which leaves the session-shared cluster untouched and needs no
restore: the database is dropped afterwards.

The fault schedule (:func:`test_faults_lose_nothing`) runs the same property with our applier as the real CLI
process (``python -m applier.cli run``) and faults injected at random steps: ``kill -9`` of the applier, an
immediate stop of the target, of the publisher, and a cut of every TCP connection between applier and publisher
(through :class:`TcpProxy`). Nothing may be lost or applied twice, and no prepared transaction may be stranded.

Profiles: the default is a fast, bounded run (a few examples, whole file well under two minutes on a loaded
2-core machine). For a deeper run::

    .venv/bin/pytest tests/differential/test_differential.py --hypothesis-profile=long

(``long`` is registered below: many more and longer workloads, no deadline). ``APPLIER_TEST_PG=15`` or ``16`` runs
everything against those versions; the native cluster gets ``wal_retrieve_retry_interval = 200ms`` so that
PostgreSQL 15's launcher does not hold a new apply worker back for 5 s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from psycopg import sql

from applier.apply.testing import ApplySetup, setup_subscription
from applier.apply.worker import WorkerStats
from applier.testing import Database, PostgresCluster, tables_differ, wait_until
from applier.testing.cluster import free_port
from applier.testing.pytest_plugin import drop_our_origins
from applier.testing.workloads import TABLES, Step, Workload, create_schema, run_workload, workloads
from tests.support.native import caught_up, create_databases, drop_native_subscription
from tests.support.tap import CliApplier, restart_if_down, set_decoding_work_mem

TIMEOUT = 90.0  # generous: the CI machine is a shared 2-core box, and crash recovery can take seconds

_LONG = settings.get_current_profile_name() == "long"

#: examples per property: bounded by default, deep under ``--hypothesis-profile=long``
EXAMPLES = 150 if _LONG else 6
FAULT_EXAMPLES = 60 if _LONG else 3
MAX_ACTIONS = 80 if _LONG else 30

#: every workload has prepared transactions (one possibly large enough to stream): the checkpoints are where the
#: property says most
_prepared_workloads = workloads(max_actions=MAX_ACTIONS, min_prepared=2, min_actions=6)
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
_counter = itertools.count(1)
_GID = re.compile(r"^pg_gid_\d+_(\d+)$")


# --- one example's databases and subscriptions ------------------------------------------------------------------


@dataclass
class Trio:
    """One publisher database feeding our target database and the native subscriber's database."""

    publisher: Database
    ours: Database
    native: Database
    name: str  # our subscription, publication and slot
    setup: ApplySetup
    stop_ours: Callable[[], None] = field(default=lambda: None)

    @property
    def native_name(self) -> str:
        return f"n_{self.name}"


@contextlib.contextmanager
def trio(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    *,
    publisher_conninfo: Callable[[Database], str] | None = None,
) -> Iterator[Trio]:
    """Fresh databases on the three clusters with the workload schema, our subscription (catalog + slot, the
    worker is started by the caller) and the native one (enabled, so already streaming); all dropped afterwards.
    ``publisher_conninfo`` overrides the conninfo our subscription stores (the fault test routes it through a
    proxy)."""
    name = f"d{os.getpid() % 10000}_{next(_counter)}"
    pub, ours, native = create_databases([publisher_cluster, target_cluster, native_cluster], name)
    t: Trio | None = None
    try:
        set_decoding_work_mem(pub, "64kB")
        create_schema(pub, ours, native)
        setup = setup_subscription(pub, ours, name, TABLES, two_phase_state="e", streaming="on")
        if publisher_conninfo is not None:
            setup.catalog.update_subscription(setup.sub.subid, subconninfo=publisher_conninfo(pub))
            setup.refresh()
        t = Trio(pub, ours, native, name, setup)
        native.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}"
                " WITH (two_phase = on, streaming = on, copy_data = false)"
            ).format(sql.Identifier(t.native_name), sql.Literal(pub.dsn), sql.Identifier(name))
        )
        yield t
    finally:
        if t is not None:
            t.stop_ours()
        for c in (publisher_cluster, target_cluster, native_cluster):
            restart_if_down(c)
        if t is not None:
            drop_native_subscription(native, t.native_name)
        with contextlib.suppress(psycopg.Error):
            drop_our_origins(ours)
        for db in (native, ours, pub):
            db.cluster.drop_database(db.name)


# --- what is compared -------------------------------------------------------------------------------------------


def prepared_xids(db: Database) -> set[int]:
    """Remote xids of the subscriber's prepared transactions in ``db``: the GIDs differ only by subscription id."""
    gids = db.query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
    xids = set()
    for (gid,) in gids:
        m = _GID.match(gid)
        assert m, f"unexpected prepared transaction {gid!r} on {db.cluster.name}"
        xids.add(int(m.group(1)))
    return xids


def publisher_prepared_xids(db: Database) -> set[int]:
    return {int(x) for (x,) in db.query("SELECT transaction::text FROM pg_prepared_xacts WHERE database = %s",
                                        (db.name,))}  # fmt: skip


def wait_both(t: Trio, *, timeout: float = TIMEOUT) -> str:
    """Both subscribers have replayed up to the publisher's current WAL position (each reports under its
    subscription name in ``pg_stat_replication``)."""
    lsn = t.publisher.cluster.scalar("SELECT pg_current_wal_lsn()::text")
    for app in (t.name, t.native_name):
        wait_until(lambda app=app: caught_up(t.publisher, app, lsn), timeout=timeout,
                   what=f"{app!r} to replay up to {lsn}")  # fmt: skip
    return lsn


def differences(a: Database, b: Database) -> list[str]:
    return [d for table in TABLES if (d := tables_differ(a, b, table))]


def check_checkpoint(t: Trio, step: Step) -> None:
    """Same rows and same prepared transactions on both subscribers, and the prepared ones are exactly the
    publisher's (both subscriptions have two-phase enabled from the start)."""
    wait_both(t)
    ours_p, native_p, pub_p = (
        prepared_xids(t.ours),
        prepared_xids(t.native),
        publisher_prepared_xids(t.publisher),
    )
    assert ours_p == native_p, f"after {step.sql!r}: prepared xids ours {ours_p} vs native {native_p}"
    assert ours_p == pub_p, f"after {step.sql!r}: prepared xids ours {ours_p} vs publisher {pub_p}"
    diff = differences(t.ours, t.native)
    assert not diff, f"after {step.sql!r}: ours vs native:\n" + "\n".join(diff)


def check_end(t: Trio) -> None:
    """After the workload everything is resolved: all three hold the same rows and nothing stays prepared."""
    wait_both(t)
    for db in (t.ours, t.native):
        diff = differences(t.publisher, db)
        assert not diff, f"publisher vs {db.cluster.name}:\n" + "\n".join(diff)
    assert prepared_xids(t.ours) == set() == prepared_xids(t.native), "a prepared transaction was stranded"


def stream_txns(t: Trio) -> tuple[int, int]:
    """Streamed transactions per slot (ours, native): evidence that the big inserts really streamed."""
    rows = dict(
        t.publisher.cluster.query(
            "SELECT slot_name, coalesce(stream_txns, 0) FROM pg_stat_replication_slots WHERE slot_name = ANY(%s)",
            ([t.name, t.native_name],),
        )
    )
    return int(rows.get(t.name, 0)), int(rows.get(t.native_name, 0))


def wait_streaming(t: Trio) -> None:
    for app in (t.name, t.native_name):
        wait_until(
            lambda app=app: t.publisher.cluster.scalar(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'",
                (app,),
            ),
            timeout=TIMEOUT,
            what=f"{app!r} to stream",
        )


# --- the property without faults --------------------------------------------------------------------------------


def _in_hypothesis() -> bool:
    from hypothesis.control import current_build_context

    try:
        current_build_context()
    except Exception:  # noqa: BLE001 - not inside @given
        return False
    return True


def _note(text: str) -> None:
    """``note`` inside hypothesis (printed with the shrunk failing example); a plain print elsewhere."""
    if _in_hypothesis():
        note(text)
    else:
        print(text)


def _event(text: str) -> None:
    """Statistics for ``--hypothesis-show-statistics`` (which kinds of example the run really covered)."""
    if _in_hypothesis():
        event(text)


def run_differential(t: Trio, workload: Workload) -> None:
    _note("workload (SQL, one session per -- sN):\n" + workload.to_sql())
    wait_streaming(t)

    def on_step(step: Step) -> None:
        if step.kind in ("prepare", "commit_prepared", "rollback_prepared"):
            check_checkpoint(t, step)

    run_workload(t.publisher, workload, on_step=on_step)
    _event(
        f"prepared transactions: {min(workload.prepared_count, 3)}{'+' if workload.prepared_count >= 3 else ''}"
    )
    _event(f"streamed: ours {stream_txns(t)[0]}, native {stream_txns(t)[1]}")
    check_end(t)


_FIXED = Workload(
    steps=(
        Step(0, "BEGIN"),
        Step(0, "INSERT INTO wl_pk (id, v, n, big) VALUES (3, 'a', '1.5', repeat(md5('3'), 300))"),
        Step(0, "INSERT INTO wl_full (a, b, ts) VALUES (1, NULL, now())"),
        Step(1, "BEGIN"),
        Step(1, "INSERT INTO wl_idx (k, v, extra) VALUES (10, 'x', ARRAY[1, NULL])"),
        Step(0, "PREPARE TRANSACTION 'a'", "prepare"),
        Step(1, "SAVEPOINT s1"),
        Step(1, "INSERT INTO wl_pk (id, v, n) SELECT g, 'bulk ' || g, g FROM generate_series(100, 2100) g"),
        Step(1, "ROLLBACK TO SAVEPOINT s1"),
        Step(1, "INSERT INTO wl_pk (id, v, n) SELECT g, 'bulk ' || g, g FROM generate_series(5000, 7000) g"),
        Step(1, "UPDATE wl_pk SET id = 8000 WHERE id = 5000"),
        Step(1, "PREPARE TRANSACTION 'b'", "prepare"),
        Step(2, "UPDATE wl_full SET b = 'c' WHERE a = 1"),  # not yet committed: touches nothing
        Step(0, "COMMIT PREPARED 'a'", "commit_prepared"),
        Step(2, "UPDATE wl_full SET b = 'c' WHERE a = 1"),
        Step(2, "UPDATE wl_pk SET v = 'only v' WHERE id = 3"),  # the TOASTed column is unchanged
        Step(1, "ROLLBACK PREPARED 'b'", "rollback_prepared"),
        Step(2, "DELETE FROM wl_full WHERE a = 1"),
        Step(2, "TRUNCATE wl_idx"),
    ),
    sessions=3,
)


@pytest.mark.core
def test_differential_fixed_workload(
    publisher_cluster: PostgresCluster, target_cluster: PostgresCluster, native_cluster: PostgresCluster
) -> None:
    """One hand-written workload through every kind of checkpoint, a streamed prepared transaction rolled back,
    an unchanged TOAST value and a TRUNCATE: the quick version of the property (CI runs it on 15, 16 and 18)."""
    with trio(publisher_cluster, target_cluster, native_cluster) as t:
        w = t.setup.start()
        t.stop_ours = w.stop
        run_differential(t, _FIXED)
        ours_streamed, native_streamed = stream_txns(t)
        assert ours_streamed >= 1 and native_streamed >= 1, "the 2000-row prepared transaction did not stream"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=_HEALTH, derandomize=not _LONG)
@given(workload=_prepared_workloads)
def test_differential_property(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    workload: Workload,
) -> None:
    """Any workload: at each checkpoint ours = native (rows and prepared xids), at the end both = publisher."""
    with trio(publisher_cluster, target_cluster, native_cluster) as t:
        w = t.setup.start()
        t.stop_ours = w.stop
        run_differential(t, workload)


# --- backlogs of small transactions (bulk apply) ------------------------------------------------------------------


#: one change of a small transaction: what our bulk apply takes (inserts, updates keeping the key, deletes by key,
#: on wl_pk and into wl_full) and what sends a transaction message by message (a key change, an unchanged TOAST
#: value, a change to wl_idx, whose array column has no array type)
def _q(template: str, *values: object) -> str:
    return sql.SQL(template).format(*map(sql.Literal, values)).as_string(None)


_bulk_change = st.one_of(
    st.builds(
        lambda k, v: _q("INSERT INTO wl_pk (id, v, n) VALUES ({}, {}, {}) ON CONFLICT DO NOTHING", k, v, k),
        st.integers(1, 12),
        st.sampled_from(["a", 'b "q"', "c\\d", "{e,f}", "", "it's"]),
    ),  # fmt: skip
    st.builds(
        lambda k, n: _q("UPDATE wl_pk SET n = {}, v = {} WHERE id = {}", n, f"u{n}", k),
        st.integers(1, 12),
        st.integers(0, 99),
    ),  # fmt: skip
    st.builds(lambda k: _q("DELETE FROM wl_pk WHERE id = {}", k), st.integers(1, 12)),
    st.builds(lambda a: _q("INSERT INTO wl_full (a, b) VALUES ({}, NULL)", a), st.integers(1, 5)),
)
_other_change = st.one_of(
    st.builds(
        lambda k, j: _q(
            "UPDATE wl_pk SET id = {} WHERE id = {} AND NOT EXISTS (SELECT FROM wl_pk WHERE id = {})", j, k, j
        ),
        st.integers(1, 12),
        st.integers(1, 12),
    ),  # fmt: skip
    st.builds(
        lambda k: _q("UPDATE wl_pk SET big = repeat(md5({}), 300) WHERE id = {}", str(k), k),
        st.integers(1, 12),
    ),
    st.builds(
        lambda k: _q("INSERT INTO wl_idx (k, v) VALUES ({}, 'x') ON CONFLICT DO NOTHING", k),
        st.integers(1, 5),
    ),
)
#: mostly what bulk apply takes, so that runs of such transactions form
_small_change = st.one_of(*[_bulk_change] * 5, _other_change)
_small_backlogs = st.lists(st.lists(_small_change, min_size=1, max_size=4), min_size=20, max_size=120)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=_HEALTH, derandomize=not _LONG)
@given(transactions=_small_backlogs)
def test_differential_small_transaction_backlogs(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    transactions: list[list[str]],
) -> None:
    """Backlogs of small transactions (committed inside one DO block, our worker started after them, so that they
    reach it in batches): what bulk apply takes and what it leaves to the message-by-message path, mixed. At the
    end ours = native = publisher."""
    # (each transaction also inserts a row of its own, so that none is empty and skipped by the publisher)
    body = " ".join(
        " ".join(f"{c};" for c in [_q("INSERT INTO wl_full (a, b) VALUES ({}, 'txn')", i), *txn, "COMMIT"])
        for i, txn in enumerate(transactions)
    )
    workload = Workload(steps=(Step(0, f"DO $do$ BEGIN {body} END $do$"),), sessions=1)
    stats = _apply_backlog((publisher_cluster, target_cluster, native_cluster), workload)
    _event(f"bulk transactions: {'some' if stats.bulk_transactions else 'none'}")


def _apply_backlog(
    clusters: tuple[PostgresCluster, PostgresCluster, PostgresCluster], workload: Workload
) -> WorkerStats:
    """``workload`` on the publisher while only native streams, then our worker started on the backlog it left; at
    the end ours = native = publisher. Our worker's stats."""
    _note("workload (SQL):\n" + workload.to_sql())
    with trio(*clusters) as t:
        run_workload(t.publisher, workload)
        w = t.setup.start()
        t.stop_ours = w.stop
        check_end(t)
        w.stop()
    return w.worker.stats


#: how a transaction of a backlog ends: committed (inside a DO block, as above), or prepared and at once committed or
#: rolled back (client-side: PREPARE TRANSACTION cannot run in PL/pgSQL)
_endings = st.sampled_from(["commit", "commit", "prepared_commit", "prepared_rollback"])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=_HEALTH, derandomize=not _LONG)
@given(transactions=st.lists(st.tuples(st.lists(_small_change, min_size=1, max_size=4), _endings), min_size=10,
                             max_size=60))  # fmt: skip
def test_differential_decided_prepared_backlogs(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    transactions: list[tuple[list[str], str]],
) -> None:
    """Backlogs where prepared transactions are committed or rolled back right after their PREPARE, among plain
    ones: ours folds those it reads together with their decision (applier.apply.fold), native prepares every one.
    At the end ours = native = publisher, and nothing is left prepared."""
    steps: list[Step] = []
    plain: list[str] = []

    def flush_plain() -> None:
        if plain:
            steps.append(Step(0, f"DO $do$ BEGIN {' '.join(plain)} END $do$"))
            plain.clear()

    for i, (txn, ending) in enumerate(transactions):
        statements = [_q("INSERT INTO wl_full (a, b) VALUES ({}, 'txn')", i), *txn]
        if ending == "commit":
            plain.append(" ".join(f"{c};" for c in [*statements, "COMMIT"]))
            continue
        flush_plain()
        gid = _q("{}", f"fold_{i}")
        verb = "COMMIT" if ending == "prepared_commit" else "ROLLBACK"
        steps += [Step(0, "BEGIN"), *(Step(0, c) for c in statements), Step(0, f"PREPARE TRANSACTION {gid}"),
                  Step(0, f"{verb} PREPARED {gid}")]  # fmt: skip
    flush_plain()
    stats = _apply_backlog((publisher_cluster, target_cluster, native_cluster), Workload(tuple(steps), 1))
    _event(f"folded prepares: {'some' if stats.folded_prepares else 'none'}")


# --- the fault schedule -----------------------------------------------------------------------------------------


class TcpProxy:
    """A 127.0.0.1 TCP forwarder to ``port`` that can cut every connection through it at once (:meth:`cut`): what a
    dropped network link looks like to both ends, without touching either server."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection through the proxy (new ones are accepted again)."""
        with self._lock:
            socks, self._sockets = self._sockets, set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


FAULTS = ("kill9", "target_crash", "publisher_crash", "cut")
#: every example gets each kind of fault once, after a random step (the long profile also draws extra ones)
_faults = st.tuples(*(st.tuples(st.integers(0, 10_000), st.just(kind)) for kind in FAULTS)).map(list)
if _LONG:
    _faults = st.tuples(
        _faults, st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(FAULTS)), max_size=4)
    ).map(lambda both: both[0] + both[1])


def run_with_faults(t: Trio, workload: Workload, faults: list[tuple[int, str]], applier: CliApplier,
                    proxy: TcpProxy, injected: list[str]) -> None:  # fmt: skip
    """:func:`run_workload` with faults injected after the chosen steps, each appended to ``injected`` (so a
    failure can say what had happened). A publisher crash waits for a step after which no session has a
    transaction open (an open one would be lost with its session, which is not what the property is about); the
    sessions then reconnect."""
    n = max(len(workload.steps), 1)
    pending = sorted((i % n, kind) for i, kind in faults)
    conns: dict[int, psycopg.Connection] = {}
    open_txn: set[int] = set()

    def inject(kind: str) -> None:
        injected.append(kind)
        _event(f"fault: {kind}")  # --hypothesis-show-statistics tells which faults the examples hit
        if kind == "kill9":
            applier.kill9()
            applier.start()
        elif kind == "target_crash":
            t.ours.cluster.crash()
            t.ours.cluster.start()
        elif kind == "publisher_crash":
            for c in conns.values():
                c.close()
            conns.clear()
            t.publisher.cluster.crash()
            t.publisher.cluster.start()
        else:
            proxy.cut()

    try:
        for index, step in enumerate(workload.steps):
            conn = conns.get(step.session)
            if conn is None:
                conn = conns[step.session] = t.publisher.connect()
            conn.execute(step.sql)  # type: ignore[arg-type]  # generated by the model, literals quoted
            verb = step.sql.split(None, 1)[0].upper()
            if verb == "BEGIN":
                open_txn.add(step.session)
            elif verb in ("COMMIT", "ROLLBACK", "PREPARE") and not step.sql.upper().startswith(
                ("COMMIT PREPARED", "ROLLBACK PREPARED", "ROLLBACK TO")
            ):
                open_txn.discard(step.session)
            while pending and pending[0][0] <= index:
                if pending[0][1] == "publisher_crash" and open_txn:
                    break  # not yet: try again after the next step
                inject(pending.pop(0)[1])
            if step.kind in ("prepare", "commit_prepared", "rollback_prepared"):
                check_checkpoint(t, step)
    finally:
        for c in conns.values():
            c.close()
    for _, kind in pending:
        inject(kind)  # what is left happens after the last step, when nothing is open


@settings(max_examples=FAULT_EXAMPLES, deadline=None, suppress_health_check=_HEALTH, derandomize=not _LONG)
@given(workload=_prepared_workloads, faults=_faults)
def test_faults_lose_nothing(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    workload: Workload,
    faults: list[tuple[int, str]],
) -> None:
    """The property under faults: our applier runs as the CLI process, its publisher connection goes through a
    proxy, and kill -9 / target crash / publisher crash / connection cuts happen at random steps. Still equal to
    the native subscriber at every checkpoint and to the publisher at the end: nothing lost, nothing applied twice,
    no prepared transaction stranded."""
    proxy = TcpProxy(publisher_cluster.port)
    try:
        with trio(
            publisher_cluster,
            target_cluster,
            native_cluster,
            publisher_conninfo=lambda pub: pub.cluster.dsn(pub.name, port=str(proxy.port)),
        ) as t:
            applier = CliApplier(t.ours, t.name)
            t.stop_ours = applier.close
            applier.start()
            _note("workload (SQL, one session per -- sN):\n" + workload.to_sql())
            _note(f"faults (after step index, kind): {faults}")
            injected: list[str] = []
            try:
                wait_streaming(t)
                run_with_faults(t, workload, faults, applier, proxy, injected)
                check_end(t)
            except BaseException:
                _note(f"injected: {injected}\napplier log:\n{applier.log_tail()}")
                raise
    finally:
        proxy.close()
