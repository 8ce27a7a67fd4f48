"""The initial copy on real servers with local Spark: type fidelity, snapshot exactness, publication rules,
exactly-once under retries and a killed process, and the catalog states it leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psycopg
import pytest
from psycopg import sql

from applier.catalog.store import Catalog
from applier.testing import table_digest, wait_until
from tablesync import InitialCopy, run_initial_copy
from tablesync.copy import SupersededError, copy_partition
from tablesync.testing import local_spark, subscribe
from tests.support.trust import evil_trigger, owned_table, superuser

pytestmark = [pytest.mark.spark]

SMALL_PARTS = 64 * 1024  # several partitions even for test-sized tables


@pytest.fixture(scope="module")
def spark():
    """One local session for the module: JVM start-up costs ~15 s on two cores. ``run_initial_copy`` reuses it."""
    session = local_spark(2)
    yield session
    session.stop()


def both(pair, ddl: str) -> None:
    pair.publisher.execute(ddl)
    pair.target.execute(ddl)


def states(pair) -> dict[str, tuple[str, str | None]]:
    return {
        r[0]: (r[1], r[2])
        for r in pair.target.query(
            "SELECT srremotename, srsubstate::text, srsublsn::text FROM applier.subscription_rel"
        )
    }


TYPES_DDL = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE alltypes (
    id bigint PRIMARY KEY, n numeric, n2 numeric(30, 10), f8 float8, f4 real, i2 smallint, b boolean,
    tx text, vc varchar(20), ch char(5), j jsonb, js json, ia int[], ta text[], ma mood[], by bytea,
    ts timestamptz, tsn timestamp, d date, tm time, iv interval, u uuid, ip inet, m mood, p posint,
    big text, r int4range, pt point
);
"""

TYPES_ROWS = """
INSERT INTO alltypes
SELECT g,
       CASE g % 5 WHEN 0 THEN 'NaN'::numeric WHEN 1 THEN (10::numeric ^ 300) + g WHEN 2 THEN -g / 7.0
                  WHEN 3 THEN 0.000000000000000000000000000001 ELSE NULL END,
       g / 3.0, CASE WHEN g % 7 = 0 THEN 'Infinity'::float8 ELSE g / 3.0 END, g / 7.0, (g % 30000)::int2, g % 2 = 0,
       'row ' || g || E' tab\\t nl\\n quote'' bs\\\\ ü', 'vc' || g, 'c' || (g % 10),
       jsonb_build_object('g', g, 'arr', jsonb_build_array(1, 'two', null), 'f', 1.5e300),
       ('{"k": ' || g || ',  "dup": 1, "dup": 2}')::json,
       ARRAY[g, NULL, -g], ARRAY['a', NULL, 'b"c', ''], ARRAY['sad', 'happy']::mood[],
       decode(md5(g::text), 'hex') || '\\x00ff'::bytea,
       CASE g % 4 WHEN 0 THEN 'infinity'::timestamptz WHEN 1 THEN '-infinity'::timestamptz
                  ELSE '2024-02-29 12:34:56.789012+05:30'::timestamptz + g * interval '1 hour' END,
       '1999-12-31 23:59:59.999999'::timestamp, 'epoch'::date + g, '23:59:59.5', make_interval(0, g, 0, 1, 2),
       md5(g::text)::uuid, ('10.0.' || (g % 256) || '.1/24')::inet, (ARRAY['sad', 'ok', 'happy'])[1 + g % 3]::mood,
       1 + g % 100,
       CASE WHEN g % 50 = 0 THEN (SELECT string_agg(md5(g::text || x::text), '') FROM generate_series(1, 3000) x)
       END,
       int4range(g, g + 10), point(g, -g)
FROM generate_series(1, 3000) g;
INSERT INTO alltypes (id) VALUES (0);
"""


