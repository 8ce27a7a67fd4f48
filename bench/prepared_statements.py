"""What our statements around a prepared transaction cost the target backend, without the rest of the apply worker.

Why: in the apply benchmark our target backend spends ~280 µs of CPU per prepared transaction where the native
apply worker spends ~150 in all. This replays the apply session's statement sequence on a throwaway cluster, in
pipeline mode as ``applier.apply.target`` sends it, and compares it with the bare sequence a native worker's
transaction amounts to:

* ``bare``: BEGIN, UPDATE, INSERT, PREPARE TRANSACTION, sync, COMMIT PREPARED, sync;
* ``sync``: the same plus ``pg_replication_origin_xact_setup`` before PREPARE TRANSACTION and before COMMIT
  PREPARED, in a session with a replication origin, as the worker sent them until issue 19's two-phase work: the
  second setup, a SELECT, then needs a sync point before COMMIT PREPARED;
* ``ours``: as the worker sends them now: the second setup in an empty transaction (BEGIN, setup, COMMIT), so
  COMMIT PREPARED follows in the same pipeline segment;
* ``record``: ``ours`` with the transaction's ``applier.prepared_xact`` record before it in a transaction of its
  own (BEGIN, the worker's own INSERT statement, COMMIT), which is what the worker sends under a live load.

It prints transactions per second and the backend's CPU (``/proc``) per transaction. Run it with fsync on (the
default, as the apply benchmark's target) and off (``--no-fsync``: CPU of the statements alone).

    .venv/bin/python bench/prepared_statements.py                   # bare, ours, bare, ours; fsync on
    .venv/bin/python bench/prepared_statements.py --no-fsync -n 4000 sync ours record sync ours record
"""

from __future__ import annotations

import argparse
import select
import time

import psycopg
from psycopg import pq

from applier.catalog import sql as catalog_sql
from applier.testing.cluster import PostgresCluster

VARIANTS = ("bare", "sync", "ours", "record")

_XACT_SETUP = (
    b"SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_catalog.pg_lsn,"
    b" '2000-01-01 00:00:00+00'::timestamptz + $2::bigint * '1 microsecond'::interval)"
)


