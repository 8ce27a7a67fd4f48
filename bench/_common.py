"""Small helpers shared by the benchmarks: process figures from ``/proc``, content fingerprints, medians.

Why ``/proc`` and not ``ru_maxrss``: the processes we measure are not our children (the native apply worker is a
child of the target's postmaster; our worker is a grandchild, spawned by ``applier run``), and we want their figures
*before* they exit, while a run is still comparable. ``VmHWM`` is the kernel's peak resident set size of a process;
``RssAnon`` is its private (anonymous) part now. A PostgreSQL backend's ``VmHWM`` also counts the shared buffers it
touched, which is why both are reported.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import psycopg
from psycopg import sql

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcSample:
    """What ``/proc/<pid>`` says about one process at one moment (kB and CPU seconds)."""

    pid: int
    vm_hwm_kb: int
    vm_rss_kb: int
    rss_anon_kb: int
    cpu_s: float  # user + system
    sys_s: float  # system alone: for a backend, mostly WAL writes and fsyncs


def proc_sample(pid: int) -> ProcSample | None:
    """Peak/current memory and CPU time of ``pid``; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields: dict[str, int] = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            fields[key] = int(rest.split()[0])
    # the command name in field 2 may hold spaces and parentheses: split after the last ')'
    after = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(after[11]), int(after[12])
    return ProcSample(
        pid,
        fields.get("VmHWM", 0),
        fields.get("VmRSS", 0),
        fields.get("RssAnon", 0),
        (utime + stime) / _CLK_TCK,
        stime / _CLK_TCK,
    )


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, found by scanning ``/proc`` (``/proc/<pid>/task/*/children`` is not always
    compiled in)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, breadth first."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = [c for p in todo for c in children(p)]
        found += kids
        todo = kids
    return found


class PeakTracker:
    """Keeps the highest ``RssAnon`` seen per process over repeated samples (``VmHWM`` is already a peak), and CPU
    time from a starting mark (so that a process's start-up is not counted as its work)."""

    def __init__(self) -> None:
        self.anon_peak_kb: dict[int, int] = {}
        self.last: dict[int, ProcSample] = {}
        self.base_cpu: dict[int, float] = {}
        self.base_sys: dict[int, float] = {}

    def mark_base(self, pids: Iterable[int]) -> None:
        for pid in pids:
            s = proc_sample(pid)
            if s is not None:
                self.base_cpu[pid] = s.cpu_s
                self.base_sys[pid] = s.sys_s

    def cpu_since_base(self, pid: int) -> float | None:
        """CPU seconds between :meth:`mark_base` and the last sample (all of it when no mark was taken)."""
        last = self.last.get(pid)
        return None if last is None else last.cpu_s - self.base_cpu.get(pid, 0.0)

    def sys_since_base(self, pid: int) -> float | None:
        last = self.last.get(pid)
        return None if last is None else last.sys_s - self.base_sys.get(pid, 0.0)

    def sample(self, pids: Iterable[int]) -> None:
        for pid in pids:
            s = proc_sample(pid)
            if s is None:
                continue
            self.last[pid] = s
            self.anon_peak_kb[pid] = max(self.anon_peak_kb.get(pid, 0), s.rss_anon_kb)


def fingerprint(conn: psycopg.Connection, table: str, key: str = "id") -> tuple[int, str]:
    """(row count, md5 of every row's text in key order), computed by the server: byte-exact equality without
    shipping a million rows to Python."""
    row = conn.execute(
        sql.SQL(
            "SELECT count(*), md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t.{key}), '')) FROM {tbl} t"
        ).format(key=sql.Identifier(key), tbl=sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def wal_fsyncs(conn: psycopg.Connection) -> int | None:
    """WAL fsyncs of the whole cluster so far: ``pg_stat_io`` (PostgreSQL 18) or ``pg_stat_wal.wal_sync`` (≤ 17).

    Cluster-wide, so it is only meaningful over a window in which one subscriber alone writes; backends report
    their counts when they exit, walwriter at most once a second, so read it a moment after the writer stopped."""
    for query in (
        "SELECT sum(fsyncs)::bigint FROM pg_catalog.pg_stat_io WHERE object = 'wal'",
        "SELECT wal_sync FROM pg_catalog.pg_stat_wal",
    ):
        try:
            with conn.transaction():
                row = conn.execute(query).fetchone()
        except psycopg.Error:
            continue
        if row and row[0] is not None:
            return int(row[0])
    return None


def waldump_stats(bindir: str, waldir: str, start: str, end: str) -> dict[str, int]:
    """Record counts per ``rmgr/record type`` between two LSNs (``pg_waldump --stats=record``), plus ``_fpi``
    (full-page images) and ``_bytes``: how many local commits, prepares, heap inserts... one side wrote."""
    import subprocess

    res = subprocess.run(
        [f"{bindir}/pg_waldump", "--stats=record", "-p", waldir, "-s", start, "-e", end],
        capture_output=True,
        text=True,
        timeout=600,
    )
    counts: dict[str, int] = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        name = parts[0]
        if "/" in name:
            counts[name] = int(parts[1])
        elif name == "Total":
            counts["_records"] = int(parts[1])
            # Total  N  [bytes (%)]  [fpi bytes (%)]  [combined]: take the record and FPI byte totals
            nums = [p for p in parts[2:] if p.isdigit()]
            if len(nums) >= 2:
                counts["_record_bytes"], counts["_fpi_bytes"] = int(nums[0]), int(nums[1])
    if res.returncode != 0 and not counts:
        counts["_error"] = 1
    return counts


def rerun_frozen(rev: str, root: Path, script: str, prefix: str) -> NoReturn:
    """Re-run ``script`` (with this process's arguments) against ``git archive <rev>`` of the project at ``root``,
    unpacked in a temporary directory, and exit with its status.

    The workers a benchmark starts import whatever ``applier/`` holds at that moment: in a tree other people are
    editing, one benchmark could otherwise measure several versions. The benchmark process itself must import the
    same version (it writes the catalog the worker reads), hence the re-execution with ``APPLY_BENCH_CODE_ROOT``
    set before anything is imported from the project."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=root, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    env = dict(os.environ, APPLY_BENCH_CODE_ROOT=str(tmp), APPLY_BENCH_CODE_REV=rev, PYTHONPATH=str(tmp))
    try:
        rc = subprocess.run([sys.executable, script, *sys.argv[1:]], env=env).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(rc)


def code_commit(root: Path) -> str:
    """The code revision a benchmark measures, for its header: the ``--code-rev`` it was frozen at, else HEAD (and
    whether ``applier/`` or ``state/`` have uncommitted changes); ``?`` where git cannot tell."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", *a], cwd=root, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    frozen = os.environ.get("APPLY_BENCH_CODE_REV")
    if frozen:
        return git("rev-parse", "--short", frozen) + " (frozen with --code-rev)"
    dirty = git("status", "--porcelain", "--", "applier", "state")
    return git("rev-parse", "--short", "HEAD") + (
        " + uncommitted changes in applier/ or state/" if dirty else ""
    )


def cluster_cpu(cluster: Any) -> float:
    """CPU seconds the cluster has used so far: its postmaster plus every backend it has reaped (``cutime``)
    plus the live ones (``cluster``: an :class:`applier.testing.cluster.PostgresCluster`). Read from /proc (0.0
    elsewhere)."""
    try:
        pid = int((Path(cluster.datadir) / "postmaster.pid").read_text().split()[0])
        tick = os.sysconf("SC_CLK_TCK")

        def ticks(p: int, children: bool) -> int:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return sum(int(f) for f in fields[11 : 15 if children else 13])

        total = ticks(pid, True)
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                total += ticks(int(child), True)
            except OSError:  # exited meanwhile: counted in the postmaster's cutime
                pass
        return total / tick
    except (OSError, ValueError, IndexError):
        return 0.0
