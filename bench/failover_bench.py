"""Publisher failover: from the promotion of the standby to the first transaction applied from the new primary,
ours against PostgreSQL's own subscriber (issue 30: "no slower than native").

Method (each round on fresh clusters, so that every round starts alike)
------------------------------------------------------------------------
* A PostgreSQL primary and its physical standby (``pg_basebackup -R`` through slot ``standby1``,
  ``hot_standby_feedback = on``, ``sync_replication_slots = on``); the primary has ``synchronized_standby_slots =
  'standby1'``. A target cluster with two databases, both subscribed to publication ``p`` of database ``app``
  through the *same* multi-host conninfo ``host=127.0.0.1,127.0.0.1 port=P1,P2 ... target_session_attrs=read-write``:
  ``ours`` (``applier create --failover --two-phase``, then ``applier run`` with its defaults) and ``native``
  (``CREATE SUBSCRIPTION ... WITH (failover = true, two_phase = true)``, other options at their defaults).
* A small steady load on the primary (one one-row insert every ``--load-ms``, 20 ms by default) for ``--warm``
  seconds; then, load still running, wait until both targets hold the primary's last row, both slots are
  synchronized on the standby (``synced AND NOT temporary`` with ``confirmed_flush_lsn`` as far as the primary's)
  and the standby replayed the primary's WAL.
* ``pg_ctl stop -m immediate`` on the primary (the load writer fails and stops), ``pg_ctl promote -w`` on the
  standby, and at once one marker row inserted on the new primary. The clock starts when the promotion command
  returns; each target is polled every ``--poll-ms`` (20 ms) for the marker. Both subscribers face the same failover
  at the same moment; nothing is changed on either side after it (no ``alter``, no ``ALTER SUBSCRIPTION``).

What the figures are made of (printed under the table, from each side's log):

* Native: the apply worker exits on the lost connection; the launcher restarts it at once (its last start is long
  past), that worker fails to connect (the old primary is down, the standby not yet promoted: it refuses a
  read-write session), and the launcher starts it again only ``wal_retrieve_retry_interval`` (5 s by default, the
  value is printed) after the previous start. So native is about 5 s minus the time between its failed start and
  the promotion's return.
* Ours: the worker retries after ``applier.retry``'s backoff: 0.5 s (+ up to 0.5 s of jitter) after the first
  failure, doubling while failures follow each other, capped by ``--max-retry-interval`` (5 s default). The waits
  the worker chose are read from its log ("will retry in").

All clusters run with fsync off (``applier.testing``'s test settings): a failover is not I/O bound, and the crashed
primary is never started again.

    .venv/bin/python bench/failover_bench.py              # 3 rounds, PostgreSQL 18
    .venv/bin/python bench/failover_bench.py --rounds 1 --warm 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the project and the bench helpers importable
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import code_commit, loadavg, median  # noqa: E402

from applier.testing.cluster import Database, PostgresBinaries, PostgresCluster, find_binaries  # noqa: E402
from applier.testing.failover import multi_host_conninfo, slot_synced  # noqa: E402
from applier.testing.waits import wait_until  # noqa: E402

OUT_DIR = ROOT / "bench" / "out"
APPLIER = [sys.executable, "-m", "applier.cli"]
TIMEOUT = 90.0
MARKER_ID = 0
#: the issue's goal: ours/native at most this
GOAL_RATIO = 1.0


@dataclass
class Round:
    n: int
    ours_s: float | None = None
    native_s: float | None = None
    promote_s: float = 0.0  # the promotion command, from its start to its return
    crash_to_promoted_s: float = 0.0  # from the crash command's start to the promotion's return
    marker_s: float = 0.0  # the marker's commit on the new primary, after the promotion's return
    #: what each side did after the crash, as (seconds relative to the promotion's return, event)
    ours_events: list[tuple[float, str]] = field(default_factory=list)
    native_events: list[tuple[float, str]] = field(default_factory=list)


class Load(threading.Thread):
    """One one-row insert every ``interval`` seconds on the primary until it fails (the crash) or is stopped."""

    def __init__(self, dsn: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.interval = dsn, interval
        self.last = 0
        self.halt = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                n = 0
                while not self.halt.is_set():
                    n += 1
                    c.execute("INSERT INTO t (id, v) VALUES (%s, 'load')", (n,))
                    self.last = n
                    self.halt.wait(self.interval)
        except psycopg.Error as exc:
            self.error = str(exc).strip().splitlines()[0]


def wait_for(pred, what: str, timeout: float = TIMEOUT) -> None:  # type: ignore[no-untyped-def]
    wait_until(pred, timeout=timeout, what=what)


_OURS_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (.*)$")
_PG_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3}) (\w+) (.*)$")


def _epoch(stamp: str, ms: str, utc: bool) -> float:
    dt = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")
    if utc:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp() + int(ms) / 1000


def ours_events(log: str, since: float, zero: float) -> list[tuple[float, str]]:
    """Our worker's warnings and starts after ``since`` (epoch), relative to ``zero``."""
    out = []
    for line in log.splitlines():
        m = _OURS_TS.match(line)
        if not m:
            continue
        t = _epoch(m[1], m[2], utc=False)
        text = m[3]
        if t < since:
            continue
        if "will retry in" in text:
            wait = re.search(r"will retry in ([\d.]+) s: (.*)", text)
            if wait:
                out.append((t - zero, f"retry in {wait[1]} s ({wait[2][:90]})"))
        elif "started streaming" in text:
            out.append((t - zero, "started streaming" + (" (failed over)" if "failed over" in text else "")))
    return out


