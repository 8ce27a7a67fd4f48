"""``applier migrate cutover --prepared carry`` and ``--reverse`` against real servers.

Carry: transactions prepared on the source and still open at the fence stay prepared on the target under their
original GIDs; the application finishes them there (COMMIT PREPARED / ROLLBACK PREPARED by GID) and the data is
right; the source's copies are rolled back once nothing decodes the source any more. Reverse: after the cutover, a
write on the new server reaches the old one exactly once."""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, wait_until
from tests.support.cli import APPLIER, create, fails, make_tables, ok
from tests.support.migrate import SCHEMA, exit_status, migrate, phase, start, wait_phase

ODD_GID = "app'tx 1"  # a GID that needs quoting


def _prepare(db: Database, gid: str, statement: str) -> None:
    with db.connect() as c:
        c.execute("BEGIN")
        c.execute(statement)
        c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))


def _prepared(db: Database) -> set[str]:
    return {r[0] for r in db.query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")}


def _two_phase_on(tgt: Database) -> bool:
    return tgt.scalar("SELECT subtwophasestate FROM applier.subscription WHERE subname = 'mig'") == "e"


def _following_with_two_phase(pair, running, tmp_path):  # type: ignore[no-untyped-def]
    """``migrate start`` of the shared schema, until it follows the source with two-phase on: (process, its log)."""
    pair.publisher.execute(SCHEMA)
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log)
    running.append(proc)
    wait_phase(pair.target, "mig", "following", proc, log)
    wait_until(lambda: _two_phase_on(pair.target), timeout=60, what="two-phase on for the migration's stream")
    return proc, log


