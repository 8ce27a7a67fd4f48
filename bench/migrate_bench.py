"""Migration speed: ``applier migrate`` against pgcopydb, pg_dump/pg_restore and the native path, same servers, same run.

What is timed, for each tool, is the wall time from an empty target database to a *consistent, indexed* copy of the
source (issue 17, "Speed"), at the same parallelism ``N`` (``--jobs``, default 2):

* ``pgcopydb``: ``pgcopydb clone --table-jobs N --index-jobs N`` (Debian package 0.10; it runs the pg_dump/pg_restore
  it finds through ``PG_CONFIG``, which the bench points at the servers' own bindir).
* ``dump_restore``: ``pg_dump -Fd -j N`` into a directory, then ``pg_restore -j N`` (default compression: gzip);
  ``dump_restore_z0``: the same with ``pg_dump -Z 0``.
* ``native``: ``pg_dump --schema-only`` once, ``pg_restore --section=pre-data``, ``CREATE PUBLICATION ... FOR ALL
  TABLES`` on the source and ``CREATE SUBSCRIPTION`` (copy_data) on the target with
  ``max_sync_workers_per_subscription = N``, wait until every table is ``r``, ``pg_restore -j N
  --section=post-data``, ``setval`` of every sequence from the source, ``DROP SUBSCRIPTION``.
* ``ours``: ``python -m applier.cli migrate start NAME --source S --target T --table-jobs N --index-jobs N
  --cutover``, timed until it exits 0 (the target is consistent, indexed, verified and cut over). Its code comes
  from ``--ours-code DIR`` (default: this work tree), copied once at start-up into a temporary directory that is put
  on ``PYTHONPATH``, so that one benchmark measures one version even while someone edits DIR (nothing is ever
  written into DIR); ``--code-rev REV`` takes ``git archive REV`` of DIR instead. When that code has no usable
  ``migrate start --cutover`` (``--help`` fails or lacks the option), the ``ours`` column says so and the others
  are still measured. A cutover fences the source, so ours runs against a fresh copy of the source database
  (``CREATE DATABASE ... TEMPLATE src STRATEGY FILE_COPY``, outside the timed part), dropped afterwards.

* ``ours_load`` (only when asked for with ``--tools``): ours again, while ``pgbench -n -R 500 -c 4`` (``--write-rate``)
  writes to its source from before ``start`` until the cutover's fence ends the sessions. It reports the write
  downtime the writers saw (their last commit on the source to the migration's ``done``), the downtime ours reports
  (fence to ``done``) and the rate pgbench achieved; the target is verified against the source as the writes left
  it (issue 17: "cutover write downtime <= 5 s while pgbench -R 500 runs on the source").

Servers: two PostgreSQL clusters from ``--pg`` (default 15, Debian's ``/usr/lib/postgresql/15/bin``: the Debian
pgcopydb drives the system's PostgreSQL 15 client, so all client tools come from that bindir), started by
``applier.testing.cluster`` with ``durable=True`` (fsync on), ``autovacuum = off``, ``max_wal_size = 8GB``,
``checkpoint_timeout = 1h`` (as bench/apply_bench.py: no autovacuum or checkpoint lands at random inside one tool's
run; a CHECKPOINT on both sides precedes each run instead). Other settings are the harness's defaults
(``shared_buffers = 128MB``, ``maintenance_work_mem`` 64MB) and are the same for every tool. ``--target-pg 18``
makes the target another version (an upgrade); the client tools stay the source's.

Dataset (built once per run of the bench, reused by every tool; only the target database is dropped and recreated
between runs): ``pgbench -i -s 30 --foreign-keys``; a ``big`` table of 2,000,000 rows (bigserial key, an integer, a
timestamp, text and a jsonb document) with three secondary indexes, one of them GIN on the jsonb; 200 tables of
5,000 rows with a serial key each (so 201 sequences); 1.5 GB as ``pg_database_size`` counts it (the issue says
1.17 GB). ``--scale F`` multiplies the pgbench scale (at least 1), the big table's rows and the small tables' rows;
``--small-tables`` sets their number.

Fairness: the tools run in a rotating order (repetition ``i`` starts at tool ``i mod k``), so none always follows
the same neighbour or always runs first on cold caches. Medians of ``--repeat`` runs (default 3); the report gives
the ratio of ours to each other tool.

Verification after each run, outside the timed part, so that a fast-but-wrong run cannot win: exact row count of
every source table, the number of valid indexes per table, the number of validated constraints per kind (primary,
unique, foreign, check) and every sequence's ``last_value`` must equal the source's. A run that fails it is reported
and left out of the medians.

Critical-path floor (issue 28; ``--no-floor`` skips it): no migration can end before its slowest table is copied
and indexed. Once per run of the bench, before the tools and outside their timed runs, each of the
:data:`FLOOR_CANDIDATES` largest tables is measured alone: one ``COPY`` of it from the source into an empty table of
a scratch target database (a Python relay of ``COPY TO STDOUT`` into ``COPY FROM STDIN``, text format), then its
indexes built as a migration chains them (costliest first, ``--jobs`` at once, GIN with ours'
``maintenance_work_mem``: 4MB before PostgreSQL 18, the server's from 18, ``synchronous_commit = off``). The floor is the slowest table's copy plus its builds; the
report prints it and ours' median against it (goal ours <= 1.1x the floor), the JSON keeps it under ``floor``.

Peak memory: the highest sum of ``Pss`` (``/proc/<pid>/smaps_rollup``: private pages plus a share of the shared
ones) over the tool's process tree (the process the bench starts and all its descendants; for ours the Spark JVM
too), sampled every 0.1 s (processes shorter than that may be missed). ``VmRSS`` summed the same way counts a page
that forked workers share once per worker: pgcopydb's tree showed 2 GB that way at ``--scale 0.25``. The server backends that do the work (COPY, CREATE INDEX, the native tablesync workers) are children of
the postmaster, not of the tool, and are not counted for anyone.

pgcopydb is not installed by ``.ci/install`` (CI does not need it); ``bash .ci/install --bench`` or, as root,
``apt-get install pgcopydb`` adds it. Without it the bench says so and measures the others.

    .venv/bin/python bench/migrate_bench.py --scale 0.05 --small-tables 20 --repeat 1   # a couple of minutes
    .venv/bin/python bench/migrate_bench.py                                              # the issue's size, 3 runs
    .venv/bin/python bench/migrate_bench.py --ours-code ../migrate --tools ours,pgcopydb
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the project and the bench helpers importable
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cluster_cpu, descendants, loadavg, median  # noqa: E402

from applier.migrate.postdata import gin_maintenance_work_mem  # noqa: E402
from applier.testing.cluster import PostgresCluster, find_binaries  # noqa: E402

OUT_DIR = ROOT / "bench" / "out"
TOOLS = ("pgcopydb", "dump_restore", "dump_restore_z0", "native", "ours", "ours_load")
#: The tools a plain run measures: ``ours_load`` (ours under writes, see :class:`WriteLoad`) is asked for by name.
DEFAULT_TOOLS = TOOLS[:-1]
SOURCE_DB = "src"
SAMPLE_S = 0.1
POLL_S = 0.05
#: The issue's goal for ours: at most this fraction of pgcopydb's time.
GOAL_VS_PGCOPYDB = 0.75
#: The issue's goal for the cutover under ``pgbench -R 500``: at most this many seconds of write downtime.
GOAL_DOWNTIME_S = 5.0
#: Top-level packages of the project that ``python -m applier.cli`` needs, copied from ``--ours-code``.
CODE_PACKAGES = ("applier", "state", "tablesync")


# --- running a tool ---------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One command of a tool's run: what it took and the peak memory (PSS) of its process tree."""

    argv: list[str]
    seconds: float
    returncode: int
    peak_pss_kb: int
    output_tail: str = ""
    peak_rss_kb: int = 0


