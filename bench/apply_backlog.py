"""Apply-rate benchmark: our worker against PostgreSQL's native subscriber over the same backlog.

Method (shared/reference/benchmarking-native.md): both subscribers' slots exist before the workload; the workload
runs on the publisher with nobody applying; then each subscriber is started in turn and timed from start until the
last change is visible on its target (polled every 10 ms). Each side gets its own target database on one target
cluster. Results are rows/s or transactions/s and the ratio ours/native, printed as a table.

    .venv/bin/python bench/apply_backlog.py [--workload inserts|mixed|prepared|streamed|all] [--scale 1.0] [--pg 18]
"""

from __future__ import annotations

import argparse
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from psycopg import sql

from applier.apply.testing import setup_subscription
from applier.testing import running_cluster, table_digest
from applier.testing.cluster import Database, PostgresCluster


@dataclass
class Workload:
    name: str
    two_phase: bool
    streaming: bool
    run: Callable[[Database, float], int]  # returns the unit count (rows or transactions)
    unit: str
    done: Callable[[Database], bool] | None = None


def inserts(pub: Database, scale: float) -> int:
    """10k-row insert transactions."""
    n = max(1, int(20 * scale))
    with pub.connect() as c:
        for i in range(n):
            c.execute("INSERT INTO t SELECT g, md5(g::text), g FROM generate_series(%s::int, %s::int) g",
                      (i * 10000 + 1, (i + 1) * 10000))  # fmt: skip
    return n * 10000


def mixed(pub: Database, scale: float) -> int:
    """Small transactions: one update + one insert each."""
    n = max(1, int(20000 * scale))
    with pub.connect() as c:
        c.execute("INSERT INTO t SELECT g, md5(g::text), g FROM generate_series(1, 1000) g")
        with c.pipeline():
            for i in range(n):
                with c.transaction():
                    c.execute("UPDATE t SET n = n + 1 WHERE id = %s", (i % 1000 + 1,))
                    c.execute("INSERT INTO t VALUES (%s, 'x', 0)", (100000 + i,))
    return n


def prepared(pub: Database, scale: float) -> int:
    """Prepared transactions (one update + one insert), 10% rolled back."""
    n = max(1, int(2000 * scale))
    with pub.connect() as c:
        c.execute("INSERT INTO t SELECT g, md5(g::text), g FROM generate_series(1, 1000) g")
        for i in range(n):
            c.execute("BEGIN")
            c.execute("UPDATE t SET n = n + 1 WHERE id = %s", (i % 1000 + 1,))
            c.execute("INSERT INTO t VALUES (%s, 'x', 0)", (100000 + i,))
            c.execute(f"PREPARE TRANSACTION 'b{i}'")
            c.execute(f"{'ROLLBACK' if i % 10 == 9 else 'COMMIT'} PREPARED 'b{i}'")
    return n


def streamed(pub: Database, scale: float) -> int:
    """One big transaction, streamed (logical_decoding_work_mem 16MB)."""
    n = max(1000, int(200000 * scale))
    pub.execute(
        sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '16MB'").format(sql.Identifier(pub.name))
    )
    with pub.connect() as c:
        c.execute("INSERT INTO t SELECT g, md5(g::text), g FROM generate_series(1, %s::int) g", (n,))
    return n


WORKLOADS = {
    "inserts": Workload("10k-row insert txns", False, False, inserts, "rows/s"),
    "mixed": Workload("update+insert txns", False, False, mixed, "txns/s"),
    "prepared": Workload("prepared txns (10% rolled back)", True, False, prepared, "txns/s"),
    "streamed": Workload("one streamed txn", False, True, streamed, "rows/s"),
}


def _setup_table(db: Database) -> None:
    db.execute("CREATE TABLE t (id int PRIMARY KEY, v text, n int)")


