"""Apply rate on a backlog: our worker against PostgreSQL's native subscriber, same machine, same run.

Method (shared/reference/benchmarking-native.md, which records what went wrong on this machine before):

* One publisher cluster and one target cluster. Every repetition of a workload gets fresh databases: one on the
  publisher, and two on the target — ``<tag>_native`` for a native ``CREATE SUBSCRIPTION`` and ``<tag>_ours`` for
  our subscription. Each subscriber has its own slot on the same publication (plus a third slot for
  ``pg_recvlogical``), all created *before* the workload, so all see exactly the same backlog.
* The workload runs on the publisher with nobody applying; a marker row is committed last.
* Then each subscriber is started in turn — native first in even repetitions, ours first in odd ones, so neither
  always gets the warmer caches — and timed until the marker row is visible on its target (polled every 10 ms;
  transactions apply in commit order, so the marker means everything before it is there too).
* Contents are verified outside the timed part: count + md5 of every row in key order, per table, on all three.
* ``pg_recvlogical`` from the same bindir reads the same backlog through a third slot, to ``/dev/null``: a reference
  consumer that does no apply work. It is not a ceiling: its time includes its own start and connection, and it
  writes every message with a system call, so both subscribers can beat it (small transactions, for one).

Why one target cluster with two databases rather than two clusters: both subscribers then write through the very
same server — same binary, settings, shared buffers, WAL device and fsync behaviour — so a difference is the apply
client's and not a configuration's or a cache's. They never run at the same time, and a CHECKPOINT before each timed
run keeps one from paying for the other's dirty buffers. A second cluster would add nothing but another set of
background processes on a 2-core machine and a way for settings to drift apart.

Clocks. ``apply`` is from the moment the subscriber's slot turns active on the publisher (``START_REPLICATION``
accepted: the worker is connected and has read its state) until the marker is visible; that point exists for both
and leaves out start-up costs that are not apply work — a Python interpreter plus ``applier run`` spawning its worker
process (1-4 s on this loaded machine) vs a forked background worker. ``start`` (launch to slot active) is reported separately.

Settings (both clusters ``durable=True``, i.e. fsync on, as in production): ``autovacuum = off``, ``max_wal_size =
8GB`` and ``checkpoint_timeout = 1h``, so neither an autovacuum run nor a checkpoint lands at random inside one
subscriber's timed window (explicit CHECKPOINTs come before each run instead). The publisher runs with ``fsync =
off``: it only affects how fast the (untimed) workload is generated — its WAL, full-page writes included, is the
same — and thousands of prepared transactions at two flushes each would otherwise take minutes to *generate*.

Workloads (default sizes; flags change each): ``inserts`` (30 transactions of a 10,000-row INSERT ... SELECT),
``small`` (40,000 transactions of one UPDATE + one INSERT), ``prepared`` (10,000 of the same as prepared
transactions, each committed or, every 10th, rolled back right after its PREPARE; two-phase on both sides; native is
fsync-bound, hence fewer; ours folds them, since each decision arrives with its transaction, unless
``APPLIER_FOLD_PREPARES=0`` is in the environment), ``streamed`` (one 1,000,000-row INSERT,
streamed: the publisher database's ``logical_decoding_work_mem`` is lowered to 16MB so that it streams, which
``pg_stat_replication_slots.stream_txns`` confirms). Peak RSS of our worker process (``VmHWM`` of the process
``applier run`` spawns) and of the native apply worker are read from ``/proc`` before they stop.

Besides the rates, each side's costs per unit are reported, because on a shared machine they are steadier than
wall-clock rates and say *why* a rate is what it is: CPU of the apply process(es) from slot active to the marker (ours:
the Python worker and the target backend it drives), CPU of the publisher's walsender, and what the target wrote
while that side ran alone (local transaction ends and WAL bytes from ``pg_waldump --stats``, WAL fsyncs from
``pg_stat_io``). ``--target-conf fsync=off`` shows what is CPU and what is flush; ``--profile-dir`` runs our worker
under py-spy (``--idle``, so waits show) and prints where the apply loop's time goes.

    .venv/bin/python bench/apply_bench.py --quick             # ~1 minute, one repetition, small sizes
    .venv/bin/python bench/apply_bench.py                     # default sizes, 3 repetitions (~10 minutes)
    .venv/bin/python bench/apply_bench.py --workloads small --reps 1 --profile-dir bench/out/prof   # py-spy
    .venv/bin/python bench/apply_bench.py --workloads prepared --reps 1 --target-conf fsync=off     # CPU only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
#: Where ``applier``, ``state`` and ``tablesync`` are imported from, here and in the worker processes: the work tree,
#: or with ``--code-rev`` a frozen ``git archive`` of one commit (see :func:`_freeze_code`).
CODE_ROOT = Path(os.environ.get("APPLY_BENCH_CODE_ROOT", ROOT))
if __package__ in (None, ""):  # run as a script: make the project and the bench helpers importable
    sys.path.insert(0, str(CODE_ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PeakTracker,
    cmdline,
    code_commit,
    descendants,
    fingerprint,
    loadavg,
    median,
    proc_sample,
    rerun_frozen,
    wal_fsyncs,
    waldump_stats,
)
from _native import NativeSubscription  # noqa: E402

from applier.apply.testing import setup_subscription  # noqa: E402
from applier.testing.cluster import Database, PostgresCluster, find_binaries  # noqa: E402

OUT_DIR = ROOT / "bench" / "out"
POLL_S = 0.01
SAMPLE_S = 0.1
TABLES = ("bulk", "accounts", "history", "bench_marker")
ACCOUNTS = 1000

SCHEMA: list[str | sql.Composable] = [
    "CREATE TABLE bulk (id bigint PRIMARY KEY, k integer NOT NULL, v text NOT NULL, ts timestamptz NOT NULL)",
    "CREATE TABLE accounts (id integer PRIMARY KEY, balance bigint NOT NULL, note text NOT NULL)",
    "CREATE TABLE history (id bigint PRIMARY KEY, account integer NOT NULL, delta integer NOT NULL,"
    " note text NOT NULL)",
    "CREATE TABLE bench_marker (id integer PRIMARY KEY, note text NOT NULL)",
    sql.SQL("INSERT INTO accounts SELECT g, 0, md5(g::text) FROM generate_series(1, {}) g").format(ACCOUNTS),
]
INSERT_BULK = (
    "INSERT INTO bulk SELECT g, g %% 1000, md5(g::text), timestamptz '2025-01-01 00:00:00+00' + g * interval '1 s'"
    " FROM generate_series(%s::bigint, %s::bigint) g"
)

# --- sizes and workloads ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Workload sizes (flags override each one)."""

    insert_txns: int = 30
    insert_rows: int = 10_000
    # Sized so that the faster side's timed run lasts about 0.4 s or more: native applies 70,000-120,000 small
    # transactions a second here, and 20,000 (0.2 s) gave ratios from 0.56 to 1.07 within one run.
    small_txns: int = 40_000
    # Fewer than the small ones: native flushes twice per prepared transaction (PREPARE and COMMIT PREPARED),
    # 2,500-4,000 transactions/s here; ours folds them (20,000+/s), so 3,000 gave it a 0.15 s run.
    prepared_txns: int = 10_000
    stream_rows: int = 1_000_000
    stream_work_mem: str = "16MB"