class ToolFailed(RuntimeError):
    """A tool exited non-zero or timed out; the message carries the command and its output's tail."""


def run_step(
    argv: list[str],
    env: dict[str, str] | None,
    timeout: float,
    cwd: str | None = None,
    log: Path | None = None,
) -> Step:
    """Run ``argv`` in a new session, sampling its process tree's memory; raise :class:`ToolFailed` unless it exits 0.

    Output goes to a temporary file rather than a pipe, so a chatty tool never blocks on a full pipe and nothing
    has to read it while it runs. ``log`` gets all of it, each line prefixed with the seconds since the start at
    which the sampler below saw it (to 0.1 s): ours' timeline, which copy and which build ran when."""
    with tempfile.TemporaryFile(mode="w+") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        peak = [0, 0]  # PSS, RSS
        done = threading.Event()
        timeline: list[str] = []
        read, partial = 0, b""  # bytes of the output read so far, and an unfinished last line

        def stamp() -> None:
            nonlocal read, partial
            while chunk := os.pread(out.fileno(), 1 << 16, read):
                read += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                at = time.monotonic() - started
                timeline.extend(f"{at:7.1f} {line.decode(errors='replace')}" for line in lines)

        def sample() -> None:
            while not done.is_set():
                pss = rss = 0
                for pid in [proc.pid, *descendants(proc.pid)]:
                    p, r = _mem_kb(pid)
                    pss, rss = pss + p, rss + r
                peak[0], peak[1] = max(peak[0], pss), max(peak[1], rss)
                if log is not None:
                    stamp()
                done.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the session we started for it, and only that
            rc = proc.wait()
            rc = rc if rc != 0 else -9
            timed_out = True
        else:
            timed_out = False
        elapsed = time.monotonic() - started
        done.set()
        sampler.join()
        out.seek(0)
        text = out.read()
        if log is not None:
            stamp()
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("\n".join([*timeline, partial.decode(errors="replace")]))
    tail = text[-4000:]
    step = Step(argv, elapsed, rc, peak[0], tail, peak[1])
    if rc != 0:
        why = f"timed out after {timeout:.0f}s" if timed_out else f"exit status {rc}"
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        raise ToolFailed(f"{' '.join(argv[:6])} ...: {why}: {last.strip()[:300]}\n{tail}")
    return step


def _mem_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of ``pid``. PSS is its private pages plus its share of the pages it shares with others: summed
    over a process tree it is the tree's real memory. RSS summed over a tree counts a page that the tool's forked
    workers share once per worker (pgcopydb's tree showed 2 GB that way), and is reported too because it is what
    most tools show. Falls back to ``VmRSS`` for both where ``smaps_rollup`` is missing or unreadable."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss:", "Rss:")):
                    found[line[:3]] = int(line.split()[1])
    except OSError:
        pass
    if len(found) == 2:
        return found["Pss"], found["Rss"]
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    kb = int(line.split()[1])
                    return kb, kb
    except OSError:
        pass
    return 0, 0


# --- the dataset ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """Sizes of the dataset; the defaults are the issue's (1.5 GB with indexes)."""

    pgbench_scale: int = 30
    big_rows: int = 2_000_000
    small_tables: int = 200
    small_rows: int = 5_000

    @classmethod
    def scaled(cls, scale: float, small_tables: int | None) -> Dataset:
        base = cls()
        return cls(
            pgbench_scale=max(1, round(base.pgbench_scale * scale)),
            big_rows=max(100, round(base.big_rows * scale)),
            small_tables=base.small_tables if small_tables is None else small_tables,
            small_rows=max(10, round(base.small_rows * scale)),
        )


BIG_DDL = [
    "CREATE TABLE big (id bigserial PRIMARY KEY, account integer NOT NULL, created timestamptz NOT NULL,"
    " label text NOT NULL, doc jsonb NOT NULL)",
    "INSERT INTO big (account, created, label, doc) SELECT g %% 100000, timestamptz '2025-01-01 00:00:00+00'"
    " + g * interval '1 s', md5(g::text) || md5((g + 1)::text), jsonb_build_object('g', g, 'tag', 't' || (g %% 50),"
    " 'flags', jsonb_build_array(g %% 3, g %% 7), 'note', md5((g * 7)::text)) FROM generate_series(1, %(rows)s) g",
    "CREATE INDEX big_account ON big (account)",
    "CREATE INDEX big_created ON big (created)",
    "CREATE INDEX big_doc ON big USING gin (doc)",
]
SMALL_DDL = (
    "CREATE TABLE {} (id serial PRIMARY KEY, k integer NOT NULL, v text NOT NULL, ts timestamptz NOT NULL)"
)
SMALL_FILL = (
    "INSERT INTO {} (k, v, ts) SELECT g %% 97, md5(g::text), timestamptz '2025-01-01 00:00:00+00' + g * interval '1 min'"
    " FROM generate_series(1, %s) g"
)


