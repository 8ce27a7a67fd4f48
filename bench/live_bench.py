"""Live replication: lag and sustainable throughput under a steady application load, ours against native.

Every other benchmark here replays a backlog. This one drives the publisher with ``pgbench -R RATE`` (a steady,
throttled load, the regime a replication target lives in) while a subscriber follows it, and measures how far
behind the target is.

Method
------
* One publisher cluster (fsync off: it only makes the load generator cheaper) and one target cluster (``durable``,
  fsync on, as in production), started from the same binaries; pgbench comes from the same bindir.
* For each workload and rate, ``native`` and ``ours`` run *in turn* (alternating which goes first), each with a
  fresh publisher database and a fresh target database initialised identically (``pgbench -i``), its own slot and
  publication, and the same load for the same time. They never run at the same time: on 2 cores two subscribers
  at once would compete for the CPU and whichever runs its hot loop more often would slow the other.
* ``native`` is ``CREATE SUBSCRIPTION ... WITH (two_phase = on, streaming = on)``; ``ours`` is ``applier run`` as a
  subprocess with its default settings (two-phase on, streaming on in the catalog).
* The load starts once the subscriber's slot is active, plus one second.

Lag (what the figures mean)
---------------------------
Both sides are measured the same way, and nothing in it runs more often for one side than for the other.

* **commit lag** (``lag``): a marker thread commits ``INSERT INTO live_marker VALUES (n, clock_timestamp())`` on the
  publisher every ``--marker-ms`` (``MARKER_S``, 20 ms), interleaved with the load, and notes the wall-clock time its
  COMMIT returned. On the target, an ``ENABLE ALWAYS`` row trigger on ``live_marker`` (:func:`create_marker_notify`)
  does ``pg_notify('live_marker', id)``: both apply workers fire it (they apply with ``session_replication_role =
  replica``, where only ALWAYS and REPLICA triggers fire; ``tests/integration/test_live_bench.py`` checks both on a
  real server), and PostgreSQL delivers a notification only after its transaction committed. A LISTEN connection
  (:class:`MarkerListener`) notes when each arrives. Lag = arrival - publisher commit, to well under a millisecond:
  the listener's backend wakes on the commit's signal and the bench process reads at once (its GIL switch interval is
  lowered to ``SWITCH_INTERVAL_S`` so that another bench thread cannot delay the read). Same host, same clock.
  Transactions apply in commit order, so a visible marker means every transaction committed before it is visible too.
  The trigger costs one notification per marker and makes ``live_marker`` unfit for our bulk (COPY) apply, which only
  matters for the marker's own one-row transactions.
* **Why a marker every 20 ms.** A percentile rests on the markers: at 75 ms (up to run 7) a 15 s run had about 200,
  so its p99 was the 2nd-3rd worst marker and one slow marker (the first one after the worker's start, say) set it.
  At 20 ms a 15 s run has about 750 and the p99 is the 7th-8th worst. A marker costs, on each side alike, one
  one-row transaction on the publisher (50 a second, a small addition to the load's hundreds to thousands), its
  decoding and apply, and one NOTIFY with its delivery to the listener on the target.
* ``lag_poll``: the old measure, a poller on the target every ``POLL_S`` (10 ms) noting when each marker id
  became visible; kept beside the new one as a cross-check, readings up to 10 ms high.
* **prepare lag** (two-phase workload), from the servers' own stamps (``prepare_lag_stamp``): the publisher's
  ``pg_prepared_xacts.prepared`` of xid N against the target's ``prepared`` of ``pg_gid_<subid>_N`` (both
  subscribers name prepared transactions so). PostgreSQL takes that stamp as PrepareTransaction starts, so the
  lag runs from the publisher's PREPARE to the target's PREPARE starting, to the microsecond; it leaves out only
  the target's WAL flush of the PREPARE record, the same work on both sides (our extra local commit of the
  prepared record comes before the PREPARE, so it is included). A PREPARE cannot notify (notifications are
  delivered at commit), so both ``pg_prepared_xacts`` are polled to read the stamps, every 10 ms
  (``--prepare-poll-ms``): the poll must only see each transaction while it is prepared (the 20-100 ms think
  time), and ``seen``/``published`` counts those it missed. ``prepare_lag`` is when the poll saw it (quantised to
  the poll interval, as in JSON version 1); ``prepare_poll`` is what the poll cost (CPU of the bench thread and of
  its target backend: at 2 ms about 0.1 CPU-second per second, which is why it is not the default). Ours may fold
  a PREPARE whose decision arrived in the same read into one plain commit, which never shows as prepared (only
  when it is behind).
* Not the LSN the worker reports about itself, nor ``pg_stat_replication``'s replay lag.
* The JSON has ``"version": 2``; a version-1 file (both lags polled every 10 ms) still renders, its methods
  named in the note under the table.

Where the time goes: ``--trace-dir`` straces the apply worker of each side and writes each prepared
transaction's timeline (publisher PREPARE, the worker's read, our PREPARE's send, the target's PREPARE), see
``bench/_trace.py``; strace slows the worker, so use it to see which segment holds the tail, not for the figures.

Bounded lag and sustainable throughput
--------------------------------------
The lag is **bounded** at a rate when (:func:`lag_bounded`) every marker committed during the load became visible
within the drain timeout after the load stopped, and the median lag of the markers committed in the last third of
the load is at most ``max(BOUND_FLOOR_S, BOUND_FACTOR × median of the first third)`` = max(0.5 s, 2 × ...): a
subscriber that keeps up has the same lag at the end as at the start; one that does not falls further behind the
longer the load lasts. The **sustainable throughput** of a side is the highest rate tried at which its lag is
bounded *and* pgbench delivered at least 90 % of the rate (else the publisher, not the subscriber, was the limit).
Rates are stepped up per workload (``--rates``), then doubled further (unless ``--no-step-up``) until a side's lag is
unbounded or the publisher cannot deliver the rate.

How long a run lasts
--------------------
60 s of load by default (``--duration``). Runs of 15 s (runs 7 and 8) hid a worker's steady state: what grows
with the time a worker has run, such as the apply-lag window of the last minute (whose summary once sorted every
sample in it, every 2 s: a stall that grew to 7-17 ms after 45 s at 1,600 tps) or a full garbage collection, does
not show in 15 s, and the start of the load weighs more in every percentile.

Workloads
---------
* ``tpcb``: pgbench's builtin ``tpcb-like`` script.
* ``2pc``: the same account update and history insert as a prepared transaction: ``PREPARE TRANSACTION``, a
  think time of 20-100 ms like a coordinator collecting the other participants' votes, then ``COMMIT PREPARED`` or,
  one time in ten, ``ROLLBACK PREPARED``. The teller and branch updates are left out: a prepared transaction holds
  its row locks through the think time, and with them every transaction would queue on the one branch row.
* ``mix``: ``tpcb-like`` plus, every ``BIG_EVERY_S`` (8 s), one ``BIG_ROWS``-row INSERT that the publisher
  streams (its database's ``logical_decoding_work_mem`` is lowered to 2MB; ``stream_txns`` confirms it).

Costs: CPU seconds over the load and drain of our ``applier run`` process tree (the parent and the worker it
spawns) and of the target cluster's server processes (the postmaster and all its children: native's apply worker,
our backend, walwriter, checkpointer, the bench's poller and listener backends — the same extras on both sides);
peak RSS (``VmHWM``) of our worker process and of the native apply worker.

    .venv/bin/python bench/live_bench.py --quick          # ~3 minutes
    .venv/bin/python bench/live_bench.py                  # ~35 minutes on 2 cores, writes bench/live-lag.svg
    .venv/bin/python bench/live_bench.py --workloads 2pc --rates 2pc=50,100 --duration 30
    .venv/bin/python bench/live_bench.py --render bench/out/live_bench.json   # report and chart of a saved run
    .venv/bin/python bench/live_bench.py --workloads 2pc --rates 2pc=400 --no-step-up --trace-dir bench/out/trace

The chart needs matplotlib: ``pip install -e '.[bench]'`` (or ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
CODE_ROOT = Path(os.environ.get("APPLY_BENCH_CODE_ROOT", ROOT))
if __package__ in (None, ""):  # run as a script: make the project and the bench helpers importable
    sys.path.insert(0, str(CODE_ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _trace  # noqa: E402
from _common import cmdline, code_commit, descendants, loadavg, proc_sample, rerun_frozen  # noqa: E402
from _native import NativeSubscription  # noqa: E402

from applier.apply.testing import setup_subscription  # noqa: E402
from applier.testing.cluster import Database, PostgresCluster, find_binaries  # noqa: E402

OUT_DIR = ROOT / "bench" / "out"
CHART = ROOT / "bench" / "live-lag.svg"
POLL_S = 0.01  # the old marker poll (``lag_poll``): kept as a cross-check of the notification figures
PREPARE_POLL_S = 0.01  # the target's pg_prepared_xacts (--prepare-poll-ms): the stamps need no faster poll
NOTIFY_CHANNEL = "live_marker"
SWITCH_INTERVAL_S = 0.0005  # the bench's own GIL hand-off: a waking listener thread must not wait 5 ms for it
JSON_VERSION = 2  # 2: commit lag by LISTEN/NOTIFY, prepare lag by server stamps (1: both polled every 10 ms)
MARKER_S = 0.02  # --marker-ms: ~750 markers per 15 s run, so that p99 is not one marker (see the docstring)
SAMPLE_S = 0.5
WARMUP_S = 1.0
BOUND_FLOOR_S = 0.5
BOUND_FACTOR = 2.0
DELIVERED = 0.9  # pgbench must deliver this share of the rate for a rate to count as sustained
BIG_EVERY_S = 8.0
BIG_ROWS = 50_000
SCALE = 1
TABLES = (
    "pgbench_accounts",
    "pgbench_branches",
    "pgbench_tellers",
    "pgbench_history",
    "live_marker",
    "live_big",
)

TWO_PC_SCRIPT = """\
\\set aid random(1, 100000 * :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
\\set think random(20, 100)
\\set decide random(1, 10)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, 1, :aid, :delta, CURRENT_TIMESTAMP);
SELECT txid_current() AS xid \\gset
PREPARE TRANSACTION 'live_:xid';
\\sleep :think ms
\\if :decide = 1
ROLLBACK PREPARED 'live_:xid';
\\else
COMMIT PREPARED 'live_:xid';
\\endif
"""


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    two_phase_load: bool
    big: bool  # a streamed large transaction now and then
    rates: tuple[int, ...]
    quick_rates: tuple[int, ...]


WORKLOADS = {
    w.key: w
    for w in (
        Workload("tpcb", "pgbench tpcb-like", False, False, (100, 400, 1600), (200,)),
        Workload("2pc", "prepared txns, 20-100 ms think time, 10% rolled back", True, False, (50, 200), (100,)),
        Workload("mix", f"tpcb-like + a streamed {BIG_ROWS:,}-row insert every {BIG_EVERY_S:.0f} s", False, True,
                 (100, 400), (200,)),
    )
}  # fmt: skip


# --- the pure parts: percentiles and the bounded-lag test ---------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default);
    NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def lag_bounded(samples: Sequence[tuple[float, float]], missing: int = 0) -> tuple[bool, str]:
    """Whether a lag series stayed bounded, and why (see the module docstring).

    ``samples`` are (commit time, lag) of the markers committed during the load, in commit order; ``missing`` counts
    markers of that window that never became visible. Unbounded when any is missing, or when the median lag of the
    last third exceeds ``max(BOUND_FLOOR_S, BOUND_FACTOR × median lag of the first third)``."""
    if missing:
        return False, f"{missing} marker(s) never became visible"
    if len(samples) < 3:
        return False, "too few markers to tell"
    third = len(samples) // 3
    first = statistics.median(lag for _, lag in samples[:third])
    last = statistics.median(lag for _, lag in samples[-third:])
    limit = max(BOUND_FLOOR_S, BOUND_FACTOR * first)
    if last > limit:
        return (
            False,
            f"median lag grew from {first:.3f} s (first third) to {last:.3f} s (last third) > {limit:.3f} s",
        )
    return True, f"median lag {first:.3f} s (first third), {last:.3f} s (last third) <= {limit:.3f} s"


def lag_slope(samples: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of lag over commit time (seconds of lag gained per second of load): informative only."""
    if len(samples) < 2:
        return None
    xs = [t for t, _ in samples]
    ys = [lag for _, lag in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def gid_xid(gid: str) -> int | None:
    """``pg_gid_<subid>_<xid>`` -> xid (the publisher's); None for any other GID."""
    m = re.fullmatch(r"pg_gid_\d+_(\d+)", gid)
    return int(m.group(1)) if m else None


def parse_pgbench(output: str) -> dict[str, float]:
    """What pgbench printed at the end: transactions processed, failed, and tps."""
    out: dict[str, float] = {}
    if m := re.search(r"number of transactions actually processed: (\d+)", output):
        out["processed"] = int(m.group(1))
    if m := re.search(r"number of failed transactions: (\d+)", output):
        out["failed"] = int(m.group(1))
    if m := re.search(r"tps = ([\d.]+) \(without initial connection time\)", output):
        out["tps"] = float(m.group(1))
    return out


# --- the measuring threads ------------------------------------------------------------------------------------------


class MarkerWriter(threading.Thread):
    """Commits marker ``n`` on the publisher every ``interval`` s and notes when each COMMIT returned."""

    def __init__(self, db: Database, interval: float = MARKER_S) -> None:
        super().__init__(daemon=True, name="marker-writer")
        self.db, self.interval = db, interval
        self.committed: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                n = 0
                next_at = time.monotonic()
                while not self.stop.is_set():
                    n += 1
                    c.execute("INSERT INTO live_marker VALUES (%s, clock_timestamp())", (n,))
                    self.committed[n] = time.time()
                    next_at += self.interval
                    self.stop.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc


class VisibilityPoller(threading.Thread):
    """Polls the target every ``POLL_S`` (10 ms) for the first moment each marker id is visible: the old commit lag
    measurement, kept as ``lag_poll`` to cross-check :class:`MarkerListener` and to compare with older runs."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True, name="visibility-poller")
        self.db = db
        self.visible: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                last = 0
                while not self.stop.is_set():
                    rows = c.execute(
                        "SELECT id FROM live_marker WHERE id > %s ORDER BY id", (last,)
                    ).fetchall()
                    now = time.time()
                    for (mid,) in rows:
                        self.visible[mid] = now
                        last = mid
                    self.stop.wait(POLL_S)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc


class MarkerListener(threading.Thread):
    """LISTENs on the target for the marker trigger's notifications (:func:`create_marker_notify`) and notes the
    arrival time of each: the moment the marker's transaction committed on the target, to within the listener
    backend's wake-up and a socket read (tens of microseconds on an idle core), the same for both sides. It costs
    the target nothing between markers (no polling) and one notification per marker."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True, name="marker-listener")
        self.db = db
        self.visible: dict[int, float] = {}
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                c.execute(sql.SQL("LISTEN {}").format(sql.Identifier(NOTIFY_CHANNEL)))
                self.ready.set()
                while not self.stop.is_set():
                    for n in c.notifies(timeout=0.1):
                        self.visible.setdefault(int(n.payload), time.time())
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self.ready.set()


class TargetPreparePoller(threading.Thread):
    """Polls the target's ``pg_prepared_xacts`` every ``interval`` (``--prepare-poll-ms``, 10 ms) for this
    database's ``pg_gid_*`` transactions: the server's own ``prepared`` stamp of each (``stamp``: taken by the
    target's PrepareTransaction as it starts, before it writes and flushes the PREPARE record), and when the poll
    first saw it (``seen``, this host's clock, quantised to the interval).

    A PREPARE cannot notify (a notification is delivered at commit, and COMMIT PREPARED is what commits), hence a
    poll; but the stamp does not depend on the poll's timing, only on the poll seeing the transaction at all, which
    it does while the transaction stays prepared (the 20-100 ms think time; ``seen``/``published`` counts any
    missed). The stamp lag is to the microsecond; what it leaves out, the target's WAL flush of the PREPARE
    record itself, is the same work on both sides (our extra local commit for the prepared record comes *before*
    the PREPARE starts, so the stamp includes it). ``cost()`` gives what the poll costs (measured: at 2 ms, on
    2 cores, about 0.1 CPU-second per second between the bench thread and its backend; that load is why 10 ms is
    the default)."""

    def __init__(self, db: Database, interval: float = PREPARE_POLL_S) -> None:
        super().__init__(daemon=True, name="target-prepare-poller")
        self.db, self.interval = db, interval
        self.seen: dict[int, float] = {}
        self.stamp: dict[int, float] = {}
        self.polls = 0
        self.elapsed_s = 0.0
        self.thread_cpu_s = 0.0
        self.backend_cpu_s = 0.0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                backend = int(c.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
                before = proc_sample(backend)
                t0, cpu0 = time.monotonic(), time.thread_time()
                query = (
                    "SELECT gid, extract(epoch FROM prepared)::float8 FROM pg_catalog.pg_prepared_xacts"
                    " WHERE database = current_database()"
                )
                while not self.stop.is_set():
                    rows = c.execute(query).fetchall()
                    now = time.time()
                    self.polls += 1
                    for gid, at in rows:
                        xid = gid_xid(gid)
                        if xid is not None and xid not in self.seen:
                            self.seen[xid], self.stamp[xid] = now, float(at)
                    self.stop.wait(self.interval)
                self.elapsed_s, self.thread_cpu_s = time.monotonic() - t0, time.thread_time() - cpu0
                after = proc_sample(backend)
                if before is not None and after is not None:
                    self.backend_cpu_s = after.cpu_s - before.cpu_s
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def cost(self) -> dict[str, float]:
        """Polls, mean interval (ms), and CPU seconds of this thread (``client_cpu_s``) and its backend."""
        interval = self.elapsed_s / self.polls * 1000 if self.polls else float("nan")
        return {"polls": self.polls, "interval_ms": round(interval, 3), "client_cpu_s": round(self.thread_cpu_s, 3),
                "backend_cpu_s": round(self.backend_cpu_s, 3), "elapsed_s": round(self.elapsed_s, 3)}  # fmt: skip


class PublisherPreparePoller(threading.Thread):
    """The publisher's own PREPARE times (``pg_prepared_xacts.prepared``) by xid, polled every ``POLL_S``."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True, name="prepare-poller")
        self.db = db
        self.prepared_at: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                while not self.stop.is_set():
                    for xid, at in c.execute(
                        "SELECT transaction::text::bigint, extract(epoch FROM prepared)::float8"
                        " FROM pg_catalog.pg_prepared_xacts WHERE database = current_database()"
                    ).fetchall():
                        self.prepared_at.setdefault(int(xid), float(at))
                    self.stop.wait(POLL_S)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc


class BigWriter(threading.Thread):
    """One ``BIG_ROWS``-row INSERT every ``BIG_EVERY_S`` on the publisher (the first after half of that)."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True, name="big-writer")
        self.db = db
        self.done = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.db.connect() as c:
                while not self.stop.wait(BIG_EVERY_S / 2 if self.done == 0 else BIG_EVERY_S):
                    base = self.done * BIG_ROWS
                    c.execute(
                        "INSERT INTO live_big SELECT g, md5(g::text) FROM generate_series(%s::bigint, %s::bigint) g",
                        (base + 1, base + BIG_ROWS),
                    )
                    self.done += 1
        except BaseException as exc:  # noqa: BLE001
            self.error = exc


class CpuTracker:
    """CPU seconds of process groups (``client``: the applier run tree; ``server``: the target cluster) from a
    starting mark, and the peak ``VmHWM`` of each process. A process is counted in the group it was first seen
    in, and with what it had used when last sampled, so one that exits mid-run still counts up to that sample."""

    def __init__(self) -> None:
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.group: dict[int, str] = {}
        self.hwm_kb: dict[int, int] = {}

    def sample(self, groups: dict[str, Sequence[int]], *, base: bool = False) -> None:
        for group, pids in groups.items():
            for pid in pids:
                s = proc_sample(pid)
                if s is None:
                    continue
                if base:
                    self.base[pid] = s.cpu_s
                self.group.setdefault(pid, group)
                self.last[pid] = s.cpu_s
                self.hwm_kb[pid] = max(self.hwm_kb.get(pid, 0), s.vm_hwm_kb)

    def cpu(self, group: str) -> float:
        """Since the base mark; a process started later counts from zero."""
        return sum(cpu - self.base.get(p, 0.0) for p, cpu in self.last.items() if self.group[p] == group)


def wal_fsyncs(db: Database) -> float | None:
    """The target cluster's WAL fsyncs so far (``pg_stat_io``'s wal rows from PostgreSQL 18, ``pg_stat_wal.wal_sync``
    before), None where neither is there. Processes report their I/O counts about once a second, so a delta over a
    run is right to within about a second of load at each end."""
    for query in ("SELECT sum(fsyncs)::float8 FROM pg_catalog.pg_stat_io WHERE object = 'wal'",
                  "SELECT wal_sync::float8 FROM pg_catalog.pg_stat_wal"):  # fmt: skip
        try:
            value = db.scalar(query)
        except psycopg.Error:
            continue
        if value is not None:
            return float(value)
    return None


def _tree(pid: int | None) -> list[int]:
    return [] if pid is None else [pid, *descendants(pid)]


def _postmaster_pid(cluster: PostgresCluster) -> int:
    assert cluster.datadir is not None
    return int((cluster.datadir / "postmaster.pid").read_text().split()[0])


# --- one side's run -------------------------------------------------------------------------------------------------


@dataclass
class SideRun:
    workload: str
    rate: int
    side: str
    ok: bool = False
    error: str | None = None
    pgbench: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    markers: int = 0
    missing: int = 0
    lag: dict[str, float] = field(default_factory=dict)  # p50, p99, max (s), measured as lag_method says
    prepare_lag: dict[str, float] = field(default_factory=dict)  # measured as prepare_method says
    # JSON version 1 had only the 10 ms polls; a saved run without these fields was measured so
    lag_method: str = "poll 10 ms"
    prepare_method: str = "poll 10 ms"  # "" for a workload without prepared transactions
    lag_poll: dict[str, float] = field(default_factory=dict)  # the 10 ms marker poll of this run
    prepare_lag_stamp: dict[str, float] = field(default_factory=dict)  # server stamps: target minus publisher
    prepare_poll: dict[str, float] = field(default_factory=dict)  # TargetPreparePoller.cost()
    wal_fsyncs: float | None = None  # the target cluster's WAL fsyncs over the load and drain (wal_fsyncs())
    prepares_published: int = 0
    prepares_seen: int = 0
    bounded: bool = False
    bound_reason: str = ""
    slope: float | None = None
    drain_s: float = float("nan")  # load end until the last marker was visible
    client_cpu_s: float = 0.0  # ours: the applier run tree
    server_cpu_s: float = 0.0  # the target cluster's processes
    worker_hwm_mb: float | None = None
    big_txns: int = 0
    stream_txns: int | None = None
    verified: bool | None = None
    load1: float = float("nan")
    series: list[tuple[float, float]] = field(default_factory=list)  # (s since load start, lag s)

    @property
    def delivered(self) -> bool:
        return self.pgbench.get("tps", 0.0) >= DELIVERED * self.rate


def _pgbench_init(bindir: Path, db: Database, *, target: bool = False) -> None:
    res = subprocess.run([str(bindir / "pgbench"), "-i", "-q", "-s", str(SCALE), "-n", db.dsn], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"pgbench -i failed: {res.stderr.strip()}")
    with db.connect() as c:
        c.execute("CREATE TABLE live_marker (id integer PRIMARY KEY, at timestamptz NOT NULL)")
        c.execute("CREATE TABLE live_big (id bigint PRIMARY KEY, v text NOT NULL)")
        if target:
            create_marker_notify(c)


def create_marker_notify(conn: psycopg.Connection) -> None:
    """On the target: a trigger that notifies ``NOTIFY_CHANNEL`` with the marker id of each applied row.

    ``ENABLE ALWAYS`` because both apply workers run with ``session_replication_role = replica`` (native's apply
    worker sets it, ours sets it on its session), where an ordinary trigger does not fire. A notification is
    delivered only once its transaction has committed, so its arrival at a listener is the moment the marker became
    visible, to within the listener backend's wake-up. The trigger makes ``live_marker`` unfit for our bulk (COPY)
    apply, so ours applies the markers statement by statement; each marker is a one-row transaction of its own."""
    conn.execute(
        "CREATE FUNCTION live_marker_notify() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN PERFORM pg_catalog.pg_notify('" + NOTIFY_CHANNEL + "', NEW.id::text); RETURN NULL; END$$"
    )
    conn.execute(
        "CREATE TRIGGER live_marker_notify AFTER INSERT ON live_marker"
        " FOR EACH ROW EXECUTE FUNCTION live_marker_notify()"
    )
    conn.execute("ALTER TABLE live_marker ENABLE ALWAYS TRIGGER live_marker_notify")


def _wait_slot_active(pub: Database, slot: str, timeout: float, proc: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + timeout
    with pub.connect() as c:
        while True:
            row = c.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            if row and row[0] is not None:
                return
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"applier run exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot} not active within {timeout:.0f}s")
            time.sleep(0.05)


def _start_ours(
    db: Database,
    name: str,
    log_path: Path,
    spool: Path,
    profile: Path | None = None,
    syscalls: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``applier run NAME``; with ``profile``, under ``py-spy record --idle`` (wall time, raw collapsed stacks);
    with ``syscalls``, under ``strace -f -c`` (a count of each system call of the whole process tree)."""
    cmd = [sys.executable, "-m", "applier.cli", "--target", db.dsn, "run", name]
    if syscalls is not None:
        cmd = ["strace", "-f", "-c", "-o", str(syscalls), *cmd]
    if profile is not None:
        pyspy = Path(sys.executable).with_name("py-spy")
        cmd = [str(pyspy), "record", "--subprocesses", "--idle", "--rate", "250", "--format", "raw", "-o",
               str(profile), "--", *cmd]  # fmt: skip
    env = dict(os.environ, APPLIER_LOG_LEVEL=os.environ.get("APPLIER_LOG_LEVEL", "WARNING"), TMPDIR=str(spool),
               PYTHONPATH=str(CODE_ROOT))  # fmt: skip
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(cmd, cwd=CODE_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def _is_cli(command: str) -> bool:
    """The ``applier run`` process itself, not the py-spy or strace wrapped around it."""
    return "applier.cli" in command and "py-spy" not in command and not command.startswith("strace")


def _stop_ours(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to ``applier run`` (under py-spy or strace: to the CLI below it, so that the wrapper writes its
    profile or counts)."""
    if proc.poll() is not None:
        return
    tree = _tree(proc.pid)
    cli = next((p for p in tree if _is_cli(cmdline(p))), proc.pid)
    os.kill(cli, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        # every process of the tree as it was, not only the wrapper: killing py-spy alone once left the worker
        # running into the next run
        print(
            f"  applier run did not stop within {timeout:g} s of SIGTERM: killing {len(tree)} processes",
            file=sys.stderr,
        )
        for pid in reversed(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def _native_worker_pid(db: Database, name: str) -> int | None:
    row = db.query(
        "SELECT pid FROM pg_stat_subscription WHERE subname = %s AND relid IS NULL AND pid IS NOT NULL LIMIT 1",
        (name,),
    )
    return int(row[0][0]) if row else None


def _ours_worker_pid(root: int) -> int | None:
    for pid in descendants(root):
        if "spawn_main" in cmdline(pid):
            return pid
    return None


@dataclass
class Env:
    pubc: PostgresCluster
    tgtc: PostgresCluster
    bindir: Path
    duration: float
    drain_timeout: float
    spool: Path
    profile_dir: Path | None = None
    strace_dir: Path | None = None
    prepare_poll_s: float = PREPARE_POLL_S
    trace_dir: Path | None = None
    marker_s: float = MARKER_S


def run_side(env: Env, wl: Workload, rate: int, side: str) -> SideRun:
    run = SideRun(wl.key, rate, side)
    tag = f"lv_{wl.key.replace('2', 'two')}_{rate}_{side}"
    pub = env.pubc.create_database(tag)
    tgt = env.tgtc.create_database(tag)
    proc: subprocess.Popen[bytes] | None = None
    native: NativeSubscription | None = None
    subid: int | None = None
    threads: list[threading.Thread] = []
    try:
        _pgbench_init(env.bindir, pub)
        _pgbench_init(env.bindir, tgt, target=True)
        if wl.big:
            pub.execute(
                sql.SQL("ALTER DATABASE {} SET logical_decoding_work_mem = '2MB'").format(sql.Identifier(tag))
            )
        tables = [f"public.{t}" for t in TABLES]
        if side == "ours":
            setup = setup_subscription(pub, tgt, tag, tables, two_phase_state="e", streaming="on")
            subid = setup.sub.subid
            setup.catalog.engine.dispose()
            profile = env.profile_dir / f"{tag}.txt" if env.profile_dir else None
            syscalls = env.strace_dir / f"{tag}.txt" if env.strace_dir else None
            proc = _start_ours(tgt, tag, OUT_DIR / f"{tag}.log", env.spool, profile, syscalls)
        else:
            pub.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(tag), sql.SQL(", ").join(sql.Identifier(*t.split(".")) for t in tables)))  # fmt: skip
            pub.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (tag,))
            native = NativeSubscription(tgt.dsn, tag, tag, tag, pub.dsn, True, "on")
            native.create()
            native.enable()
        _wait_slot_active(pub, tag, 120.0, proc)
        time.sleep(WARMUP_S)
        run.load1 = loadavg()[0]
        run_load(env, wl, rate, run, pub, tgt, proc, tag, threads)
        if wl.big:
            run.stream_txns = _stream_txns(pub, tag, expect=True)
        run.ok = run.error is None
    except Exception as exc:  # noqa: BLE001 - reported in the table, the benchmark goes on
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        for t in threads:
            t.stop.set()  # type: ignore[attr-defined]
        if run.ok:
            _verify(pub, tgt, run)
        if proc is not None:
            _stop_ours(proc)
        if native is not None:
            native.disable()
            native.drop()
        if subid is not None:
            try:
                tgt.execute("SELECT pg_replication_origin_drop(%s)", (f"applier_{subid}",))
            except psycopg.Error:
                pass
        env.tgtc.drop_database(tag)
        env.pubc.drop_database(tag)
    return run


def _stream_txns(pub: Database, slot: str, expect: bool) -> int | None:
    deadline = time.monotonic() + 3.0
    while True:
        rows = pub.query("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (slot,))
        value = int(rows[0][0]) if rows and rows[0][0] is not None else None
        if value or not expect or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def run_load(env: Env, wl: Workload, rate: int, run: SideRun, pub: Database, tgt: Database,
             proc: subprocess.Popen[bytes] | None, tag: str, threads: list[threading.Thread]) -> None:  # fmt: skip
    """The load, the lag measurement and the costs of one side at one rate; fills ``run``."""
    writer = MarkerWriter(pub, env.marker_s)
    poller = VisibilityPoller(tgt)
    listener = MarkerListener(tgt)
    pub_prep = PublisherPreparePoller(pub) if wl.two_phase_load else None
    tgt_prep = TargetPreparePoller(tgt, env.prepare_poll_s) if wl.two_phase_load else None
    big = BigWriter(pub) if wl.big else None
    threads += [t for t in (writer, poller, listener, pub_prep, tgt_prep, big) if t is not None]
    tgt_root = _postmaster_pid(env.tgtc)
    client_root = proc.pid if proc is not None else None
    cpu = CpuTracker()
    cpu.sample({"client": _tree(client_root), "server": _tree(tgt_root)}, base=True)
    clients = max(4, math.ceil(rate * 0.15) + 4) if wl.two_phase_load else 4
    cmd = [str(env.bindir / "pgbench"), "-n", "-R", str(rate), "-T", str(int(env.duration)), "-c", str(clients),
           "-j", "2", "--max-tries", "10"]  # fmt: skip
    script: Path | None = None
    if wl.two_phase_load:
        fd, name = tempfile.mkstemp(prefix="live-2pc-", suffix=".sql")
        script = Path(name)
        with os.fdopen(fd, "w") as f:
            f.write(TWO_PC_SCRIPT)
        cmd += ["-f", str(script)]
    else:
        cmd += ["-b", "tpcb-like"]
    cmd.append(pub.dsn)
    listener.start()
    listener.ready.wait(10)
    poller.start()
    for t in (pub_prep, tgt_prep):
        if t is not None:
            t.start()
    load_start = time.time()
    writer.start()
    if big is not None:
        big.start()
    traces = _start_traces(env, tgt, proc, tag)
    fsyncs_before = wal_fsyncs(tgt)
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_sample = 0.0
    while bench.poll() is None:
        if time.monotonic() - last_sample >= SAMPLE_S:
            last_sample = time.monotonic()
            cpu.sample({"client": _tree(client_root), "server": _tree(tgt_root)})
            if proc is not None and proc.poll() is not None:
                run.error = f"applier run exited with status {proc.returncode}"
        time.sleep(0.05)
    output = bench.stdout.read() if bench.stdout else ""
    if script is not None:
        script.unlink(missing_ok=True)
    load_end = time.time()
    _trace.stop(traces)
    if big is not None:  # before the last marker, so that the marker also waits for the last big insert
        big.stop.set()
        big.join()
        run.big_txns = big.done
    writer.stop.set()
    writer.join()
    run.pgbench = parse_pgbench(output)
    if bench.returncode != 0:
        run.error = f"pgbench exited with {bench.returncode}: {output.strip()[-500:]}"
    run.duration_s = load_end - load_start
    # drain: until the last marker is visible (and, two-phase, no prepared transaction is left on the target)
    last_id = max(writer.committed, default=0)
    deadline = time.monotonic() + env.drain_timeout
    native_pid = None
    while time.monotonic() < deadline:
        if time.monotonic() - last_sample >= SAMPLE_S:
            last_sample = time.monotonic()
            cpu.sample({"client": _tree(client_root), "server": _tree(tgt_root)})
        if last_id in listener.visible:
            break
        if last_id in poller.visible and time.time() - poller.visible[last_id] > 2.0:
            break  # visible, but no notification came: counted as missing (the report says so)
        time.sleep(0.02)
    if last_id in listener.visible:  # 0 when it was visible before pgbench's exit was noticed
        run.drain_s = max(0.0, listener.visible[last_id] - load_end)
    if proc is None:
        native_pid = _native_worker_pid(tgt, tag)
    time.sleep(1.1)  # the workers report their I/O counts about once a second
    fsyncs_after = wal_fsyncs(tgt)
    if fsyncs_before is not None and fsyncs_after is not None:
        run.wal_fsyncs = fsyncs_after - fsyncs_before
    cpu.sample({"client": _tree(client_root), "server": _tree(tgt_root)})
    for t in (poller, listener, pub_prep, tgt_prep):
        if t is not None:
            t.stop.set()
            t.join()
    for t in (writer, poller, listener, pub_prep, tgt_prep, big):
        if t is not None and t.error is not None:
            run.error = f"{t.name}: {type(t.error).__name__}: {t.error}"
    run.client_cpu_s = cpu.cpu("client")
    run.server_cpu_s = cpu.cpu("server")
    worker = _ours_worker_pid(proc.pid) if proc is not None else native_pid
    if worker is not None and worker in cpu.hwm_kb:
        run.worker_hwm_mb = cpu.hwm_kb[worker] / 1024
    _fill_lags(run, writer.committed, listener.visible, load_start, pub_prep, tgt_prep, poller.visible)
    run.lag_method += f", a marker every {env.marker_s * 1000:g} ms"
    if env.trace_dir is not None and pub_prep is not None and tgt_prep is not None:
        stamps = {"pub": pub_prep.prepared_at, "tgt": tgt_prep.stamp, "seen": tgt_prep.seen}
        (env.trace_dir / f"{tag}.prepares.json").write_text(json.dumps(stamps))
        report = _trace.analyse(env.trace_dir, tag)
        (env.trace_dir / f"{tag}.timeline.txt").write_text(report + "\n")
        print(report, file=sys.stderr, flush=True)


def _start_traces(env: Env, tgt: Database, proc: subprocess.Popen[bytes] | None,
                  tag: str) -> list[subprocess.Popen[bytes]]:  # fmt: skip
    """With ``--trace-dir``: strace the apply worker for the load (:mod:`_trace`)."""
    if env.trace_dir is None:
        return []
    worker = _ours_worker_pid(proc.pid) if proc is not None else _native_worker_pid(tgt, tag)
    if worker is None:
        raise RuntimeError("no apply worker to trace")
    traces = _trace.start(env.trace_dir, tag, {"worker": worker})
    time.sleep(0.5)  # strace attaches
    return traces


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of a lag list (NaN for none)."""
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values, default=float("nan")),
    }


def paired_lags(start: dict[int, float], end: dict[int, float]) -> list[tuple[float, float]]:
    """(start, end - start) for every key in both, in key order (marker ids are in commit order)."""
    return [(start[k], end[k] - start[k]) for k in sorted(start) if k in end]


def _fill_lags(run: SideRun, committed: dict[int, float], visible: dict[int, float], load_start: float,
               pub_prep: PublisherPreparePoller | None, tgt_prep: TargetPreparePoller | None,
               polled: dict[int, float] | None = None) -> None:  # fmt: skip
    """The run's lag figures: commit lag from the notifications (``visible``), the 10 ms poll's (``polled``) beside
    it; prepare lag as the poll saw it (``prepare_lag``, the field's meaning in JSON version 1) and from the
    servers' stamps (``prepare_lag_stamp``, the precise one)."""
    samples = paired_lags(committed, visible)
    run.lag_method = (
        f"LISTEN/NOTIFY (ALWAYS trigger on the target), bench switch interval {SWITCH_INTERVAL_S * 1000:g} ms"
    )
    run.markers = len(committed)
    run.missing = len(committed) - len(samples)
    run.lag = summary([lag for _, lag in samples])
    if polled is not None:
        run.lag_poll = summary([lag for _, lag in paired_lags(committed, polled)])
    run.bounded, run.bound_reason = lag_bounded(samples, run.missing)
    run.slope = lag_slope(samples)
    run.series = [(round(t - load_start, 3), round(lag, 5)) for t, lag in samples]
    run.prepare_method = ""
    if pub_prep is not None and tgt_prep is not None:
        run.prepare_method = f"poll {tgt_prep.interval * 1000:g} ms"
        run.prepares_published = len(pub_prep.prepared_at)
        plags = paired_lags(pub_prep.prepared_at, tgt_prep.seen)
        run.prepares_seen = len(plags)
        run.prepare_lag = summary([lag for _, lag in plags])
        run.prepare_lag_stamp = summary([lag for _, lag in paired_lags(pub_prep.prepared_at, tgt_prep.stamp)])
        run.prepare_poll = tgt_prep.cost()


def _verify(pub: Database, tgt: Database, run: SideRun) -> None:
    """Same contents on both sides once drained: every table's row count and a server-side hash (the history
    table has no key: count and the sum of its deltas), and no prepared transaction left on the target."""
    checks = {
        "pgbench_accounts": "SELECT count(*), md5(string_agg(aid || ':' || abalance, ',' ORDER BY aid)) FROM pgbench_accounts",
        "pgbench_tellers": "SELECT count(*), md5(string_agg(tid || ':' || tbalance, ',' ORDER BY tid)) FROM pgbench_tellers",
        "pgbench_branches": "SELECT count(*), md5(string_agg(bid || ':' || bbalance, ',' ORDER BY bid)) FROM pgbench_branches",
        "pgbench_history": "SELECT count(*), coalesce(sum(delta), 0)::text FROM pgbench_history",
        "live_marker": "SELECT count(*), max(id)::text FROM live_marker",
        "live_big": "SELECT count(*), max(id)::text FROM live_big",
    }  # fmt: skip
    bad = []
    deadline = time.monotonic() + 30
    while True:
        bad = []
        for table, query in checks.items():
            want, got = pub.query(query)[0], tgt.query(query)[0]
            if want != got:
                bad.append(f"{table}: {got} vs {want}")
        left = tgt.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
        if left:
            bad.append(f"{left} prepared transaction(s) left")
        if not bad or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run.verified = not bad
    if bad:
        run.error = "MISMATCH " + "; ".join(bad)


# --- the report -----------------------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "—" if value is None or value != value else format(value, fmt)


def sustainable(runs: Sequence[SideRun], workload: str, side: str) -> str:
    """The highest rate tried at which the side's lag stayed bounded and pgbench delivered the rate; ``≥`` when it
    was bounded at the highest rate tried (a lower bound only)."""
    mine = sorted((r for r in runs if r.workload == workload and r.side == side), key=lambda r: r.rate)
    good = [r.rate for r in mine if r.ok and r.bounded and r.delivered]
    if not good:
        return "< " + str(mine[0].rate) if mine else "—"
    top = mine[-1]
    return (f"≥ {good[-1]}" if good[-1] == top.rate else str(good[-1])) + " tps"


def _per_txn(r: SideRun) -> str:
    """The target's WAL fsyncs per pgbench transaction (two-phase: PREPARE and COMMIT PREPARED are always flushed,
    whatever ``synchronous_commit`` says; plain commits of either side are not)."""
    done = r.pgbench.get("processed")
    return _f(r.wal_fsyncs / done if r.wal_fsyncs is not None and done else None, ".2f")


def _ms(d: dict[str, float], *keys: str) -> str:
    return " / ".join(_f(d[k] * 1000 if k in d else None, ".1f") for k in keys)


def render(runs: Sequence[SideRun]) -> str:
    """Markdown: one row per workload, rate and side; then sustainable throughput per workload; then how the lags
    were measured. Lags in milliseconds. Commit lag by notification (JSON version 2; a version-1 run's is its
    10 ms poll, and its poll column is empty), with the 10 ms poll's p99 beside it as a cross-check. Prepare lag
    by the servers' stamps (version 2), and as the poll saw it (its interval in the note below the table)."""
    head = ["workload", "rate (tps)", "side", "pgbench tps", "commit lag p50 / p99 / max (ms)", "10 ms poll p99 (ms)",
            "prepare lag, stamps p50 / p99 / max (ms)", "prepare seen by poll p50 / p99 (ms) [seen/published]",
            "bounded", "drain s", "CPU s: applier + target server", "WAL fsyncs / txn", "peak RSS MB",
            "load"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(runs, key=lambda r: (list(WORKLOADS).index(r.workload), r.rate, r.side)):
        prep = (f"{_ms(r.prepare_lag, 'p50', 'p99')} [{r.prepares_seen}/{r.prepares_published}]"
                if r.prepares_published else "—")  # fmt: skip
        stamp = _ms(r.prepare_lag_stamp, "p50", "p99", "max") if r.prepare_lag_stamp else "—"
        bounded = "yes" if r.bounded else "NO"
        if r.error:
            bounded += f" (error: {r.error[:120]})"
        extra = f", {r.big_txns} big, stream_txns {r.stream_txns}" if WORKLOADS[r.workload].big else ""
        lines.append("| " + " | ".join([
            r.workload, str(r.rate), r.side, _f(r.pgbench.get("tps"), ".0f"), _ms(r.lag, "p50", "p99", "max"),
            _ms(r.lag_poll, "p99") if r.lag_poll else "—", stamp, prep, bounded + extra,
            _f(r.drain_s, ".2f"), f"{_f(r.client_cpu_s, '.1f')} + {_f(r.server_cpu_s, '.1f')}", _per_txn(r),
            _f(r.worker_hwm_mb, ".0f"), _f(r.load1, ".1f"),
        ]) + " |")  # fmt: skip
    lines += ["", "| workload | sustainable: native | sustainable: ours |", "|---|---|---|"]
    for key in WORKLOADS:
        if any(r.workload == key for r in runs):
            lines.append(f"| {key} | {sustainable(runs, key, 'native')} | {sustainable(runs, key, 'ours')} |")
    lines += ["", *sorted({f"Commit lag: {r.lag_method}." for r in runs})]
    lines += sorted({f"Prepare lag seen by: {r.prepare_method}." for r in runs if r.prepares_published})
    if costs := [r for r in runs if r.prepare_poll]:
        lines.append("Prepare poll cost per run (polls, mean interval, CPU s of the bench thread + its target "
                     "backend): " + "; ".join(
                         f"{r.workload}/{r.rate}/{r.side} {r.prepare_poll['polls']:.0f}, "
                         f"{r.prepare_poll['interval_ms']:.2f} ms, {r.prepare_poll['client_cpu_s']:.2f} + "
                         f"{r.prepare_poll['backend_cpu_s']:.2f}" for r in costs) + ".")  # fmt: skip
    return "\n".join(lines)


def plot(runs: Sequence[SideRun], path: Path, title: str) -> str:
    """Lag over time, ours and native, one panel per workload and rate; returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is missing; install it with  pip install -e '.[bench]'  (or pip install matplotlib)"
    panels = sorted({(r.workload, r.rate) for r in runs}, key=lambda p: (list(WORKLOADS).index(p[0]), p[1]))
    cols = max(len([p for p in panels if p[0] == k]) for k in WORKLOADS if any(p[0] == k for p in panels))
    rows = [k for k in WORKLOADS if any(p[0] == k for p in panels)]
    fig, axes = plt.subplots(len(rows), cols, figsize=(4.2 * cols, 2.9 * len(rows)), squeeze=False)
    for i, key in enumerate(rows):
        mine = [p for p in panels if p[0] == key]
        for j in range(cols):
            ax = axes[i][j]
            if j >= len(mine):
                ax.axis("off")
                continue
            rate = mine[j][1]
            for r in sorted(runs, key=lambda r: r.side):  # native first: the same legend order in every panel
                if (r.workload, r.rate) == (key, rate) and r.series:
                    xs, ys = zip(*r.series, strict=True)
                    ax.plot(xs, [y * 1000 for y in ys], lw=0.8, label=f"{r.side} (p99 {r.lag['p99'] * 1000:.0f} ms)",
                            color="tab:blue" if r.side == "ours" else "tab:orange")  # fmt: skip
            ax.set_title(f"{key} at {rate} tps", fontsize=9)
            ax.set_xlabel("s since load start", fontsize=8)
            ax.set_ylabel("commit → visible lag (ms)", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.5)  # notifications resolve well under a millisecond; a commit takes longer
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 60 * cols)), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return f"chart: {path}"


# --- main -----------------------------------------------------------------------------------------------------------


def _freeze_code(rev: str) -> None:
    """Re-run this script against ``git archive <rev>`` (bench/_common.py's rerun_frozen says why)."""
    rerun_frozen(rev, ROOT, str(Path(__file__).resolve()), "live-bench-code-")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one rate per workload, 8 s loads (about 3 minutes)")
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of: " + ", ".join(WORKLOADS)
    )
    ap.add_argument("--rates", action="append", default=[], metavar="WORKLOAD=R1,R2",
                    help="rates (transactions/s) for one workload, e.g. tpcb=100,400")  # fmt: skip
    ap.add_argument("--no-step-up", action="store_true",
                    help="only the given rates; by default (not with --quick) the rate is then doubled while a "
                    "side's lag stays bounded and pgbench delivers it (at most --max-rate)")  # fmt: skip
    ap.add_argument("--max-rate", type=int, default=6400)
    ap.add_argument("--duration", type=float, help="seconds of load per run (default 60: a steady state, see the "
                    "module docstring; --quick 8)")  # fmt: skip
    ap.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for the last marker")
    ap.add_argument("--prepare-poll-ms", type=float, default=PREPARE_POLL_S * 1000,
                    help="interval of the target's pg_prepared_xacts poll (two-phase); the stamp lag does not "
                    "depend on it, the 'seen by poll' figure does, and a faster poll costs CPU (reported)")  # fmt: skip
    ap.add_argument("--marker-ms", type=float, default=MARKER_S * 1000,
                    help="interval of the commit-lag markers, the same on both sides (up to run 7: 75); p99 rests "
                    "on duration / interval markers")  # fmt: skip
    ap.add_argument("--pg", default="18", help="server version (15, 16, 18) or a bindir")
    ap.add_argument("--profile-dir", type=Path, help="run ours under py-spy (wall time, raw stacks); its lag is "
                    "then not comparable")  # fmt: skip
    ap.add_argument("--strace-dir", type=Path, help="run ours under strace -f -c (system call counts per run, "
                    "e.g. sends per transaction); its lag and CPU are then not comparable")  # fmt: skip
    ap.add_argument("--trace-dir", type=Path, help="strace the apply worker of each side during "
                    "the load and write each prepared transaction's timeline (bench/_trace.py); lags and CPU are "
                    "then not comparable")  # fmt: skip
    ap.add_argument(
        "--code-rev", metavar="REV", help="run the applier code of this commit (a frozen git archive)"
    )
    ap.add_argument("--json", type=Path, default=OUT_DIR / "live_bench.json")
    ap.add_argument("--chart", type=Path, help=f"the lag chart (default {CHART.relative_to(ROOT)}, with --quick "
                    "bench/out/live-lag.svg)")  # fmt: skip
    ap.add_argument(
        "--render", type=Path, metavar="JSON", help="only print the report (and chart) of a saved run"
    )
    args = ap.parse_args(argv)
    args.keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    if unknown := [k for k in args.keys if k not in WORKLOADS]:
        ap.error(f"unknown workload(s): {', '.join(unknown)}")
    args.rate_map = {k: (WORKLOADS[k].quick_rates if args.quick else WORKLOADS[k].rates) for k in args.keys}
    for item in args.rates:
        key, _, values = item.partition("=")
        if key not in WORKLOADS:
            ap.error(f"--rates: unknown workload {key!r}")
        args.rate_map[key] = tuple(int(v) for v in values.split(",") if v)
    args.step_up = not (args.no_step_up or args.quick)
    args.duration = args.duration or (8.0 if args.quick else 60.0)
    args.chart = (args.chart or (OUT_DIR / "live-lag.svg" if args.quick else CHART)).resolve()
    args.json = args.json.resolve()
    return args


def _progress(r: SideRun) -> None:
    print(f"  {r.workload:5} {r.rate:5} tps {r.side:6} pgbench {_f(r.pgbench.get('tps'), '.0f'):>6} tps, lag p50 / "
          f"p99 / max {_ms(r.lag, 'p50', 'p99', 'max')} ms (10 ms poll p99 {_ms(r.lag_poll, 'p99')}), prepare p99 "
          f"{_ms(r.prepare_lag, 'p99')} ms, WAL fsyncs/txn {_per_txn(r)}, "
          f"{'bounded' if r.bounded else 'UNBOUNDED'}, CPU {r.client_cpu_s:.1f}+{r.server_cpu_s:.1f} s, load "
          f"{r.load1:.1f}" + (f"  ERROR {r.error}" if r.error else ""), file=sys.stderr, flush=True)  # fmt: skip


def run_workload(env: Env, wl: Workload, rates: Sequence[int], step_up: bool, max_rate: int,
                 first: list[int]) -> list[SideRun]:  # fmt: skip
    """Every rate for both sides, alternating which goes first across all runs (``first`` carries the count)."""
    out: list[SideRun] = []
    todo = list(rates)
    while todo:
        rate = todo.pop(0)
        order = ["native", "ours"] if first[0] % 2 == 0 else ["ours", "native"]
        first[0] += 1
        here = []
        for side in order:
            r = run_side(env, wl, rate, side)
            _progress(r)
            here.append(r)
        out += here
        if step_up and not todo and rate * 2 <= max_rate:
            if any(r.ok and r.bounded for r in here) and all(r.delivered for r in here if r.ok):
                todo.append(rate * 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.code_rev and "APPLY_BENCH_CODE_ROOT" not in os.environ:
        _freeze_code(args.code_rev)
    if args.render:
        data = json.loads(args.render.read_text())
        runs = [
            SideRun(**{k: v for k, v in r.items() if k in SideRun.__dataclass_fields__}) for r in data["runs"]
        ]
        runs = [SideRun(**{**asdict(r), "series": [tuple(p) for p in r.series]}) for r in runs]
        print(data["header"] + "\n\n" + render(runs))
        print(plot(runs, args.chart, data["header"]))
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    started = datetime.now(UTC)
    load_start = loadavg()
    common = {"autovacuum": "off", "max_wal_size": "8GB", "checkpoint_timeout": "1h",
              "max_prepared_transactions": "200", "max_connections": "200"}  # fmt: skip
    binaries = find_binaries(args.pg)
    pubc = PostgresCluster(binaries, name="live-pub", durable=True, settings={**common, "fsync": "off"})
    tgtc = PostgresCluster(binaries, name="live-tgt", durable=True, settings=common)
    spool = Path(tempfile.mkdtemp(prefix="live-bench-tmp-"))
    runs: list[SideRun] = []
    header = ""
    try:
        pubc.start()
        tgtc.start()
        version = str(pubc.scalar("SHOW server_version"))
        header = (f"{started:%Y-%m-%d %H:%M} UTC; PostgreSQL {version}; Python {platform.python_version()}; commit "
                  f"{code_commit(ROOT)}; {os.cpu_count()} CPUs; load at start {load_start[0]:.1f}; {args.duration:.0f} s of "
                  f"load per run")  # fmt: skip
        print("live_bench " + header, file=sys.stderr, flush=True)
        if args.profile_dir:
            args.profile_dir = args.profile_dir.resolve()
            args.profile_dir.mkdir(parents=True, exist_ok=True)
        if args.strace_dir:
            args.strace_dir = args.strace_dir.resolve()
            args.strace_dir.mkdir(parents=True, exist_ok=True)
        if args.trace_dir:
            args.trace_dir = args.trace_dir.resolve()
            args.trace_dir.mkdir(parents=True, exist_ok=True)
        env = Env(pubc, tgtc, binaries.bindir, args.duration, args.drain_timeout, spool, args.profile_dir,
                  args.strace_dir, args.prepare_poll_ms / 1000, args.trace_dir, args.marker_ms / 1000)  # fmt: skip
        first = [0]
        for key in args.keys:
            runs += run_workload(env, WORKLOADS[key], args.rate_map[key], args.step_up, args.max_rate, first)
    finally:
        tgtc.destroy()
        pubc.destroy()
        shutil.rmtree(spool, ignore_errors=True)
    header += f"; load at end {loadavg()[0]:.1f}"
    report = render(runs)
    print("\n" + header + "\n\n" + report)
    args.json.write_text(json.dumps(
        {"version": JSON_VERSION, "header": header, "argv": sys.argv, "runs": [asdict(r) for r in runs]}, indent=1))  # fmt: skip
    (OUT_DIR / "live_bench.md").write_text(header + "\n\n" + report + "\n")
    print(plot(runs, args.chart, header))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
