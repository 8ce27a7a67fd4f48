"""The cutover's row counts before the fence (issue 28, :mod:`applier.migrate.counts`): a table changed after the
pre-fence count is counted again after the fence, so a difference that arises after that count is still found; and
the cutover's output and the migration's notes say which tables were counted before the fence (at which position)
and which after it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from applier.lsn import parse_lsn as lsn_int
from applier.migrate import counts as counting
from applier.testing import wait_until
from applier.testing.cluster import Database
from tests.support.cli import APPLIER
from tests.support.migrate import SCHEMA, Writer, exit_status, following, migrate, phase, start, wait_phase

pytestmark = pytest.mark.core

APPLIER_CUTOVER = [*APPLIER, "migrate", "cutover", "mig"]
QUIET = "CREATE TABLE quiet (id int PRIMARY KEY); INSERT INTO quiet SELECT generate_series(1, 300);"


@contextlib.contextmanager
def _held_before_the_fence(pub: Database, tgt: Database) -> Iterator[subprocess.Popen[str]]:
    """A cutover held between its count's point and the fence (its count of ``quiet`` waits for a lock) while
    the block runs; released at the block's end."""
    locker = tgt.connect()
    locker.execute("BEGIN")
    locker.execute("LOCK TABLE quiet IN ACCESS EXCLUSIVE MODE")
    cut = subprocess.Popen([*APPLIER_CUTOVER, "--target", tgt.dsn, "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_until(
            lambda: (
                pub.scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '%\\_count'") == 1
                and tgt.scalar(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'quiet'::regclass"
                )
                == 1
            ),
            timeout=60,
            what="the cutover's count before the fence, waiting for quiet",
        )
        yield cut
    finally:
        locker.rollback()
        locker.close()


@pytest.mark.anyversion  # our counting rules; the slot is read with proto_version 1 on every server
def test_a_table_changed_after_the_count_before_the_fence_is_counted_again(pair, procs, tmp_path) -> None:
    """A row the target loses after the pre-fence count (a trigger swallows it there) must fail the verification:
    both servers' counts before the fence agree, so only counting the changed table again after the fence can
    see it."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA + QUIET)
    # on the target only: a trigger that fires for the apply too (ENABLE ALWAYS) and drops one marked row
    tgt.execute(
        "CREATE FUNCTION lose() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;"
        "CREATE TRIGGER lose BEFORE INSERT ON log FOR EACH ROW WHEN (NEW.note = 'lost') EXECUTE FUNCTION lose();"
        "ALTER TABLE log ENABLE ALWAYS TRIGGER lose"
    )
    # hold the cutover between its count point and the fence: its count of quiet (the last table) waits for this
    with _held_before_the_fence(pub, tgt) as cut:
        pub.execute("INSERT INTO log (note) VALUES ('lost')")  # after the count's point, before the fence
        wait_until(
            lambda: pub.scalar(
                "SELECT confirmed_flush_lsn >= pg_current_wal_lsn() FROM pg_replication_slots WHERE slot_name = 'mig'"
            ),
            timeout=60,
            what="the row applied (and lost) on the target",
        )
    out, _ = cut.communicate(timeout=120)
    assert cut.returncode == 1, out
    assert "verification failed: public.log: 501 rows on the source, 500 on the target" in out, out
    assert "the source is unfenced" in out
    assert phase(tgt, "mig") == "following"
    notes = json.loads(migrate(tgt, "status", "mig", "--json").stdout)["notes"]["verify"]
    assert "public.log" in notes["counted_after_fence"] and "public.quiet" not in notes["counted_after_fence"]
    assert pub.scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '%\\_count'") == 0
    assert migrate(tgt, "abort", "mig").returncode == 0
    assert exit_status(proc, log) == 1


@pytest.mark.anyversion  # our report of the counts
def test_the_report_says_what_was_counted_before_and_after_the_fence(pair, procs, tmp_path) -> None:
    """Under writes to acc and log (not quiet): quiet's counts are those from before the fence, acc and log are
    counted again after it; the output and ``status --json``'s notes say so, with the count's position."""
    pub, tgt = pair.publisher, pair.target
    pub.execute(SCHEMA + QUIET)
    writer = Writer(pub, pause=0.01)
    writer.start()
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log)
    procs.append(proc)
    wait_phase(tgt, "mig", "following", proc, log)
    wait_until(lambda: len(writer.committed) >= 20, timeout=60, what="some writes")
    res = migrate(tgt, "cutover", "mig", "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr
    writer.halt.set()
    writer.join(timeout=30)
    assert exit_status(proc, log) == 0, log.read_text()
    notes = json.loads(migrate(tgt, "status", "mig", "--json").stdout)["notes"]["verify"]
    assert notes["tables"] == 3 and notes["fallback"] is None, notes
    assert notes["counted_before_fence"] == 1 and notes["before_fence_at"], notes
    assert sorted(notes["counted_after_fence"]) == ["public.acc", "public.log"], notes
    # the source's counts of acc and log: the counts at the point plus the rows inserted since (none deleted)
    derived = notes["source_derived"]
    assert sorted(derived) == ["public.acc", "public.log"] and derived["public.acc"]["inserted"] > 0, notes
    assert derived["public.acc"]["deleted"] == 0, notes
    line = f"1 counted before the fence at {notes['before_fence_at']} and unchanged since, 2 changed since"
    assert line in res.stdout, res.stdout
    for table in ("acc", "log", "quiet"):
        query = f"SELECT count(*) FROM {table}"  # noqa: S608 - our own table names
        assert tgt.scalar(query) == pub.scalar(query)
    assert pub.scalar("SELECT count(*) FROM pg_replication_slots") == 0


UPDATED = """
CREATE TABLE upd (id int PRIMARY KEY, v int NOT NULL);
CREATE TABLE trg (id int PRIMARY KEY, v int NOT NULL);
INSERT INTO upd SELECT g, 0 FROM generate_series(1, 100) g;
INSERT INTO trg SELECT g, 0 FROM generate_series(1, 100) g;
"""


def _update_both(conn: Any) -> int:
    """One transaction updating a row of ``upd`` and one of ``trg`` (ids 1-50; no row in or out)."""
    (i,) = conn.execute("SELECT 1 + floor(random() * 50)::int").fetchone()
    conn.execute("UPDATE upd SET v = v + 1 WHERE id = %s", (i,))
    conn.execute("UPDATE trg SET v = v + 1 WHERE id = %s", (i,))
    return int(i)


@pytest.mark.anyversion  # our counting rules
def test_tables_only_updated_after_the_count_keep_their_counts_from_before_the_fence(
    pair,
    procs,
    tmp_path,
) -> None:
    """Tables that the writes after C only update are not counted again under the fence (an UPDATE moves no
    count), yet still verified: a row the target lacks is found by the counts from before the fence (the first
    cutover fails); a table whose ALWAYS trigger on the target fires for the apply is counted again after it."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, UPDATED + QUIET)
    tgt.execute(
        "CREATE FUNCTION keep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;"
        "CREATE TRIGGER keep BEFORE UPDATE ON trg FOR EACH ROW EXECUTE FUNCTION keep();"
        "ALTER TABLE trg ENABLE ALWAYS TRIGGER keep;"
        "DELETE FROM upd WHERE id = 100"  # a row the target lost, before the count's point
    )
    writer = Writer(pub, write=_update_both, pause=0.01)
    writer.start()
    try:
        wait_until(lambda: len(writer.committed) >= 20, timeout=60, what="some updates")
        res = migrate(tgt, "cutover", "mig", "--timeout", "60")
        assert res.returncode == 1, res.stdout + res.stderr
        out = res.stdout + res.stderr
        assert "public.upd: 100 rows on the source, 99 on the target (both at" in out, out
        assert phase(tgt, "mig") == "following"
    finally:
        writer.halt.set()
        writer.join(timeout=30)
    tgt.execute("INSERT INTO upd VALUES (100, 0)")
    with _held_before_the_fence(pub, tgt) as cut:  # the first cutover's fence ended the writer: update here
        with pub.connect() as conn:
            for _ in range(10):
                _update_both(conn)
    out, _ = cut.communicate(timeout=120)
    assert cut.returncode == 0, out
    assert exit_status(proc, log) == 0, log.read_text()
    notes = json.loads(migrate(tgt, "status", "mig", "--json").stdout)["notes"]["verify"]
    assert notes["fallback"] is None and notes["before_fence_at"], notes
    assert notes["updated_only_since"] == ["public.upd"], notes
    assert notes["counted_after_fence"] == ["public.trg"], notes
    assert "(or only updated: 1)" in out, out
    for table in ("upd", "trg"):
        query = f"SELECT count(*), sum(v) FROM {table}"  # noqa: S608 - our own table names
        assert tgt.query(query) == pub.query(query)


@pytest.mark.anyversion  # our fallback when the count slot cannot be created
def test_a_prepared_transaction_on_the_source_means_counting_after_the_fence(pair, procs, tmp_path) -> None:
    """A prepared transaction would hold the count slot's creation: every table is counted after the fence, and
    the notes say why."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    with pub.connect() as c:
        c.execute("BEGIN")
        c.execute("INSERT INTO acc (v) VALUES (777)")
        c.execute("PREPARE TRANSACTION 'app_tx_2'")

    def commit_once_fenced() -> None:  # the cutover (--prepared wait) waits for it under the fence
        wait_until(
            lambda: pub.scalar(
                "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase"
                " WHERE d.datname = current_database() AND 'default_transaction_read_only=on' = ANY(s.setconfig)"
            ),
            timeout=60,
            what="the cutover's fence",
        )
        pub.execute("COMMIT PREPARED 'app_tx_2'")

    committer = threading.Thread(target=commit_once_fenced)
    committer.start()
    res = migrate(tgt, "cutover", "mig", "--timeout", "60")
    committer.join()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all counted after the fence" in res.stdout, res.stdout
    notes = json.loads(migrate(tgt, "status", "mig", "--json").stdout)["notes"]["verify"]
    assert notes["before_fence_at"] is None and notes["counted_before_fence"] == 0 and notes["fallback"], (
        notes
    )
    assert exit_status(proc, log) == 0, log.read_text()


# truncate: our fallback to counting again (anyversion); dml decodes the count slot on this version
@pytest.mark.parametrize(
    "truncate", [False, pytest.param(True, marks=pytest.mark.anyversion)], ids=["dml", "truncate"]
)
def test_rows_deleted_and_inserted_after_the_count_are_derived_exactly(
    pair,
    procs,
    tmp_path,
    truncate,
) -> None:
    """Deletes, inserts and updates between the count's point and the fence: the source's count of the table is
    its count at the point plus the inserts less the deletes, which must equal the target's, counted again. After
    a TRUNCATE nothing is derived: the source counts again."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA + QUIET)
    with _held_before_the_fence(pub, tgt) as cut:
        if truncate:
            pub.execute("TRUNCATE log")
        pub.execute("DELETE FROM log WHERE id <= 10")
        pub.execute("INSERT INTO log (note) VALUES ('a'), ('b'), ('c')")
        pub.execute("UPDATE log SET note = 'u' WHERE id BETWEEN 20 AND 30")
    out, _ = cut.communicate(timeout=120)
    assert cut.returncode == 0, out
    notes = json.loads(migrate(tgt, "status", "mig", "--json").stdout)["notes"]["verify"]
    assert notes["counted_after_fence"] == ["public.log"], notes
    derived = {} if truncate else {"public.log": {"inserted": 3, "deleted": 10}}
    assert notes["source_derived"] == derived, notes
    assert (
        tgt.scalar("SELECT count(*) FROM log")
        == pub.scalar("SELECT count(*) FROM log")
        == (3 if truncate else 493)
    )
    assert exit_status(proc, log) == 0, log.read_text()


def test_the_last_event_since_the_count_includes_a_rolled_back_prepared_transaction(pair) -> None:
    """The cutover waits for the target's origin to reach the stream's last event since C: a transaction prepared
    after C and rolled back is not in the counts' decoding, yet its PREPARE and ROLLBACK PREPARED reach the
    target, so the last event lies past the last commit (waiting only for that could leave the PREPARE applied
    and its ROLLBACK PREPARED not)."""
    pub = pair.publisher
    pub.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p FOR TABLE t")
    quiet, point = (
        counting.Baseline(
            name, pub.scalar("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)),
            {}, {}, 0.0,
        )
        for name in ("quiet", "busy")
    )  # fmt: skip
    with psycopg.connect(pub.dsn, autocommit=True) as src:
        src.execute("INSERT INTO t VALUES (1)")
        committed = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        src.execute("BEGIN")
        src.execute("INSERT INTO t VALUES (2)")
        src.execute("PREPARE TRANSACTION 'undone'")
        src.execute("ROLLBACK PREPARED 'undone'")
        end = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        changes = counting.read_changes(
            src, point, "p"
        )  # once per slot, as the cutover does (see read_changes)
        assert changes is not None and changes.error is None
        assert changes.tables == {"public.t"} and changes.inserted == {"public.t": 1}, changes
        assert changes.last_commit is not None and changes.last_event is not None
        lsn = [lsn_int(x) for x in (point.point, changes.last_commit, committed, changes.last_event, end)]
        assert lsn[0] < lsn[1] <= lsn[2] < lsn[3] <= lsn[4], (point, changes, committed, end)
        src.execute("SELECT pg_replication_slot_advance('quiet', pg_current_wal_lsn())")  # C after all of it
        nothing = counting.read_changes(src, quiet, "p")
        assert nothing is not None and nothing.last_commit is None and nothing.last_event == "0/0", nothing