@pytest.mark.core
def test_every_common_type_copies_byte_exact(pair, spark):
    # Make the target's type OIDs differ from the publisher's, so mood[] must fall back to text.
    pair.target.execute("CREATE TYPE unrelated AS ENUM ('x'); CREATE TABLE unrelated_t (a int)")
    both(pair, TYPES_DDL)
    pair.publisher.execute(TYPES_ROWS)
    pair.publisher.execute("CREATE TABLE plain (id int, v text)")
    pair.target.execute("CREATE TABLE plain (id bigint, v text)")  # differing type: text format
    pair.publisher.execute("INSERT INTO plain SELECT g, repeat('x', g % 100) FROM generate_series(1, 5000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE alltypes, plain")
    toast = pair.publisher.scalar(
        "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'alltypes'::regclass"
    )
    assert pair.publisher.scalar(f"SELECT count(*) FROM {toast}") > 0  # noqa: S608 - big values are out of line
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.alltypes", "public.plain"])

    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)

    assert table_digest(pair.publisher, "public.alltypes") == table_digest(pair.target, "public.alltypes")
    assert table_digest(pair.publisher, "public.plain") == table_digest(pair.target, "public.plain")
    at, pl = result.tables["public.alltypes"], result.tables["public.plain"]
    assert at.rows == 3001 and pl.rows == 5000 and at.partitions > 1
    assert not at.binary and "mood[]" in (at.text_reason or "")
    assert not pl.binary and "bigint" in (pl.text_reason or "")
    lsn = pair.target.scalar(
        "SELECT %s::pg_lsn::text", (f"{result.snapshot_lsn >> 32:X}/{result.snapshot_lsn & 0xFFFFFFFF:X}",)
    )
    assert states(pair) == {"public.alltypes": ("s", lsn), "public.plain": ("s", lsn)}
    # progress was recorded for `applier status`, and the markers were cleaned up
    assert pair.target.scalar("SELECT sum(srrows) FROM applier.subscription_rel") == 8001
    assert pair.target.scalar("SELECT count(*) FROM applier.tablesync_partition") == 0


@pytest.mark.core
def test_binary_format_when_types_match(pair, spark):
    both(pair, "CREATE TYPE mood AS ENUM ('sad', 'ok'); CREATE TABLE b (id int, m mood, a int[], n numeric)")
    pair.publisher.execute(
        "INSERT INTO b SELECT g, 'ok', ARRAY[g], 'NaN' FROM generate_series(1, 20000) g;"
        "INSERT INTO b VALUES (NULL, NULL, NULL, NULL)"
    )
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE b")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.b"])
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)
    assert result.tables["public.b"].binary and result.tables["public.b"].partitions > 1
    assert table_digest(pair.publisher, "public.b") == table_digest(pair.target, "public.b")


@pytest.mark.core
def test_the_copy_is_exactly_the_snapshot(pair, spark):
    both(pair, "CREATE TABLE s (id int PRIMARY KEY, v text); CREATE TABLE s2 (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO s SELECT g, 'v' || g FROM generate_series(1, 20000) g")
    pair.publisher.execute("INSERT INTO s2 SELECT g, 'w' || g FROM generate_series(1, 3000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE s, s2")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.s", "public.s2"])
    before = {t: table_digest(pair.publisher, t) for t in ("public.s", "public.s2")}

    copier = InitialCopy(pair.target.dsn, pair.name, partition_bytes=SMALL_PARTS)
    try:
        copier.load()
        slot = copier.open_snapshot()
        assert pair.publisher.scalar(
            "SELECT temporary FROM pg_replication_slots WHERE slot_name = %s", (slot.slot_name,)
        )
        # After the snapshot: new rows (also on pages past the planned size), updates, deletes.
        pair.publisher.execute("INSERT INTO s SELECT g, 'late' FROM generate_series(20001, 40000) g")
        pair.publisher.execute("UPDATE s SET v = 'changed' WHERE id % 3 = 0")
        pair.publisher.execute("DELETE FROM s WHERE id % 5 = 0")
        # (not TRUNCATE: it is not MVCC-safe, an older snapshot sees the table empty; the stream's TRUNCATE
        # message then agrees with the copy, as natively)
        pair.publisher.execute("DELETE FROM s2 WHERE id > 10")
        copier.plan()
        assert len(copier.plans["public.s"].ranges) > 1
        copier.claim()
        assert copier.copy(spark)
        result = copier.complete()
    finally:
        copier.close()
    for t in ("public.s", "public.s2"):
        assert table_digest(pair.target, t) == before[t]
        assert table_digest(pair.publisher, t) != before[t]
    assert result.snapshot_lsn == slot.lsn
    # the temporary slot went away with its connection
    wait_until(
        lambda: (
            not pair.publisher.scalar(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot.slot_name,)
            )
        ),
        what="the temporary slot to be dropped",
    )