@pytest.mark.core
def test_carry_keeps_open_prepared_transactions_under_their_gids(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    proc, log = _following_with_two_phase(pair, procs, tmp_path)
    assert tgt.scalar("SELECT subgidformat FROM applier.subscription WHERE subname = 'mig'") == "original"

    # while following, the source's decisions reach the target's copies by their original GIDs
    _prepare(pub, "app_tx_c", "INSERT INTO acc (v) VALUES (1001)")
    _prepare(pub, "app_tx_r", "INSERT INTO acc (v) VALUES (1002)")
    wait_until(lambda: {"app_tx_c", "app_tx_r"} <= _prepared(tgt), timeout=60, what="prepared on the target")
    pub.execute("COMMIT PREPARED 'app_tx_c'")
    pub.execute("ROLLBACK PREPARED 'app_tx_r'")
    wait_until(lambda: not _prepared(tgt), timeout=60, what="decided on the target")
    assert tgt.scalar("SELECT count(*) FROM acc WHERE v IN (1001, 1002)") == 1

    # open at the fence: carried
    _prepare(pub, ODD_GID, "INSERT INTO acc (v) VALUES (2001)")
    _prepare(pub, "app_tx_2", "UPDATE log SET note = 'from tx 2' WHERE id = 7")
    wait_until(lambda: _prepared(tgt) == {ODD_GID, "app_tx_2"}, timeout=60, what="prepared on the target")
    res = migrate(tgt, "cutover", "mig", "--prepared", "carry", "--timeout", "90")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "prepared: 2 transaction(s) carried" in res.stdout
    assert "copies of 2 carried transaction(s) rolled back there" in res.stdout
    assert "COMMIT PREPARED or ROLLBACK PREPARED 'app''tx 1'" in res.stdout
    assert exit_status(proc, log) == 0, log.read_text()
    assert phase(tgt, "mig") == "done"
    assert _prepared(pub) == set()  # nothing left holding locks on the old server
    assert _prepared(tgt) == {ODD_GID, "app_tx_2"}
    doc = json.loads(migrate(tgt, "status", "mig", "--json").stdout)
    assert sorted(doc["prepared_on_target"]) == sorted([ODD_GID, "app_tx_2"])
    # both tables are locked by a carried transaction: their identity waits (BY DEFAULT until then)
    assert [s.replace('"', "") for s in doc["pending_statements"]] == [
        "ALTER TABLE public.acc ALTER COLUMN id SET GENERATED ALWAYS"
    ]
    # the subscription cannot be dropped while its carried transactions are open (found through its records)
    res = subprocess.run(
        [*APPLIER, "--target", tgt.dsn, "drop", "mig"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 1 and "app_tx_2" in res.stderr and "app'tx 1" in res.stderr

    # the application's transaction manager finishes them on the new server
    tgt.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(ODD_GID)))
    tgt.execute("ROLLBACK PREPARED 'app_tx_2'")
    assert tgt.scalar("SELECT count(*) FROM acc WHERE v = 2001") == 1
    assert tgt.scalar("SELECT note FROM log WHERE id = 7") == "n"
    for s in doc["pending_statements"]:
        tgt.execute(s)
    (new_id,) = tgt.query("INSERT INTO acc (v) VALUES (-3) RETURNING id")[0]  # identity ALWAYS again
    assert new_id > tgt.scalar("SELECT max(id) FROM acc WHERE v <> -3")
    # everything else is the source's
    assert tgt.query("SELECT * FROM log ORDER BY id") == pub.query("SELECT * FROM log ORDER BY id")
    assert tgt.query("SELECT id, v FROM acc WHERE v NOT IN (2001, -3) ORDER BY id") == pub.query(
        "SELECT id, v FROM acc ORDER BY id"
    )


def test_a_gid_in_use_on_the_target_fails_clearly_then_recovers(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    proc, log = _following_with_two_phase(pair, procs, tmp_path)
    tgt.execute("CREATE TABLE target_only (x int)")
    _prepare(tgt, "dup", "INSERT INTO target_only VALUES (1)")  # the target's own application
    _prepare(pub, "dup", "INSERT INTO acc (v) VALUES (4242)")

    def told() -> bool:
        out = subprocess.run(
            [*APPLIER, "--target", tgt.dsn, "status", "mig"], capture_output=True, text=True
        ).stdout
        return "SQLSTATE 42710" in out and "already has" in out

    wait_until(told, timeout=60, what="the error and its hint in status")
    # the record of the target's own transaction was not taken over: nothing of ours names it
    assert tgt.scalar("SELECT count(*) FROM applier.prepared_xact WHERE gid = 'dup'") == 0
    tgt.execute("ROLLBACK PREPARED 'dup'")
    wait_until(lambda: "dup" in _prepared(tgt), timeout=120, what="the retry to prepare it")
    pub.execute("COMMIT PREPARED 'dup'")
    wait_until(
        lambda: tgt.scalar("SELECT count(*) FROM acc WHERE v = 4242") == 1, timeout=60, what="committed"
    )
    assert tgt.scalar("SELECT count(*) FROM target_only") == 0
    res = migrate(tgt, "abort", "mig")
    assert res.returncode == 0, res.stderr
    assert exit_status(proc, log) == 1


def test_a_transaction_prepared_during_the_copy_is_carried(pair, procs, tmp_path) -> None:
    """Prepared on the source after the slot's snapshot, while the tables are still being copied: every table is
    copied at that one snapshot, so the stream has two-phase on from its start (no pending state, no restart;
    state.twophase.ready_at_slot_snapshot) and the transaction arrives at its PREPARE, once, and is carried. (A
    stream that had two-phase off while it was prepared, after a start resumed mid-copy, gets it only at COMMIT
    PREPARED; the cutover then refuses to carry it: applier.migrate.carry.)"""
    pub, tgt = pair.publisher, pair.target
    pub.execute(SCHEMA)
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log)
    procs.append(proc)
    wait_until(lambda: phase(tgt, "mig") == "copy" or proc.poll() is not None, timeout=120, what="phase copy")
    _prepare(pub, "early", "INSERT INTO acc (v) VALUES (5005)")  # no seed row has it
    wait_phase(tgt, "mig", "following", proc, log)
    assert _two_phase_on(tgt)  # from the set-up's end, before the worker's first stream
    assert {r[0] for r in tgt.query("SELECT srsubstate FROM applier.subscription_rel")} == {"r"}
    wait_until(lambda: "early" in _prepared(tgt), timeout=60, what="prepared on the target at its PREPARE")
    assert "will restart so that two_phase can be enabled" not in log.read_text()
    res = migrate(tgt, "cutover", "mig", "--prepared", "carry", "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "prepared: 1 transaction(s) carried" in res.stdout
    assert exit_status(proc, log) == 0
    tgt.execute("COMMIT PREPARED 'early'")
    assert tgt.scalar("SELECT count(*) FROM acc WHERE v = 5005") == 1  # once
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        pub.execute("INSERT INTO acc (v) VALUES (6)")


def _reverse_round_trip(pair, src: Database, procs, tmp_path) -> None:
    """Cut over with --reverse from ``src``, then write on the new server: each write reaches the old one once."""
    tgt = pair.target
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log, source=src)
    procs.append(proc)
    wait_phase(tgt, "mig", "following", proc, log)
    src.execute("INSERT INTO acc (v) VALUES (900)")  # followed before the cutover
    res = migrate(tgt, "cutover", "mig", "--reverse", "--timeout", "90")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "reverse: the old server follows the new one" in res.stdout
    assert exit_status(proc, log) == 0, log.read_text()
    # the application moves to the new server: inserts, an update and a delete, in several transactions
    with tgt.connect() as c:
        for i in range(5):
            c.execute("INSERT INTO acc (v) VALUES (%s)", (1000 + i,))
        c.execute("UPDATE log SET note = 'changed on the new server' WHERE id = 3")
        c.execute("DELETE FROM log WHERE id = 4")
    q_acc, q_log = "SELECT id, v FROM acc ORDER BY id", "SELECT * FROM log ORDER BY id"
    wait_until(lambda: src.query(q_acc) == tgt.query(q_acc) and src.query(q_log) == tgt.query(q_log), timeout=60,
               what="the new server's writes on the old one")  # fmt: skip
    assert src.scalar("SELECT count(*) FROM acc WHERE v >= 1000") == 5  # exactly once
    # the applications stay fenced on the old server
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        src.execute("INSERT INTO acc (v) VALUES (6)")
    # (what the old server applies is the new server's own writes only: nothing came back twice)
    assert src.scalar("SELECT count(*) FROM acc WHERE v = 900") == 1
    # the user's clean up, as documented (it also drops the new server's slot)
    with src.connect() as c:
        c.execute("SET default_transaction_read_only = off")
        c.execute("DROP SUBSCRIPTION mig_reverse")
    assert tgt.scalar("SELECT count(*) FROM pg_replication_slots") == 0


@pytest.mark.core
def test_reverse_leaves_the_old_server_following_the_new_one(pair, procs, tmp_path) -> None:
    pair.publisher.execute(SCHEMA)
    _reverse_round_trip(pair, pair.publisher, procs, tmp_path)


def test_reverse_from_a_postgresql_15_source(pair, pg15, procs, tmp_path) -> None:
    """PostgreSQL 15 has no ``origin`` option: the slot's starting point alone keeps our apply's writes out."""
    src = pg15.create_database(pair.name)
    try:
        src.execute(SCHEMA)
        _reverse_round_trip(pair, src, procs, tmp_path)
    finally:
        with pg15.connect() as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(pair.name)))


