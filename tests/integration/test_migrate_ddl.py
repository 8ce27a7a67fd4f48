"""Schema changes while following, end to end (issue 39, docs/migrate.md "Schema changes while following"): under a
steady write load on the source (with the application's own prepared transactions, committed and rolled back),
``applier migrate start`` follows DDL of every kind the issue names, each followed by writes that need it; after the
cutover the target's schema (``pg_dump --schema-only``, as a multiset of its entries), every table and every
sequence equal the source's, and nothing of ours is left on the source. Smaller tests: a ``kill -9`` of the follower
while a DDL's transaction is being applied (and at random points of a DDL stream) applies each DDL exactly once;
``--no-ddl`` stops at the first write that needs the DDL, naming what to run, and goes on once it has run; the same
from a PostgreSQL 14 source (no two-phase decoding there; the capture works).

The capture and the replay on their own: test_ddl_capture.py, test_migrate_ddl_capture.py, test_ddl_replay.py."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from applier.migrate.tools import find_dump_tools
from applier.testing import Database, PostgresCluster, assert_tables_equal, wait_until
from applier.testing.roles import drop_role
from tests.support.migrate import exit_status, migrate, start, wait_phase

NAME = "mig"
SCHEMA = """
CREATE TABLE acc (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int NOT NULL);
CREATE TABLE log (id serial PRIMARY KEY, acc bigint REFERENCES acc, note text);
CREATE TABLE items (k int PRIMARY KEY, qty int NOT NULL, label text);
CREATE TABLE doomed (id int PRIMARY KEY);
INSERT INTO acc (v) SELECT g FROM generate_series(1, 2000) g;
INSERT INTO log (acc, note) SELECT g, 'n' FROM generate_series(1, 2000) g;
INSERT INTO items SELECT g, g, 'l' || g FROM generate_series(1, 1000) g;
INSERT INTO doomed SELECT generate_series(1, 10);
"""

#: The DDL stream of the main test, in order: each step one client string (one implicit transaction, several
#: statements in most: the capture must find each DDL in the string), its DDL followed by writes that need it.
STEPS: tuple[tuple[str, str], ...] = (
    ("add column with a default", "ALTER TABLE items ADD COLUMN color text NOT NULL DEFAULT 'red';"
     " INSERT INTO items (k, qty, label, color) VALUES (1001, 1, 'x', 'blue')"),
    ("add column on the loaded table", "ALTER TABLE acc ADD COLUMN tag text DEFAULT 'plain'"),
    ("column type with USING", "ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty::bigint * 10;"
     " INSERT INTO items (k, qty) VALUES (1002, 5000000000)"),
    ("drop column", "ALTER TABLE items DROP COLUMN label; INSERT INTO items (k, qty) VALUES (1003, 3)"),
    ("rename column", "ALTER TABLE items RENAME COLUMN color TO colour;"
     " INSERT INTO items (k, qty, colour) VALUES (1004, 4, 'green'); UPDATE items SET colour = 'pink' WHERE k < 10"),
    ("rename table", "ALTER TABLE items RENAME TO stock; INSERT INTO stock (k, qty) VALUES (1005, 5);"
     " DELETE FROM stock WHERE k BETWEEN 10 AND 19"),
    ("check constraint", "ALTER TABLE stock ADD CONSTRAINT qty_pos CHECK (qty >= 0);"
     " INSERT INTO stock (k, qty) VALUES (1006, 6)"),
    ("foreign key, validated", "ALTER TABLE stock ADD COLUMN owner bigint;"
     " ALTER TABLE stock ADD CONSTRAINT stock_owner FOREIGN KEY (owner) REFERENCES acc (id) NOT VALID;"
     " ALTER TABLE stock VALIDATE CONSTRAINT stock_owner;"
     " ALTER TABLE log ADD CONSTRAINT log_note_len CHECK (length(note) < 100);"
     " UPDATE stock SET owner = k WHERE k <= 100"),
    ("index", "CREATE UNIQUE INDEX stock_colour_k ON stock (colour, k); INSERT INTO stock (k, qty) VALUES (1007, 7)"),
    ("sequence and a default using it", "CREATE SEQUENCE ticket_seq START 500; ALTER TABLE stock ADD COLUMN ticket int;"
     " ALTER TABLE stock ALTER COLUMN ticket SET DEFAULT nextval('ticket_seq');"
     " INSERT INTO stock (k, qty) SELECT g, g FROM generate_series(1100, 1120) g"),
    ("enum type", "CREATE TYPE mood AS ENUM ('calm', 'fine'); ALTER TABLE stock ADD COLUMN mood mood;"
     " UPDATE stock SET mood = 'fine' WHERE k = 1"),
    ("enum value added", "ALTER TYPE mood ADD VALUE 'angry' AFTER 'calm'"),
    ("enum value used", "INSERT INTO stock (k, qty, mood) VALUES (1008, 8, 'angry')"),
    ("views", "CREATE VIEW big_stock AS SELECT k, qty FROM stock WHERE qty > 100;"
     " CREATE MATERIALIZED VIEW acc_count AS SELECT count(*) AS n FROM acc WHERE id <= 2000;"
     " CREATE INDEX acc_count_n ON acc_count (n)"),
    ("function and trigger", "CREATE FUNCTION stock_stamp() RETURNS trigger LANGUAGE plpgsql AS $f$"
     " BEGIN NEW.qty := NEW.qty + 1000; RETURN NEW; END $f$;"
     " CREATE TRIGGER stock_stamp BEFORE INSERT ON stock FOR EACH ROW EXECUTE FUNCTION stock_stamp();"
     " INSERT INTO stock (k, qty) VALUES (1009, 9)"),
    ("policy", "ALTER TABLE stock ENABLE ROW LEVEL SECURITY; CREATE POLICY stock_mine ON stock USING (qty >= 0);"
     " INSERT INTO stock (k, qty) VALUES (1010, 10)"),
    ("comments", "COMMENT ON TABLE stock IS 'was items'; COMMENT ON COLUMN stock.colour IS 'renamed';"
     " COMMENT ON FUNCTION stock_stamp() IS 'adds 1000'"),
    ("grant", "GRANT SELECT, INSERT ON stock TO @ROLE@; GRANT USAGE ON SEQUENCE ticket_seq TO @ROLE@"),
    ("table created while following", "CREATE TABLE fresh (id int PRIMARY KEY, t text);"
     " INSERT INTO fresh SELECT g, 't' || g FROM generate_series(1, 200) g"),
    ("rows into it later", "UPDATE fresh SET t = 'u' WHERE id <= 50; DELETE FROM fresh WHERE id > 190"),
    ("table created without a key", "CREATE TABLE keyless (a int, b text); INSERT INTO keyless VALUES (1, 'a'), (2, 'b')"),
    ("table created with rows", "CREATE TABLE copied AS SELECT g AS id, md5(g::text) AS h FROM generate_series(1, 300) g"),
    ("a key for it, then rows", "ALTER TABLE copied ADD PRIMARY KEY (id); INSERT INTO copied VALUES (301, 'late')"),
    ("table dropped", "DROP TABLE doomed"),
    ("a schema and a table in it", "CREATE SCHEMA extra; CREATE TABLE extra.t (id int PRIMARY KEY, v text);"
     " INSERT INTO extra.t VALUES (1, 'one')"),
    ("identity and serial columns", "CREATE TABLE idents (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
     " n serial, v text); INSERT INTO idents (v) SELECT 'v' || g FROM generate_series(1, 30) g"),
    ("a multi-statement string", "ALTER TABLE fresh ADD COLUMN m text; INSERT INTO fresh (id, m) VALUES (1000, 'm');"
     " CREATE INDEX fresh_m ON fresh (m); UPDATE fresh SET m = 'n' WHERE id < 5"),
)  # fmt: skip


class Load(threading.Thread):
    """The application's writes on the source: a row in ``acc`` and its ``log`` entry per transaction, every fifth
    one prepared, then committed (or, every tenth, rolled back) by the same session; until :attr:`halt`."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True)
        self.db, self.halt, self.error = db, threading.Event(), None
        self.transactions = self.prepared = 0

    def run(self) -> None:
        try:
            with self.db.connect() as conn:
                while not self.halt.is_set():
                    self._one(conn)
                    self.halt.wait(0.005)
        except psycopg.Error as exc:
            self.error = str(exc)

    def _one(self, conn: psycopg.Connection[Any]) -> None:
        n = self.transactions = self.transactions + 1
        conn.execute("BEGIN")
        (i,) = conn.execute("INSERT INTO acc (v) VALUES (%s) RETURNING id", (n,)).fetchone()  # type: ignore[misc]
        conn.execute("INSERT INTO log (acc, note) VALUES (%s, 'w')", (i,))
        if n % 5:
            conn.execute("COMMIT")
            return
        gid = f"app_{os.getpid()}_{n}"
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        decision = "ROLLBACK" if n % 10 == 0 else "COMMIT"
        conn.execute(sql.SQL(decision + " PREPARED {}").format(sql.Literal(gid)))
        self.prepared += 1