def build_dataset(src: PostgresCluster, ds: Dataset, bindir: str) -> None:
    """pgbench's tables, the big table and the small ones, then VACUUM ANALYZE (so every tool reads the same
    all-visible, hinted pages) and a CHECKPOINT."""
    src.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(SOURCE_DB)))
    env = dict(os.environ, PGHOST="127.0.0.1", PGPORT=str(src.port), PGUSER="postgres")
    subprocess.run(
        [f"{bindir}/pgbench", "-i", "-q", "-s", str(ds.pgbench_scale), "--foreign-keys", SOURCE_DB],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    with src.connect(SOURCE_DB) as c:
        for stmt in BIG_DDL:
            c.execute(stmt, {"rows": ds.big_rows} if "%(rows)s" in stmt else None)
        for i in range(ds.small_tables):
            name = sql.Identifier(f"small_{i:03d}")
            c.execute(sql.SQL(SMALL_DDL).format(name))
            c.execute(sql.SQL(SMALL_FILL).format(name), (ds.small_rows,))
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")


# --- verification -----------------------------------------------------------------------------------------------


def user_schemas(conn: psycopg.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
    ).fetchall()
    return sorted(r[0] for r in rows)


def snapshot(conn: psycopg.Connection, schemas: Sequence[str]) -> dict[str, Any]:
    """What a copy must reproduce, in ``schemas`` (the source's: a tool may add its own, e.g. ``applier``): exact
    row counts, valid index counts per table, validated constraints per kind, sequence values."""
    nsp = list(schemas)
    tables = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'p') AND n.nspname = ANY(%s) ORDER BY 1, 2",
        (nsp,),
    ).fetchall()
    counts = {}
    for schema, rel in tables:
        q = sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(rel))
        counts[f"{schema}.{rel}"] = conn.execute(q).fetchone()[0]  # type: ignore[index]
    indexes = dict(
        conn.execute(
            "SELECT n.nspname || '.' || t.relname, count(*) FILTER (WHERE i.indisvalid AND i.indisready)"
            " FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace"
            " WHERE n.nspname = ANY(%s) GROUP BY 1",
            (nsp,),
        ).fetchall()
    )
    constraints = dict(
        conn.execute(
            "SELECT k.contype::text, count(*) FILTER (WHERE k.convalidated) FROM pg_constraint k"
            " JOIN pg_namespace n ON n.oid = k.connamespace WHERE k.contype IN ('p', 'u', 'f', 'c')"
            " AND n.nspname = ANY(%s) GROUP BY 1",
            (nsp,),
        ).fetchall()
    )
    sequences = dict(
        conn.execute(
            "SELECT schemaname || '.' || sequencename, last_value FROM pg_sequences WHERE schemaname = ANY(%s)",
            (nsp,),
        ).fetchall()
    )
    return {"rows": counts, "indexes": indexes, "constraints": constraints, "sequences": sequences}


def differences(expected: dict[str, Any], got: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable differences, at most ``limit`` of them."""
    out = []
    for kind, exp in expected.items():
        have = got.get(kind, {})
        for key in sorted(set(exp) | set(have)):
            if exp.get(key) != have.get(key):
                out.append(f"{kind} {key}: source {exp.get(key)!r}, target {have.get(key)!r}")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


# --- the tools --------------------------------------------------------------------------------------------------


@dataclass
class Context:
    """What every tool's run needs."""

    src: PostgresCluster
    tgt: PostgresCluster
    bindir: str
    jobs: int
    timeout: float
    workdir: Path  # scratch space for dumps and pgcopydb's work directory, emptied after each run
    ours_code: Path | None
    ours_env: dict[str, str] = field(default_factory=dict)
    write_rate: int = 500  # ours_load's pgbench -R

    def uri(self, cluster: PostgresCluster, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{cluster.port}/{db}"

    def tool_env(self) -> dict[str, str]:
        """PATH and PG_CONFIG pointing at the servers' bindir, so every client tool matches the servers."""
        return dict(
            os.environ,
            PATH=f"{self.bindir}:{os.environ.get('PATH', '')}",
            PG_CONFIG=f"{self.bindir}/pg_config",
            TMPDIR=str(self.workdir),
        )


def run_pgcopydb(ctx: Context, target_db: str) -> list[Step]:
    argv = ["pgcopydb", "clone", "--source", ctx.uri(ctx.src, SOURCE_DB), "--target", ctx.uri(ctx.tgt, target_db),
            "--table-jobs", str(ctx.jobs), "--index-jobs", str(ctx.jobs), "--dir", str(ctx.workdir / "pgcopydb")]  # fmt: skip
    return [run_step(argv, ctx.tool_env(), ctx.timeout)]


def _dump_restore(ctx: Context, target_db: str, extra: list[str]) -> list[Step]:
    dump = str(ctx.workdir / "dump")
    b = ctx.bindir
    return [
        run_step([f"{b}/pg_dump", "-Fd", "-j", str(ctx.jobs), *extra, "-f", dump, "-d", ctx.uri(ctx.src, SOURCE_DB)],
                 ctx.tool_env(), ctx.timeout),
        run_step([f"{b}/pg_restore", "-j", str(ctx.jobs), "-d", ctx.uri(ctx.tgt, target_db), dump],
                 ctx.tool_env(), ctx.timeout),
    ]  # fmt: skip


def run_dump_restore(ctx: Context, target_db: str) -> list[Step]:
    return _dump_restore(ctx, target_db, [])


def run_dump_restore_z0(ctx: Context, target_db: str) -> list[Step]:
    return _dump_restore(ctx, target_db, ["-Z", "0"])


def run_native(ctx: Context, target_db: str) -> list[Step]:
    """pre-data, CREATE SUBSCRIPTION's copy, post-data with -j N, setval, DROP SUBSCRIPTION (see the docstring)."""
    b, env, schema = ctx.bindir, ctx.tool_env(), str(ctx.workdir / "schema.dump")
    tgt_uri, src_uri = ctx.uri(ctx.tgt, target_db), ctx.uri(ctx.src, SOURCE_DB)
    steps = [
        run_step([f"{b}/pg_dump", "-Fc", "--schema-only", "-f", schema, "-d", src_uri], env, ctx.timeout),
        run_step([f"{b}/pg_restore", "--section=pre-data", "-d", tgt_uri, schema], env, ctx.timeout),
    ]
    name = f"migbench_{target_db}"
    deadline = time.monotonic() + ctx.timeout
    with ctx.src.connect(SOURCE_DB) as s, ctx.tgt.connect(target_db) as t:
        s.execute(sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(name)))
        ntables = s.execute(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = %s", (name,)
        ).fetchone()[0]  # type: ignore[index]
        t.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (copy_data = true, streaming = off)"
            ).format(sql.Identifier(name), sql.Literal(ctx.src.dsn(SOURCE_DB)), sql.Identifier(name))
        )
        while True:
            total, ready = t.execute(
                "SELECT count(*), count(*) FILTER (WHERE srsubstate = 'r') FROM pg_subscription_rel"
            ).fetchone()  # type: ignore[misc]
            if total == ntables and ready == total:
                break
            if time.monotonic() > deadline:
                raise ToolFailed(f"native: {ready}/{ntables} tables ready after {ctx.timeout:.0f}s")
            time.sleep(POLL_S)
    steps.append(
        run_step([f"{b}/pg_restore", "-j", str(ctx.jobs), "--section=post-data", "-d", tgt_uri, schema], env,
                 ctx.timeout)
    )  # fmt: skip
    with ctx.src.connect(SOURCE_DB) as s, ctx.tgt.connect(target_db) as t:
        seqs = s.execute(
            "SELECT schemaname, sequencename, last_value FROM pg_sequences WHERE last_value IS NOT NULL"
        ).fetchall()
        with t.transaction():
            for nsp, seq, value in seqs:
                t.execute(
                    "SELECT pg_catalog.setval(%s::regclass, %s, true)",
                    (sql.Identifier(nsp, seq).as_string(t), value),
                )
        ident = sql.Identifier(name)
        t.execute(sql.SQL("DROP SUBSCRIPTION {}").format(ident))  # drops the slot on the source too
        s.execute(sql.SQL("DROP PUBLICATION {}").format(ident))
    return steps


