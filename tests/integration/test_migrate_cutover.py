"""``applier migrate status``, ``cutover`` and ``abort`` against real servers: a cutover under a light write load
(and with a prepared transaction open at the fence) loses and duplicates nothing, sets the sequences and puts the
identity columns back; a failed verification unfences the source; abort cleans the source up."""

from __future__ import annotations

import json
import subprocess
import threading

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, wait_until
from tests.support.cli import APPLIER
from tests.support.migrate import SCHEMA, Writer, exit_status, following, migrate, phase, start, wait_phase

pytestmark = pytest.mark.core


@pytest.mark.anyversion  # our fence and switch; the cutover on this version is the older-source tests'
def test_cutover_under_writes_loses_and_duplicates_nothing(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    pub.execute(SCHEMA)
    # writes all along: before the slot and its snapshot, during the schema, the copy and post-data, while following
    writer = Writer(pub)
    writer.start()
    wait_until(lambda: len(writer.committed) >= 20, timeout=60, what="some writes")
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log)
    procs.append(proc)
    wait_phase(tgt, "mig", "following", proc, log)

    doc = json.loads(migrate(tgt, "status", "mig", "--json").stdout)
    assert doc["phase"] == "following" and {t["state"] for t in doc["tables"]} <= {"s", "r"}
    assert "lag_bytes" in doc and "lag_seconds" in doc and len(doc["tables"]) == 2

    # a prepared transaction open at the fence: --prepared wait waits for its decision, which still works fenced
    with pub.connect() as c:
        c.execute("BEGIN")
        c.execute("INSERT INTO acc (v) VALUES (777)")
        c.execute("PREPARE TRANSACTION 'app_tx_1'")
    wait_until(lambda: pub.scalar("SELECT count(*) FROM pg_prepared_xacts") == 1, what="prepared")

    def decide() -> None:
        wait_until(lambda: "waiting for 1 prepared" in (cut_out.get("text") or ""), timeout=60, interval=0.05,
                   what="the cutover to wait for the prepared transaction")  # fmt: skip
        pub.execute("COMMIT PREPARED 'app_tx_1'")

    cut_out: dict[str, str] = {}
    cut = subprocess.Popen([*APPLIER, "migrate", "cutover", "mig", "--target", tgt.dsn, "--timeout", "90"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    decider = threading.Thread(target=decide, daemon=True)
    decider.start()
    lines = []
    assert cut.stdout is not None
    for line in cut.stdout:
        lines.append(line)
        cut_out["text"] = "".join(lines)
    assert cut.wait() == 0, cut_out["text"]
    writer.join(timeout=30)
    assert writer.error is not None and ("read-only" in writer.error or "terminat" in writer.error)
    assert exit_status(proc, log) == 0, log.read_text()
    out = cut_out["text"]
    assert "cutover done: write downtime" in out and "sequences: 3 set from the source" in out

    # nothing lost, nothing duplicated (the keys are unique), the prepared transaction's row included
    src_rows = pub.query("SELECT id, v FROM acc ORDER BY id")
    assert tgt.query("SELECT id, v FROM acc ORDER BY id") == src_rows
    assert tgt.query("SELECT * FROM log ORDER BY id") == pub.query("SELECT * FROM log ORDER BY id")
    assert set(writer.committed) <= {i for i, _ in src_rows} and (777,) in {(v,) for _, v in src_rows}
    # sequences: the next values follow the source's, past every row
    assert tgt.scalar("SELECT nextval('free_seq')") == 43
    assert tgt.scalar("SELECT nextval('log_id_seq')") > tgt.scalar("SELECT max(id) FROM log")
    tgt.execute("INSERT INTO acc (v) VALUES (1)")  # the identity is ALWAYS again, and past the copied rows
    assert (
        tgt.scalar("SELECT attidentity FROM pg_attribute WHERE attrelid = 'acc'::regclass AND attname = 'id'")
        == "a"
    )
    # the source: fenced, and nothing of ours left there
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        pub.execute("INSERT INTO log (note) VALUES ('late')")
    assert pub.scalar("SELECT count(*) FROM pg_replication_slots") == 0
    assert pub.scalar("SELECT count(*) FROM pg_publication") == 0
    assert phase(tgt, "mig") == "done"
    # (the fixture drops the fenced database from another one)


@pytest.mark.anyversion  # our verification and unfence
def test_a_failed_verification_unfences_and_keeps_following(pair, procs, tmp_path) -> None:
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    with tgt.connect() as c:  # a row only the target has, beyond the sequence of its column
        c.execute("SET session_replication_role = replica")
        c.execute("INSERT INTO log (id, note) VALUES (100000, 'stray')")
    res = migrate(tgt, "cutover", "mig", "--timeout", "60")
    assert res.returncode == 1 and "the source is unfenced" in res.stderr and "Traceback" not in res.stderr
    assert (
        "sequence public.log_id_seq would next give 501, but public.log.id already holds 100000" in res.stderr
    )
    assert phase(tgt, "mig") == "following"
    tgt.execute("UPDATE log SET id = -5 WHERE id = 100000")  # now only the counts differ
    res = migrate(tgt, "cutover", "mig", "--timeout", "60")
    assert (
        res.returncode == 1 and "verification failed: public.log: 500 rows on the source, 501" in res.stderr
    )
    assert "the source is unfenced" in res.stderr
    pub.execute("INSERT INTO acc (v) VALUES (5)")  # writable again
    assert phase(tgt, "mig") == "following" and proc.poll() is None
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM acc") == 501, timeout=60, what="still following")

    res = migrate(tgt, "abort", "mig")
    assert res.returncode == 0, res.stderr
    assert exit_status(proc, log) == 1 and "aborted" in log.read_text()
    assert pub.scalar("SELECT count(*) FROM pg_replication_slots") == 0
    assert pub.scalar("SELECT count(*) FROM pg_publication") == 0
    assert tgt.scalar("SELECT count(*) FROM applier.subscription") == 0
    assert phase(tgt, "mig") == "failed"


@pytest.mark.anyversion  # our fence
def test_a_session_that_connects_after_the_fence_is_not_ended(pair, procs, tmp_path) -> None:
    """The fence ends the sessions connected before it, waiting for one inside a transaction that has written; a
    session that connects meanwhile is read-only and is left alone (an application's transaction manager
    connecting to decide a prepared transaction under ``--prepared wait`` was ended)."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    writing = pub.connect()
    writing.execute("BEGIN")
    writing.execute("INSERT INTO acc (v) VALUES (888)")  # an xid: the fence lets it finish
    cut = subprocess.Popen([*APPLIER, "migrate", "cutover", "mig", "--target", tgt.dsn, "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert cut.stdout is not None
    lines, late = [], None
    for line in cut.stdout:
        lines.append(line)
        if late is None and "waiting for 1 transaction(s) in progress" in line:
            late = pub.connect()  # after the fence, while it waits for the writer (looking every 10 ms)
            assert late.execute("SHOW transaction_read_only").fetchone() == ("on",)
            writing.execute("COMMIT")
    assert cut.wait() == 0 and late is not None, "".join(lines)
    assert "fence: 1 session(s) ended" in "".join(lines)
    assert late.execute("SELECT count(*) FROM acc WHERE v = 888").fetchone() == (1,)  # still connected
    late.close()
    assert exit_status(proc, log) == 0, log.read_text()
    assert tgt.scalar("SELECT count(*) FROM acc WHERE v = 888") == 1


def test_a_postgresql_15_source_into_this_target(pair, pg15, procs, tmp_path) -> None:
    _an_older_source_into_this_target(pair, pg15, procs, tmp_path)


def test_a_postgresql_16_source_into_this_target(pair, pg16, procs, tmp_path) -> None:
    _an_older_source_into_this_target(pair, pg16, procs, tmp_path)


def test_a_postgresql_14_source_into_this_target(pair, pg14, procs, tmp_path) -> None:
    """From 14 (issue 31): a transaction prepared on the source arrives when it is committed; ``--prepared carry``
    is refused before the fence (no two-phase decoding before 15), the source stays writable, the migration keeps
    following, and the cutover that waits (the default) completes."""

    def carry_refused(src: Database) -> None:
        with src.connect() as c:
            c.execute("BEGIN")
            c.execute("INSERT INTO acc (v) VALUES (1414)")
            c.execute("PREPARE TRANSACTION 'app_14'")
        res = migrate(pair.target, "cutover", "mig", "--timeout", "60", "--prepared", "carry")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
        assert "runs PostgreSQL 14, whose pgoutput cannot decode prepared transactions" in res.stderr
        assert "use --prepared wait" in res.stderr
        assert phase(pair.target, "mig") == "following"
        src.execute("INSERT INTO acc (v) VALUES (10)")  # not fenced
        assert pair.target.scalar("SELECT count(*) FROM acc WHERE v = 1414") == 0  # prepared: not yet arrived
        src.execute("COMMIT PREPARED 'app_14'")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM acc WHERE v = 1414") == 1, timeout=60,
                   what="the committed prepared transaction")  # fmt: skip
        state = pair.target.scalar("SELECT subtwophasestate FROM applier.subscription")
        assert state == "d", state

    # --verify counts: the count before the fence reads a 14 source's changes through pgoutput too
    _an_older_source_into_this_target(
        pair, pg14, procs, tmp_path, before_cutover=carry_refused, verify="counts"
    )


def _an_older_source_into_this_target(pair, old, procs, tmp_path, before_cutover=None, verify="full") -> None:  # type: ignore[no-untyped-def]
    """The major-version upgrade: pg_dump of the target's version reads the old server; identity, generated
    columns and sequences come across; a cutover completes."""
    src = old.create_database(pair.name)
    try:
        src.execute(SCHEMA + "ALTER TABLE log ADD COLUMN n2 int GENERATED ALWAYS AS (length(note) * 2) STORED;"
                    "CREATE INDEX log_note ON log (note)")  # fmt: skip
        log = tmp_path / "start.log"
        proc = start(pair, "mig", log=log, source=src)
        procs.append(proc)
        wait_phase(pair.target, "mig", "following", proc, log)
        src.execute("INSERT INTO acc (v) VALUES (9); INSERT INTO log (acc, note) VALUES (501, 'late')")
        if before_cutover is not None:
            before_cutover(src)
        res = migrate(pair.target, "cutover", "mig", "--timeout", "60", "--verify", verify)
        assert res.returncode == 0, res.stdout + res.stderr
        if verify == "full":
            assert "every table equal" in res.stdout
        else:  # both tables counted before the fence, nothing changed since
            assert "2 counted before the fence at" in res.stdout, res.stdout
        assert exit_status(proc, log) == 0, log.read_text()
        for q in ("SELECT * FROM acc ORDER BY id", "SELECT * FROM log ORDER BY id"):
            assert pair.target.query(q) == src.query(q)
        assert pair.target.scalar("SELECT nextval('free_seq')") == 43
        assert pair.target.scalar("SELECT indexdef FROM pg_indexes WHERE indexname = 'log_note'") is not None
        assert (
            pair.target.scalar("SELECT nextval('acc_id_seq')")
            == src.scalar("SELECT last_value FROM acc_id_seq") + 1
        )
    finally:
        with old.connect() as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(pair.name)))


@pytest.mark.anyversion  # our chaining of start and cutover
def test_start_with_cutover_does_the_whole_job_in_one_command(pair) -> None:
    pub, tgt = pair.publisher, pair.target
    pub.execute(SCHEMA)
    res = subprocess.run([*APPLIER, "migrate", "start", "mig", "--source", pub.dsn, "--target", tgt.dsn, "--cutover"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cutting over" in res.stdout and "cutover done: write downtime" in res.stdout
    assert 'migration "mig" done' in res.stdout
    assert "stopping the workers" in res.stderr  # at once, not at the worker's next look at the catalog
    for q in ("SELECT * FROM acc ORDER BY id", "SELECT * FROM log ORDER BY id"):
        assert tgt.query(q) == pub.query(q)
    assert tgt.scalar("SELECT nextval('free_seq')") == 43
    assert phase(tgt, "mig") == "done"
    assert pub.scalar("SELECT count(*) FROM pg_replication_slots") == 0