@pytest.mark.core
def test_row_filters_and_column_lists_are_honoured(pair, spark):
    ddl = (
        "CREATE TABLE t (id int, a text, b text, g int GENERATED ALWAYS AS (id * 2) STORED);"
        "CREATE TABLE u (id int, a text, g int GENERATED ALWAYS AS (id * 3) STORED)"
    )
    both(pair, ddl)
    pair.publisher.execute("INSERT INTO t SELECT g, 'a' || g, 'b' || g FROM generate_series(1, 5000) g")
    pair.publisher.execute("INSERT INTO u SELECT g, 'u' || g FROM generate_series(1, 5000) g")
    pair.publisher.execute(
        "CREATE PUBLICATION p1 FOR TABLE t (id, a) WHERE (id % 2 = 0), u WHERE (id > 4000)"
    )
    pair.publisher.execute("CREATE PUBLICATION p2 FOR TABLE t (id, a) WHERE (id < 11 AND a <> 'a3')")
    pair.publisher.execute("CREATE PUBLICATION p3 FOR TABLES IN SCHEMA public")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"], publications=["p1", "p2"])
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name + "_u", ["public.u"], publications=["p1", "p3"])

    run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)
    run_initial_copy(pair.target.dsn, pair.name + "_u", progress=False)

    expected_t = pair.publisher.query(
        "SELECT id, a, NULL::text, g FROM t WHERE (id % 2 = 0) OR (id < 11 AND a <> 'a3') ORDER BY id"
    )
    assert pair.target.query("SELECT id, a, b, g FROM t ORDER BY id") == expected_t
    assert len(expected_t) == 2500 + 4  # the even ids, and 1, 5, 7, 9 (3 is filtered out)
    # u is also in a TABLES IN SCHEMA publication: its row filter is ignored, every row is copied
    assert table_digest(pair.publisher, "public.u") == table_digest(pair.target, "public.u")


@pytest.mark.core
def test_different_column_lists_fail_with_the_native_message(pair, spark):
    both(pair, "CREATE TABLE t (id int, a text, b text)")
    pair.publisher.execute(
        "CREATE PUBLICATION p1 FOR TABLE t (id, a); CREATE PUBLICATION p2 FOR TABLE t (id, b)"
    )
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"], publications=["p1", "p2"])
    from tablesync import TablesyncError

    with pytest.raises(TablesyncError, match="different column lists") as failed:
        run_initial_copy(pair.target.dsn, pair.name, progress=False)
    assert failed.value.relation == "public.t"  # for applier status's record
    assert states(pair)["public.t"][0] == "i"  # nothing was claimed


@pytest.mark.core
@pytest.mark.anyversion  # our partition markers and generations
def test_a_partition_is_copied_once_however_often_its_task_runs(pair, spark):
    both(pair, "CREATE TABLE nopk (id int, v text)")  # no key: a duplicate copy would show as extra rows
    pair.publisher.execute("INSERT INTO nopk SELECT g, md5(g::text) FROM generate_series(1, 30000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE nopk")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.nopk"])
    copier = InitialCopy(pair.target.dsn, pair.name, partition_bytes=SMALL_PARTS)
    try:
        copier.load()
        copier.open_snapshot()
        tasks = copier.plan()
        copier.claim()
        assert len(tasks) > 2
        first = copy_partition(tasks[0], pair.publisher.dsn, pair.target.dsn)
        again = copy_partition(tasks[0], pair.publisher.dsn, pair.target.dsn)  # a retried task
        assert not first.skipped and again.skipped and again.rows == first.rows > 0
        assert pair.target.scalar("SELECT count(*) FROM nopk") == first.rows
        assert copier.copy(spark)  # the whole job, including the partition already done
        copier.complete()
        stale = tasks[1].__class__(**{**tasks[1].__dict__, "snapshot": "00000000-00000000-1"})
        with pytest.raises(SupersededError):  # a task of an older generation never copies
            copy_partition(stale, pair.publisher.dsn, pair.target.dsn)
    finally:
        copier.close()
    assert table_digest(pair.publisher, "public.nopk") == table_digest(pair.target, "public.nopk")