def ours_source(target_db: str) -> str:
    return f"{SOURCE_DB}_{target_db}"


def prepare_ours(ctx: Context, target_db: str) -> Callable[[], None]:
    """A fresh copy of the source for ours (a cutover fences its source), made before the clock starts; returns
    what drops it afterwards (which also drops the slot(s) the migration left there)."""
    src_db = ours_source(target_db)
    # STRATEGY is PostgreSQL 15's (before it, a template is always copied file by file)
    strategy = sql.SQL(" STRATEGY FILE_COPY" if ctx.src.binaries.major >= 15 else "")
    ctx.src.execute(
        sql.SQL("CREATE DATABASE {} TEMPLATE {}{}").format(
            sql.Identifier(src_db), sql.Identifier(SOURCE_DB), strategy
        )
    )
    return lambda: ctx.src.drop_database(src_db)


class WriteLoad:
    """``pgbench -n -R rate -c 4 -j 2`` (TPC-B-like) on ours' copy of the source during ``ours_load``'s whole run,
    from before ours starts until the cutover's fence ends its sessions (every client then aborts and pgbench
    exits by itself). Each committed transaction is logged (``pgbench -l``) with the time it completed, so the
    write downtime the writers saw is measured from their side: from the last commit on the source to the moment
    the migration says ``done`` (the target takes the writes from then on)."""

    CLIENTS = 4

    def __init__(self, ctx: Context, db: str, rate: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="migbench-pgbench-"))
        self.out = open(self.dir / "pgbench.out", "w")  # noqa: SIM115 - closed in stop()
        argv = [f"{ctx.bindir}/pgbench", "-n", "-R", str(rate), "-c", str(self.CLIENTS), "-j", "2", "-T", "7200",
                "-l", "--log-prefix", str(self.dir / "tx"), ctx.uri(ctx.src, db)]  # fmt: skip
        self.rate = rate
        self.proc = subprocess.Popen(
            argv, env=ctx.tool_env(), stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self, wait: float = 60.0) -> dict[str, Any]:
        """Wait for pgbench to end (the fence ended its sessions), or stop it; what its log says."""
        try:
            self.proc.wait(wait)
            ended = "by itself (its sessions ended by the fence)"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session we started for it, and only that
            self.proc.wait()
            ended = "killed: it was still running (its last log lines may be lost)"
        self.out.close()
        done: list[float] = []
        for log in self.dir.glob("tx*"):
            for line in log.read_text().splitlines():
                f = line.split()
                if len(f) >= 6 and f[2].isdigit():  # client, txno, latency us, script, epoch s, us
                    done.append(int(f[4]) + int(f[5]) / 1e6)
        tail = (self.dir / "pgbench.out").read_text()[-600:]
        shutil.rmtree(self.dir, ignore_errors=True)
        return {
            "rate": self.rate, "clients": self.CLIENTS, "ended": ended, "transactions": len(done),
            "first_commit": min(done, default=None), "last_commit": max(done, default=None), "output_tail": tail,
        }  # fmt: skip


def write_downtime(load: dict[str, Any], details: list[Any]) -> dict[str, Any]:
    """The downtime the writers saw (last commit on the source to the migration's ``done``) and the one ours
    reports (its fence to ``done``), next to what pgbench did."""
    row = next((d for d in details if isinstance(d, dict) and d.get("phase") == "done"), None)
    out = {k: v for k, v in load.items() if k != "output_tail"}
    if row is None or load["last_commit"] is None:
        return out | {"error": "no done migration or no commit logged", "pgbench": load["output_tail"]}
    done_at = datetime.fromisoformat(row["updated"]).timestamp()
    span = load["last_commit"] - load["first_commit"]
    return out | {
        "writers_downtime_s": round(done_at - load["last_commit"], 3),
        "reported_downtime_s": round(row["times"].get("cutover downtime", float("nan")), 3),
        "achieved_tps": round(load["transactions"] / span, 1) if span > 0 else None,
    }


def run_ours(ctx: Context, target_db: str) -> list[Step]:
    """``applier migrate start --cutover`` against the copy of the source :func:`prepare_ours` made."""
    if ctx.ours_code is None:
        raise ToolFailed("no code for ours")
    argv = [sys.executable, "-m", "applier.cli", "migrate", "start", f"migbench_{target_db}",
            "--source", ctx.src.dsn(ours_source(target_db)), "--target", ctx.tgt.dsn(target_db),
            "--table-jobs", str(ctx.jobs), "--index-jobs", str(ctx.jobs), "--cutover"]  # fmt: skip
    log = OUT_DIR / f"ours-{target_db}.log"
    return [run_step(argv, ctx.ours_env, ctx.timeout, cwd=str(ctx.workdir), log=log)]


RUNNERS: dict[str, Callable[[Context, str], list[Step]]] = {
    "pgcopydb": run_pgcopydb,
    "dump_restore": run_dump_restore,
    "dump_restore_z0": run_dump_restore_z0,
    "native": run_native,
    "ours": run_ours,
    "ours_load": run_ours,
}
#: What a tool needs made before its clock starts: returns what undoes it after the run.
PREPARE: dict[str, Callable[[Context, str], Callable[[], None]]] = {
    "ours": prepare_ours,
    "ours_load": prepare_ours,
}
LABELS = {
    "pgcopydb": "pgcopydb clone",
    "dump_restore": "pg_dump -Fd -j N, then pg_restore -j N",
    "dump_restore_z0": "the same with pg_dump -Z 0",
    "native": "native (pre-data, subscription copy, post-data -j N, setval)",
    "ours": "applier migrate start --cutover",
    "ours_load": "the same under pgbench -R on the source",
}


# --- availability -----------------------------------------------------------------------------------------------