def test_reverse_with_prepared_transactions_to_carry_is_refused(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    proc, log = _following_with_two_phase(pair, procs, tmp_path)
    _prepare(pub, "open_one", "INSERT INTO acc (v) VALUES (1)")
    res = migrate(tgt, "cutover", "mig", "--prepared", "carry", "--reverse", "--timeout", "60")
    assert (
        res.returncode == 1
        and "--reverse cannot be combined with prepared transactions to carry" in res.stderr
    )
    assert "the source is unfenced" in res.stderr and phase(tgt, "mig") == "following"
    assert tgt.scalar("SELECT count(*) FROM pg_publication") == 0
    pub.execute("INSERT INTO acc (v) VALUES (2)")  # writable again
    pub.execute("ROLLBACK PREPARED 'open_one'")
    res = migrate(tgt, "abort", "mig")
    assert res.returncode == 0, res.stderr


def test_gid_format_of_a_plain_subscription(pair, tmp_path) -> None:
    """``alter --set gid_format=original``: only while disabled and with nothing prepared; then ``applier run``
    prepares under the publisher's GID and finishes it when the publisher does."""
    pub, tgt = pair.publisher, pair.target
    make_tables(pair, "t1")
    create(pair, "s", "--two-phase", "--no-copy-data")
    assert "for enabled subscription" in fails(tgt, "alter", "s", "--set", "gid_format=original")
    ok(tgt, "alter", "s", "--disable")
    ok(tgt, "alter", "s", "--set", "gid_format=original")
    assert tgt.scalar("SELECT subgidformat FROM applier.subscription WHERE subname = 's'") == "original"
    ok(tgt, "alter", "s", "--enable")
    with open(tmp_path / "run.log", "w") as out:
        run = subprocess.Popen(
            [*APPLIER, "--target", tgt.dsn, "run", "s"], stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _prepare(pub, "pub gid 1", "INSERT INTO t1 VALUES (1, 'a')")
            wait_until(lambda: "pub gid 1" in _prepared(tgt), timeout=60, what="prepared on the target")
            pub.execute("COMMIT PREPARED 'pub gid 1'")
            wait_until(lambda: tgt.scalar("SELECT count(*) FROM t1") == 1, timeout=60, what="committed")
            _prepare(pub, "pub gid 2", "INSERT INTO t1 VALUES (2, 'b')")
            wait_until(lambda: "pub gid 2" in _prepared(tgt), timeout=60, what="prepared on the target")
        finally:
            run.terminate()
            run.wait(timeout=60)
    ok(tgt, "alter", "s", "--disable")
    refusal = fails(tgt, "alter", "s", "--set", "gid_format=subscription")
    assert "while 1 prepared transaction(s)" in refusal
    pub.execute("ROLLBACK PREPARED 'pub gid 2'")
    tgt.execute("ROLLBACK PREPARED 'pub gid 2'")