@pytest.mark.slow  # a second JVM in a child process: run once (PostgreSQL 18), not in the per-version core set
def test_killed_copy_resumes_without_loss_or_duplicates(pair, spark, tmp_path):
    both(pair, "CREATE TABLE big (id int, v text); CREATE TABLE small (id int)")
    pair.publisher.execute(
        "INSERT INTO big SELECT g, repeat(md5(g::text), 3) FROM generate_series(1, 400000) g"
    )
    pair.publisher.execute("INSERT INTO small SELECT generate_series(1, 10)")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE big, small")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.big", "public.small"])

    log = open(tmp_path / "child.log", "w")  # noqa: SIM115 - closed below
    child = subprocess.Popen(
        [sys.executable, "-m", "tablesync.testing", pair.target.dsn, pair.name, "--partition-bytes", "1048576",
         "--master", "local[2,4]"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: (
                child.poll() is not None
                or pair.target.scalar("SELECT count(*) FROM applier.tablesync_partition WHERE part >= 0") >= 3
            ),
            timeout=180,
            what="some partitions to be committed by the child",
        )
        assert child.poll() is None, (tmp_path / "child.log").read_text()
        os.kill(child.pid, signal.SIGKILL)  # the driver only, as `kill -9 <applier>` would
        child.wait()
        done = pair.target.scalar("SELECT count(*) FROM applier.tablesync_partition WHERE part >= 0")
        assert 0 < pair.target.scalar("SELECT count(*) FROM big") < 400000
        assert states(pair)["public.big"][0] in ("d", "f")
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # whatever the kill left behind (JVM, Python workers)
        except ProcessLookupError:
            pass
        log.close()
    assert done >= 3

    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=1 << 20)
    assert result.completed
    for t in ("public.big", "public.small"):
        assert table_digest(pair.publisher, t) == table_digest(pair.target, t)
    assert {s for s, _ in states(pair).values()} == {"s"}


@pytest.mark.core
@pytest.mark.anyversion  # our table states
def test_finished_tables_are_left_alone_and_f_settles_by_the_stream_position(pair, spark):
    both(pair, "CREATE TABLE a (id int); CREATE TABLE b (id int); CREATE TABLE c (id int)")
    pair.publisher.execute(
        "INSERT INTO a VALUES (1); INSERT INTO b VALUES (2); INSERT INTO c VALUES (3), (4)"
    )
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE a, b, c")
    sub = subscribe(
        pair.target.dsn, pair.publisher.dsn, pair.name, ["public.a", "public.b", "public.c"], state="r"
    )
    pair.target.execute("INSERT INTO c VALUES (3)")  # what a copy at 0/800 had left
    cat = Catalog.connect(pair.target.dsn)
    cat.update_subscription(sub.subid, subslotconsistentlsn=0x1000)  # the stream starts at 0/1000
    rel = {r.name: r.relid for r in cat.table_states(sub.subid)}
    cat.set_table_state(
        sub.subid, rel["public.b"], "f", 0x1234
    )  # complete at 0/1234, after the stream's start
    cat.set_table_state(sub.subid, rel["public.c"], "f", 0x800)  # complete before it: changes were missed
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False)
    assert result.resumed == {"public.b": 0x1234} and result.skipped == ("public.a",)
    assert set(result.tables) == {"public.c"}
    st = states(pair)
    assert st["public.a"] == ("r", None) and st["public.b"] == ("s", "0/1234") and st["public.c"][0] == "s"
    assert pair.target.scalar("SELECT count(*) FROM a") == 0  # nothing copied for a or b
    assert pair.target.scalar("SELECT count(*) FROM b") == 0
    assert table_digest(pair.publisher, "public.c") == table_digest(
        pair.target, "public.c"
    )  # emptied, recopied