def _wait_equal(pub: Database, tgt: Database, deadline: float) -> None:
    want = pub.scalar("SELECT count(*) || ':' || coalesce(sum(n), 0) FROM t")
    with tgt.connect() as c:
        while time.monotonic() < deadline:
            got = c.execute("SELECT count(*) || ':' || coalesce(sum(n), 0) FROM t").fetchone()[0]
            if got == want:
                return
            time.sleep(0.01)
    raise TimeoutError(f"target did not catch up: want {want}")


def run_one(
    pubc: PostgresCluster, tgtc: PostgresCluster, key: str, scale: float, tag: str
) -> tuple[float, float]:
    wl = WORKLOADS[key]
    name = f"b_{key}_{tag}"
    pub = pubc.create_database(name)
    ours = tgtc.create_database(name + "_ours")
    native = tgtc.create_database(name + "_native")
    try:
        for db in (pub, ours, native):
            _setup_table(db)
        s = setup_subscription(pub, ours, name, ["public.t"], two_phase_state="e" if wl.two_phase else "d",
                               streaming="on" if wl.streaming else "off")  # fmt: skip
        pub.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
                    (name + "_nat", wl.two_phase))  # fmt: skip
        native.execute(sql.SQL(
            "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (copy_data = false, create_slot = false, "
            "slot_name = {}, enabled = false, streaming = {}, two_phase = {})").format(
            sql.Identifier(name + "_nat"), sql.Literal(pub.dsn), sql.Identifier(name), sql.Literal(name + "_nat"),
            sql.Literal("on" if wl.streaming else "off"), sql.Literal(wl.two_phase)))  # fmt: skip
        units = wl.run(pub, scale)

        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        w = s.start()
        try:
            _wait_equal(pub, ours, t0 + 600)
            t_ours = time.monotonic() - t0
        finally:
            w.stop()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(
            f"  peak RSS of this process: {rss_before / 1024:.0f} MB before, {rss_after / 1024:.0f} MB after ours"
        )
        t0 = time.monotonic()
        native.execute(sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(name + "_nat")))
        _wait_equal(pub, native, t0 + 600)
        t_native = time.monotonic() - t0
        native.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(name + "_nat")))
        assert table_digest(pub, "t") == table_digest(ours, "t"), "ours differs from the publisher"
        return units / t_ours, units / t_native
    finally:
        native.execute("DO $$BEGIN IF EXISTS (SELECT FROM pg_subscription) THEN "
                       "EXECUTE (SELECT format('ALTER SUBSCRIPTION %I SET (slot_name = NONE)', subname) "
                       "FROM pg_subscription LIMIT 1); END IF; END$$")  # fmt: skip
        for sub in native.query("SELECT subname FROM pg_subscription WHERE subdbid = "
                                "(SELECT oid FROM pg_database WHERE datname = current_database())"):  # fmt: skip
            native.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(sub[0])))
        tgtc.drop_database(native.name)
        tgtc.drop_database(ours.name)
        pubc.drop_database(pub.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--pg", default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--durable", action="store_true", help="fsync on (slower, realistic)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    keys = list(WORKLOADS) if args.workload == "all" else [args.workload]
    with running_cluster(args.pg, name="bench-pub", durable=args.durable) as pubc, \
            running_cluster(args.pg, name="bench-tgt", durable=args.durable) as tgtc:  # fmt: skip
        print(f"PostgreSQL {pubc.scalar('SHOW server_version')}, scale {args.scale}, durable={args.durable}")
        print(f"{'workload':36} {'ours':>12} {'native':>12} {'ratio':>7}")
        for key in keys:
            for r in range(args.repeat):
                ours, native = run_one(pubc, tgtc, key, args.scale, str(r))
                unit = WORKLOADS[key].unit
                print(
                    f"{WORKLOADS[key].name:36} {ours:>9.0f} {unit:6} {native:>9.0f} {unit:6} {ours / native:>6.2f}"
                )


if __name__ == "__main__":
    main()