@pytest.fixture
def load(pair: Any) -> Iterator[Load]:
    """The load, started on the source's schema once it exists (the test starts it), stopped at the end."""
    w = Load(pair.publisher)
    yield w
    w.halt.set()
    if w.is_alive():
        w.join(10)


@pytest.fixture
def grantee(pair: Any) -> Iterator[str]:
    """A role that exists on both servers (roles are global: the migration does not create them)."""
    role = f"{pair.name}_r"[:60]
    for db in (pair.publisher, pair.target):
        db.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    yield role
    # a finished migration leaves the source read-only (its fence): new sessions may write again to drop the role
    pair.publisher.cluster.execute(
        sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(sql.Identifier(pair.name))
    )
    for db in (pair.publisher, pair.target):
        drop_role(db, role)


def following(pair: Any, procs: list[Any], log: Path, *extra: str, source: Database | None = None) -> Any:
    """``migrate start`` (in ``procs``) until it follows."""
    proc = start(pair, NAME, *extra, log=log, source=source)
    procs.append(proc)
    wait_phase(pair.target, NAME, "following", proc, log)
    return proc


def caught_up(src: Database, target: Database, proc: Any, log: Path, timeout: float = 60) -> None:
    """Wait until the apply has reported the source's WAL position of now as applied (``replay_lsn`` of its
    walsender, which keepalives move past WAL that is not ours, where the target's origin stays at the last commit
    applied): every transaction committed before the call is on the target. Fail with the log and the apply's last
    error when ``start`` ends or the time is up."""
    lsn = src.scalar("SELECT pg_current_wal_lsn()::text")

    def done() -> bool:
        return proc.poll() is not None or bool(src.scalar(
            "SELECT coalesce(bool_or(replay_lsn >= %s::pg_lsn), false) FROM pg_stat_replication"
            " WHERE application_name = %s", (lsn, NAME)))  # fmt: skip

    try:
        wait_until(done, timeout=timeout, interval=0.1, what="the target to catch up")
    except Exception:  # noqa: BLE001 - reported with what explains it
        pytest.fail(f"not caught up to {lsn}: {_last_error(target)}\n{log.read_text()[-4000:]}")
    assert proc.poll() is None, log.read_text()[-4000:]