def prepare_ours_code(source: Path, code_rev: str | None) -> Path:
    """A private, frozen copy of the project's packages (see the docstring): the working files of ``source``, or
    ``git archive code_rev`` of it."""
    dest = Path(tempfile.mkdtemp(prefix="migbench-code-"))
    if code_rev:
        archive = subprocess.run(
            ["git", "-C", str(source), "archive", "--format=tar", code_rev, *CODE_PACKAGES],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        for pkg in CODE_PACKAGES:
            if (source / pkg).is_dir():
                shutil.copytree(
                    source / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                )
    return dest


def ours_unavailable(env: dict[str, str], cwd: Path) -> str | None:
    """Why ``applier migrate start --cutover`` cannot be run from this code, or None when it can."""
    res = subprocess.run(
        [sys.executable, "-m", "applier.cli", "migrate", "start", "--help"],
        env=env, cwd=str(cwd), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = res.stdout + res.stderr
    if res.returncode != 0:
        return (
            f"`applier migrate start --help` exits {res.returncode}: {text.strip().splitlines()[-1:] or ''}"
        )
    if "--cutover" not in text:
        return "`applier migrate start` has no --cutover option in this code"
    return None


def pgcopydb_unavailable() -> str | None:
    if shutil.which("pgcopydb") is None:
        return (
            "pgcopydb is not installed (bash .ci/install --bench, or as root: apt-get install pgcopydb); "
            "its column is left out"
        )
    return None


# --- the critical-path floor ------------------------------------------------------------------------------------

#: How many of the largest tables (heap and indexes together) the floor measures; it is the slowest of them.
FLOOR_CANDIDATES = 2
#: The goal for ours against the floor (issue 28): at most this multiple of it.
GOAL_VS_FLOOR = 1.1
FLOOR_DB = "floor"
_FLOOR_METHOD_FACTOR = {"gin": 4.0, "gist": 3.0, "spgist": 3.0, "brin": 0.2}  # as applier.migrate.postdata's


@dataclass
class FloorTable:
    """One table measured alone: its COPY between the two servers, then its index builds, ``jobs`` at a time."""

    table: str
    copy_s: float
    indexes_s: float
    indexes: list[tuple[str, float]]  # (index, seconds of its build), in the order they started

    @property
    def seconds(self) -> float:
        return self.copy_s + self.indexes_s


def measure_floor(ctx: Context) -> dict[str, Any]:
    """The critical-path floor of the dataset (issue 28): for each of the :data:`FLOOR_CANDIDATES` largest tables,
    one COPY of it alone from the source into an empty table of a scratch target database, then its indexes built
    as a migration would chain them (costliest first, ``--jobs`` at once, GIN at ours' 4MB); the floor is the
    slowest such table. No migration can finish before that table is copied and indexed. Outside every tool's timed
    run; the scratch database is dropped afterwards."""
    with ctx.src.connect(SOURCE_DB) as s:
        tables = [r[0] for r in s.execute(
            "SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE c.relkind = 'r' AND n.nspname = ANY(%s)"
            " ORDER BY pg_total_relation_size(c.oid) DESC LIMIT %s",
            (user_schemas(s), FLOOR_CANDIDATES),
        )]  # fmt: skip
    measured = []
    for table in tables:
        ctx.tgt.create_database(FLOOR_DB)
        try:
            with ctx.src.connect() as s, ctx.tgt.connect() as t:
                s.execute("CHECKPOINT")
                t.execute("CHECKPOINT")
            measured.append(_floor_of(ctx, table))
        finally:
            ctx.tgt.drop_database(FLOOR_DB)
    slowest = max(measured, key=lambda m: m.seconds)
    return {"seconds": round(slowest.seconds, 2), "table": slowest.table, "jobs": ctx.jobs,
            "tables": [asdict(m) | {"seconds": round(m.seconds, 2)} for m in measured]}  # fmt: skip


def _floor_of(ctx: Context, table: str) -> FloorTable:
    """Copy ``table`` alone (one COPY stream, text format, into a table made from the source's column list), then
    build its indexes; each timed."""
    with ctx.src.connect(SOURCE_DB) as s, ctx.tgt.connect(FLOOR_DB) as t:
        columns = s.execute(
            "SELECT string_agg(format('%%I %%s%%s', attname, format_type(atttypid, atttypmod),"
            " CASE WHEN attnotnull THEN ' NOT NULL' ELSE '' END), ', ' ORDER BY attnum)"
            " FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            (table,),
        ).fetchone()[0]  # type: ignore[index]
        indexes = s.execute(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid), am.amname, pg_relation_size(i.indexrelid)"
            " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam"
            " WHERE i.indrelid = %s::regclass",
            (table,),
        ).fetchall()
        schema = table.partition(".")[0]
        t.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.SQL(schema)))
        t.execute(sql.SQL("CREATE TABLE {} ({})").format(sql.SQL(table), sql.SQL(columns)))
        started = time.monotonic()
        with s.cursor().copy(sql.SQL("COPY {} TO STDOUT").format(sql.SQL(table))) as out, \
                t.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(sql.SQL(table))) as into:  # fmt: skip
            for chunk in out:
                into.write(chunk)
        copy_s = time.monotonic() - started
    order = sorted(indexes, key=lambda r: -r[3] * _FLOOR_METHOD_FACTOR.get(r[2], 1.0))
    indexes_s, builds = _build_chained(ctx, [(name, ddl, am) for name, ddl, am, _ in order])
    return FloorTable(table, round(copy_s, 2), round(indexes_s, 2), builds)


def _build_chained(ctx: Context, order: list[tuple[str, str, str]]) -> tuple[float, list[tuple[str, float]]]:
    """Build the indexes in ``order`` on the scratch database, ``ctx.jobs`` at a time (the next starts when one
    ends), each in its own session as ours' post-data does; the wall time of all, and each build's."""
    from concurrent.futures import ThreadPoolExecutor

    def build(ddl: str, am: str) -> float:
        with ctx.tgt.connect(FLOOR_DB) as t:
            t.execute("SET synchronous_commit = off")
            # a GIN build's memory as ours sets it (before PostgreSQL 18 less than the server's: see there)
            mem = gin_maintenance_work_mem(t.info.server_version)
            if am == "gin" and mem is not None:
                t.execute("SELECT set_config('maintenance_work_mem', %s, false)", (mem,))
            began = time.monotonic()
            t.execute(ddl)
            return time.monotonic() - began

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, ctx.jobs)) as pool:
        futures = [(name, pool.submit(build, ddl, am)) for name, ddl, am in order]
        builds = [(name, round(f.result(), 2)) for name, f in futures]
    return time.monotonic() - started, builds


# --- one run and the report -------------------------------------------------------------------------------------


@dataclass
class RunResult:
    tool: str
    rep: int
    seconds: float | None  # None: the tool failed
    peak_pss_mb: float | None
    verified: bool
    steps: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    load: float = 0.0
    #: ours: its rows of ``applier.migration`` after the run
    details: list[Any] = field(default_factory=list)
    peak_rss_mb: float | None = None
    #: ours_load: what the writers did and saw (:func:`write_downtime`)
    writes: dict[str, Any] | None = None
    #: CPU seconds during the run (:class:`CpuMeter`): the tool's processes, the source's and the target's servers
    cpu: dict[str, float] = field(default_factory=dict)


