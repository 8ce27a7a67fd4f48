"""Tables added by ``applier alter NAME --refresh-publication`` while ``applier run`` streams are copied and caught
up live (tablesync/live.py), under a workload that never pauses: i -> d -> f -> [w -> c ->] s -> r without a
restart, and at the end every table equals the publisher's, nothing lost, nothing doubled.

Both ways a synced table joins the stream are exercised: the stream behind the copy's snapshot point (P <= C: ``s`` at
C, no catch-up) and ahead of it (P > C: a catch-up from the temporary slot), and a ``kill -9`` mid-sync.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, tables_differ, wait_until
from state.errors import IllegalTransition
from state.tables import SyncState, TableState, join_apply_stream
from tests.support.cli import catalog_tables, create, make_tables, ok, status
from tests.support.tap import CliApplier, set_decoding_work_mem, stream_txns

pytestmark = pytest.mark.spark

TIMEOUT = 60.0


def test_join_apply_stream_rule() -> None:
    """P <= C: ``s`` at C; P > C: ``c`` at P (the catch-up's goal); only from ``w``."""
    w = TableState("t", SyncState.SYNCWAIT, 100)
    assert join_apply_stream(w, 50) == TableState("t", SyncState.SYNCDONE, 100)
    assert join_apply_stream(w, 100) == TableState("t", SyncState.SYNCDONE, 100)
    assert join_apply_stream(w, 101) == TableState("t", SyncState.CATCHUP, 101)
    with pytest.raises(IllegalTransition):
        join_apply_stream(TableState("t", SyncState.FINISHEDCOPY, 100), 50)


class Workload:
    """Inserts, updates and deletes on the publisher, one small transaction after another, until stopped."""

    def __init__(
        self, publisher: Database, tables: list[str], *, first_id: int = 100_000, big_every: int = 0
    ) -> None:
        self.publisher = publisher
        self.tables = tables
        self.big_every = big_every  # every so many transactions, one with 500 new rows per table (streamed)
        self.ids = itertools.count(first_id)
        self.stop = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(5)
        try:
            with self.publisher.connect(autocommit=False) as conn:
                while not self.stop.is_set():
                    for name in self.tables:
                        t = sql.Identifier(name)
                        conn.execute(
                            sql.SQL("INSERT INTO {} VALUES (%s, 'new')").format(t), (next(self.ids),)
                        )
                        conn.execute(sql.SQL("UPDATE {} SET v = v || '+' WHERE id = %s").format(t),
                                     (rnd.randint(1, 2000),))  # fmt: skip
                        if rnd.random() < 0.3:
                            conn.execute(
                                sql.SQL("DELETE FROM {} WHERE id = %s").format(t), (rnd.randint(1, 2000),)
                            )
                        if self.big_every and self.transactions % self.big_every == 0:
                            first = next(self.ids)
                            for _ in range(500):
                                last = next(self.ids)
                            conn.execute(sql.SQL("INSERT INTO {} SELECT g, 'big' FROM generate_series(%s, %s) g")
                                         .format(t), (first, last))  # fmt: skip
                    conn.commit()
                    self.transactions += 1
                    self.stop.wait(0.005)
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc

    def __enter__(self) -> Workload:
        self.thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert self.error is None, self.error

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def run_cli(pair: Any) -> Iterator[Any]:
    runs: list[CliApplier] = []

    def start(name: str = "s", env: dict[str, str] | None = None) -> CliApplier:
        cli = CliApplier(pair.target, name, env=env).start()
        runs.append(cli)
        return cli

    yield start
    for cli in runs:
        cli.close()


def log_text(cli: CliApplier) -> str:
    return cli.log.read_text(errors="replace")


def print_sync_lines(cli: CliApplier) -> None:
    """The table sync's log lines (shown with ``pytest -s`` or on failure)."""
    print("\n".join(line for line in log_text(cli).splitlines() if "synchroniz" in line or "copy" in line))


def table_state(pair: Any, table: str) -> str | None:
    return dict(catalog_tables(pair.target, "s")).get(table)


def prepare(pair: Any, rows: int = 2000, streaming: str = "off", *create_args: str) -> None:
    """t1 published and subscribed; t2 on both sides, with rows on the publisher, not yet published."""
    make_tables(pair, "t1", rows=rows)
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO t2 SELECT g, 'row ' || g FROM generate_series(1, %s) g", (rows,))
    create(pair, "s", "--streaming", streaming, *create_args)


def wait_ready(pair: Any, cli: CliApplier, table: str, timeout: float = TIMEOUT) -> None:
    wait_until(lambda: table_state(pair, table) == "r", timeout=timeout,
               what=f"{table} ready; applier log:\n{cli.log_tail()}")  # fmt: skip


def add_t2(pair: Any) -> str:
    pair.publisher.execute(f"ALTER PUBLICATION {pair.name} ADD TABLE t2")
    return ok(pair.target, "alter", "s", "--refresh-publication")


def assert_equal_eventually(pair: Any, cli: CliApplier, *tables: str) -> None:
    for t in tables:
        wait_until(lambda t=t: tables_differ(pair.publisher, pair.target, t) is None, timeout=TIMEOUT,
                   what=f"{t} equal to the publisher's; applier log:\n{cli.log_tail()}")  # fmt: skip


@pytest.mark.parametrize("streaming", ["off", "on"])
def test_added_table_is_copied_and_caught_up_live_under_a_workload(pair, run_cli, streaming) -> None:
    """P > C: the stream keeps applying t1 while t2 is copied, so it is past the copy's snapshot point when the
    copy ends: t2 is caught up from the temporary slot, then joins the stream; run is never restarted. With
    ``streaming = on`` the stream gets big transactions in chunks (applied at STREAM COMMIT), the catch-up whole;
    that case copies t2 with Spark (no driver head start), the other on the driver, as a default run here does."""
    if streaming == "on":
        set_decoding_work_mem(pair.publisher)
    prepare(pair, streaming=streaming)
    cli = run_cli(env={"APPLIER_TABLESYNC_HEAD_START": "0"} if streaming == "on" else None)
    wait_ready(pair, cli, "t1")
    with Workload(pair.publisher, ["t1", "t2"], big_every=40 if streaming == "on" else 0) as work:
        wait_until(lambda: work.transactions > 20, timeout=TIMEOUT, what="the workload running")
        out = add_t2(pair)
        assert "being copied and caught up by the running worker" in out
        wait_ready(pair, cli, "t2")
        seen = work.transactions
        wait_until(lambda: work.transactions > seen + 20, timeout=TIMEOUT, what="more workload after ready")
        work.finish()
    assert cli.alive and cli.starts == 1
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)
    log = log_text(cli)
    for state in ("d", "f", "w", "c", "s"):
        assert re.search(rf'table "public\.t2": state {state}\b', log), (state, log[-3000:])
    assert 'table "public.t2" has finished' in log
    caught = re.search(r"caught up (\d+) transaction", log)
    assert caught and int(caught.group(1)) > 0, log[-3000:]
    # the catch-up's origin is gone, the subscription's is untouched; the temporary slot is gone
    origins = [r[0] for r in pair.target.query("SELECT roname FROM pg_replication_origin")]
    assert not [o for o in origins if o.endswith("_sync")], origins
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots WHERE temporary") == 0
    if streaming == "on":
        assert stream_txns(pair.publisher, "s") > 0