def native_events(server_log: str, since: float, zero: float) -> list[tuple[float, str]]:
    """The native apply worker's starts and errors (target server log) after ``since``, relative to ``zero``."""
    out = []
    for line in server_log.splitlines():
        m = _PG_TS.match(line)
        if not m:
            continue
        t = _epoch(m[1], m[2], utc=m[3] == "UTC")
        if t < since:
            continue
        text = m[4]
        if not any(k in text for k in ('"native"', "publisher", "logical replication", "WAL stream")):
            continue
        if "has started" in text:
            out.append((t - zero, "worker started"))
        else:
            out.append((t - zero, re.sub(r"\s+", " ", text.split(" ", 1)[-1])[:110]))
    return out


def one_round(
    n: int, binaries: PostgresBinaries, args: argparse.Namespace, logdir: Path
) -> tuple[Round, str]:
    r = Round(n)
    primary = PostgresCluster(binaries, name=f"fo{n}-primary").start()
    standby: PostgresCluster | None = None
    target = PostgresCluster(binaries, name=f"fo{n}-target").start()
    proc: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    ours_log = logdir / f"round{n}-ours.log"
    try:
        standby = primary.standby(
            f"fo{n}-standby", slot="standby1", settings={"sync_replication_slots": "on"}
        )
        primary.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
        primary.reload()
        retry = str(target.scalar("SHOW wal_retrieve_retry_interval"))
        pub = primary.create_database("app")
        pub.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE t")
        multi = multi_host_conninfo(primary, standby, "app")
        ours = target.create_database("ours")
        native = target.create_database("native")
        for db in (ours, native):
            db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        subprocess.run([*APPLIER, "--target", ours.dsn, "create", "s", "--publisher", multi, "--publication", "p",
                        "--failover", "--two-phase"], check=True, capture_output=True, cwd=ROOT)  # fmt: skip
        env = dict(os.environ, APPLIER_LOG_LEVEL="INFO", PYTHONPATH=str(ROOT))
        with open(ours_log, "wb") as f:
            proc = subprocess.Popen([*APPLIER, "--target", ours.dsn, "run", "s"], cwd=ROOT, env=env, stdout=f,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        native.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION native CONNECTION {} PUBLICATION p WITH (failover = true, two_phase = true)"
            ).format(sql.Literal(multi))
        )
        wait_for(lambda: ours.scalar("SELECT count(*) FROM applier.subscription WHERE subtwophasestate = 'e'") == 1,
                 "ours: two-phase enabled")  # fmt: skip
        wait_for(
            lambda: native.scalar("SELECT subtwophasestate FROM pg_subscription") == "e", "native: two-phase"
        )
        load = Load(pub.dsn, args.load_ms / 1000)
        load.start()
        time.sleep(args.warm)
        last = load.last
        for db in (ours, native):
            wait_for(lambda db=db: db.scalar("SELECT count(*) FROM t WHERE id = %s", (last,)) == 1,
                     f"{db.name} caught up")  # fmt: skip
        for slot in ("s", "native"):
            wait_for(lambda slot=slot: slot_synced(primary, standby, slot), f"slot {slot} synchronized")  # type: ignore[arg-type]
        wal = primary.scalar("SELECT pg_current_wal_lsn()::text")
        wait_for(lambda: standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (wal,)), "replayed")  # type: ignore[union-attr]

        # the failover
        # steady state: the native worker has run longer than wal_retrieve_retry_interval, so that the launcher
        # may restart it at once when it fails (as for any subscription up for more than a few seconds); ours has
        # applied transactions, which resets its backoff
        retry_s = float(target.scalar("SELECT setting::float / 1000 FROM pg_settings WHERE name = %s",
                                      ("wal_retrieve_retry_interval",)))  # fmt: skip

        def native_uptime() -> float:
            return float(native.scalar(
                "SELECT coalesce(max(extract(epoch FROM now() - a.backend_start)), 0) FROM pg_stat_subscription s"
                " JOIN pg_stat_activity a USING (pid) WHERE s.subname = 'native' AND s.relid IS NULL"))  # fmt: skip

        wait_for(lambda: native_uptime() > retry_s + 1, "the native worker up longer than wal_retrieve_retry_interval",
                 retry_s + 60)  # fmt: skip
        crash_wall = time.time()
        t_crash = time.monotonic()
        primary.crash()
        time.sleep(args.gap)
        t_promote = time.monotonic()
        standby.promote()
        t0 = time.monotonic()
        zero = time.time()
        r.promote_s, r.crash_to_promoted_s = t0 - t_promote, t0 - t_crash
        with psycopg.connect(Database(standby, "app").dsn, autocommit=True) as c:
            c.execute("INSERT INTO t (id, v) VALUES (%s, 'marker')", (MARKER_ID,))
        r.marker_s = time.monotonic() - t0
        polls = {"ours": psycopg.connect(ours.dsn, autocommit=True),
                 "native": psycopg.connect(native.dsn, autocommit=True)}  # fmt: skip
        seen: dict[str, float] = {}
        try:
            while len(seen) < 2 and time.monotonic() - t0 < TIMEOUT:
                for side, c in polls.items():
                    if (
                        side not in seen
                        and c.execute("SELECT 1 FROM t WHERE id = %s", (MARKER_ID,)).fetchone()
                    ):
                        seen[side] = time.monotonic() - t0
                time.sleep(args.poll_ms / 1000)
        finally:
            for c in polls.values():
                c.close()
        r.ours_s, r.native_s = seen.get("ours"), seen.get("native")
        load.join(5)
        time.sleep(0.2)  # the logs' last lines
        r.ours_events = ours_events(ours_log.read_text(errors="replace"), crash_wall - 1.0, zero)
        server_log = target.logfile.read_text(errors="replace")
        (logdir / f"round{n}-target-server.log").write_text(server_log)
        r.native_events = native_events(server_log, crash_wall - 1.0, zero)
        return r, retry
    finally:
        if load is not None:
            load.halt.set()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        target.destroy()
        if standby is not None:
            standby.destroy()
        primary.destroy()


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(rounds: list[Round], header: str) -> str:
    lines = [header, "", "| round | ours s | native s | ours/native | promote s | crash→promoted s | marker commit s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rounds:
        ratio = r.ours_s / r.native_s if r.ours_s is not None and r.native_s else None
        lines.append(f"| {r.n} | {fmt(r.ours_s)} | {fmt(r.native_s)} | {fmt(ratio)} | {r.promote_s:.2f} | "
                     f"{r.crash_to_promoted_s:.2f} | {r.marker_s:.3f} |")  # fmt: skip
    ours = [r.ours_s for r in rounds if r.ours_s is not None]
    native = [r.native_s for r in rounds if r.native_s is not None]
    mo, mn = median(ours), median(native)
    lines.append(f"| **median** | **{mo:.2f}** | **{mn:.2f}** | **{mo / mn:.2f}** | | | |")
    lines.append("")
    lines.append(f"Goal ours/native <= {GOAL_RATIO}: {'met' if mo / mn <= GOAL_RATIO else 'NOT met'}"
                 f" ({len(ours)}/{len(rounds)} ours, {len(native)}/{len(rounds)} native reached the marker)")  # fmt: skip
    lines.append("")
    lines.append("Events after the crash, in seconds from the promotion's return (negative: before it):")
    for r in rounds:
        lines.append(f"  round {r.n}:")
        for side, events in (("ours", r.ours_events), ("native", r.native_events)):
            for t, what in events:
                lines.append(f"    {side:6} {t:+6.2f}  {what}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="failovers, each on fresh clusters (default 3)")
    ap.add_argument(
        "--pg", default="18", help="server version or a bindir (18: failover slots with two-phase)"
    )
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of load before the failover (default 3)")
    ap.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds between the crash and the promotion command "
        "(default 0: promoted at once; a failover manager takes longer to decide)",
    )
    ap.add_argument("--load-ms", type=float, default=20.0, help="one insert every this many ms (default 20)")
    ap.add_argument(
        "--poll-ms", type=float, default=20.0, help="poll each target every this many ms (default 20)"
    )
    ap.add_argument(
        "--out", type=Path, default=OUT_DIR / "failover_bench.md", help="the report, also printed"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binaries = find_binaries(args.pg)
    if binaries.major < 18:
        print(f"failover slots with two-phase need PostgreSQL 18 (got {binaries.major})", file=sys.stderr)
        return 2
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    logdir = args.out.parent / "failover_bench_logs"  # ours' log and the target server's, per round
    logdir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    load_start = loadavg()
    rounds: list[Round] = []
    retry = "?"
    for n in range(1, args.rounds + 1):
        r, retry = one_round(n, binaries, args, logdir)
        print(f"round {n}: ours {fmt(r.ours_s)} s, native {fmt(r.native_s)} s", file=sys.stderr, flush=True)
        rounds.append(r)
    version = ".".join(str(binaries.major).split(".")[:1])
    header = (f"{started:%Y-%m-%d %H:%M} UTC; PostgreSQL {version}; Python {platform.python_version()}; commit "
              f"{code_commit(ROOT)}; {os.cpu_count()} CPUs (shared machine); load {load_start[0]:.1f} at start, "
              f"{loadavg()[0]:.1f} at end; target wal_retrieve_retry_interval = {retry}; ours: applier run defaults "
              f"(backoff 0.5 s doubling, cap 5 s); crash-to-promote gap {args.gap:g} s; load one insert / {args.load_ms:g} ms, poll {args.poll_ms:g} ms")  # fmt: skip
    report = render(rounds, header)
    print("\n" + report)
    args.out.write_text(report + "\n")
    ok = all(r.ours_s is not None and r.native_s is not None for r in rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
