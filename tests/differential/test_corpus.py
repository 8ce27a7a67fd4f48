"""The corpus: real schemas and workloads that nobody on this team wrote, through our applier and through
PostgreSQL's own subscriber from the same publisher, with every table compared (issue 16; ``docs/corpus.md``).

Per case and mode, three fresh databases (publisher, our target, the native subscriber's target):

1. the case's schema and initial rows on the publisher, its target schema on both targets (by default the same
   script, then every table emptied: the initial copy brings the rows);
2. a publication (``FOR ALL TABLES`` unless the case's source says otherwise), the native subscription
   (``copy_data = true``) and ours (``applier create`` + ``applier run``, the real commands: the copy included);
3. both initial syncs finish, then the workload runs on the publisher (each unit one transaction; in mode
   ``twophase`` every unit becomes ``PREPARE TRANSACTION`` + ``COMMIT PREPARED``, every fourth one
   ``ROLLBACK PREPARED``);
4. both have replayed up to the publisher's WAL position: EVERY table of our target equals the native
   subscriber's, and (unless the case's target schema differs from the publisher's on purpose) the publisher's.

Modes: ``off`` (streaming off), ``on`` (streaming on; ``logical_decoding_work_mem`` is 64kB so that the larger
units really stream), ``twophase`` (two-phase on and streaming on).

The default run (CI) takes a small, fast subset (:data:`FAST`); the rest is ``pytest -m corpus``, all of it
``pytest -m "corpus or not corpus" tests/differential/test_corpus.py``. A case may carry strict xfails (``Case.xfail``) for a
known bug that is not fixed yet; none does now.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from corpus_sources import CORPUS, psql_script, read, regress_statements, tap_sql
from psycopg import sql

from applier.testing import Database, PostgresBinaries, PostgresCluster, wait_until
from applier.testing.pytest_plugin import drop_our_origins
from applier.testing.waits import WaitTimeout
from tests.support.cli import ok
from tests.support.native import caught_up, create_databases, drop_native_subscription
from tests.support.tap import CliApplier, drop_slot, restart_if_down, set_decoding_work_mem

TIMEOUT = (
    180.0  # shared 2-core machine; the Chinook/Northwind copies and pgbench's 100k accounts take a while
)
MODES = ("off", "on", "twophase")
_counter = itertools.count(1)

Units = list[str]


@dataclass(frozen=True)
class Case:
    """One corpus case. ``setup``: publisher SQL units (or a callable, e.g. ``pgbench -i``); ``target``: units for
    both targets (None: ``setup``, then every table emptied); ``after_sync``: units on both targets once the copy
    is done (e.g. their triggers); ``workload``: publisher units, one transaction each (or a callable taking the
    publisher and the mode); ``same_as_publisher``: False when the case's target tables differ from the
    publisher's on purpose (then only ours = native is checked)."""

    name: str
    source: str
    setup: Units | Callable[[Database], None]
    workload: Units | Callable[[Database, str], None]
    target: Units | Callable[[Database], None] | None = None
    after_sync: Units = field(default_factory=list)
    publication: str = "FOR ALL TABLES"
    same_as_publisher: bool = True
    min_pg: int = 15
    extensions: tuple[
        str, ...
    ] = ()  # contrib modules the schema creates (the PostgreSQL 16 wheel ships none)
    xfail: dict[str, str] = field(default_factory=dict)  # mode ("*": all) -> reason
    check: Callable[[CliApplier], None] | None = None


# --- loading ---------------------------------------------------------------------------------------------------


def run_units(db: Database, units: Units) -> None:
    """Each unit as one simple-protocol query (several statements in a unit are one implicit transaction)."""
    with db.connect() as conn:
        for unit in units:
            conn.execute(unit)  # type: ignore[arg-type]  # vendored SQL


def run_tolerant(db: Database, statements: Units) -> None:
    """Regression scripts insert invalid input on purpose: a statement the server refuses is skipped, exactly
    as in the regression run (nothing of it reaches WAL)."""
    with db.connect() as conn:
        for st in statements:
            with contextlib.suppress(psycopg.DataError):  # SQLSTATE class 22: the invalid inputs
                conn.execute(st)  # type: ignore[arg-type]