def test_stream_behind_the_snapshot_joins_without_catch_up(pair, run_cli) -> None:
    """P <= C: a big t1 transaction is open on the publisher when the sync creates its slot, so the slot's
    consistent point C comes after its commit; the apply loop is then held inside that transaction (a lock on the
    target) until the copy is done. At its end P <= C, so t2 becomes ``s`` at C with no catch-up, and the stream
    applies the workload's t2 changes from C on."""
    prepare(pair)
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    with Workload(pair.publisher, ["t2"], first_id=200_000) as work:
        big = psycopg.connect(pair.publisher.dsn, autocommit=False)
        holder = psycopg.connect(pair.target.dsn, autocommit=False)
        try:
            for _ in range(3):  # more statements than the apply pipeline holds: the apply loop waits in it
                big.execute("UPDATE t1 SET v = v || '!'")
            holder.execute("LOCK TABLE t1 IN ACCESS EXCLUSIVE MODE")
            add_t2(pair)
            wait_until(lambda: pair.publisher.scalar(
                "SELECT count(*) FROM pg_replication_slots WHERE temporary") > 0,
                timeout=TIMEOUT, what=f"the sync's slot being created; log:\n{cli.log_tail()}")  # fmt: skip
            big.commit()
            wait_until(lambda: re.search(r'table "public\.t2": state w', log_text(cli)), timeout=TIMEOUT,
                       what=f"t2 copied; log:\n{cli.log_tail()}")  # fmt: skip
            assert table_state(pair, "t2") == "f"
        finally:
            holder.rollback()
            holder.close()
            big.close()
        wait_ready(pair, cli, "t2")
        seen = work.transactions
        wait_until(lambda: work.transactions > seen + 20, timeout=TIMEOUT, what="more workload after ready")
        work.finish()
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)
    log = log_text(cli)
    assert re.search(r'table "public\.t2": state s at \S+ \(the apply stream is at \S+: no catch-up needed\)',
                     log), log[-3000:]  # fmt: skip
    assert not re.search(r'table "public\.t2": state c', log)