@pytest.mark.core
@pytest.mark.anyversion  # our stop and resume
def test_stop_event_cancels_and_a_later_run_finishes(pair, spark):
    import threading

    both(pair, "CREATE TABLE t (id int, v text)")
    pair.publisher.execute("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 100000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    stop = threading.Event()
    stop.set()
    result = run_initial_copy(pair.target.dsn, pair.name, stop=stop, progress=False)
    assert result.stopped and states(pair)["public.t"][0] == "i"
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS * 4)
    assert result.completed and result.rows == 100000
    assert table_digest(pair.publisher, "public.t") == table_digest(pair.target, "public.t")


@pytest.mark.core
def test_partitioned_root_and_inheritance_parent(pair, spark):
    pair.publisher.execute(
        "CREATE TABLE pt (id int, v text) PARTITION BY RANGE (id);"
        "CREATE TABLE pt_1 PARTITION OF pt FOR VALUES FROM (0) TO (1000);"
        "CREATE TABLE pt_2 PARTITION OF pt FOR VALUES FROM (1000) TO (100000);"
        "CREATE TABLE par (id int, v text); CREATE TABLE chi () INHERITS (par)"
    )
    pair.target.execute("CREATE TABLE pt (id int, v text); CREATE TABLE par (id int, v text)")
    pair.publisher.execute("INSERT INTO pt SELECT g, 'p' || g FROM generate_series(1, 5000) g")
    pair.publisher.execute("INSERT INTO par SELECT g, 'par' FROM generate_series(1, 100) g")
    pair.publisher.execute("INSERT INTO chi SELECT g, 'child' FROM generate_series(1, 50) g")
    pair.publisher.execute(
        "CREATE PUBLICATION pub FOR TABLE pt, par WITH (publish_via_partition_root = true)"
    )
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.pt", "public.par"])

    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)

    assert result.tables["public.pt"].rows == 5000 and result.tables["public.pt"].partitions == 1
    assert table_digest(pair.publisher, "public.pt") == table_digest(pair.target, "public.pt")
    # ONLY: the inheritance child's rows are not the parent's (natively they are copied as the child's own table)
    assert pair.target.query("SELECT v, count(*) FROM par GROUP BY v") == [("par", 100)]


def hold_partitions(pair, subid: int, table: str, parts: range) -> psycopg.Connection:
    """A target session holding the advisory locks of ``table``'s partitions ``parts``: their copy tasks wait
    (tablesync.copy locks a partition before copying it) until it is closed or its session ends."""
    conn = pair.target.connect()
    for part in parts:
        conn.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"applier.tablesync:{subid}:{table}:{part}",)
        )
    return conn


@pytest.mark.core
@pytest.mark.anyversion  # our stop and resume
def test_stop_while_copying_keeps_finished_partitions_and_the_next_run_completes(pair, spark):
    import threading

    both(pair, "CREATE TABLE t (id int, v text)")
    pair.publisher.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 20000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    sub = subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    # Partitions 3 and up wait for locks this session holds, so the copy cannot finish before the stop.
    blocker = hold_partitions(pair, sub.subid, "public.t", range(3, 200))
    stop = threading.Event()

    def stop_after_first_partitions() -> None:
        wait_until(
            lambda: (
                pair.target.scalar("SELECT count(*) FROM applier.tablesync_partition WHERE part >= 0") >= 2
            ),
            timeout=120,
            what="two partitions",
        )
        stop.set()

    watcher = threading.Thread(target=stop_after_first_partitions, daemon=True)
    watcher.start()
    try:
        result = run_initial_copy(
            pair.target.dsn, pair.name, stop=stop, progress=False, partition_bytes=64 * 1024
        )
    finally:
        blocker.close()
    watcher.join()
    assert result.stopped
    assert states(pair)["public.t"][0] == "d"
    assert pair.target.scalar("SELECT count(*) FROM t") > 0  # the finished partitions stayed
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False)
    assert result.completed and result.rows == 20000
    assert table_digest(pair.publisher, "public.t") == table_digest(pair.target, "public.t")