QUICK = Sizes(insert_txns=5, small_txns=5_000, prepared_txns=500, stream_rows=100_000, stream_work_mem="1MB")


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    unit: str  # what a rate counts: rows or txns
    two_phase: bool
    streaming: bool
    goal: float  # ours/native ratio the issue asks for
    units: Callable[[Sizes], int]
    txns: Callable[[Sizes], int]  # remote transactions in the backlog, the marker's not counted
    generate: Callable[[psycopg.Connection, Sizes], None]


def _gen_inserts(c: psycopg.Connection, s: Sizes) -> None:
    for i in range(s.insert_txns):
        c.execute(INSERT_BULK, (i * s.insert_rows + 1, (i + 1) * s.insert_rows))


def _gen_small(c: psycopg.Connection, s: Sizes) -> None:
    """Server-side, one COMMIT per iteration: 20,000 client round trips would make generation slower than apply."""
    c.execute("SET synchronous_commit = off")
    c.execute(
        sql.SQL(
            "DO $$ BEGIN FOR i IN 1..{n} LOOP"
            " UPDATE accounts SET balance = balance + (i % 7) - 3 WHERE id = i % {a} + 1;"
            " INSERT INTO history VALUES (i, i % {a} + 1, (i % 7) - 3, md5(i::text));"
            " COMMIT; END LOOP; END $$"
        ).format(n=sql.Literal(s.small_txns), a=sql.Literal(ACCOUNTS))
    )


def _gen_prepared(c: psycopg.Connection, s: Sizes) -> None:
    """PREPARE TRANSACTION cannot run in PL/pgSQL, so this one is client-side, pipelined; COMMIT/ROLLBACK PREPARED
    get a sync point of their own (they cannot share an implicit transaction)."""
    upd = "UPDATE accounts SET balance = balance + %s WHERE id = %s"
    ins = "INSERT INTO history VALUES (%s, %s, %s, md5(%s::text))"
    with c.pipeline() as p:
        for i in range(1, s.prepared_txns + 1):
            gid = sql.Literal(f"bench_{i}")
            acct, delta = i % ACCOUNTS + 1, (i % 7) - 3
            c.execute("BEGIN")
            c.execute(upd, (delta, acct))
            c.execute(ins, (i, acct, delta, i))
            c.execute(sql.SQL("PREPARE TRANSACTION {}").format(gid))
            p.sync()
            verb = "ROLLBACK PREPARED {}" if i % 10 == 0 else "COMMIT PREPARED {}"
            c.execute(sql.SQL(verb).format(gid))
            p.sync()


def _gen_streamed(c: psycopg.Connection, s: Sizes) -> None:
    c.execute(INSERT_BULK, (1, s.stream_rows))


WORKLOADS: dict[str, Workload] = {
    w.key: w
    for w in (
        Workload("inserts", "10k-row insert txns", "rows", False, False, 1.0,
                 lambda s: s.insert_txns * s.insert_rows, lambda s: s.insert_txns, _gen_inserts),
        Workload("small", "update+insert txns", "txns", False, False, 0.7,
                 lambda s: s.small_txns, lambda s: s.small_txns, _gen_small),
        Workload("prepared", "prepared txns, 10% rolled back", "txns", True, False, 0.9,
                 lambda s: s.prepared_txns, lambda s: s.prepared_txns, _gen_prepared),
        Workload("streamed", "one streamed txn", "rows", False, True, 1.0,
                 lambda s: s.stream_rows, lambda s: 1, _gen_streamed),
    )
}  # fmt: skip
RSS_GOAL_MB = 300

# --- results ----------------------------------------------------------------------------------------------------


@dataclass
class SideRun:
    """One subscriber's timed pass over one backlog."""

    side: str  # "native" | "ours"
    ok: bool = False
    error: str | None = None
    start_s: float = float("nan")  # launch until the slot is active
    apply_s: float = float("nan")  # slot active until the marker is visible
    load1: float = float("nan")  # 1-minute load average at launch
    # CPU from slot active to marker visible: native: the apply worker; ours: our Python worker process
    worker_cpu_s: float | None = None
    backend_cpu_s: float | None = None  # ours only: the target backend our worker drives
    worker_sys_s: float | None = None  # the system-time part of worker_cpu_s (JSON only)
    backend_sys_s: float | None = None
    walsender_cpu_s: float | None = None  # the publisher's walsender (decoding) for this slot
    worker_hwm_kb: int | None = None
    worker_anon_peak_kb: int | None = None
    backend_hwm_kb: int | None = None
    stream_txns: int | None = None
    verified: bool | None = None
    worker_errors: list[str] = field(default_factory=list)  # ours: ERROR lines logged (a retried session)
    # what the target cluster wrote while this side ran alone (after its CHECKPOINT, until it stopped)
    wal_bytes: int | None = None
    wal_fsyncs: int | None = None
    wal_records: dict[str, int] = field(default_factory=dict)  # pg_waldump --stats=record

    def local_xacts(self) -> int | None:
        """Local transaction ends written: commits, prepares, commit/rollback prepared, aborts."""
        if not self.wal_records:
            return None
        n = sum(n for k, n in self.wal_records.items() if k.startswith("Transaction/") and k.split("/")[1] in
                ("COMMIT", "PREPARE", "COMMIT_PREPARED", "ABORT_PREPARED", "ABORT"))  # fmt: skip
        # the window also holds our own ALTER SUBSCRIPTION ... ENABLE and DISABLE: not the worker's doing
        return n - 2 if self.side == "native" else n