def test_kill_9_during_live_sync_then_restart_ends_equal(pair, run_cli) -> None:
    prepare(pair, rows=20_000)
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    with Workload(pair.publisher, ["t1", "t2"], first_id=300_000) as work:
        wait_until(lambda: work.transactions > 10, timeout=TIMEOUT, what="the workload running")
        add_t2(pair)
        wait_until(lambda: re.search(r'table "public\.t2": state d', log_text(cli)), timeout=TIMEOUT,
                   what=f"the live copy of t2 started; log:\n{cli.log_tail()}")  # fmt: skip
        cli.kill9()
        assert table_state(pair, "t2") in ("d", "f", "s", "r")
        with contextlib.suppress(Exception):
            pair.publisher.scalar("SELECT 1")
        cli.start()
        wait_ready(pair, cli, "t2")
        work.finish()
    assert_equal_eventually(pair, cli, "t1", "t2")


def test_no_free_slot_is_reported_clearly_and_the_sync_retried(pair, run_cli) -> None:
    """The publisher refuses the sync's temporary slot (max_replication_slots): the log says so and what to do; the
    sync is retried and finishes once a slot is free."""
    prepare(pair)
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    limit = int(pair.publisher.scalar("SHOW max_replication_slots"))
    used = int(pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots"))
    fillers = [f"filler_{pair.name}_{i}" for i in range(limit - used)]
    try:
        for name in fillers:
            pair.publisher.execute("SELECT pg_create_physical_replication_slot(%s)", (name,))
        add_t2(pair)
        wait_until(lambda: re.search(
            r'table synchronization for subscription "s" failed during \w+ on public\.t2: failure 1 in a row; next '
            r"attempt in [\d.]+ s \(applier status shows the error\): .*cannot get a temporary slot"
            r".*all replication slots are in use.* raise max_replication_slots on the publisher", log_text(cli)),
            timeout=TIMEOUT, what=f"the slot error in the log; log:\n{cli.log_tail()}")  # fmt: skip
        assert table_state(pair, "t2") == "i"
    finally:
        for name in fillers:
            with contextlib.suppress(psycopg.Error):
                pair.publisher.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    with Workload(pair.publisher, ["t1", "t2"], first_id=400_000) as work:
        wait_ready(pair, cli, "t2")
        work.finish()
    assert cli.alive and cli.starts == 1
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)


def test_kill_9_during_catch_up_copies_again_after_restart(pair, run_cli) -> None:
    """Killed while catching up: t2 is ``f`` with the LSN its caught-up rows are complete to (moved in the same
    transactions as those rows), beyond the copy's snapshot point. The stream's origin is behind that (only t2
    changed, and the stream skipped those), but the publisher's slot is not: the stream reported the skipped
    transactions flushed, so a restart resumes after them and never sees them again. The next run must therefore
    copy t2 again (it did go wrong: taking the origin as the resume point made t2 ``s`` at its ``f`` LSN and lost
    those changes); at the end it is equal, nothing lost or doubled."""
    prepare(pair)
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    with Workload(pair.publisher, ["t2"], first_id=500_000) as work:
        add_t2(pair)
        m = wait_until(lambda: re.search(r'table "public\.t2": state d \(copying at snapshot point (\S+)\)',
                                         log_text(cli)), timeout=TIMEOUT, what=f"the copy; log:\n{cli.log_tail()}")  # fmt: skip
        snapshot_lsn = m.group(1)
        wait_until(lambda: work.transactions > 30, timeout=TIMEOUT, what="workload after the snapshot")
        # a big transaction after the snapshot point: the catch-up needs seconds for it
        pair.publisher.execute("INSERT INTO t2 SELECT g, 'big' FROM generate_series(1000001, 1150000) g")
        wait_until(lambda: re.search(r'table "public\.t2": state c', log_text(cli)), timeout=TIMEOUT,
                   what=f"the catch-up; log:\n{cli.log_tail()}")  # fmt: skip
        wait_until(lambda: pair.target.scalar(
            "SELECT srsublsn > %s::pg_lsn FROM applier.subscription_rel WHERE srrelid = 't2'::regclass",
            (snapshot_lsn,)), timeout=TIMEOUT, what="catch-up progress committed")  # fmt: skip
        cli.kill9()
        state, lsn = pair.target.query(
            "SELECT srsubstate, srsublsn::text FROM applier.subscription_rel WHERE srrelid = 't2'::regclass"
        )[0]
        assert state == "f", (state, lsn, cli.log_tail())
        cli.start()
        wait_ready(pair, cli, "t2")
        work.finish()
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)
    log = log_text(cli)
    restart = log[log.index("--- start 2 ---") :]
    assert re.search(r"public\.t2: copied at \S+ but the stream is at \S+: copying it again", restart), (
        restart
    )