def _last_error(target: Database) -> str | None:
    return target.scalar("SELECT message FROM applier.apply_error ORDER BY id DESC LIMIT 1")  # type: ignore[no-any-return]


# --- the comparison --------------------------------------------------------------------------------------------


def dump_entries(db: Database, *, not_null_names: bool = True) -> collections.Counter[str]:
    """``pg_dump --schema-only`` as a multiset of its entries (each ``-- Name: ...`` header with its statements).
    Left out, as legitimately different: our catalog schema ``applier`` on the target (``--exclude-schema``),
    publications and subscriptions (the migration's own on the source; none is the application's here), the
    ``\\restrict`` lines (a random key per dump) and the server version in the header; without ``not_null_names``
    the names PostgreSQL 18 gives NOT NULL constraints (from the table's name when it was made)."""
    tools, _ = find_dump_tools(db.scalar("SELECT current_setting('server_version_num')::int") // 10000)
    assert tools is not None
    out = subprocess.run([tools.pg_dump, "--schema-only", "--no-publications", "--no-subscriptions",
                          "--exclude-schema=applier", "--dbname", db.dsn], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    lines = [
        ln for ln in out.splitlines() if not ln.startswith(("\\restrict", "\\unrestrict", "-- Dumped from"))
    ]
    text = "\n".join(lines)
    if not not_null_names:
        text = re.sub(r" CONSTRAINT \w+_not_null NOT NULL", " NOT NULL", text)
    entries = re.split(r"\n--\n(?=-- Name: )", text)
    return collections.Counter(re.sub(r"\n{2,}", "\n", e.strip("-\n ")) for e in entries)


def assert_same_schema(src: Database, target: Database) -> None:
    """The target's schema is the source's. From an older source, the source's is taken as the target's server
    makes it: its dump restored into a scratch database there (the views' text, the NOT NULL constraints'
    names are the server's own)."""
    same = src.scalar("SELECT current_setting('server_version_num')::int / 10000") == target.scalar(
        "SELECT current_setting('server_version_num')::int / 10000"
    )
    if same:
        a, b = dump_entries(src), dump_entries(target)
    else:
        tools, _ = find_dump_tools(18)
        assert tools is not None
        scratch = target.cluster.create_database(target.name + "_s")
        try:
            dump = subprocess.run([tools.pg_dump, "-Fc", "--schema-only", "--no-publications", "--dbname", src.dsn],
                                  capture_output=True, check=True).stdout  # fmt: skip
            subprocess.run(
                [tools.pg_restore, "--dbname", scratch.dsn], input=dump, check=True, capture_output=True
            )
            a = dump_entries(scratch, not_null_names=False)
        finally:
            target.cluster.drop_database(scratch.name)
        b = dump_entries(target, not_null_names=False)
    only_src, only_target = a - b, b - a
    assert not only_src and not only_target, (
        f"only on the source: {list(only_src)}\nonly on the target: {list(only_target)}"
    )


def user_tables(db: Database) -> list[str]:
    return [r[0] for r in db.query(
        "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'm') AND n.nspname IN ('public', 'extra') ORDER BY 1")]  # fmt: skip


def sequences(db: Database) -> list[tuple[Any, ...]]:
    return db.query(
        "SELECT schemaname, sequencename, last_value FROM pg_sequences WHERE schemaname <> 'applier'"
        " ORDER BY 1, 2"
    )


def nothing_of_ours(src: Database) -> None:
    """No event trigger, function, schema, publication or slot of the migration is left on the source."""
    left = src.query(
        "SELECT 'event trigger ' || evtname FROM pg_event_trigger"
        " UNION ALL SELECT 'schema ' || nspname FROM pg_namespace WHERE nspname = 'applier_capture'"
        " UNION ALL SELECT 'function ' || proname FROM pg_proc WHERE proname LIKE 'ddl\\_%%'"
        " UNION ALL SELECT 'publication ' || pubname FROM pg_publication"
        " UNION ALL SELECT 'slot ' || slot_name FROM pg_replication_slots"
        " WHERE database = current_database()"
    )
    assert left == [], left


# --- the main test ---------------------------------------------------------------------------------------------


def _prepared_ddl(
    src: Database, gid: str, decision: str, statements: str, while_prepared: Callable[[], None]
) -> None:
    """``statements`` in a transaction prepared on the source, then ``decision`` (COMMIT / ROLLBACK) PREPARED after
    ``while_prepared`` ran (the apply then holds the prepared DDL's locks on the target)."""
    with src.connect() as conn:
        conn.execute("BEGIN")
        conn.pgconn.exec_(statements.encode())
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    while_prepared()
    src.execute(sql.SQL(decision + " PREPARED {}").format(sql.Literal(gid)))


def stream_small(db: Database) -> None:
    """The source database decodes with 64 kB of memory (its walsender reads the setting when it starts: a
    session's own SET would not reach it), so that a large transaction is streamed while in progress."""
    db.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'").format(sql.Identifier(db.name))
    )


def _streamed_ddl(src: Database) -> None:
    """A large transaction, streamed to the apply while in progress (:func:`stream_small`), with a DDL in its
    middle and rows after it that need it; checked to have been streamed."""
    with src.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO fresh SELECT g, repeat('s', 50) FROM generate_series(10000, 13000) g")
        conn.execute("ALTER TABLE fresh ADD COLUMN big bigint DEFAULT 7")
        conn.execute("INSERT INTO fresh (id, big) SELECT g, g * 3 FROM generate_series(13001, 16000) g")
    wait_until(lambda: src.scalar("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (NAME,)),
               timeout=30, what="the large transaction streamed")  # fmt: skip


def _run_steps(pair: Any, role: str, proc: Any, log: Path) -> None:
    src, target = pair.publisher, pair.target
    for what, text in STEPS:
        with src.connect() as conn:  # the client's string as one simple query, as psql -c sends it
            res = conn.pgconn.exec_(text.replace("@ROLE@", sql.Identifier(role).as_string(conn)).encode())
            assert res.status != psycopg.pq.ExecStatus.FATAL_ERROR, f"{what}: {res.error_message.decode()}"
    src.execute("CREATE INDEX CONCURRENTLY acc_v ON acc (v)")  # alone: not in a transaction block
    src.execute("REFRESH MATERIALIZED VIEW acc_count")
    caught_up(src, target, proc, log)

    def target_holds_it(create: str | None) -> Callable[[], None]:
        def holds() -> None:
            wait_until(lambda: target.scalar("SELECT count(*) FROM pg_prepared_xacts") == 1, timeout=30,
                       what="the DDL's transaction prepared on the target")  # fmt: skip
            # the apply goes on around the prepared DDL's locks: rows, other DDL, a table joining (catalog writes);
            # not while the prepared one created a table (test_a_prepared_create_table_blocks_no_other_one)
            src.execute("INSERT INTO acc (v) VALUES (-7); ALTER TABLE log ADD COLUMN IF NOT EXISTS seen bool")
            if create:
                src.execute(sql.SQL("CREATE TABLE {t} (id int PRIMARY KEY); INSERT INTO {t} VALUES (1)").format(
                    t=sql.Identifier(create)))  # fmt: skip
            caught_up(src, target, proc, log)
            assert target.scalar("SELECT count(*) FROM pg_prepared_xacts") == 1

        return holds

    _prepared_ddl(src, f"ddl_keep_{pair.name}", "COMMIT", "ALTER TABLE fresh ADD COLUMN kept int DEFAULT 1;"
                  " INSERT INTO fresh (id, kept) VALUES (2000, 2)", target_holds_it("side"))  # fmt: skip
    _prepared_ddl(src, f"ddl_undo_{pair.name}", "ROLLBACK", "ALTER TABLE fresh ADD COLUMN undone int;"
                  " CREATE TABLE never (id int PRIMARY KEY); INSERT INTO fresh (id, undone) VALUES (2001, 1)",
                  target_holds_it(None))  # fmt: skip
    _streamed_ddl(src)
    caught_up(src, target, proc, log)
    assert target.scalar("SELECT to_regclass('public.never')") is None
    assert "undone" not in [c for (c,) in target.query(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'fresh'::regclass")]  # fmt: skip


@pytest.mark.core  # 5-10 s here: on every version CI runs (18; 15 and 16 as source and target)
def test_ddl_of_every_kind_under_load_then_cutover(pair: Any, procs: list[Any], tmp_path: Path, load: Load,
                                                   grantee: str) -> None:  # fmt: skip
    src, target = pair.publisher, pair.target
    src.execute(SCHEMA)
    stream_small(src)
    load.start()
    wait_until(lambda: load.transactions >= 20, timeout=30, what="the load to run")
    log = tmp_path / "start.log"
    proc = following(pair, procs, log)
    _run_steps(pair, grantee, proc, log)
    assert load.error is None, load.error
    assert load.prepared > 0
    load.halt.set()
    load.join(10)

    # the table created with rows was copied (its rows are not in the stream), and every table is ready
    wait_until(lambda: target.scalar("SELECT count(*) FROM applier.subscription_rel WHERE srsubstate <> 'r'") == 0,
               timeout=60, what="every table ready (the one created with rows copied)")  # fmt: skip
    res = migrate(target, "cutover", NAME, "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr + log.read_text()[-3000:]
    assert exit_status(proc, log) == 0, log.read_text()
    said = log.read_text()
    assert "could not replay" not in said, said
    # the table created with rows was copied by the live table sync (its rows are in no change of the stream)
    assert 'table "public.copied" has finished' in said, said

    assert_same_schema(src, target)
    assert target.scalar("SELECT count(*) FROM pg_index WHERE NOT indisvalid OR NOT indisready") == 0
    tables = user_tables(src)
    assert tables == user_tables(target)
    assert_tables_equal(src, target, *tables)
    assert sequences(src) == sequences(target)
    nothing_of_ours(src)


# --- kill -9 of the follower ---------------------------------------------------------------------------------------

KILL_SCHEMA = """
CREATE TABLE big (id int PRIMARY KEY, v int NOT NULL);
CREATE TABLE small (id int PRIMARY KEY);
INSERT INTO big SELECT g, g FROM generate_series(1, 200000) g;
"""


def columns(db: Database, table: str) -> list[tuple[str, str]]:
    return db.query("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s::regclass"
                    " AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (table,))  # fmt: skip


def indexes(db: Database) -> list[tuple[str, str]]:
    return db.query("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1")


def _kill(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _applying(target: Database, prefix: str) -> bool:
    """Whether the apply's session on the target is running a statement that begins with ``prefix`` now."""
    return bool(target.scalar("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE %s"
                              " AND pid <> pg_backend_pid()", (prefix + "%",)))  # fmt: skip


def _killed_while_applying(pair: Any, procs: list[Any], log: Path, proc: Any, rounds: int,
                           source: Database | None = None) -> Any:  # fmt: skip
    """``rounds`` times: a transaction with slow DDL (a rewrite, an index build on 200,000 rows) and rows that need
    it; ``kill -9`` of ``start`` as soon as the target runs its DDL; ``start`` again."""
    src, target = source or pair.publisher, pair.target
    types = ("bigint", "numeric", "bigint")
    for i in range(rounds):
        src.execute(f"ALTER TABLE big ADD COLUMN c{i} int DEFAULT {i}, ALTER COLUMN v TYPE {types[i % 3]};"  # noqa: S608
                    f" CREATE INDEX big_v{i} ON big (v, c{i}); INSERT INTO big (id, v, c{i}) VALUES (-{i + 1}, 0, 9);"
                    f" INSERT INTO small VALUES ({i})")  # fmt: skip
        wait_until(lambda: _applying(target, "ALTER TABLE big") or _applying(target, "CREATE INDEX big_v"),
                   timeout=30, interval=0.005, what="the DDL applying on the target")  # fmt: skip
        _kill(proc)
        proc = following(pair, procs, log, source=source)
    return proc


def _killed_at_random(pair: Any, procs: list[Any], log: Path, proc: Any, rng: random.Random) -> Any:
    """A stream of 40 small DDL transactions (a column, an index, a rename, a row needing each) and three
    ``kill -9`` at random moments of it, each followed by ``start`` again."""
    src = pair.publisher
    kills = sorted(rng.sample(range(40), 3))
    for j in range(40):
        src.execute(f"ALTER TABLE small ADD COLUMN d{j} int; INSERT INTO small (id, d{j}) VALUES ({100 + j}, {j});"  # noqa: S608
                    f" CREATE INDEX small_d{j} ON small (d{j}); ALTER INDEX small_d{j} RENAME TO small_e{j}")  # fmt: skip
        if kills and j == kills[0]:
            kills.pop(0)
            time.sleep(rng.random() * 0.05)
            _kill(proc)
            proc = following(pair, procs, log)
    return proc


@pytest.mark.core
@pytest.mark.anyversion  # recovery after kill -9: ours, not the server version's
def test_a_kill_while_a_ddl_applies_then_start_again_applies_each_ddl_once(pair: Any, procs: list[Any],
                                                                         tmp_path: Path) -> None:  # fmt: skip
    src, target = pair.publisher, pair.target
    src.execute(KILL_SCHEMA)
    log = tmp_path / "start.log"
    proc = following(pair, procs, log)
    proc = _killed_while_applying(pair, procs, log, proc, rounds=3)
    seed = int(os.environ.get("APPLIER_DDL_KILL_SEED", random.randrange(1 << 30)))
    print(f"kill points from seed {seed} (APPLIER_DDL_KILL_SEED)")
    proc = _killed_at_random(pair, procs, log, proc, random.Random(seed))
    caught_up(src, target, proc, log)
    for table in ("big", "small"):
        assert columns(target, table) == columns(src, table)
    assert indexes(target) == indexes(src)
    assert_tables_equal(src, target, "public.big", "public.small")
    said = log.read_text()
    assert "already exists" not in said and "does not exist" not in said, said[-4000:]


# --- --no-ddl ----------------------------------------------------------------------------------------------------


def _no_ddl(pair: Any, procs: list[Any], tmp_path: Path, source: Database) -> None:
    """``start --no-ddl``: new columns and a row that fills them stop the apply with the error that names the
    ALTER TABLE to run (a time type's precision where the grammar wants it) and says to give it the source's
    DEFAULT; run on the target so, the apply goes on by itself and loses nothing."""
    target = pair.target
    source.execute("CREATE TABLE acc (id int PRIMARY KEY, v int); INSERT INTO acc SELECT g, g FROM"
                   " generate_series(1, 100) g")  # fmt: skip
    log = tmp_path / "start.log"
    proc = following(pair, procs, log, "--no-ddl", source=source)
    source.execute("ALTER TABLE acc ADD COLUMN note text DEFAULT 'n', ADD COLUMN at timestamp(3) with time zone;"
                   " INSERT INTO acc VALUES (101, 1, 'new', '2026-12-06 10:00:00.123+00')")  # fmt: skip
    source.execute("INSERT INTO acc VALUES (102, 2, 'after')")

    def stopped() -> str | None:
        assert proc.poll() is None, log.read_text()
        return _last_error(target)

    error = wait_until(stopped, timeout=60, what="the apply to stop on the missing column")
    assert error is not None and 'missing replicated columns: "note", "at"' in error, error
    shown = json.loads(migrate(target, "status", NAME, "--json").stdout)[
        "apply_error"
    ]  # where the user looks
    assert shown is not None and shown["message"] == error and shown["finish_lsn"], shown
    assert "apply stopped at" in migrate(target, "status", NAME).stdout
    assert "with its DEFAULT, if it has one" in error, error
    statement = error.split("the rows already there take it): ", 1)[1]
    assert (
        statement
        == 'ALTER TABLE "public"."acc" ADD COLUMN "note" text, ADD COLUMN "at" timestamp(3) with time zone'
    )
    assert target.scalar("SELECT count(*) FROM acc WHERE id > 100") == 0
    # what it says to run, with the source's DEFAULT, as it says
    target.execute(statement.replace('"note" text', "\"note\" text DEFAULT 'n'"))
    caught_up(source, target, proc, log)
    assert_tables_equal(source, target, "public.acc")
    assert target.query("SELECT count(*) FROM pg_event_trigger") == [(0,)]


@pytest.mark.core
def test_no_ddl_stops_at_the_write_that_needs_it_and_goes_on_once_it_ran(pair: Any, procs: list[Any],
                                                                        tmp_path: Path) -> None:  # fmt: skip
    _no_ddl(pair, procs, tmp_path, pair.publisher)


# --- from PostgreSQL 14 --------------------------------------------------------------------------------------------


@pytest.fixture
def src14(pair: Any, pg14: PostgresCluster, procs: list[Any]) -> Iterator[Database]:
    """The test's source database on PostgreSQL 14 (no two-phase decoding; the capture works); dropped at the end
    after the test's ``start`` processes are killed (an active slot keeps a database from being dropped)."""
    db = pg14.create_database(pair.name)
    yield db
    for p in procs:
        if p.poll() is None:
            _kill(p)
    with pg14.connect() as c:
        wait_until(lambda: not c.execute("SELECT count(*) FROM pg_replication_slots WHERE active AND database = %s",
                                         (pair.name,)).fetchone()[0], timeout=30, what="the slot let go")  # fmt: skip
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                  (pair.name,))  # fmt: skip
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(pair.name)))


def test_from_postgresql_14_ddl_then_writes_then_cutover(pair: Any, procs: list[Any], tmp_path: Path,
                                                         src14: Database) -> None:  # fmt: skip
    """The capture on 14: DDL of several kinds with writes needing them, a table created while following, one
    dropped, a prepared transaction with DDL (decoded at its COMMIT PREPARED on 14); cutover; schema and rows
    equal, nothing of ours left."""
    src14.execute(SCHEMA)
    stream_small(src14)
    log = tmp_path / "start.log"
    proc = following(pair, procs, log, source=src14)
    for what, text in STEPS:
        if "@ROLE@" in text:
            continue
        with src14.connect() as conn:
            res = conn.pgconn.exec_(text.encode())
            assert res.status != psycopg.pq.ExecStatus.FATAL_ERROR, f"{what}: {res.error_message.decode()}"
    _prepared_ddl(src14, f"ddl14_{pair.name}", "COMMIT", "ALTER TABLE fresh ADD COLUMN kept int DEFAULT 1;"
                  " INSERT INTO fresh (id, kept) VALUES (2000, 2)", lambda: None)  # fmt: skip
    _streamed_ddl(src14)
    caught_up(src14, pair.target, proc, log)
    wait_until(lambda: pair.target.scalar("SELECT count(*) FROM applier.subscription_rel WHERE srsubstate <> 'r'")
               == 0, timeout=60, what="every table ready")  # fmt: skip
    res = migrate(pair.target, "cutover", NAME, "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr + log.read_text()[-3000:]
    assert exit_status(proc, log) == 0, log.read_text()
    assert_same_schema(src14, pair.target)
    tables = user_tables(src14)
    assert_tables_equal(src14, pair.target, *tables)
    assert sequences(src14) == sequences(pair.target)
    nothing_of_ours(src14)


def test_from_postgresql_14_a_kill_while_a_ddl_applies(pair: Any, procs: list[Any], tmp_path: Path,
                                                       src14: Database) -> None:  # fmt: skip
    src14.execute(KILL_SCHEMA)
    log = tmp_path / "start.log"
    proc = following(pair, procs, log, source=src14)
    proc = _killed_while_applying(pair, procs, log, proc, rounds=2, source=src14)
    caught_up(src14, pair.target, proc, log)
    assert columns(pair.target, "big") == columns(src14, "big")
    assert_tables_equal(src14, pair.target, "public.big", "public.small")


def test_from_postgresql_14_no_ddl(pair: Any, procs: list[Any], tmp_path: Path, src14: Database) -> None:
    _no_ddl(pair, procs, tmp_path, src14)


@pytest.mark.core
@pytest.mark.anyversion  # what the replay can and cannot reproduce: ours
def test_a_volatile_default_gives_existing_rows_the_sources_values(pair: Any, procs: list[Any],
                                                                    tmp_path: Path) -> None:  # fmt: skip
    """``ADD COLUMN ... DEFAULT random()`` (or ``now()``) fills the table's rows on the source with the source's
    values, and the stream carries no rewritten row: the replay computes its own, so the table is copied again
    (applier.ddl.statements.fills_rows_anew) and ends with the source's values."""
    src, target = pair.publisher, pair.target
    src.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 100)")
    log = tmp_path / "start.log"
    proc = following(pair, procs, log)
    src.execute("ALTER TABLE t ADD COLUMN r float8 DEFAULT random(), ADD COLUMN at timestamptz DEFAULT now()")
    caught_up(src, target, proc, log)
    wait_until(lambda: target.query("SELECT srsubstate FROM applier.subscription_rel") == [("r",)], timeout=60,
               what="the table copied again and in sync")  # fmt: skip
    src.execute("INSERT INTO t VALUES (101)")  # a change after: applied to the copied table
    caught_up(src, target, proc, log)
    assert_tables_equal(src, target, "public.t")
    assert "the table is copied again" in log.read_text()


@pytest.mark.core
@pytest.mark.anyversion  # the capture's own locking
def test_a_create_table_behind_a_prepared_one_waits_and_is_never_left_out(pair: Any, procs: list[Any],
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """A prepared transaction (on the source) that created a table in the selection holds the lock the capture
    took to add it to the publication (``ALTER PUBLICATION`` locks the publication until its transaction ends):
    another session's CREATE TABLE in the selection waits for COMMIT/ROLLBACK PREPARED (a known cost of the
    capture); with a ``lock_timeout`` it fails, and is not created without joining the publication (its rows
    would then never be migrated). Once the prepared one is decided, it joins and its rows arrive."""
    src, target = pair.publisher, pair.target
    src.execute("CREATE TABLE acc (id int PRIMARY KEY)")
    log = tmp_path / "start.log"
    proc = following(pair, procs, log)
    gid = f"mk_{pair.name}"
    with src.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("CREATE TABLE made (id int PRIMARY KEY)")
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        with src.connect() as conn, pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute("SET lock_timeout = '1s'")
            conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    finally:
        src.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
    assert src.scalar("SELECT to_regclass('other')") is None
    src.execute(
        "CREATE TABLE other (id int PRIMARY KEY); INSERT INTO other VALUES (1), (2); INSERT INTO made VALUES (3)"
    )
    assert src.query("SELECT tablename FROM pg_publication_tables ORDER BY 1") == [
        ("acc",),
        ("made",),
        ("other",),
    ]
    caught_up(src, target, proc, log)
    assert_tables_equal(src, target, "public.other", "public.made")