@pytest.mark.parametrize(
    "where", [pytest.param("driver", marks=[pytest.mark.core, pytest.mark.anyversion]), "spark"]
)  # driver: our error report and table states
def test_a_failing_copy_reports_the_server_error_and_leaves_tables_to_redo(pair, spark, monkeypatch, where):
    """The target refuses some rows (a check constraint: every attempt would meet it): the copy fails after one
    attempt with the server's error, and the table is left to copy again. On the driver (``where="driver"``,
    beside the module's Spark session, ready at once) the job is not started to meet the refusal again (it was,
    once: two attempts). In a Spark task (``where="spark"``:
    ``APPLIER_TABLESYNC_HEAD_START=0``, Spark copies everything) the task returns the refusal instead of raising
    it, so Spark does not attempt the task again (four attempts per task here). A sequence that a trusted ALWAYS
    trigger advances at the first row counts the attempts (a rollback keeps its value)."""
    from tablesync import TablesyncError

    if where == "spark":
        monkeypatch.setenv("APPLIER_TABLESYNC_HEAD_START", "0")
    pair.publisher.execute("CREATE TABLE t (id int, v int)")
    pair.target.execute("CREATE TABLE t (id int, v int CHECK (v < 100))")  # the target refuses some rows
    pair.target.execute("CREATE SEQUENCE attempts")
    pair.target.execute(
        "CREATE FUNCTION count_attempt() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN IF NEW.id = 1 THEN PERFORM nextval('attempts'); END IF; RETURN NEW; END $$"
    )
    pair.target.execute("CREATE TRIGGER c BEFORE INSERT ON t FOR EACH ROW EXECUTE FUNCTION count_attempt()")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER c")
    pair.publisher.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 200) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    with pytest.raises(TablesyncError, match='violates check constraint "t_v_check"') as failed:
        run_initial_copy(pair.target.dsn, pair.name, progress=False)
    assert failed.value.relation == "public.t"  # for applier status's record
    assert pair.target.scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM attempts") == 1
    assert states(pair)["public.t"][0] == "d"
    assert pair.target.scalar("SELECT count(*) FROM t") == 0
    wait_until(
        lambda: (
            not pair.publisher.scalar(
                "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
            )
        ),
        what="the temporary slot to go away",
    )


def test_the_trust_check_refuses_an_owners_trigger_in_a_spark_task(pair, spark, monkeypatch, mallory):
    """The copy's trust check runs in Spark's tasks as on the driver (test_trust.py): a table owned by an
    unprivileged role, with an ALWAYS trigger of that role's, is refused (SQLSTATE 42501) before a row is written;
    the trigger never runs (it would make its owner a superuser) and the refusal ends the job at once."""
    from tablesync import TablesyncError

    monkeypatch.setenv("APPLIER_TABLESYNC_HEAD_START", "0")
    owned_table(pair, mallory)
    evil_trigger(pair, mallory, "BEFORE INSERT")
    pair.publisher.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 100) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    with pytest.raises(TablesyncError, match="runs no code that a role") as failed:
        run_initial_copy(pair.target.dsn, pair.name, progress=False)
    assert "InsufficientPrivilege" in str(failed.value) and failed.value.relation == "public.t"
    assert pair.target.scalar("SELECT count(*) FROM t") == 0
    assert not superuser(pair, mallory)