def sync_errors(pair: Any) -> list[dict[str, Any]]:
    """The subscription's error records, oldest first, with the wait each one announced (next attempt - when)."""
    with pair.target.connect() as conn:
        cur = conn.execute(
            "SELECT e.retry_count, extract(epoch FROM e.next_retry_at - e.occurred_at)::float8 AS wait,"
            " e.message, e.message_type, e.relation FROM applier.apply_error e"
            " JOIN applier.subscription s USING (subid) WHERE s.subname = 's' ORDER BY e.id"
        )
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def test_failing_live_sync_is_in_status_backs_off_and_finishes_once_fixed(pair, run_cli) -> None:
    """A row already on the target makes t2's live copy fail (duplicate key), again and again: every failure is
    recorded for ``applier status`` with t2 as the relation and ``COPY``, the announced wait grows (applier.retry,
    capped by APPLIER_MAX_RETRY_INTERVAL), ``run`` keeps running and applying t1 meanwhile; once the row is gone
    the next attempt copies t2 and it ends equal to the publisher's, nothing lost."""
    prepare(pair, 200)
    pair.target.execute("INSERT INTO t2 VALUES (5, 'in the way')")
    cli = run_cli(env={"APPLIER_MAX_RETRY_INTERVAL": "8"})
    wait_ready(pair, cli, "t1")
    add_t2(pair)
    wait_until(lambda: len(sync_errors(pair)) >= 3, timeout=4 * TIMEOUT,
               what=f"three failed syncs; log:\n{cli.log_tail()}")  # fmt: skip
    errors = sync_errors(pair)[:3]
    assert [e["retry_count"] for e in errors] == [1, 2, 3], errors
    assert all(e["relation"] == "public.t2" and e["message_type"] == "COPY" for e in errors), errors
    assert all("duplicate key" in e["message"] for e in errors), errors
    # retry_delay(n) with 0.5 s initial: [0.5, 1.0], [1.0, 1.5], [2.0, 2.5] (jitter)
    assert errors[0]["wait"] <= 1.1 < errors[2]["wait"] and errors[1]["wait"] <= errors[2]["wait"], errors
    last = status(pair.target, "s")["last_error"]
    assert last["relation"] == "public.t2" and last["message_type"] == "COPY" and last["next_retry_at"]
    text = ok(pair.target, "status", "s")
    assert "during COPY on public.t2" in text and "next attempt at" in text, text
    # the worker keeps running and applying the other table meanwhile
    pair.publisher.execute("INSERT INTO t1 VALUES (100001, 'while t2 fails')")
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t1 WHERE id = 100001") == 1, timeout=TIMEOUT,
               what=f"t1 applied while t2 fails; log:\n{cli.log_tail()}")  # fmt: skip
    assert table_state(pair, "t2") in ("i", "d") and cli.alive and cli.starts == 1
    pair.target.execute("DELETE FROM t2 WHERE id = 5")
    with Workload(pair.publisher, ["t1", "t2"], first_id=600_000) as work:
        wait_ready(pair, cli, "t2", timeout=4 * TIMEOUT)
        work.finish()
    assert cli.alive and cli.starts == 1
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)
    log = log_text(cli)
    assert re.search(r'table synchronization for subscription "s" failed during COPY on public\.t2: failure 2 '
                     r"in a row; next attempt in [\d.]+ s \(applier status shows the error\): .*duplicate key", log), log[-3000:]  # fmt: skip
    # one line per failure: the sync thread's own error line is gone (debug only)
    assert not re.search(r"failed \(tables public\.t2\)", log), log[-3000:]


