"""Initial-sync benchmark: PostgreSQL's native tablesync against our Spark copy, on the same data in the same run.

Cases: ``one`` — one table of ``--rows`` rows (5,000,000 for the headline figure); ``many`` — ``--tables`` tables
of ``--rows-per-table`` rows. Three clusters: the publisher, a native subscriber, and our target.

* Pipe: the C baseline of our relay, on our target's cluster: ``psql -c 'COPY t TO STDOUT' | psql -c 'COPY t FROM
  STDIN'`` per table, two tables at a time. Its psql processes' CPU against our process tree's, per MB, is what a
  byte costs in our Python relay beyond a plain pipe (no snapshot, no markers: a floor, not a rival).

* Native: ``CREATE SUBSCRIPTION ... WITH (copy_data = true)`` on the native cluster, timed from that statement
  until every ``pg_subscription_rel.srsubstate`` is ``r`` (polled every 10 ms). Defaults as shipped
  (``max_sync_workers_per_subscription = 2``, text COPY unless ``--native-binary``).
* Ours: the catalog rows are written, then a fresh process runs the copy (``python -m tablesync.testing``), timed
  from launch to exit: interpreter, imports, Spark/JVM start-up, the snapshot, the job and the catalog updates are
  all included, until our process exits (a Spark JVM abandoned because the driver's head start copied everything
  before it was ready may take a moment more to go away; that is waited for outside the timed part). It ends with
  the tables in ``s`` (the apply loop turns them ``r`` when it streams past Y). Each line also shows the CPU seconds
  the publisher and the subscriber's cluster used during the run, our process tree's (what it reaped), and when our
  copy reached its phases: ``snapshot`` taken, ``spark`` ready (with ``head_parts`` of ``parts`` partitions copied
  by the driver meanwhile), ``start`` of the Spark job, ``copied`` (tables in ``s``), in seconds since launch.

Each side's result is verified outside the timed part (row count and an order-independent hash per table).
MB/s is the publisher's heap size (``pg_relation_size``) over the elapsed time, for both sides.

    .venv/bin/python bench/tablesync_bench.py                       # quick: small sizes
    .venv/bin/python bench/tablesync_bench.py --rows 5000000 --tables 100 --rows-per-table 20000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from psycopg import sql

if __package__ in (None, ""):  # run as a script: make the bench helpers importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cluster_cpu  # noqa: E402

from applier.testing.cluster import Database, PostgresCluster, find_binaries  # noqa: E402
from tablesync.testing import subscribe  # noqa: E402

ROW_DDL = "(id bigint PRIMARY KEY, a integer, b text, c timestamptz, d numeric, e jsonb)"
ROW_FILL = (
    "INSERT INTO {tbl} SELECT g, g %% 1000, md5(g::text) || md5((g + 1)::text), now() - g * interval '1 s',"
    " g / 7.0, jsonb_build_object('g', g, 's', 'x') FROM generate_series(1, %s) g"
)


@dataclass
class Outcome:
    case: str
    side: str
    tables: int
    rows: int
    heap_mb: float
    seconds: float
    #: CPU seconds during the run: the publisher cluster, the subscriber's cluster, our process tree (0 for native)
    pub_cpu: float = 0.0
    sub_cpu: float = 0.0
    proc_cpu: float = 0.0
    #: ours: seconds since launch when the snapshot, the Spark session, the job start and the copied line appeared
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.heap_mb / self.seconds


def table_names(case: str, ntables: int) -> list[str]:
    return ["big"] if case == "one" else [f"t{i:03d}" for i in range(ntables)]


def create_tables(db: Database, names: list[str]) -> None:
    with db.connect() as c:
        for n in names:
            c.execute(sql.SQL("CREATE TABLE {} " + ROW_DDL).format(sql.Identifier(n)))  # noqa: S608


def fill(db: Database, names: list[str], rows: int) -> None:
    with db.connect() as c:
        for n in names:
            c.execute(sql.SQL(ROW_FILL).format(tbl=sql.Identifier(n)), (rows,))  # type: ignore[arg-type]
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")


def fingerprint(db: Database, names: list[str]) -> dict[str, tuple[int, str]]:
    """Count and an order-independent hash of every row's text, computed by the server."""
    out = {}
    with db.connect() as c:
        for n in names:
            q = sql.SQL(
                "SELECT count(*), coalesce(sum(hashtextextended(r_::text, 0)::numeric), 0)::text FROM {} r_"
            )
            out[n] = tuple(c.execute(q.format(sql.Identifier(n))).fetchone())  # type: ignore[arg-type]
    return out