@pytest.mark.core
@pytest.mark.anyversion  # our retry of the copy
def test_a_target_restart_mid_copy_is_retried(pair, spark, target_cluster):
    import threading

    both(pair, "CREATE TABLE t (id int, v text)")
    pair.publisher.execute("INSERT INTO t SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 20000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    sub = subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    # Partitions 3 and up wait (for locks this session holds) until the restart ends the session.
    blocker = hold_partitions(pair, sub.subid, "public.t", range(3, 200))

    def restart_after_first_partitions() -> None:
        wait_until(
            lambda: (
                pair.target.scalar("SELECT count(*) FROM applier.tablesync_partition WHERE part >= 0") >= 2
            ),
            timeout=120,
            what="two partitions",
        )
        target_cluster.restart()  # terminates the waiting tasks' sessions (and the blocker's)

    watcher = threading.Thread(target=restart_after_first_partitions, daemon=True)
    watcher.start()
    try:
        result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=64 * 1024)
    finally:
        watcher.join()
        blocker.close()
    assert result.completed and result.rows == 20000
    assert table_digest(pair.publisher, "public.t") == table_digest(pair.target, "public.t")
    assert states(pair)["public.t"][0] == "s"


@pytest.mark.core
def test_a_slow_snapshot_says_it_waits_for_open_transactions(pair, monkeypatch):
    import io
    import threading

    import tablesync.initial
    from tablesync.progress import CopyProgress

    monkeypatch.setattr(tablesync.initial, "SLOT_WAIT_NOTE_AFTER", 0.3)
    both(pair, "CREATE TABLE t (id int)")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE t")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.t"])
    with pair.publisher.connect() as c:  # a prepared transaction holds back every new slot
        c.execute("BEGIN")
        c.execute("INSERT INTO t VALUES (1)")
        c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(pair.name)))
    out = io.StringIO()
    copier = InitialCopy(pair.target.dsn, pair.name, reporter=CopyProgress("lines", out))
    copier.load()
    opened = threading.Thread(target=copier.open_snapshot, daemon=True)
    opened.start()
    try:
        wait_until(lambda: "waiting for the transactions open on the publisher" in out.getvalue(), timeout=30,
                   what="the note about open transactions")  # fmt: skip
        assert "1 prepared" in out.getvalue() and opened.is_alive()
        pair.publisher.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(pair.name)))
        opened.join(30)
        assert copier.slot is not None
    finally:
        copier.close()  # (a prepared transaction left by a failure is rolled back by the pair fixture)


def test_the_drivers_head_start_and_spark_share_the_partitions_exactly_once(pair, spark):
    """The driver copies partitions while Spark starts (``HeadStart``); the Spark job takes the others, including
    one the driver may still be copying (its task waits on the advisory lock and finds the marker). Every row once,
    and none of it counted as a retried partition."""
    from tablesync.copy import HeadStart

    both(pair, "CREATE TABLE hs (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO hs SELECT g, repeat('x', 50) || g FROM generate_series(1, 30000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE hs")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.hs"])
    before = table_digest(pair.publisher, "public.hs")
    copier = InitialCopy(pair.target.dsn, pair.name, partition_bytes=SMALL_PARTS)
    try:
        copier.load()
        copier.open_snapshot()
        copier.plan()
        nparts = len(copier.tasks)
        assert nparts > 6
        copier.claim()
        copier.head_start = HeadStart(
            copier.tasks, copier.publisher_conninfo, copier.target_conninfo, streams=2
        )
        wait_until(lambda: len(copier.head_start.done) >= 2, what="the head start to copy two partitions")
        copier.head_start.stop()
        assert copier.copy(spark)
        result = copier.complete()
    finally:
        copier.close()
    assert 2 <= len(copier.head_start.done) < nparts
    assert table_digest(pair.target, "public.hs") == before
    assert result.tables["public.hs"].rows == 30000
    assert result.tables["public.hs"].skipped_partitions == 0