class CpuMeter:
    """The CPU a run used: the tool's processes (every child this process reaped meanwhile, with the children
    they reaped: the tool's commands, ours' worker and copy streams) and each cluster's servers. On C cores a
    run cannot take less than their sum / C seconds: what decides a run when that is above the critical path."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.start = self._now()

    def _now(self) -> tuple[float, float, float]:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime, cluster_cpu(self.ctx.src), cluster_cpu(self.ctx.tgt)

    def used(self) -> dict[str, float]:
        end = self._now()
        tool, source, target = (round(b - a, 1) for a, b in zip(self.start, end, strict=True))
        return {"tool": tool, "source": source, "target": target, "total": round(tool + source + target, 1)}


#: --statements: every statement of every database, utility commands included, nested ones (functions) too
STATEMENTS_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.max": "20000",
}


def statements_reset(tgt: PostgresCluster) -> None:
    with tgt.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        c.execute("SELECT pg_stat_statements_reset()")


def statements_report(tgt: PostgresCluster, title: str, top: int = 30) -> str:
    """What the target ran since :func:`statements_reset`: totals by kind of statement (its first word), then the
    ``top`` statements by total time. Execution time is not CPU time, but for the short statements it is close."""
    with tgt.connect() as c:
        rows = c.execute(
            "SELECT query, calls, total_exec_time + total_plan_time FROM pg_stat_statements"
            " WHERE query NOT LIKE '%%pg_stat_statements%%' ORDER BY 3 DESC"
        ).fetchall()
    kinds: dict[str, list[float]] = {}
    for query, calls, ms in rows:
        kind = (query.split() or ["?"])[0].upper()
        k = kinds.setdefault(kind, [0, 0.0])
        k[0] += calls
        k[1] += ms
    out = [
        f"## {title}",
        "",
        f"{sum(r[1] for r in rows):,} statements, {sum(r[2] for r in rows) / 1e3:.1f} s",
        "",
    ]
    out += ["| kind | calls | total s |", "|---|---|---|"]
    out += [
        f"| {k} | {v[0]:,} | {v[1] / 1e3:.2f} |" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])
    ]
    out += ["", "| total s | calls | ms per call | statement |", "|---|---|---|---|"]
    for query, calls, ms in rows[:top]:
        text = " ".join(query.split())[:160].replace("|", "\\|")
        out.append(f"| {ms / 1e3:.2f} | {calls:,} | {ms / max(calls, 1):.3f} | `{text}` |")
    return "\n".join(out) + "\n\n"


def one_run(ctx: Context, tool: str, rep: int, expected: dict[str, Any], schemas: list[str]) -> RunResult:
    target_db = f"{tool}_{rep}"
    ctx.tgt.create_database(target_db)
    shutil.rmtree(ctx.workdir, ignore_errors=True)
    ctx.workdir.mkdir(parents=True)
    cleanup = PREPARE[tool](ctx, target_db) if tool in PREPARE else None
    with ctx.src.connect() as s, ctx.tgt.connect() as t:
        s.execute("CHECKPOINT")
        t.execute("CHECKPOINT")
    load = WriteLoad(ctx, ours_source(target_db), ctx.write_rate) if tool == "ours_load" else None
    meter = CpuMeter(ctx)
    started = time.monotonic()
    try:
        steps = RUNNERS[tool](ctx, target_db)
        seconds = time.monotonic() - started
        cpu = meter.used()
    except (ToolFailed, psycopg.Error, subprocess.SubprocessError) as exc:
        text = str(exc)
        head, _, rest = text.partition("\n")
        error = head[:1000] + ("\n" + rest[-2500:] if rest else "")
        result = RunResult(tool, rep, None, None, False, error=error, load=os.getloadavg()[0])
    else:
        if load is not None:  # the writes changed the source: the target must equal it as it is now
            with ctx.src.connect(ours_source(target_db)) as s:
                expected = snapshot(s, schemas)
        with ctx.tgt.connect(target_db) as t:
            got = snapshot(t, schemas)
        diff = differences(expected, got)
        result = RunResult(
            tool, rep, seconds, max(s.peak_pss_kb for s in steps) / 1024, not diff,
            [asdict(s) | {"output_tail": s.output_tail[-500:]} for s in steps],
            "; ".join(diff), os.getloadavg()[0], peak_rss_mb=max(s.peak_rss_kb for s in steps) / 1024,
            cpu=cpu,
        )  # fmt: skip
    finally:
        writes = load.stop() if load is not None else None
        shutil.rmtree(ctx.workdir, ignore_errors=True)
        if cleanup is not None:
            cleanup()
    if tool.startswith("ours"):
        result.details = migration_rows(ctx.tgt, target_db)
    if writes is not None:
        result.writes = write_downtime(writes, result.details)
    ctx.tgt.drop_database(target_db)
    return result


def migration_rows(cluster: PostgresCluster, db: str) -> list[Any]:
    """Our migration's own record (phase, time of each phase, when it ended), kept with the run: it tells a slow
    exit from a slow migration. Best effort: the table belongs to ``applier migrate`` and may change."""
    try:
        with cluster.connect(db) as c:
            rows = [r[0] for r in c.execute("SELECT to_jsonb(m) FROM applier.migration m").fetchall()]
            slow = c.execute(
                "SELECT step, round(seconds::numeric, 2)::float8, finished::text FROM applier.migration_step"
                " WHERE seconds >= 0.3 ORDER BY finished"
            ).fetchall()
            return [*rows, {"post-data steps of 0.3 s or more (step, s, finished)": [list(r) for r in slow]}]
    except psycopg.Error as exc:
        return [f"(no applier.migration: {str(exc).strip()[:200]})"]


def describe(r: RunResult) -> str:
    if r.seconds is None:
        return "FAILED: " + (r.error.strip().splitlines() or [""])[0][:300]
    check = "verified" if r.verified else f"WRONG: {r.error}"
    return f"{r.seconds:7.2f}s  peak PSS {r.peak_pss_mb or 0:6.0f} MB  {check}"


@dataclass
class ToolSummary:
    tool: str
    median_s: float | None
    runs_s: list[float]
    failed: int
    peak_pss_mb: float | None
    unavailable: str = ""
    errors: list[str] = field(default_factory=list)
    peak_rss_mb: float | None = None
    writes: list[dict[str, Any]] = field(default_factory=list)  # ours_load: one per good run
    cpu: dict[str, float] = field(default_factory=dict)  # medians of the good runs' CpuMeter figures


def summarize(tool: str, results: list[RunResult], unavailable: str | None) -> ToolSummary:
    good = [r for r in results if r.seconds is not None and r.verified]
    bad = [r for r in results if not (r.seconds is not None and r.verified)]
    return ToolSummary(
        tool,
        median([r.seconds for r in good]) if good else None,  # type: ignore[misc]
        [round(r.seconds, 2) for r in good],  # type: ignore[arg-type]
        len(bad),
        max((r.peak_pss_mb or 0.0) for r in good) if good else None,
        unavailable or "",
        [f"run {r.rep}: " + (r.error or "verification failed").strip().splitlines()[0][:300] for r in bad],
        max((r.peak_rss_mb or 0.0) for r in good) if good else None,
        [r.writes for r in good if r.writes is not None],
        {k: median([r.cpu[k] for r in good]) for k in ("tool", "source", "target", "total")}
        if good and all(r.cpu for r in good)
        else {},
    )


def render(summaries: list[ToolSummary], header: str, floor: dict[str, Any] | None = None) -> str:
    by = {s.tool: s for s in summaries}
    ours = by.get("ours")
    lines = [
        header,
        "",
        "| tool | median s | runs s | peak memory (PSS) of its processes MB | ours / this |"
        f" CPU s: tool + source + target = total (/ {os.cpu_count()} cores) |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if s.unavailable:
            lines.append(f"| {LABELS[s.tool]} | not run: {s.unavailable} | | | | |")
            continue
        ratio = ""
        if ours and ours.median_s and s.median_s and not s.tool.startswith("ours"):
            ratio = f"{ours.median_s / s.median_s:.2f}"
        med = f"{s.median_s:.1f}" if s.median_s is not None else "FAILED"
        runs = ", ".join(f"{x:.1f}" for x in s.runs_s) + (f" ({s.failed} failed)" if s.failed else "")
        rss = f"{s.peak_pss_mb:.0f}" if s.peak_pss_mb is not None else ""
        c = s.cpu
        cpu = (
            f"{c['tool']:.0f} + {c['source']:.0f} + {c['target']:.0f} = {c['total']:.0f}"
            f" ({c['total'] / (os.cpu_count() or 1):.1f})"
            if c
            else ""
        )
        lines.append(f"| {LABELS[s.tool]} | {med} | {runs} | {rss} | {ratio} | {cpu} |")
    pg = by.get("pgcopydb")
    if ours and ours.median_s and pg and pg.median_s:
        r = ours.median_s / pg.median_s
        verdict = "met" if r <= GOAL_VS_PGCOPYDB else "NOT met"
        lines += ["", f"Goal ours <= {GOAL_VS_PGCOPYDB}x pgcopydb: {r:.2f}x, {verdict}."]
    elif ours is not None:
        lines += [
            "",
            "Goal ours <= 0.75x pgcopydb: not measured (" + (ours.unavailable or "see above") + ").",
        ]
    lines += render_floor(floor, ours)
    lines += render_writes(by.get("ours_load"))
    problems = [f"{s.tool}: {e}" for s in summaries for e in s.errors]
    if problems:
        lines += ["", "Problems:"] + [f"- {p}" for p in problems]
    return "\n".join(lines)


def render_floor(floor: dict[str, Any] | None, ours: ToolSummary | None) -> list[str]:
    """The critical-path floor (:func:`measure_floor`), each table measured, and ours against it."""
    if floor is None:
        return []
    parts = "; ".join(
        f"{m['table']}: copy {m['copy_s']:.2f} s + its indexes {m['indexes_s']:.2f} s = {m['seconds']:.2f} s"
        for m in floor["tables"]
    )
    lines = ["", f"Critical-path floor {floor['seconds']:.2f} s ({floor['table']}; each table alone, "
             f"index builds {floor['jobs']} at a time: {parts})."]  # fmt: skip
    if ours is not None and ours.median_s:
        r = ours.median_s / floor["seconds"]
        verdict = "met" if r <= GOAL_VS_FLOOR else "NOT met"
        lines.append(f"Goal ours <= {GOAL_VS_FLOOR}x the floor: {r:.2f}x ({ours.median_s - floor['seconds']:.1f} s "
                     f"beyond it), {verdict}.")  # fmt: skip
    return lines


def render_writes(s: ToolSummary | None) -> list[str]:
    """ours_load's lines: the write downtime of each run, seen by the writers and as ours reports it."""
    if s is None or not s.writes:
        return []
    w0 = s.writes[0]
    lines = [
        "",
        f"Ours under writes (pgbench -n -R {w0.get('rate')} -c {w0.get('clients')} on the source for the whole run), "
        f"peak memory of ours' processes: PSS {s.peak_pss_mb or 0:.0f} MB, RSS {s.peak_rss_mb or 0:.0f} MB:",
        "",
        "| run | s | write downtime seen by the writers s | reported by ours (fence to done) s | pgbench tps |",
        "|---|---|---|---|---|",
    ]
    for i, (secs, w) in enumerate(zip(s.runs_s, s.writes, strict=False)):
        seen = w.get("writers_downtime_s")
        lines.append(
            f"| {i} | {secs:.1f} | {seen if seen is not None else w.get('error')} | {w.get('reported_downtime_s')}"
            f" | {w.get('achieved_tps')} |"
        )
    worst = max((w["writers_downtime_s"] for w in s.writes if "writers_downtime_s" in w), default=None)
    if worst is not None:
        verdict = "met" if worst <= GOAL_DOWNTIME_S else "NOT met"
        lines += ["", f"Goal write downtime <= {GOAL_DOWNTIME_S:.0f} s: worst run {worst:.2f} s, {verdict}."]
    return lines