def _cpu_seconds(pid: int) -> float:
    """Time on the CPU, to the nanosecond (``schedstat``; ``stat`` counts in 10 ms ticks)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


class _Session:
    """One pipelined connection, counting the sync points it still has to read."""

    def __init__(self, dsn: str, origin: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("SET session_replication_role = replica")
        self.conn.execute("SET synchronous_commit = off")
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_create(%s)", (origin,))
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", (origin,))
        self.pid = self.conn.info.backend_pid
        self.pg = self.conn.pgconn
        self.syncs = 0
        self.pg.enter_pipeline_mode()

    def sync(self) -> None:
        self.pg.pipeline_sync()
        self.syncs += 1

    def drain(self, down_to: int = 0) -> None:
        pg = self.pg
        while self.syncs > down_to:
            while pg.is_busy():
                select.select([pg.socket], [], [], 1.0)
                pg.consume_input()
            res = pg.get_result()
            if res is None:
                continue
            if res.status == pq.ExecStatus.PIPELINE_SYNC:
                self.syncs -= 1
            elif res.status == pq.ExecStatus.FATAL_ERROR:
                raise RuntimeError((res.error_message or b"").decode())


def run(cluster: PostgresCluster, variant: str, n: int, run_no: int) -> tuple[float, float]:
    """(transactions per second, backend CPU µs per transaction) of one variant."""
    s = _Session(cluster.dsn(), f"bench_{run_no}")
    pg = s.pg
    pg.send_prepare(b"b", b"BEGIN", [])
    pg.send_prepare(b"c", b"COMMIT", [])
    pg.send_prepare(b"u", b"UPDATE acc SET bal = bal + $1 WHERE id = $2", [23, 23])
    pg.send_prepare(b"i", b"INSERT INTO hist VALUES ($1, $2, $3, $4)", [23, 23, 23, 25])
    pg.send_prepare(b"x", _XACT_SETUP, [])
    pg.send_prepare(b"r", catalog_sql.RECORD_PREPARED, [])
    s.sync()
    s.drain()
    lsn = 1 << 24
    start, cpu = time.monotonic(), _cpu_seconds(s.pid)
    for i in range(1, n + 1):
        gid = f"g_{run_no}_{i}"
        if variant == "record":
            pg.send_query_prepared(b"b", [], None)
            pg.send_query_prepared(b"r", [gid.encode(), b"1", str(i).encode(), f"0/{lsn + 50:X}".encode(),
                                          f"0/{lsn + 100:X}".encode(), b"1000"], None)  # fmt: skip
            pg.send_query_prepared(b"c", [], None)
        pg.send_query_prepared(b"b", [], None)
        pg.send_query_prepared(b"u", [b"1", str(i % 1000 + 1).encode()], None)
        pg.send_query_prepared(b"i", [str(i).encode(), b"1", b"1", b"abcdef"], None)
        if variant != "bare":
            lsn += 100
            pg.send_query_prepared(b"x", [f"0/{lsn:X}".encode(), b"1000"], None)
        pg.send_query_params(b"PREPARE TRANSACTION '" + gid.encode() + b"'", None)
        if variant == "sync":
            lsn += 100
            pg.send_query_prepared(b"x", [f"0/{lsn:X}".encode(), b"1000"], None)
        if variant in ("bare", "sync"):
            s.sync()  # COMMIT PREPARED must start a pipeline segment (or follow a transaction command)
        else:
            lsn += 100
            pg.send_query_prepared(b"b", [], None)
            pg.send_query_prepared(b"x", [f"0/{lsn:X}".encode(), b"1000"], None)
            pg.send_query_prepared(b"c", [], None)
        pg.send_query_params(b"COMMIT PREPARED '" + gid.encode() + b"'", None)
        s.sync()
        pg.flush()
        if s.syncs > 200:
            s.drain(100)
    s.drain()
    elapsed, used = time.monotonic() - start, _cpu_seconds(s.pid) - cpu
    s.conn.close()
    return n / elapsed, used / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2000, help="prepared transactions per run (default 2000)")
    ap.add_argument("--no-fsync", action="store_true", help="fsync off: the statements' CPU alone")
    ap.add_argument(
        "variants", nargs="*", help=f"{', '.join(VARIANTS)}, in order (default: bare ours bare ours)"
    )
    args = ap.parse_args()
    variants = args.variants or ["bare", "ours", "bare", "ours"]
    if set(variants) - set(VARIANTS):
        ap.error(f"variants are {', '.join(VARIANTS)}")
    settings = {
        "max_prepared_transactions": "100",
        "wal_level": "logical",
        "fsync": "off" if args.no_fsync else "on",
    }
    with PostgresCluster(name="prepbench", durable=True, settings=settings) as c:
        c.execute("CREATE TABLE acc (id int PRIMARY KEY, bal int)")
        c.execute("INSERT INTO acc SELECT g, 0 FROM generate_series(1, 1000) g")
        c.execute("CREATE TABLE hist (id int PRIMARY KEY, a int, d int, note text)")
        # the worker's record table, as applier.catalog.schema has it (the subscription row its key refers to)
        c.execute("CREATE SCHEMA applier; CREATE TABLE applier.subscription (subid bigint PRIMARY KEY)")
        c.execute("INSERT INTO applier.subscription VALUES (1)")
        c.execute(
            "CREATE TABLE applier.prepared_xact (gid text PRIMARY KEY, subid bigint NOT NULL REFERENCES"
            " applier.subscription ON DELETE CASCADE, remote_xid bigint NOT NULL, prepare_lsn pg_lsn NOT NULL,"
            " prepare_end_lsn pg_lsn NOT NULL, prepare_time bigint NOT NULL, recorded_at timestamptz NOT NULL"
            " DEFAULT now())"
        )
        print(
            f"PostgreSQL {c.binaries.major}, fsync {'off' if args.no_fsync else 'on'}, {args.n} transactions per run"
        )
        for k, variant in enumerate(variants):
            c.execute("TRUNCATE hist, applier.prepared_xact")
            rate, cpu = run(c, variant, args.n, k)
            print(f"  {variant:5s} {rate:8.0f} txns/s   backend CPU {cpu:6.1f} µs/txn")


if __name__ == "__main__":
    main()