def test_a_copy_the_driver_finishes_before_spark_is_ready_does_not_wait_for_spark(pair, monkeypatch):
    """Spark never becomes ready here (its start blocks): the driver's head start copies every partition, the
    copy completes, and the abandoned start is left to end on its own."""
    import threading

    from tablesync import job

    both(pair, "CREATE TABLE hs2 (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO hs2 SELECT g, 'v' || g FROM generate_series(1, 5000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE hs2")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.hs2"])
    release = threading.Event()

    def never_ready(*args, **kwargs):
        release.wait(60)
        raise RuntimeError("Spark start-up abandoned by the test")

    monkeypatch.setattr(job, "spark_session", never_ready)
    try:
        result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)
    finally:
        release.set()
    assert result.completed and result.rows == 5000
    assert result.tables["public.hs2"].partitions > 1
    assert table_digest(pair.target, "public.hs2") == table_digest(pair.publisher, "public.hs2")
    assert states(pair)["public.hs2"][0] == "s"


def test_a_local_spark_that_adds_no_parallelism_is_not_started(pair, monkeypatch):
    """A local Spark running no more tasks at once than the driver's streams would only add its start-up: the
    driver copies every partition and Spark is never started (its start fails the test if it is)."""
    from tablesync import job

    both(pair, "CREATE TABLE lz (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO lz SELECT g, repeat('y', 40) || g FROM generate_series(1, 20000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE lz")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.lz"])

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark was started although the driver's streams cover its parallelism")

    monkeypatch.setattr(job, "local_parallelism", lambda master=None: 2)
    monkeypatch.setattr(job, "spark_session", no_spark)
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)
    assert result.completed and result.rows == 20000
    assert result.tables["public.lz"].partitions > 2
    assert result.spark_seconds == 0
    assert table_digest(pair.target, "public.lz") == table_digest(pair.publisher, "public.lz")
    assert states(pair)["public.lz"][0] == "s"


def test_partitions_the_driver_leaves_over_are_copied_by_spark_started_then(pair, spark, monkeypatch):
    """The same, but the driver's streams end with partitions left (here: they were given only half of them, as
    when a stream fails): Spark is started then and copies the rest, every row once."""
    from tablesync import initial, job
    from tablesync.copy import HeadStart

    class HalfHeadStart(HeadStart):
        def __init__(self, tasks, *args, **kwargs):
            super().__init__(tasks[len(tasks) // 2 :], *args, **kwargs)

    both(pair, "CREATE TABLE lz2 (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO lz2 SELECT g, repeat('z', 40) || g FROM generate_series(1, 20000) g")
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE lz2")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.lz2"])
    monkeypatch.setattr(job, "local_parallelism", lambda master=None: 2)
    monkeypatch.setattr(initial, "HeadStart", HalfHeadStart)
    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=SMALL_PARTS)
    assert result.completed and result.rows == 20000
    assert result.spark_seconds > 0  # the module's session copied the other half
    assert result.tables["public.lz2"].skipped_partitions == 0
    assert table_digest(pair.target, "public.lz2") == table_digest(pair.publisher, "public.lz2")


@pytest.mark.parametrize(
    ("master", "expected"),
    [("local[3]", 3), ("local[2,4]", 2), ("local", 1), ("spark://h:7077", None), ("sc://h:15002", None),
     ("yarn", None)],
)  # fmt: skip
def test_local_parallelism_reads_the_master(master, expected):
    from tablesync import job

    assert job.local_parallelism(master) == expected
    assert job.local_parallelism("local[*]") == len(os.sched_getaffinity(0))


def test_head_start_streams_do_not_import_the_main_module(tmp_path):
    """A head-start stream is a spawned process; it must not import the parent's main module (whatever started the
    copy, and everything that imports, before the stream's first row). A main script
    without a ``__main__`` guard shows it: importing it in the child would start the head start again, which
    multiprocessing refuses."""
    script = tmp_path / "unguarded_main.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.getcwd()!r})\n"
        "from tablesync.copy import HeadStart\n"
        "hs = HeadStart([], 'host=127.0.0.1 port=1', 'host=127.0.0.1 port=1', streams=2)\n"
        "print('done', sorted(hs.join()))\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "done []"
    assert "bootstrapping phase" not in res.stderr