@dataclass
class RepResult:
    workload: str
    rep: int
    units: int
    txns: int  # remote transactions, the marker's included
    order: list[str]
    sides: dict[str, SideRun] = field(default_factory=dict)
    decode_s: float | None = None
    generate_s: float = float("nan")
    notes: list[str] = field(default_factory=list)

    def rate(self, side: str) -> float | None:
        r = self.sides.get(side)
        return self.units / r.apply_s if r is not None and r.ok and r.verified else None


# --- one subscriber's timed run --------------------------------------------------------------------------------


class _Poller:
    """The timed wait: slot active on the publisher (start of ``apply``), then the marker on the target."""

    def __init__(self, pub: Database, side_db: Database, slot: str) -> None:
        self.pub = pub.connect()
        self.tgt = side_db.connect()
        self.slot = slot

    def close(self) -> None:
        self.pub.close()
        self.tgt.close()

    def slot_pid(self) -> int | None:
        row = self.pub.execute(
            "SELECT active_pid FROM pg_catalog.pg_replication_slots WHERE slot_name = %s", (self.slot,)
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else None

    def wait(
        self, launched: float, timeout: float, tick: Callable[[float, bool], None]
    ) -> tuple[float, float]:
        """Returns (slot active, marker visible) as monotonic times; ``tick(now, active)`` runs between polls."""
        active: float | None = None
        deadline = launched + timeout
        while True:
            if active is None and self.slot_pid() is not None:
                active = time.monotonic()
            if self.tgt.execute("SELECT EXISTS (SELECT FROM bench_marker WHERE id = 1)").fetchone()[0]:  # type: ignore[index]
                done = time.monotonic()
                return (active if active is not None else done), done
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the marker did not arrive within {timeout:.0f}s")
            tick(now, active is not None)
            time.sleep(POLL_S)

    def wait_slot_inactive(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.slot_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.05)

    def slot_stream_txns(self, expect: bool) -> int | None:
        """``stream_txns`` of the slot; the walsender reports it when it exits, so wait a little for it."""
        deadline = time.monotonic() + (3.0 if expect else 0.5)
        while True:
            row = self.pub.execute(
                "SELECT stream_txns FROM pg_catalog.pg_stat_replication_slots WHERE slot_name = %s",
                (self.slot,),
            ).fetchone()
            value = int(row[0]) if row and row[0] is not None else None
            if (value or not expect) or time.monotonic() > deadline:
                return value
            time.sleep(0.1)


class _TargetWindow:
    """What the target cluster writes while one side runs: WAL bytes, WAL fsyncs, and WAL records by type.

    Opened after the side's CHECKPOINT, closed after the side has stopped (its processes report their I/O counts
    when they exit) and before the next CHECKPOINT can recycle the segments ``pg_waldump`` reads."""

    def __init__(self, tgtc: PostgresCluster, waldump: bool) -> None:
        self.tgtc = tgtc
        self.waldump = waldump
        with tgtc.connect() as c:
            self.lsn = str(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            self.fsyncs = wal_fsyncs(c)

    def close(self, run: SideRun) -> None:
        time.sleep(1.0)  # walwriter reports its counts at most once a second
        with self.tgtc.connect() as c:
            end = str(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            run.wal_bytes = int(
                c.execute(
                    "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (end, self.lsn)
                ).fetchone()[0]  # type: ignore[index]
            )
            fsyncs = wal_fsyncs(c)
        if fsyncs is not None and self.fsyncs is not None:
            run.wal_fsyncs = fsyncs - self.fsyncs
        if self.waldump:
            run.wal_records = waldump_stats(
                str(self.tgtc.binaries.bindir),
                str(self.tgtc.datadir / "pg_wal"),
                self.lsn,
                end,  # type: ignore[operator]
            )


@dataclass
class _Ctx:
    """What one repetition's runs share."""

    pubc: PostgresCluster
    tgtc: PostgresCluster
    pub: Database
    tag: str
    workload: Workload
    timeout: float
    profile_dir: Path | None
    log_dir: Path
    spool_root: Path
    waldump: bool
    profile_idle: bool


def _run_native(ctx: _Ctx, db: Database, sub: NativeSubscription) -> SideRun:
    run = SideRun("native")
    poller = _Poller(ctx.pub, db, sub.slot)
    peaks = PeakTracker()
    pid: int | None = None
    last_sample = 0.0

    def tick(now: float, active: bool) -> None:
        nonlocal pid, last_sample
        if pid is None:
            pid = sub.worker_pid(poller.tgt)
        if pid is not None and active and pid not in peaks.base_cpu:
            peaks.mark_base([pid])
        if pid is not None and now - last_sample >= SAMPLE_S:
            last_sample = now
            peaks.sample([pid])

    window: _TargetWindow | None = None
    try:
        ctx.tgtc.execute("CHECKPOINT")
        window = _TargetWindow(ctx.tgtc, ctx.waldump)
        run.load1 = loadavg()[0]
        launched = time.monotonic()
        sub.enable()
        active, done = poller.wait(launched, ctx.timeout, tick)
        run.start_s, run.apply_s = active - launched, done - active
        pid = pid or sub.worker_pid(poller.tgt)
        wal_pid = poller.slot_pid()
        if pid is not None:
            peaks.sample([pid])
            run.worker_cpu_s = peaks.cpu_since_base(pid)
            run.worker_sys_s = peaks.sys_since_base(pid)
            run.worker_hwm_kb = peaks.last[pid].vm_hwm_kb
            run.worker_anon_peak_kb = peaks.anon_peak_kb[pid]
        if wal_pid is not None and (ws := proc_sample(wal_pid)) is not None:
            run.walsender_cpu_s = ws.cpu_s
        run.ok = True
        if ctx.workload.two_phase and (state := sub.two_phase_state()) != "e":
            run.error = f"native two-phase state is {state!r}, not 'e'"
    except Exception as exc:  # noqa: BLE001 - reported in the table, the benchmark goes on
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        sub.disable()
        poller.wait_slot_inactive()
        run.stream_txns = poller.slot_stream_txns(ctx.workload.streaming and run.ok)
        poller.close()
        if window is not None:
            window.close(run)
    return run


def _ours_command(db: Database, name: str, profile: Path | None, idle: bool) -> list[str]:
    """``applier run NAME``, under py-spy when profiling: with ``--idle`` the profile is of wall time (waits on
    the sockets show), without it of CPU time."""
    cmd = [sys.executable, "-m", "applier.cli", "--target", db.dsn, "run", name]
    if profile is None:
        return cmd
    pyspy = Path(sys.executable).with_name("py-spy")
    return [str(pyspy), "record", "--subprocesses", *(["--idle"] if idle else []), "--rate", "250", "--format", "raw",
            "-o", str(profile), "--", *cmd]  # fmt: skip


def _find_worker(root: int) -> tuple[int | None, int | None]:
    """(the ``applier run`` parent, the worker process it spawned) below ``root`` (which may be py-spy)."""
    cli: int | None = None
    worker: int | None = None
    for pid in [root, *descendants(root)]:
        line = cmdline(pid)
        if "applier.cli" in line and "py-spy" not in line:
            cli = pid
        elif "spawn_main" in line:
            worker = pid
    return cli, worker


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_ours(ctx: _Ctx, db: Database, name: str) -> SideRun:
    run = SideRun("ours")
    poller = _Poller(ctx.pub, db, name)
    peaks = PeakTracker()
    log_path = ctx.log_dir / f"{name}_ours.log"
    profile = ctx.profile_dir / f"{name}.txt" if ctx.profile_dir else None
    # A private TMPDIR gives our worker a spool directory of its own: the default one is shared by every worker
    # of this OS user and keyed by subid only, and other processes on this machine (tests) use subid 1 too.
    env = dict(
        os.environ,
        APPLIER_LOG_LEVEL=os.environ.get("APPLIER_LOG_LEVEL", "WARNING"),
        TMPDIR=str(ctx.spool_root),
        PYTHONPATH=str(CODE_ROOT),  # ahead of the editable install's finder, which comes last
    )
    app_name = f"applier {name}"
    worker: int | None = None
    backend: int | None = None
    last_find = last_sample = 0.0
    proc: subprocess.Popen[bytes] | None = None

    def tick(now: float, active: bool) -> None:
        nonlocal worker, backend, last_find, last_sample
        assert proc is not None
        if proc.poll() is not None:
            raise RuntimeError(f"applier run exited with status {proc.returncode}:\n{_tail(log_path)}")
        if worker is None and (active or now - last_find >= 0.05):
            last_find = now
            worker = _find_worker(proc.pid)[1]
        if backend is None:
            row = poller.tgt.execute(
                "SELECT pid FROM pg_catalog.pg_stat_activity WHERE application_name = %s", (app_name,)
            ).fetchone()
            backend = int(row[0]) if row else None
        if active:  # CPU from here on is apply work, not interpreter start-up and imports
            peaks.mark_base([p for p in (worker, backend) if p is not None and p not in peaks.base_cpu])
        if now - last_sample >= SAMPLE_S:
            last_sample = now
            peaks.sample([p for p in (worker, backend) if p is not None])

    window: _TargetWindow | None = None
    try:
        ctx.tgtc.execute("CHECKPOINT")
        window = _TargetWindow(ctx.tgtc, ctx.waldump)
        run.load1 = loadavg()[0]
        with open(log_path, "wb") as log_file:
            launched = time.monotonic()
            proc = subprocess.Popen(_ours_command(db, name, profile, ctx.profile_idle), cwd=CODE_ROOT, env=env, stdout=log_file,
                                    stderr=subprocess.STDOUT)  # fmt: skip
            try:
                active, done = poller.wait(launched, ctx.timeout, tick)
                run.start_s, run.apply_s = active - launched, done - active
                worker = worker or _find_worker(proc.pid)[1]
                backend = None  # found again: a worker that restarted its session has a new backend
                tick(time.monotonic() + SAMPLE_S, True)
                wal_pid = poller.slot_pid()
                if worker is not None and worker in peaks.last:
                    run.worker_cpu_s = peaks.cpu_since_base(worker)
                    run.worker_sys_s = peaks.sys_since_base(worker)
                    run.worker_hwm_kb = peaks.last[worker].vm_hwm_kb
                    run.worker_anon_peak_kb = peaks.anon_peak_kb[worker]
                if backend is not None and backend in peaks.last:
                    run.backend_cpu_s = peaks.cpu_since_base(backend)
                    run.backend_sys_s = peaks.sys_since_base(backend)
                    run.backend_hwm_kb = peaks.last[backend].vm_hwm_kb
                if wal_pid is not None and (ws := proc_sample(wal_pid)) is not None:
                    run.walsender_cpu_s = ws.cpu_s
                run.ok = True
            finally:
                _stop_ours(proc)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the benchmark goes on
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        run.worker_errors = _logged_errors(log_path)
        poller.wait_slot_inactive()
        run.stream_txns = poller.slot_stream_txns(ctx.workload.streaming and run.ok)
        poller.close()
        if window is not None:
            window.close(run)
    return run


def _logged_errors(path: Path) -> list[str]:
    """ERROR lines of our worker's log: a session that failed and was retried still ends with the right data,
    but its time includes the retry, so the table must say so."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.split(" ERROR ", 1)[1][:300] for line in lines if " ERROR " in line]


def _stop_ours(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``applier run`` (its documented clean stop); under py-spy, to the CLI below it, so py-spy
    writes its profile when its child exits."""
    if proc.poll() is not None:
        return
    cli = _find_worker(proc.pid)[0] or proc.pid
    try:
        os.kill(cli, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    except ProcessLookupError:
        proc.wait(10)


def _run_decode(ctx: _Ctx, slot: str, end_lsn: str, bindir: Path) -> float:
    """``pg_recvlogical`` over the same backlog to ``/dev/null``, launch included: a reference consumer's rate."""
    wl = ctx.workload
    cmd = [str(bindir / "pg_recvlogical"), "-d", ctx.pub.dsn, "--slot", slot, "--start", "--endpos", end_lsn,
           "--no-loop", "-f", "/dev/null", "-o", "proto_version=4", "-o", f"publication_names={ctx.tag}"]  # fmt: skip
    if wl.streaming:
        cmd += ["-o", "streaming=on"]
    if wl.two_phase:
        cmd += ["-o", "two_phase=on"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.timeout)
    elapsed = time.monotonic() - t0
    if res.returncode != 0:
        raise RuntimeError(f"pg_recvlogical failed ({res.returncode}): {res.stderr.strip()}")
    return elapsed


# --- one repetition ---------------------------------------------------------------------------------------------


def run_repetition(pubc: PostgresCluster, tgtc: PostgresCluster, wl: Workload, sizes: Sizes, rep: int,
                   args: argparse.Namespace) -> RepResult:  # fmt: skip
    tag = f"ab_{wl.key}_{rep}"
    units = wl.units(sizes)
    order = ["native", "ours"] if rep % 2 == 0 else ["ours", "native"]
    result = RepResult(wl.key, rep, units, wl.txns(sizes) + 1, order)
    pub = pubc.create_database(tag)
    nat_db = tgtc.create_database(f"{tag}_native")
    ours_db = tgtc.create_database(f"{tag}_ours")
    native: NativeSubscription | None = None
    subid: int | None = None
    try:
        for db in (pub, nat_db, ours_db):
            with db.connect() as c:
                for stmt in SCHEMA:
                    c.execute(stmt)
        if wl.streaming:
            pub.execute(
                sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = {}").format(
                    sql.Identifier(tag), sql.Literal(sizes.stream_work_mem)
                )
            )
        setup = setup_subscription(pub, ours_db, tag, [f"public.{t}" for t in TABLES],
                                   two_phase_state="e" if wl.two_phase else "d",
                                   streaming="on" if wl.streaming else "off")  # fmt: skip
        subid = setup.sub.subid
        setup.catalog.engine.dispose()
        for slot in (f"{tag}_native", f"{tag}_decode"):
            pub.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (slot, wl.two_phase)
            )
        native = NativeSubscription(nat_db.dsn, f"{tag}_native", f"{tag}_native", tag, pub.dsn, wl.two_phase,
                                    "on" if wl.streaming else "off")  # fmt: skip
        native.create()

        t0 = time.monotonic()
        with pub.connect() as c:
            wl.generate(c, sizes)
            c.execute("INSERT INTO bench_marker VALUES (1, 'end of backlog')")
            end_lsn = str(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        result.generate_s = time.monotonic() - t0
        pubc.execute("CHECKPOINT")

        ctx = _Ctx(pubc, tgtc, pub, tag, wl, args.timeout, args.profile_dir, OUT_DIR, args.spool_root,
                   not args.no_waldump, args.profile_what == "wall")  # fmt: skip
        for side in order:
            if side == "native":
                result.sides[side] = _run_native(ctx, nat_db, native)
            else:
                result.sides[side] = _run_ours(ctx, ours_db, tag)
            _progress(wl, result, result.sides[side])
        if not args.no_decode:
            try:
                result.decode_s = _run_decode(ctx, f"{tag}_decode", end_lsn, Path(pubc.binaries.bindir))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                result.notes.append(f"pg_recvlogical: {exc}")

        _verify(pub, {"native": nat_db, "ours": ours_db}, result)
    finally:
        if native is not None:
            native.drop()
        if subid is not None:
            try:
                ours_db.execute("SELECT pg_replication_origin_drop(%s)", (f"applier_{subid}",))
            except psycopg.Error as exc:
                result.notes.append(f"could not drop origin applier_{subid}: {exc}")
        for cluster, name in ((tgtc, nat_db.name), (tgtc, ours_db.name), (pubc, pub.name)):
            cluster.drop_database(name)
    return result


def _verify(pub: Database, sides: dict[str, Database], result: RepResult) -> None:
    """Count + content hash per table, publisher against each subscriber; no prepared transaction left behind."""
    with pub.connect() as c:
        want = {t: fingerprint(c, t) for t in TABLES}
    for side, db in sides.items():
        run = result.sides.get(side)
        if run is None or not run.ok:
            continue
        with db.connect() as c:
            got = {t: fingerprint(c, t) for t in TABLES}
            leftover = c.execute(
                "SELECT count(*) FROM pg_catalog.pg_prepared_xacts WHERE database = current_database()"
            ).fetchone()[0]  # type: ignore[index]
        bad = [f"{t}: {got[t][0]} rows vs {want[t][0]}" for t in TABLES if got[t] != want[t]]
        if leftover:
            bad.append(f"{leftover} prepared transaction(s) left")
        run.verified = not bad
        if bad:
            run.error = (run.error + "; " if run.error else "") + "MISMATCH " + ", ".join(bad)
    if result.workload == "streamed":
        for side in sides:
            run = result.sides.get(side)
            if run is not None and run.ok and not run.stream_txns:
                result.notes.append(
                    f"{side}: the transaction was NOT streamed (stream_txns={run.stream_txns})"
                )


def _progress(wl: Workload, result: RepResult, run: SideRun) -> None:
    if run.ok and run.apply_s == run.apply_s:
        rate = f"{result.units / run.apply_s:10.0f} {wl.unit}/s in {run.apply_s:6.2f}s (start {run.start_s:.2f}s)"
    else:
        rate = "FAILED"
    extra = f" error: {run.error}" if run.error else ""
    print(f"  {wl.key:9} rep {result.rep} {run.side:6} {rate} load {run.load1:.1f}{extra}", file=sys.stderr,
          flush=True)  # fmt: skip


# --- the report -------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    """Medians over the repetitions of one workload (the ratio: median of per-repetition ratios, each from one
    alternating pair run minutes apart, which cancels most of the machine's drift)."""

    workload: Workload
    units: int
    reps: int
    rates: dict[str, float | None]  # side -> median rate
    ratio: float | None
    ratios: list[float]
    decode: float | None
    start: dict[str, float | None]
    cpu_us: dict[str, float | None]  # CPU per unit: native worker, ours worker, ours backend, walsenders
    wal: dict[
        str, dict[str, float | None]
    ]  # side -> local xacts and fsyncs per remote xact, WAL bytes per unit
    hwm_mb: dict[str, float | None]
    stream_txns: str
    load: str
    failures: list[str]


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return median(vals) if vals else None


def _max(values: list[int | None], scale: float) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) * scale if vals else None


def summarize(wl: Workload, reps: list[RepResult]) -> Summary:
    def runs(side: str) -> list[tuple[SideRun, int]]:
        return [(r.sides[side], r.units) for r in reps if side in r.sides and r.sides[side].ok]

    def per_unit(
        side: str, value: Callable[[SideRun], float | int | None], scale: float = 1.0
    ) -> float | None:
        return _med([v * scale / u if (v := value(s)) is not None else None for s, u in runs(side)])

    def per_txn(side: str, value: Callable[[SideRun], float | int | None]) -> float | None:
        return _med([v / r.txns if side in r.sides and (v := value(r.sides[side])) is not None else None
                     for r in reps])  # fmt: skip

    ratios = [o / n for r in reps if (o := r.rate("ours")) and (n := r.rate("native"))]
    failures = [f"rep {r.rep} {s.side}: {s.error}" for r in reps for s in r.sides.values() if s.error]
    failures += [f"rep {r.rep}: {n}" for r in reps for n in r.notes]
    failures += [f"rep {r.rep} {s.side} logged (its time includes a retried session): {e}"
                 for r in reps for s in r.sides.values() for e in s.worker_errors[:2]]  # fmt: skip
    loads = [s.load1 for r in reps for s in r.sides.values()]
    sides = ("native", "ours")
    return Summary(
        workload=wl, units=reps[0].units, reps=len(reps),
        rates={side: _med([r.rate(side) for r in reps]) for side in sides},
        ratio=_med(ratios), ratios=ratios,  # type: ignore[arg-type]
        decode=_med([r.units / r.decode_s if r.decode_s else None for r in reps]),
        start={side: _med([s.start_s for s, _ in runs(side)]) for side in sides},
        cpu_us={
            "native": per_unit("native", lambda s: s.worker_cpu_s, 1e6),
            "ours": per_unit("ours", lambda s: s.worker_cpu_s, 1e6),
            "ours_backend": per_unit("ours", lambda s: s.backend_cpu_s, 1e6),
            "native_walsender": per_unit("native", lambda s: s.walsender_cpu_s, 1e6),
            "ours_walsender": per_unit("ours", lambda s: s.walsender_cpu_s, 1e6),
        },
        wal={side: {"xacts": per_txn(side, SideRun.local_xacts), "fsyncs": per_txn(side, lambda s: s.wal_fsyncs),
                    "bytes": per_unit(side, lambda s: s.wal_bytes)} for side in sides},
        hwm_mb={
            "native": _max([s.worker_hwm_kb for s, _ in runs("native")], 1 / 1024),
            "native_anon": _max([s.worker_anon_peak_kb for s, _ in runs("native")], 1 / 1024),
            "ours": _max([s.worker_hwm_kb for s, _ in runs("ours")], 1 / 1024),
            "ours_backend": _max([s.backend_hwm_kb for s, _ in runs("ours")], 1 / 1024),
        },
        stream_txns=" ".join(f"{s.side}={s.stream_txns}" for r in reps for s in r.sides.values()),
        load=f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?",
        failures=failures,
    )  # fmt: skip


def _f(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def _table(head: list[str], rows: list[list[str]], md: bool) -> list[str]:
    if md:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
            "| " + " | ".join(r) + " |" for r in rows
        ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]]


def render(summaries: list[Summary], md: bool) -> str:
    """The results: rates and ratios against the goals, then where each side spends (CPU, local transactions,
    fsyncs, WAL per unit), then peak memory for the streamed transaction and any problem."""
    rows = []
    for s in summaries:
        wl = s.workload
        verdict = "?" if s.ratio is None else ("PASS" if s.ratio >= wl.goal else "FAIL")
        spread = f" ({min(s.ratios):.2f}-{max(s.ratios):.2f})" if len(s.ratios) > 1 else ""
        rows.append([
            wl.label, f"{s.units:,} {wl.unit}" + (f" ×{s.reps}" if s.reps > 1 else ""),
            f"{_f(s.rates['native'])} {wl.unit}/s", f"{_f(s.rates['ours'])} {wl.unit}/s",
            f"{_f(s.ratio, '.2f')}{spread}", f"≥ {wl.goal:.1f} {verdict}", f"{_f(s.decode)} {wl.unit}/s",
            f"{_f(s.start['native'], '.2f')} / {_f(s.start['ours'], '.2f')}", s.load,
        ])  # fmt: skip
    lines = _table(["workload", "size", "native", "ours", "ours/native (range)", "goal", "pg_recvlogical",
                    "start s (native / ours)", "load"], rows, md)  # fmt: skip
    lines += ["", "Costs, medians (n = native, o = ours): CPU µs per unit (row or transaction) of the apply "
              "process(es) and of the publisher's walsender, from slot active to marker; what the target wrote while "
              "that side ran alone: local transaction ends (commit, prepare, commit/rollback prepared) and WAL "
              "fsyncs per remote transaction, WAL bytes per unit.", ""]  # fmt: skip
    rows = []
    for s in summaries:
        c, w = s.cpu_us, s.wal
        rows.append([
            s.workload.key,
            f"{_f(c['native'], '.1f')} / {_f(c['ours'], '.1f')} + {_f(c['ours_backend'], '.1f')}",
            f"{_f(c['native_walsender'], '.1f')} / {_f(c['ours_walsender'], '.1f')}",
            f"{_f(w['native']['xacts'], '.2f')} / {_f(w['ours']['xacts'], '.2f')}",
            f"{_f(w['native']['fsyncs'], '.2f')} / {_f(w['ours']['fsyncs'], '.2f')}",
            f"{_f(w['native']['bytes'], ',.0f')} / {_f(w['ours']['bytes'], ',.0f')}",
        ])  # fmt: skip
    lines += _table(["workload", "apply CPU µs/unit: n / o worker + its backend", "walsender CPU µs/unit: n / o",
                     "local xact ends/remote xact: n / o", "WAL fsyncs/remote xact: n / o", "WAL bytes/unit: n / o"],
                    rows, md)  # fmt: skip
    for s in summaries:
        if s.workload.streaming:
            hwm = s.hwm_mb
            verdict = "?" if hwm["ours"] is None else ("PASS" if hwm["ours"] < RSS_GOAL_MB else "FAIL")
            lines += ["", (
                f"Peak RSS, {s.units:,}-row streamed transaction: ours {_f(hwm['ours'], '.0f')} MB (VmHWM of the "
                f"worker process; goal < {RSS_GOAL_MB} MB: {verdict}), plus its target backend "
                f"{_f(hwm['ours_backend'], '.0f')} MB; native apply worker {_f(hwm['native'], '.0f')} MB (VmHWM, "
                f"which counts the shared buffers it touched; private memory, sampled every {SAMPLE_S:.1f} s: "
                f"{_f(hwm['native_anon'], '.0f')} MB). stream_txns per run: {s.stream_txns}."
            )]  # fmt: skip
    problems = [f"{s.workload.key}: {f}" for s in summaries for f in s.failures]
    if problems:
        lines += ["", "Problems:"] + [f"- {p}" for p in problems]
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------------------


def _versions(pubc: PostgresCluster) -> dict[str, str]:
    commit = code_commit(ROOT)
    return {
        "postgresql": str(pubc.scalar("SHOW server_version")),
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "commit": commit,
        "cpus": str(os.cpu_count()),
        "kernel": platform.release(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and one repetition (about a minute)")
    ap.add_argument("--workloads", default="inserts,small,prepared,streamed",
                    help="comma-separated subset of: " + ", ".join(WORKLOADS))  # fmt: skip
    ap.add_argument("--reps", type=int, help="repetitions per workload (default 3, --quick 1)")
    ap.add_argument("--insert-txns", type=int)
    ap.add_argument("--insert-rows", type=int, help="rows per insert transaction")
    ap.add_argument("--small-txns", type=int)
    ap.add_argument("--prepared-txns", type=int)
    ap.add_argument("--stream-rows", type=int)
    ap.add_argument("--stream-work-mem", help="publisher logical_decoding_work_mem for the streamed workload")
    ap.add_argument("--pg", default="18", help="server version (15, 16, 18) or a bindir")
    ap.add_argument("--target-conf", action="append", default=[], metavar="NAME=VALUE",
                    help="extra postgresql.conf setting for the target cluster (both subscribers), e.g. fsync=off "
                    "to see what is CPU and what is flush; such runs are not the headline figures")  # fmt: skip
    ap.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one subscriber may take for one backlog"
    )
    ap.add_argument("--no-decode", action="store_true", help="skip the pg_recvlogical reference run")
    ap.add_argument(
        "--no-waldump", action="store_true", help="skip counting the target's WAL records per side"
    )
    ap.add_argument("--profile-dir", type=Path,
                    help="run our worker under py-spy (raw collapsed stacks here); its timings are then not comparable")  # fmt: skip
    ap.add_argument("--profile-what", choices=("wall", "cpu"), default="wall",
                    help="with --profile-dir: wall time (waits included, default) or CPU time only")  # fmt: skip
    ap.add_argument("--code-rev", metavar="REV",
                    help="run the applier code of this commit (a frozen git archive), not the work tree, which "
                    "other people may be editing while the benchmark runs")  # fmt: skip
    ap.add_argument(
        "--render", type=Path, metavar="JSON", help="only print the report of a saved --json file"
    )
    ap.add_argument("--render-markdown", action="store_true", help="with --render: as Markdown")
    ap.add_argument("--json", type=Path, default=OUT_DIR / "apply_bench.json", help="raw results")
    ap.add_argument("--markdown", type=Path, default=OUT_DIR / "apply_bench.md", help="the table as Markdown")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else Sizes()
    overrides = {k: getattr(args, k) for k in ("insert_txns", "insert_rows", "small_txns", "prepared_txns",
                                               "stream_rows", "stream_work_mem") if getattr(args, k) is not None}  # fmt: skip
    args.sizes = replace(base, **overrides)
    # absolute: the worker (and py-spy writing its profile) runs in the code directory, not in ours
    for name in ("profile_dir", "json", "markdown", "render"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).resolve())
    args.reps = args.reps or (1 if args.quick else 3)
    args.keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    unknown = [k for k in args.keys if k not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s): {', '.join(unknown)}")
    return args


def _header(started: datetime, versions: dict[str, str], load_at_start: Sequence[float],
            load_at_end: Sequence[float], target_conf: Sequence[str]) -> str:  # fmt: skip
    return (f"{started:%Y-%m-%d %H:%M} UTC; PostgreSQL {versions.get('postgresql')}; Python {versions.get('python')}; "
            f"psycopg {versions.get('psycopg')}; commit {versions.get('commit')}; {versions.get('cpus')} CPUs; "
            f"load average at start {load_at_start[0]:.1f}, at end {load_at_end[0]:.1f}"
            + (f"; target settings {', '.join(target_conf)}" if target_conf else ""))  # fmt: skip


def load_results(path: Path) -> tuple[str, list[Summary]]:
    """A saved ``--json`` file back into the header and summaries, so that a run can be rendered again (for
    instance after the report's format changed) without running it again."""
    data = json.loads(path.read_text())
    sizes = Sizes(**data["sizes"])
    side_fields = {f.name for f in fields(SideRun)}
    by_workload: dict[str, list[RepResult]] = {}
    for raw in data["results"]:
        raw = dict(raw)
        sides = {
            k: SideRun(**{f: v for f, v in s.items() if f in side_fields})
            for k, s in raw.pop("sides").items()
        }
        raw.setdefault("txns", WORKLOADS[raw["workload"]].txns(sizes) + 1)
        result = RepResult(**raw)
        result.sides = sides
        by_workload.setdefault(result.workload, []).append(result)
    argv = data.get("argv", [])
    target_conf = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--target-conf"]
    header = _header(datetime.fromisoformat(data["started"]), data["versions"], data["load_at_start"],
                     data["load_at_end"], target_conf)  # fmt: skip
    return header, [summarize(WORKLOADS[k], reps) for k, reps in by_workload.items()]


def _freeze_code(rev: str) -> None:
    """Re-run this script against ``git archive <rev>`` (bench/_common.py's rerun_frozen says why)."""
    rerun_frozen(rev, ROOT, str(Path(__file__).resolve()), "apply-bench-code-")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.code_rev and "APPLY_BENCH_CODE_ROOT" not in os.environ:
        _freeze_code(args.code_rev)
    if args.render:
        header, summaries = load_results(args.render)
        print(header + "\n")
        print(render(summaries, md=args.render_markdown))
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    args.spool_root = Path(tempfile.mkdtemp(prefix="apply-bench-tmp-"))
    started = datetime.now(UTC)
    load_at_start = loadavg()
    common = {
        "autovacuum": "off",
        "max_wal_size": "8GB",
        "checkpoint_timeout": "1h",
        "max_prepared_transactions": "100",
    }
    binaries = find_binaries(args.pg)
    pubc = PostgresCluster(binaries, name="abench-pub", durable=True, settings={**common, "fsync": "off"})
    extra = dict(item.split("=", 1) for item in args.target_conf)
    tgtc = PostgresCluster(binaries, name="abench-tgt", durable=True, settings={**common, **extra})
    results: list[RepResult] = []
    versions: dict[str, str] = {}
    summaries: list[Summary] = []
    try:
        pubc.start()
        tgtc.start()
        versions = _versions(pubc)
        print(f"apply_bench {started:%Y-%m-%d %H:%M} UTC, PostgreSQL {versions['postgresql']}, "
              f"{versions['cpus']} CPUs, load {load_at_start[0]:.1f}/{load_at_start[1]:.1f}/{load_at_start[2]:.1f}, "
              f"sizes {asdict(args.sizes)}, reps {args.reps}", file=sys.stderr, flush=True)  # fmt: skip
        for key in args.keys:
            wl = WORKLOADS[key]
            reps = [run_repetition(pubc, tgtc, wl, args.sizes, rep, args) for rep in range(args.reps)]
            results += reps
            summaries.append(summarize(wl, reps))
    finally:
        tgtc.destroy()
        pubc.destroy()
        shutil.rmtree(args.spool_root, ignore_errors=True)
    load_at_end = loadavg()
    header = _header(started, versions, load_at_start, load_at_end, args.target_conf)
    print()
    print(header)
    print(render(summaries, md=False))
    args.markdown.write_text(header + "\n\n" + render(summaries, md=True) + "\n")
    args.json.write_text(json.dumps({
        "started": started.isoformat(), "argv": sys.argv, "versions": versions, "sizes": asdict(args.sizes),
        "load_at_start": load_at_start, "load_at_end": load_at_end,
        "results": [asdict(r) for r in results],
    }, indent=2, default=str))  # fmt: skip
    if args.profile_dir:
        for path in sorted(args.profile_dir.glob("*.txt")):
            print(f"\nprofile {path.name} (py-spy, ours):\n{summarize_profile(path)}")
    ok = all(s.ratio is not None and not s.failures for s in summaries)
    return 0 if ok else 1


def _function(frame: str) -> str:
    """``Pipeline._wait (applier/apply/target.py:151)`` -> ``Pipeline._wait (applier/apply/target.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def summarize_profile(path: Path, top: int = 20) -> str:
    """Where the apply loop's time goes, from py-spy's raw (collapsed) stacks: wall time (recorded with ``--idle``,
    so waiting in select on the target or publisher socket shows) or CPU time. Only stacks inside
    ``ApplyWorker._stream`` count: start-up, imports and the helper threads are left out."""
    self_line: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if "ApplyWorker._stream" not in stack or not count_s.isdigit():
            continue
        frames = stack.split(";")
        n = int(count_s)
        total += n
        self_line[frames[-1]] += n
        self_fn[_function(frames[-1])] += n
        for f in {_function(f) for f in frames}:
            incl_fn[f] += n
    if not total:
        return "(no samples inside ApplyWorker._stream)"
    out = [f"{total} samples in the apply loop; self time by function:"]
    out += [f"  {c / total:6.1%}  {f}" for f, c in self_fn.most_common(top)]
    out.append("hottest lines:")
    out += [f"  {c / total:6.1%}  {f}" for f, c in self_line.most_common(top)]
    out.append("inclusive, by function:")
    out += [f"  {c / total:6.1%}  {f}" for f, c in incl_fn.most_common(top * 2)]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