def psql(db: Database, script: str) -> None:
    """A dump-like script through ``psql`` (which understands everything such a script may hold)."""
    binaries: PostgresBinaries = db.cluster.binaries  # type: ignore[attr-defined]
    res = subprocess.run(
        [binaries.path("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db.dsn, "-f", "-"],
        input=script, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert res.returncode == 0, f"psql failed on {db.name}: {res.stderr[-2000:]}"


def _load(db: Database, what: Units | Callable[[Database], None]) -> None:
    if callable(what):
        what(db)
    else:
        run_units(db, what)


Table = tuple[str, str]  # (schema, name)


def user_tables(db: Database) -> list[Table]:
    """Every table outside the system schemas and our catalog: plain tables and partitioned roots (a partition
    is compared through its root, whose layout may differ between publisher and targets)."""
    return [
        (r[0], r[1])
        for r in db.query(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition"
            " AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'applier') AND n.nspname NOT LIKE 'pg_%%'"
            " ORDER BY 1, 2"
        )
    ]


def empty_tables(db: Database) -> None:
    tables = user_tables(db)
    if tables:
        db.execute(
            sql.SQL("TRUNCATE {} CASCADE").format(sql.SQL(", ").join(sql.Identifier(*t) for t in tables))
        )


def columns(db: Database, table: Table) -> list[str]:
    return [
        r[0]
        for r in db.query(
            "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            table,
        )
    ]


def rows(db: Database, table: Table, cols: list[str]) -> list[str]:
    """The table's rows as text, sorted (what ``applier.testing.tables_differ`` compares, for any schema name)."""
    query = sql.SQL("SELECT corpus_row_::text FROM (SELECT {} FROM {}) corpus_row_ ORDER BY 1").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in cols), sql.Identifier(*table)
    )
    return [r[0] for r in db.query(query)]


def differ(a: Database, b: Database, table: Table, cols: list[str] | None = None) -> str | None:
    cols = cols or columns(a, table)
    ra, rb = rows(a, table, cols), rows(b, table, cols)
    if ra == rb:
        return None
    only_a, only_b = sorted(set(ra) - set(rb))[:5], sorted(set(rb) - set(ra))[:5]
    return f"{table}: {len(ra)} vs {len(rb)} rows; only on {a.cluster.name}: {only_a}; only on {b.cluster.name}: {only_b}"


# --- one case through both subscribers -------------------------------------------------------------------------


@dataclass
class Run:
    publisher: Database
    ours: Database
    native: Database
    name: str
    applier: CliApplier | None = None

    @property
    def native_name(self) -> str:
        return f"n_{self.name}"


@contextlib.contextmanager
def three_databases(clusters: tuple[PostgresCluster, PostgresCluster, PostgresCluster]) -> Iterator[Run]:
    name = f"c{os.getpid() % 10000}_{next(_counter)}"
    pub, ours, native = create_databases(list(clusters), name)
    run = Run(pub, ours, native, name)
    try:
        yield run
    finally:
        if run.applier is not None:
            run.applier.close()
        for c in clusters:
            restart_if_down(c)
        drop_native_subscription(native, run.native_name)
        with contextlib.suppress(psycopg.Error):
            drop_slot(pub, name)
        with contextlib.suppress(psycopg.Error):
            drop_our_origins(ours)
        for db in (native, ours, pub):
            with contextlib.suppress(psycopg.Error):
                db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND pid <> pg_backend_pid()")  # fmt: skip
                for (gid,) in db.query(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                ):
                    db.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            db.cluster.drop_database(db.name)


def synced(run: Run, mode: str) -> bool:
    native = run.native.scalar(
        "SELECT bool_and(r.srsubstate = 'r') AND bool_and(s.subtwophasestate IN ('d', 'e'))"
        " FROM pg_subscription_rel r JOIN pg_subscription s ON s.oid = r.srsubid"
    )
    ours = run.ours.scalar(
        "SELECT bool_and(r.srsubstate = 'r') AND bool_and(s.subtwophasestate IN ('d', 'e'))"
        " FROM applier.subscription_rel r JOIN applier.subscription s USING (subid)"
    )
    if not (native and ours):
        # a table turns ready once the stream passes its copy's LSN: give the stream something to pass
        run.publisher.execute("SELECT pg_logical_emit_message(false, 'corpus', 'tick')")
    return bool(native and ours)


def sync_states(run: Run) -> str:
    """Both subscriptions' table states and the native worker's last errors (for a sync that never ends)."""
    native = run.native.query(
        "SELECT srrelid::regclass::text, srsubstate FROM pg_subscription_rel WHERE srsubstate <> 'r' ORDER BY 1"
    )
    ours = run.ours.query(
        "SELECT srrelid::text, srsubstate FROM applier.subscription_rel WHERE srsubstate <> 'r' ORDER BY 1"
    )
    two_phase = (
        run.native.query("SELECT subtwophasestate FROM pg_subscription"),
        run.ours.query("SELECT subtwophasestate FROM applier.subscription"),
    )
    return (
        f"not ready: native {native}, ours {ours}; two-phase (native, ours) {two_phase}\n"
        + "\n".join(line for line in run.native.cluster.log_tail(400).splitlines() if "ERROR" in line)[-3000:]
    )


def our_error(run: Run) -> str | None:
    """Our log's tail when it holds an ERROR: our worker retries a failing transaction forever (as the native one
    does), so waiting on would only end at the timeout. Nothing in the corpus is expected to fail."""
    if run.applier is None:
        return None
    text = run.applier.log.read_text(errors="replace")
    if re.search(r"^\S+ \S+ ERROR ", text, re.M):
        return f"our applier logged an error:\n{run.applier.log_tail(80)}"
    return None


def wait_for(run: Run, predicate: Callable[[], object], what: str) -> None:
    """:func:`wait_until` that ends at once, failing, when our applier logs an error."""
    error: list[str] = []

    def check() -> object:
        if message := our_error(run):
            error.append(message)
            return True
        return predicate()

    wait_until(check, timeout=TIMEOUT, what=what)
    if error:
        raise AssertionError(error[0])


def wait_both(run: Run) -> None:
    lsn = run.publisher.cluster.scalar("SELECT pg_current_wal_lsn()::text")
    for app in (run.name, run.native_name):
        wait_for(run, lambda app=app: caught_up(run.publisher, app, lsn), f"{app!r} to replay up to {lsn}")


def subscribe(run: Run, case: Case, mode: str) -> None:
    streaming = "off" if mode == "off" else "on"
    two_phase = mode == "twophase"
    run.publisher.execute(
        sql.SQL("CREATE PUBLICATION {} ").format(sql.Identifier(run.name)) + sql.SQL(case.publication)  # type: ignore[arg-type]
    )
    run.native.execute(
        sql.SQL(
            "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}"
            " WITH (copy_data = true, streaming = {}, two_phase = {})"
        ).format(
            sql.Identifier(run.native_name),
            sql.Literal(run.publisher.dsn),
            sql.Identifier(run.name),
            sql.Literal(streaming),
            sql.Literal(two_phase),
        )  # fmt: skip
    )
    ok(run.ours, "create", run.name, "--publisher", run.publisher.dsn, "--publication", run.name,
       "--streaming", streaming, *(["--two-phase"] if two_phase else []))  # fmt: skip
    run.applier = CliApplier(run.ours, run.name).start()


def run_workload(db: Database, units: Units, mode: str, label: str) -> None:
    """Each unit one transaction; in mode ``twophase`` prepared and then committed (every fourth rolled back)."""
    with db.connect() as conn:
        for i, unit in enumerate(units):
            if mode != "twophase":
                conn.execute(unit)  # type: ignore[arg-type]
                continue
            gid = f"{label}_{i}"
            conn.execute(f"BEGIN; {unit}; PREPARE TRANSACTION '{gid}'")  # type: ignore[arg-type]
            verb = "ROLLBACK" if i % 4 == 3 else "COMMIT"
            conn.execute(f"{verb} PREPARED '{gid}'")  # type: ignore[arg-type]


def compare(run: Run, case: Case) -> None:
    ours_tables, native_tables = user_tables(run.ours), user_tables(run.native)
    assert ours_tables == native_tables, f"targets differ in tables: {ours_tables} vs {native_tables}"
    problems = [d for t in ours_tables if (d := differ(run.ours, run.native, t))]
    assert not problems, "ours vs native:\n" + "\n".join(problems)
    if case.same_as_publisher:
        pub_tables = user_tables(run.publisher)
        for t in pub_tables:
            if t in ours_tables:
                cols = columns(run.publisher, t)
                d = differ(run.publisher, run.ours, t, cols)
                problems += [d] if d else []
        assert not problems, "publisher vs ours:\n" + "\n".join(problems)
    prepared = [db.name for db in (run.ours, run.native)
                if db.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")]  # fmt: skip
    assert not prepared, f"prepared transactions left on {prepared}"


def run_case(
    clusters: tuple[PostgresCluster, PostgresCluster, PostgresCluster], case: Case, mode: str
) -> None:
    if clusters[0].binaries.major < case.min_pg:  # type: ignore[attr-defined]
        pytest.skip(f"needs PostgreSQL {case.min_pg}")
    available = {r[0] for r in clusters[0].query("SELECT name FROM pg_available_extensions")}
    if missing := sorted(set(case.extensions) - available):
        pytest.skip(f"extensions not available on this server build: {', '.join(missing)}")
    with three_databases(clusters) as run:
        set_decoding_work_mem(run.publisher, "64kB")
        _load(run.publisher, case.setup)
        for db in (run.ours, run.native):
            if case.target is None:
                _load(db, case.setup)
                empty_tables(db)
            else:
                _load(db, case.target)
        subscribe(run, case, mode)
        assert run.applier is not None
        try:
            wait_for(run, lambda: synced(run, mode), f"both initial syncs of {case.name}")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}\n{sync_states(run)}\nour log:\n{run.applier.log_tail()}") from None
        for db in (run.ours, run.native):
            run_units(db, case.after_sync)
        if callable(case.workload):
            case.workload(run.publisher, mode)
        else:
            run_workload(run.publisher, case.workload, mode, run.name)
        wait_both(run)
        try:
            compare(run, case)
            if case.check is not None:
                case.check(run.applier)
        except AssertionError:
            print(run.applier.log_tail(200))
            raise


# --- the cases -------------------------------------------------------------------------------------------------


def units(relative: str) -> Units:
    """A file of units separated by blank lines (comment-only units dropped): ``tests/differential/corpus/ours/*.sql``."""
    chunks = [c.strip() for c in read(relative).split("\n\n")]
    return [c for c in chunks if any(line.strip() and not line.startswith("--") for line in c.splitlines())]


def psql_loader(relative: str) -> Callable[[Database], None]:
    return lambda db: psql(db, psql_script(relative))


def regress_loader(files: dict[str, list[str]]) -> Callable[[Database], None]:
    """CREATE TABLE + INSERT statements of the named tables from vendored regression scripts (the inserts the
    server refuses on purpose in the regression run are skipped here too)."""

    def load(db: Database) -> None:
        for relative, tables in files.items():
            run_tolerant(db, regress_statements(relative, tables))

    return load


def tsearch_loader(db: Database) -> None:
    """regress/sql/tsearch.sql's ``test_tsvector`` table, filled from regress/data/tsearch.data as that script's
    ``COPY test_tsvector FROM :'filename'`` does."""
    run_units(db, regress_statements("postgresql/regress/tsearch.sql", ["test_tsvector"]))
    with db.connect() as conn, conn.cursor().copy("COPY test_tsvector FROM STDIN") as copy:
        copy.write((CORPUS / "postgresql/regress/tsearch.data").read_bytes())


def regress_setup(db: Database) -> None:
    regress_loader({
        "postgresql/regress/numeric.sql": ["num_data", "num_input_test"],
        "postgresql/regress/bit.sql": ["BIT_TABLE", "VARBIT_TABLE", "bit_defaults"],
    })(db)  # fmt: skip
    tsearch_loader(db)


REGRESS_WORKLOAD = [  # OURS: changes to the regression tables (which have no key: inserts only)
    "INSERT INTO num_input_test SELECT n1 * 2 FROM num_input_test",
    "INSERT INTO test_tsvector SELECT t || ' again', a || 'again:1'::tsvector FROM test_tsvector WHERE t LIKE 'a%'",
    "INSERT INTO bit_table VALUES (B'10101010101'), (B'00000000000')",
    "INSERT INTO num_data SELECT id + 100, val * -1 FROM num_data",
]


def pgbench(db: Database, *args: str) -> None:
    binaries: PostgresBinaries = db.cluster.binaries  # type: ignore[attr-defined]
    res = subprocess.run(
        [binaries.path("pgbench"), *args, db.dsn], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert res.returncode == 0, (
        f"pgbench {' '.join(args)} failed:\n{res.stdout[-1500:]}\n{res.stderr[-1500:]}"
    )


def pgbench_init(db: Database) -> None:
    pgbench(db, "-i", "-q", "-s", "1", "-I", "dtgp")


def pgbench_schema(db: Database) -> None:
    pgbench(db, "-i", "-q", "-I", "dtp")


def prepared_script(script: str) -> str:
    """A builtin pgbench script with its transaction turned into PREPARE TRANSACTION + COMMIT PREPARED, one in
    four ROLLBACK PREPARED (the GID is unique per client and transaction)."""
    gid = "'pgb_:client_id_:gid'"
    body = script.replace("BEGIN;", "\\set gid random(1, 2000000000)\nBEGIN;")
    return body.replace(
        "END;",
        f"PREPARE TRANSACTION {gid};\n\\if :gid % 4 = 0\nROLLBACK PREPARED {gid};\n\\else\nCOMMIT PREPARED {gid};\n\\endif",
    )


def pgbench_workload(script: str, transactions: int, clients: int) -> Callable[[Database, str], None]:
    def run(db: Database, mode: str) -> None:
        text = read(f"pgbench/{script}.sql")
        path = Path("/tmp") / f"corpus-{os.getpid()}-{db.name}-{script}.sql"
        path.write_text(prepared_script(text) if mode == "twophase" else text)
        try:
            pgbench(db, "-n", "-c", str(clients), "-j", "1", "-t", str(transactions), "-f", str(path))
        finally:
            path.unlink(missing_ok=True)

    return run


def process_group_peak_rss_kb(pgid: int) -> int:
    """The largest peak RSS (VmHWM) among the Python processes of group ``pgid`` (``applier run`` and its worker;
    not a Spark JVM, which the copy of these small tables does not start anyway)."""
    peak = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            status = (stat.parent / "status").read_text()
            if "python" not in (stat.parent / "cmdline").read_bytes().decode(errors="replace"):
                continue
        except (OSError, IndexError, ValueError):
            continue
        m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
        peak = max(peak, int(m.group(1)) if m else 0)
    return peak


#: bounds for the loud trigger: its NOTICEs total ~300 MB per run (1 MB per row); our log must not carry them, and
#: our memory must not hold them (the worker's peak RSS is ~70 MB without them)
NOTICE_LOG_LIMIT = 256 * 1024
NOTICE_RSS_LIMIT_KB = 250 * 1024


def check_notices_bounded(applier: CliApplier) -> None:
    size = applier.log.stat().st_size
    assert size < NOTICE_LOG_LIMIT, f"our log grew to {size} bytes under a NOTICE-raising trigger"
    assert applier.proc is not None
    rss = process_group_peak_rss_kb(applier.proc.pid)
    print(f"loud trigger: log {size} bytes, peak RSS {rss} kB")
    assert 0 < rss < NOTICE_RSS_LIMIT_KB, f"peak RSS {rss} kB under a NOTICE-raising trigger"


_XML_LITERAL = "'<foo>bar</foo><foo>bar</foo>'::xml"

DEBEZIUM_OURS = [  # OURS: updates and deletes of the rows Debezium's statements insert
    "UPDATE numeric_table SET r_nan = 'Infinity', db_pinf = '-Infinity', db_ninf = 'NaN'",
    "UPDATE numeric_decimal_table SET nvs = 'NaN', nvs_nan = 'Infinity' WHERE pk % 2 = 1",
    "UPDATE bitbin_table SET bvunlimited2 = bvunlimited2 || B'1', bs = B'01'",
    """UPDATE text_table SET jb = jb || '{"k": [1, 2.5, null, "\\u00e9"]}'""",
    "UPDATE array_table SET int_array = int_array || 4, jsonb_array = NULL",
    "DELETE FROM string_table",
    """INSERT INTO "Quoted_"" . Schema"."Quoted_"" . Table" ("Quoted_"" . Text_Column") VALUES ('q1'), ('q2')""",
    """UPDATE "Quoted_"" . Schema"."Quoted_"" . Table" SET "Quoted_"" . Text_Column" = 'it''s ' || pk""",
    "INSERT INTO table_without_pk (val) SELECT g FROM generate_series(1, 100) g",
]


def debezium_workload(db: Database, mode: str) -> None:
    """Debezium's INSERT statements, then ours. A server built without libxml (the embedded PostgreSQL 18) cannot
    parse the one XML literal: there it becomes NULL::xml (the only change to a vendored statement; see
    docs/corpus.md)."""
    text = read("debezium/AbstractRecordsProducerTest.inserts.sql")
    statements = [s.strip() for s in text.split(";\n") if s.strip()]
    try:
        db.execute("SELECT '<a/>'::xml")
    except psycopg.errors.FeatureNotSupported:
        statements = [s.replace(_XML_LITERAL, "NULL::xml") for s in statements]
    run_workload(db, statements + DEBEZIUM_OURS, mode, f"{db.name}_dbz")


_T002 = "postgresql/subscription/002_types.pl"
_T011 = "postgresql/subscription/011_generated.pl"
_T013 = "postgresql/subscription/013_partition.pl"
_SKIP_TAP = r"\b(PUBLICATION|SUBSCRIPTION)\b|^\s*SELECT\b|^\s*SET timezone"

CASES = [
    Case(
        "pg002_types",
        f"{_T002}: arrays, enums, composites, ranges, hstore, a domain with a CHECK",
        setup=tap_sql(_T002, "publisher", 1, 110, skip=_SKIP_TAP),
        workload=tap_sql(_T002, "publisher", 111, 999, skip=_SKIP_TAP),
        extensions=("hstore",),
    ),
    Case(
        "pg011_generated",
        f"{_T011}: stored generated columns computed differently on the subscriber, ENABLE "
        "REPLICA trigger on the subscriber",
        setup=tap_sql(_T011, "publisher", 1, 34, skip=_SKIP_TAP),
        target=tap_sql(_T011, "subscriber", 1, 34, skip=_SKIP_TAP),
        after_sync=tap_sql(_T011, "subscriber", 60, 82, skip=_SKIP_TAP),
        workload=tap_sql(_T011, "publisher", 50, 999, skip=_SKIP_TAP),
        same_as_publisher=False,
    ),
    Case(
        "pg013_leaf_to_subpartitioned",
        f"{_T013}: leaf partitions published, target partitioned differently "
        "(sub-partitioned), ENABLE REPLICA triggers on part of the tree",
        setup=tap_sql(_T013, "publisher", 30, 40, skip=_SKIP_TAP),
        target=tap_sql(_T013, "subscriber1", 45, 106, skip=_SKIP_TAP),
        workload=tap_sql(_T013, "publisher", 160, 345, skip=_SKIP_TAP),
        same_as_publisher=False,
    ),
    Case(
        "pg013_leaf_to_flat",
        f"{_T013}: leaf partitions published into plain tables",
        setup=tap_sql(_T013, "publisher", 30, 40, skip=_SKIP_TAP),
        target=tap_sql(_T013, "subscriber2", 107, 154, skip=_SKIP_TAP),
        workload=tap_sql(_T013, "publisher", 160, 345, skip=_SKIP_TAP),
        same_as_publisher=False,
    ),
    Case(
        "pg013_via_root",
        f"{_T013}: publish_via_partition_root into a range-partitioned root and a plain table",
        setup=tap_sql(_T013, "publisher", 30, 40, skip=_SKIP_TAP)
        + tap_sql(_T013, "publisher", 390, 415, skip=_SKIP_TAP)
        + tap_sql(_T013, "publisher", 433, 433),
        target=tap_sql(_T013, "subscriber1", 437, 447, skip=_SKIP_TAP),
        publication="FOR TABLE tab2, tab2_1, tab3_1 WITH (publish_via_partition_root = true)",  # line 423
        workload=tap_sql(_T013, "publisher", 495, 735, skip=_SKIP_TAP),
        same_as_publisher=False,
    ),
    Case(
        "pg013_via_root_hash",
        f"{_T013}: publish_via_partition_root, FOR ALL TABLES, into a hash-partitioned root",
        setup=tap_sql(_T013, "publisher", 30, 40, skip=_SKIP_TAP)
        + tap_sql(_T013, "publisher", 390, 415, skip=_SKIP_TAP)
        + tap_sql(_T013, "publisher", 433, 433),
        target=[s for s in tap_sql(_T013, "subscriber2", 107, 122, skip=_SKIP_TAP) if "tab1 " not in s]
        + tap_sql(_T013, "subscriber2", 453, 482, skip=_SKIP_TAP + r"|^DROP TABLE"),
        publication="FOR ALL TABLES WITH (publish_via_partition_root = true)",  # lines 29 and 417
        workload=tap_sql(_T013, "publisher", 495, 735, skip=_SKIP_TAP),
        same_as_publisher=False,
    ),
    Case(
        "debezium_types",
        "debezium/postgres_create_tables.ddl + the INSERT constants of "
        "AbstractRecordsProducerTest.java: numeric NaN/±Infinity, float ±Infinity, bit/varbit, bytea, jsonb, "
        "ranges, arrays, money, time, network, hstore/ltree/isn/citext",
        setup=units("debezium/init_database.ddl") + [read("debezium/postgres_create_tables.ddl")],
        workload=debezium_workload,
        extensions=("ltree", "isn", "citext", "hstore"),
    ),
    Case(
        "regress_types",
        "postgresql/regress/{numeric,bit,tsearch}.sql tables (numeric incl. NaN/±Infinity input, "
        "bit/varbit, tsvector from tsearch.data); none has a key: insert-only",
        setup=regress_setup,
        workload=REGRESS_WORKLOAD,
    ),
    Case(
        "chinook",
        "chinook/Chinook_PostgreSql.sql + ours/chinook_workload.sql",
        setup=psql_loader("chinook/Chinook_PostgreSql.sql"),
        workload=units("ours/chinook_workload.sql"),
    ),
    Case(
        "chinook_identity",
        "chinook/Chinook_PostgreSql_AutoIncrementPKs.sql (GENERATED ALWAYS AS IDENTITY keys) "
        "+ ours/chinook_identity_workload.sql",
        setup=psql_loader("chinook/Chinook_PostgreSql_AutoIncrementPKs.sql"),
        workload=units("ours/chinook_identity_workload.sql"),
    ),
    Case(
        "northwind",
        "northwind/northwind.sql (bytea photos, text notes) + ours/northwind_workload.sql",
        setup=psql_loader("northwind/northwind.sql"),
        workload=units("ours/northwind_workload.sql"),
    ),
    Case(
        "pgbench_tpcb",
        "pgbench -i (pgbench_history: no key) + the builtin tpcb-like script",
        setup=pgbench_init,
        target=pgbench_schema,
        workload=pgbench_workload("tpcb-like", 150, 2),
    ),
    Case(
        "ours_loud_trigger",
        "OURS: pgbench simple-update on targets with an ENABLE ALWAYS trigger raising a 1 MB "
        "NOTICE per row and an ENABLE REPLICA counting trigger",
        setup=pgbench_init,
        target=pgbench_schema,
        after_sync=units("ours/notice_trigger_target.sql"),
        workload=pgbench_workload("simple-update", 300, 1),
        same_as_publisher=False,
        check=check_notices_bounded,
    ),
    Case(
        "ours_identity_always",
        "OURS: GENERATED ALWAYS AS IDENTITY as key and as non-key column",
        setup=units("ours/identity.sql"),
        workload=units("ours/identity_workload.sql"),
    ),
    Case(
        "ours_identity_by_default",
        "OURS: GENERATED BY DEFAULT AS IDENTITY as key and as non-key column",
        setup=units("ours/identity_by_default.sql"),
        workload=units("ours/identity_by_default_workload.sql"),
    ),
    Case(
        "ours_toast_full",
        "OURS: REPLICA IDENTITY FULL with toasted text/jsonb/bytea; a table without any key",
        setup=units("ours/toast_full.sql"),
        workload=units("ours/toast_full_workload.sql"),
    ),
    Case(
        "ours_toast_unchanged",
        "OURS: UPDATEs that only rewrite toasted columns to themselves (issue 16 bug 2)",
        setup=units("ours/toast_unchanged.sql"),
        workload=units("ours/toast_unchanged_workload.sql"),
    ),
    Case(
        "ours_generated_stored",
        "OURS: stored generated columns (numeric NaN/Infinity inputs, toasted source)",
        setup=units("ours/generated.sql"),
        workload=units("ours/generated_workload.sql"),
    ),
    Case(
        "ours_generated_virtual",
        "OURS: PostgreSQL 18 virtual generated columns",
        setup=units("ours/generated_virtual.sql"),
        workload=units("ours/generated_virtual_workload.sql"),
        min_pg=18,
    ),
    Case(
        "ours_flat_to_partitioned",
        "OURS: a plain publisher table into a range-partitioned target",
        setup=units("ours/flat_to_partitioned_publisher.sql"),
        target=units("ours/flat_to_partitioned_target.sql"),
        workload=units("ours/flat_to_partitioned_workload.sql"),
    ),
]

#: the default run's subset (CI), (case, mode) -> also ``core`` (runs on PostgreSQL 15 and 16 in CI too). The
#: whole subset takes ~2 minutes on PostgreSQL 18 on a loaded 2-core machine; its core part about half of that.
FAST = {
    ("pg002_types", "on"): True,
    ("pg013_leaf_to_subpartitioned", "twophase"): True,
    ("debezium_types", "off"): True,
    ("ours_toast_full", "on"): True,
    ("ours_identity_always", "off"): False,
}


def _params() -> list[object]:
    params = []
    for case in CASES:
        for mode in MODES:
            marks: list[pytest.MarkDecorator] = []
            reason = case.xfail.get(mode) or case.xfail.get("*")
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            if (case.name, mode) not in FAST:
                marks.append(pytest.mark.corpus)
            elif FAST[case.name, mode]:
                marks.append(pytest.mark.core)
            params.append(pytest.param(case, mode, id=f"{case.name}-{mode}", marks=marks))
    return params


@pytest.mark.parametrize(("case", "mode"), _params())
def test_corpus(
    publisher_cluster: PostgresCluster,
    target_cluster: PostgresCluster,
    native_cluster: PostgresCluster,
    case: Case,
    mode: str,
) -> None:
    """One corpus case in one mode: ours = native (= publisher where the target has the publisher's tables)."""
    run_case((publisher_cluster, target_cluster, native_cluster), case, mode)