def heap_mb(db: Database, names: list[str]) -> float:
    with db.connect() as c:
        return (
            sum(
                c.execute("SELECT pg_relation_size(%s::regclass)", (f"public.{n}",)).fetchone()[0]  # type: ignore[index]
                for n in names
            )
            / 1e6
        )


def run_native(pub: Database, native: PostgresCluster, dbname: str, names: list[str], binary: bool) -> float:
    db = native.create_database(dbname)
    create_tables(db, names)
    with db.connect() as c:
        started = time.monotonic()
        c.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION pub"
                " WITH (copy_data = true, streaming = off, binary = {})"
            ).format(sql.Identifier(dbname), sql.Literal(pub.dsn), sql.SQL("true" if binary else "false"))
        )
        while True:
            pending = c.execute(
                "SELECT count(*) FROM pg_subscription_rel WHERE srsubstate <> 'r'"
            ).fetchone()[0]  # type: ignore[index]
            total = c.execute("SELECT count(*) FROM pg_subscription_rel").fetchone()[0]  # type: ignore[index]
            if total == len(names) and pending == 0:
                break
            time.sleep(0.01)
        elapsed = time.monotonic() - started
        c.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(dbname)))
        c.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(sql.Identifier(dbname)))
        c.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(dbname)))
    pub.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (dbname,)
    )
    return elapsed