def test_failing_live_sync_with_disable_on_error_disables_the_subscription(pair, run_cli) -> None:
    """With disable_on_error the first failed live copy disables the subscription (behaviour 101): recorded with
    no next attempt, the log says how to re-enable, ``run`` ends its worker; fixed and re-enabled, t2 is copied
    and nothing is lost."""
    prepare(pair, 200, "off", "--disable-on-error")
    pair.target.execute("INSERT INTO t2 VALUES (5, 'in the way')")
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    add_t2(pair)
    assert cli.proc is not None
    cli.proc.wait(timeout=4 * TIMEOUT)  # its only worker stopped: run ends
    entry = status(pair.target, "s")
    assert not entry["enabled"], entry
    last = entry["last_error"]
    assert (
        last["relation"] == "public.t2" and last["message_type"] == "COPY" and last["next_retry_at"] is None
    )
    assert "duplicate key" in last["message"]
    assert [e["retry_count"] for e in sync_errors(pair)] == [1]
    log = log_text(cli)
    assert re.search(r'subscription "s" has been disabled because of an error: table synchronization failed during '
                     r"COPY on public\.t2 \(disable_on_error\): .*duplicate key.*; fix the cause, then: applier alter s "
                     r"--enable", log), log[-3000:]  # fmt: skip
    pair.target.execute("DELETE FROM t2 WHERE id = 5")
    pair.publisher.execute("INSERT INTO t1 VALUES (100001, 'while disabled'), (100002, 'x')")
    pair.publisher.execute("INSERT INTO t2 VALUES (100001, 'while disabled')")
    ok(pair.target, "alter", "s", "--enable")
    cli.start()
    wait_ready(pair, cli, "t2", timeout=4 * TIMEOUT)
    assert_equal_eventually(pair, cli, "t1", "t2")


def test_failing_catch_up_is_recorded_with_the_change_it_was_applying(pair, run_cli) -> None:
    """A change to t2 after the copy's snapshot point meets a row already on the target while the live sync catches
    up: the record names the catch-up's message (INSERT), the relation and the remote transaction, without a skip
    command (a skip-LSN does not apply to the catch-up); the next attempt copies t2 again and finishes."""
    prepare(pair, 200)
    pair.target.execute("INSERT INTO t2 VALUES (900001, 'in the way')")
    cli = run_cli()
    wait_ready(pair, cli, "t1")
    with Workload(pair.publisher, ["t1"], first_id=700_000) as work:  # the stream moves past C: a catch-up
        add_t2(pair)
        wait_until(lambda: re.search(r'table "public\.t2": state d \(copying', log_text(cli)), timeout=TIMEOUT,
                   what=f"the copy; log:\n{cli.log_tail()}")  # fmt: skip
        pair.publisher.execute("INSERT INTO t2 VALUES (900001, 'after the snapshot')")
        wait_until(
            lambda: sync_errors(pair), timeout=2 * TIMEOUT, what=f"the failure; log:\n{cli.log_tail()}"
        )
        first = sync_errors(pair)[0]
        assert first["message_type"] == "INSERT" and first["relation"] == "public.t2", first
        assert "duplicate key" in first["message"] and first["retry_count"] == 1, first
        last = status(pair.target, "s")["last_error"]
        assert last["remote_xid"] and last["sqlstate"] == "23505" and last["finish_lsn"] is None, last
        assert last["skip_command"] is None and "CONTEXT" not in last["message"], last
        # the log has it on one line (written just after the record), with the catch-up's error context, which
        # names the catch-up's own origin
        wait_until(lambda: re.search(
            r'table synchronization for subscription "s" failed during INSERT on public\.t2: failure 1 in a row; next '
            r"attempt in [\d.]+ s \(applier status shows the error\): duplicate key.* CONTEXT: processing remote data "
            r'for replication origin "applier_\d+_sync" during message type "INSERT"', log_text(cli)),
            timeout=TIMEOUT, what=f"the failure's log line; log:\n{cli.log_tail()}")  # fmt: skip
        # the retry empties t2 (its rows are a copy of ours, ``f``) and copies it again, the publisher's row included
        wait_ready(pair, cli, "t2", timeout=4 * TIMEOUT)
        work.finish()
    assert cli.alive and cli.starts == 1
    assert_equal_eventually(pair, cli, "t1", "t2")
    print_sync_lines(cli)