def rotation(tools: Sequence[str], rep: int) -> list[str]:
    """Repetition ``rep`` starts at tool ``rep mod k``: each tool takes every position once in k repetitions."""
    k = len(tools)
    return [tools[(rep + i) % k] for i in range(k)]


def git_rev(path: Path) -> str:
    try:
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", *CODE_PACKAGES],
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


# --- main -------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scale", type=float, default=1.0, help="fraction of the issue's dataset (default 1: ~1.5 GB)"
    )
    ap.add_argument("--small-tables", type=int, help="number of small tables (default 200)")
    ap.add_argument("--jobs", type=int, default=2, help="parallelism N of every tool (table and index jobs)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool, in rotating order")
    ap.add_argument(
        "--tools", default=",".join(DEFAULT_TOOLS), help="comma-separated subset of: " + ", ".join(TOOLS)
    )
    ap.add_argument(
        "--write-rate", type=int, default=500, help="ours_load: pgbench -R on the source (transactions/s)"
    )
    ap.add_argument(
        "--pg", default="15", help="server version or bindir (default 15: Debian, as pgcopydb needs)"
    )
    ap.add_argument(
        "--target-pg",
        help="the target's version or bindir, when it differs from --pg (an upgrade); the client tools stay --pg's",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one tool may take for one run")
    ap.add_argument("--ours-code", type=Path, default=ROOT, help="project tree whose applier runs as ours")
    ap.add_argument(
        "--code-rev", metavar="REV", help="ours from `git archive REV` of --ours-code, not its files"
    )
    ap.add_argument("--no-floor", action="store_true", help="do not measure the critical-path floor")
    ap.add_argument(
        "--statements", type=Path, metavar="FILE",
        help="load pg_stat_statements on the target and write, per run, what each tool's target ran (by total "
        "time; the extension's own cost slows every run a little, so time the tools without it)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=OUT_DIR / "migrate_bench.json", help="raw results")
    ap.add_argument(
        "--markdown", type=Path, default=OUT_DIR / "migrate_bench.md", help="the table as Markdown"
    )
    args = ap.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown:
        ap.error(f"unknown tool(s): {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ds = Dataset.scaled(args.scale, args.small_tables)
    started = datetime.now(UTC)
    load_at_start = loadavg()
    binaries = find_binaries(args.pg)
    bindir = str(binaries.bindir)
    common = {"autovacuum": "off", "max_wal_size": "8GB", "checkpoint_timeout": "1h"}
    src = PostgresCluster(binaries, name="mbench-src", durable=True, settings=common)
    tgt_binaries = find_binaries(args.target_pg) if args.target_pg else binaries
    tgt = PostgresCluster(tgt_binaries, name="mbench-tgt", durable=True,
                          settings={**common, "max_sync_workers_per_subscription": str(args.jobs),
                                    **(STATEMENTS_SETTINGS if args.statements else {})})  # fmt: skip
    unavailable: dict[str, str] = {}
    if "pgcopydb" in args.tools and (why := pgcopydb_unavailable()):
        unavailable["pgcopydb"] = why
    ours_code: Path | None = None
    ours_rev = ""
    scratch = Path(tempfile.mkdtemp(prefix="migbench-"))
    os.chmod(scratch, 0o755)
    ctx: Context | None = None
    results: list[RunResult] = []
    floor: dict[str, Any] | None = None
    try:
        if "ours" in args.tools or "ours_load" in args.tools:
            ours_code = prepare_ours_code(args.ours_code.resolve(), args.code_rev)
            ours_rev = args.code_rev or git_rev(args.ours_code)
            env = dict(os.environ, PYTHONPATH=str(ours_code), PYSPARK_PYTHON=sys.executable)
            if why := ours_unavailable(env, ours_code):
                for t in ("ours", "ours_load"):
                    unavailable[t] = f"{why} (code of {args.ours_code} at {ours_rev})"
        for tool, why in unavailable.items():
            print(f"note: {tool}: {why}", file=sys.stderr, flush=True)
        src.start()
        tgt.start()
        t0 = time.monotonic()
        build_dataset(src, ds, bindir)
        with src.connect(SOURCE_DB) as c:
            schemas = user_schemas(c)
            expected = snapshot(c, schemas)
            size_mb = c.execute("SELECT pg_database_size(current_database())").fetchone()[0] / 1e6  # type: ignore[index]
        version = str(src.scalar("SHOW server_version"))
        if args.target_pg:
            version += " source, " + str(tgt.scalar("SHOW server_version")) + " target"
        print(f"migrate_bench {started:%Y-%m-%d %H:%M} UTC, PostgreSQL {version}, dataset {asdict(ds)}: "
              f"{len(expected['rows'])} tables, {sum(expected['rows'].values()):,} rows, {size_mb:,.0f} MB, built in "
              f"{time.monotonic() - t0:.0f}s; jobs {args.jobs}; load {load_at_start[0]:.1f}", file=sys.stderr,
              flush=True)  # fmt: skip
        ctx = Context(src, tgt, bindir, args.jobs, args.timeout, scratch / "work", ours_code,
                      dict(os.environ, PYTHONPATH=str(ours_code or ""), PYSPARK_PYTHON=sys.executable),
                      args.write_rate)  # fmt: skip
        if not args.no_floor:
            floor = measure_floor(ctx)
            print(f"  critical-path floor {floor['seconds']:.2f}s: " + "; ".join(
                f"{m['table']} copy {m['copy_s']:.2f}s + indexes {m['indexes_s']:.2f}s" for m in floor["tables"]),
                file=sys.stderr, flush=True)  # fmt: skip
        tools = [t for t in args.tools if t not in unavailable]
        for rep in range(args.repeat):
            for tool in rotation(tools, rep):
                if args.statements:
                    statements_reset(tgt)
                r = one_run(ctx, tool, rep, expected, schemas)
                if args.statements:
                    with args.statements.open("a") as f:
                        f.write(statements_report(tgt, f"{tool} run {rep} ({describe(r)})"))
                results.append(r)
                print(
                    f"  run {rep} {tool:<16} {describe(r)}  (load {r.load:.1f})", file=sys.stderr, flush=True
                )
    finally:
        tgt.destroy()
        src.destroy()
        shutil.rmtree(scratch, ignore_errors=True)
        if ours_code is not None:
            shutil.rmtree(ours_code, ignore_errors=True)
    load_at_end = loadavg()
    summaries = [summarize(t, [r for r in results if r.tool == t], unavailable.get(t)) for t in args.tools]
    header = (
        f"{started:%Y-%m-%d %H:%M} UTC; PostgreSQL {version}{'' if args.target_pg else ' source and target'}"
        f" (client tools from {bindir}); "
        f"dataset --scale {args.scale:g} ({len(expected['rows'])} tables, {sum(expected['rows'].values()):,} rows, "
        f"{size_mb:,.0f} MB); N = {args.jobs} jobs; {args.repeat} run(s) per tool, rotating order; ours: code of "
        f"{args.ours_code} at {ours_rev or '-'}; bench at {git_rev(ROOT)}; {os.cpu_count()} CPUs; load average "
        f"at start {load_at_start[0]:.1f}, at end {load_at_end[0]:.1f}"
    )  # fmt: skip
    report = render(summaries, header, floor)
    print("\n" + report)
    for path in (args.json, args.markdown):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(report + "\n")
    args.json.write_text(json.dumps({
        "started": started.isoformat(), "argv": sys.argv, "dataset": asdict(ds), "size_mb": size_mb,
        "postgresql": version, "jobs": args.jobs, "ours_code": str(args.ours_code), "ours_rev": ours_rev,
        "bench_rev": git_rev(ROOT), "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_at_start": load_at_start, "load_at_end": load_at_end, "expected": expected,
        "floor": floor,
        "summaries": [asdict(s) for s in summaries], "results": [asdict(r) for r in results],
    }, indent=2, default=str))  # fmt: skip
    ok = all(s.failed == 0 and s.median_s is not None for s in summaries if not s.unavailable)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