def run_pipe(
    pub: Database, target: PostgresCluster, dbname: str, names: list[str], psql: str, streams: int = 2
) -> tuple[float, dict[str, float]]:
    """The C baseline of our relay: ``psql -c 'COPY t TO STDOUT' | psql -c 'COPY t FROM STDIN'`` per table,
    ``streams`` tables at a time; return its wall time and the CPU seconds of the psql processes (the relay's
    share: the servers' CPU is counted per cluster as for the other sides)."""
    db = target.create_database(dbname)
    create_tables(db, names)
    todo = list(names)
    lock = threading.Lock()
    cpu: list[float] = []
    failed: list[str] = []

    def one(name: str) -> None:
        table = sql.Identifier(name).as_string(None)
        out = subprocess.Popen([psql, "-X", "-q", "-d", pub.dsn, "-c", f"COPY {table} TO STDOUT"],
                               stdout=subprocess.PIPE)  # fmt: skip
        inp = subprocess.Popen([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db.dsn, "-c",
                                f"COPY {table} FROM STDIN"], stdin=out.stdout)  # fmt: skip
        assert out.stdout is not None
        out.stdout.close()  # the reader has it
        for proc in (out, inp):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            with lock:
                cpu.append(usage.ru_utime + usage.ru_stime)
                if proc.returncode:
                    failed.append(f"{name}: psql exited {proc.returncode}")

    def stream() -> None:
        while True:
            with lock:
                if not todo:
                    return
                name = todo.pop()
            one(name)

    started = time.monotonic()
    threads = [threading.Thread(target=stream) for _ in range(min(streams, len(names)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    if failed:
        raise SystemExit(f"the pipe failed: {failed}")
    return elapsed, {"cpu": sum(cpu)}


#: Progress lines of the copy (``tablesync: ...`` on stderr) that mark the end of a phase.
PHASE_MARKS = (("snapshot", "snapshot "), ("spark", "Spark "), ("start", "copying "), ("copied", "copied "))
#: ``Spark ready after S s; meanwhile the driver copied N/M partition(s)``
HEAD_START = re.compile(r"Spark ready after ([\d.]+)s; meanwhile the driver copied (\d+)/(\d+)")


def run_ours(
    pub: Database, target: PostgresCluster, dbname: str, names: list[str], master: str, head_start: str | None
) -> tuple[float, dict[str, float]]:
    """Run our copy in a fresh process; return its wall time and details: when each phase mark was printed
    (seconds since launch) and the CPU seconds of the process tree (driver, JVM, Python workers)."""
    db = target.create_database(dbname)
    create_tables(db, names)
    subscribe(db.dsn, pub.dsn, dbname, [f"public.{n}" for n in names])
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    if head_start is not None:
        env["APPLIER_TABLESYNC_HEAD_START"] = head_start
    marks: dict[str, float] = {}
    err: list[str] = []
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tablesync.testing", db.dsn, dbname, "--master", master],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if m := HEAD_START.search(line):
                marks["spark_ready_after"] = float(m.group(1))
                marks["head_parts"] = float(m.group(2))
                marks["parts"] = float(m.group(3))
            for key, prefix in PHASE_MARKS:
                if line.startswith("tablesync: " + prefix) and key not in marks:
                    marks[key] = time.monotonic() - started

    chunks: list[str] = []
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out_reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    out_reader.start()
    # Timed until our process exits. A JVM abandoned at the end (the driver copied everything before Spark was
    # ready) still holds the pipes a moment after; it is waited for here, outside the timed part.
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    out_reader.join(30)
    reader.join(30)
    out = "".join(chunks)
    if proc.returncode != 0:
        raise SystemExit(f"our copy failed:\n{out}\n{''.join(err)[-5000:]}")
    marks["cpu"] = usage.ru_utime + usage.ru_stime
    return elapsed, marks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=["one", "many", "all"], default="all")
    ap.add_argument("--rows", type=int, default=300_000, help="rows of the single table (headline: 5000000)")
    ap.add_argument("--tables", type=int, default=20, help="tables in the many-table case")
    ap.add_argument("--rows-per-table", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs per case")
    ap.add_argument(
        "--pg", default=None, help="server version (15, 16, 18) or bindir; default APPLIER_TEST_PG or 18"
    )
    ap.add_argument("--master", default="local[*,4]")
    ap.add_argument(
        "--head-start", default=None, help="APPLIER_TABLESYNC_HEAD_START for our copy (partitions the driver copies "
        "at once while Spark starts; 0 = Spark only); default: the environment's, else 2",
    )  # fmt: skip
    ap.add_argument("--native-binary", action="store_true", help="native subscription with binary = true")
    ap.add_argument("--durable", action="store_true", help="fsync on (default off, as in the tests)")
    ap.add_argument("--json", type=Path, default=Path("bench/out/tablesync.json"))
    args = ap.parse_args()

    from tablesync.job import class_data_sharing_options

    cds = class_data_sharing_options()
    print(
        "Spark class-data-sharing archive: "
        + (
            "present"
            if "SharedArchiveFile" in cds
            else "absent (this run's first JVM writes it at exit)"
            if cds
            else "off"
        ),
        flush=True,
    )
    binaries = find_binaries(args.pg)
    settings = {
        "max_sync_workers_per_subscription": "2",
        "max_wal_size": "4GB",
        "checkpoint_timeout": "30min",
    }
    clusters = [PostgresCluster(binaries, name=n, settings=settings, durable=args.durable) for n in ("pub", "native", "ours")]  # fmt: skip
    outcomes: list[Outcome] = []
    try:
        pubc, native, ours = (c.start() for c in clusters)
        cases = ["one", "many"] if args.case == "all" else [args.case]
        for case in cases:
            names = table_names(case, args.tables)
            rows = args.rows if case == "one" else args.rows_per_table
            pub = pubc.create_database(f"src_{case}")
            create_tables(pub, names)
            t0 = time.monotonic()
            fill(pub, names, rows)
            pub.execute("CREATE PUBLICATION pub FOR ALL TABLES")
            expected = fingerprint(pub, names)
            mb = heap_mb(pub, names)
            total_rows = rows * len(names)
            print(f"== {case}: {len(names)} table(s), {total_rows:,} rows, {mb:.1f} MB heap "
                  f"(loaded in {time.monotonic() - t0:.1f}s)", flush=True)  # fmt: skip
            for i in range(args.repeat):
                order = (
                    [("native", native), ("ours", ours), ("pipe", ours)]
                    if i % 2 == 0
                    else [("pipe", ours), ("ours", ours), ("native", native)]
                )
                for side, cluster in order:
                    dbname = f"{side}_{case}_{i}"
                    cpu0 = (cluster_cpu(pubc), cluster_cpu(cluster))
                    marks: dict[str, float] = {}
                    if side == "native":
                        secs = run_native(pub, cluster, dbname, names, args.native_binary)
                    elif side == "pipe":
                        secs, marks = run_pipe(pub, cluster, dbname, names, binaries.path("psql"))
                    else:
                        secs, marks = run_ours(pub, cluster, dbname, names, args.master, args.head_start)
                    time.sleep(0.3)  # let the walsender / backends exit, so their CPU is counted
                    pcpu, scpu = cluster_cpu(pubc) - cpu0[0], cluster_cpu(cluster) - cpu0[1]
                    got = fingerprint(cluster.database(dbname), names)
                    if got != expected:
                        raise SystemExit(
                            f"{side} {case}: copy differs from the publisher: {got} vs {expected}"
                        )
                    o = Outcome(
                        case, side, len(names), total_rows, mb, secs, pcpu, scpu, marks.pop("cpu", 0.0), marks
                    )
                    outcomes.append(o)
                    detail = f"cpu s: pub {pcpu:.1f} sub {scpu:.1f}"
                    if side == "pipe":
                        detail += f" psql {o.proc_cpu:.1f}"
                    if side == "ours":
                        detail += f" ours {o.proc_cpu:.1f}; at s: " + " ".join(
                            f"{k} {v:.1f}" for k, v in marks.items()
                        )
                    print(f"   {side:<6} {secs:7.2f}s  {o.rows_per_s:>10,.0f} rows/s  {o.mb_per_s:7.1f} MB/s  (verified; "
                          f"{detail}; load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                    cluster.drop_database(dbname)
        print(
            "\n(medians of the runs above)\n| case | tables | rows | heap MB | native s | ours s | native MB/s | ours MB/s | native/ours time |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for case in cases:
            nat = [o for o in outcomes if o.case == case and o.side == "native"]
            our = [o for o in outcomes if o.case == case and o.side == "ours"]
            ns, os_ = statistics.median(o.seconds for o in nat), statistics.median(o.seconds for o in our)
            o = nat[0]
            print(f"| {case} | {o.tables} | {o.rows:,} | {o.heap_mb:.0f} | {ns:.1f} | {os_:.1f} | "
                  f"{o.heap_mb / ns:.1f} | {o.heap_mb / os_:.1f} | {ns / os_:.2f}× |")  # fmt: skip
        print(
            "\n(medians; CPU per MB of heap: the relay's process, i.e. ours (driver, JVM if started, Python workers)"
            " or the two psql of the pipe; and the two servers)\n| case | ours s | pipe s | ours CPU ms/MB | pipe"
            " CPU ms/MB | servers ours ms/MB | servers pipe ms/MB |\n|---|---|---|---|---|---|---|"
        )
        for case in cases:
            med = {
                side: {
                    k: statistics.median(getattr(o, k) for o in outcomes if o.case == case and o.side == side)
                    for k in ("seconds", "proc_cpu", "pub_cpu", "sub_cpu", "heap_mb")
                }
                for side in ("ours", "pipe")
            }
            ms = {side: {k: 1000 * v / m["heap_mb"] for k, v in m.items()} for side, m in med.items()}
            print(f"| {case} | {med['ours']['seconds']:.1f} | {med['pipe']['seconds']:.1f} | "
                  f"{ms['ours']['proc_cpu']:.1f} | {ms['pipe']['proc_cpu']:.1f} | "
                  f"{ms['ours']['pub_cpu'] + ms['ours']['sub_cpu']:.1f} | "
                  f"{ms['pipe']['pub_cpu'] + ms['pipe']['sub_cpu']:.1f} |")  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "pg": binaries.major,
                    "master": args.master,
                    "head_start": args.head_start,
                    "native_binary": args.native_binary,
                    "durable": args.durable,
                    "cpus": os.cpu_count(),
                    "outcomes": [
                        asdict(o) | {"rows_per_s": o.rows_per_s, "mb_per_s": o.mb_per_s} for o in outcomes
                    ],
                },
                indent=2,
            )  # fmt: skip
        )
    finally:
        for c in clusters:
            c.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
