"""What the demo shows while it runs: one snapshot of both servers, rendered as a live terminal view (rich) or as
plain log lines when there is no terminal.

The snapshot is read from the same places an operator would look: ``applier status`` (catalog, origin, publisher
slot), ``pg_prepared_xacts`` on both sides, and the target's commit counter for the apply rate. Prepared
transactions are paired across the servers by the publisher's xid, which is part of our GID
(``pg_gid_<subid>_<xid>``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from applier.demo.workload import WorkloadStats
from applier.subscriptions import status
from applier.testing import Database
from state.tables import SyncState
from state.twophase import TwoPhaseState

#: What the demo calls each state; keyed by the enums, looked up with the status document's letters (equal to them)
STATE_NAMES = {
    SyncState.INIT: "init",
    SyncState.DATASYNC: "copying",
    SyncState.FINISHEDCOPY: "copied",
    SyncState.SYNCDONE: "synced",
    SyncState.READY: "ready",
    SyncState.SYNCWAIT: "syncwait",
    SyncState.CATCHUP: "catchup",
}
TWO_PHASE_NAMES = {s: s.name.lower() for s in TwoPhaseState}


@dataclass
class Snapshot:
    elapsed: float
    status: dict[str, Any]
    publisher_prepared: list[tuple[str, int]]  # (gid, xid)
    target_prepared: list[str]
    target_commits: int
    commits_per_second: float
    workload: WorkloadStats
    two_phase_history: list[tuple[float, str]] = field(default_factory=list)


class Watcher:
    """Takes snapshots and remembers what the view needs across them (rates, the tri-state's history)."""

    def __init__(self, publisher: Database, target: Database, subname: str, workload: WorkloadStats) -> None:
        self.publisher, self.target, self.subname, self.workload = publisher, target, subname, workload
        self.started = time.monotonic()
        self.history: list[tuple[float, str]] = []
        self._last_commits: tuple[float, int] | None = None
        self._rate = 0.0

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        [st] = status(self.target.dsn, self.subname, publisher_timeout=3)
        if not self.history or self.history[-1][1] != st["two_phase"]:
            self.history.append((now - self.started, st["two_phase"]))
        pub_prepared = [
            (g, int(x))
            for g, x in self.publisher.query(
                "SELECT gid, transaction::text FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared"
            )
        ]
        tgt_prepared = [
            g
            for (g,) in self.target.query(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared"
            )
        ]
        commits = int(
            self.target.scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        )
        if self._last_commits is not None and now > self._last_commits[0]:
            self._rate = (commits - self._last_commits[1]) / (now - self._last_commits[0])
        self._last_commits = (now, commits)
        return Snapshot(
            now - self.started,
            st,
            pub_prepared,
            tgt_prepared,
            commits,
            self._rate,
            dataclasses.replace(self.workload),
            list(self.history),
        )


def _lag(st: dict[str, Any]) -> str:
    rep = st.get("replication", {})
    lag_b, lag_s = rep.get("lag_bytes"), rep.get("lag_seconds")
    b = "?" if lag_b is None else f"{lag_b:,} bytes"
    s = "" if lag_s is None else f", {lag_s:.2f} s"
    return b + s


def _history(snap: Snapshot) -> str:
    return " → ".join(
        f"{TWO_PHASE_NAMES.get(state, state)} ({at:.1f}s)" for at, state in snap.two_phase_history
    )


def render(snap: Snapshot) -> Group:
    st = snap.status
    head = Table.grid(padding=(0, 2))
    head.add_row(
        "subscription",
        f"[bold]{st['name']}[/] (subid {st['subid']}), {'enabled' if st['enabled'] else 'DISABLED'}",
    )
    head.add_row(
        "two-phase",
        f"[bold]{TWO_PHASE_NAMES.get(st['two_phase'], st['two_phase'])}[/]   history: {_history(snap)}",
    )
    head.add_row("worker", str(st.get("worker") or "-"))
    head.add_row("lag", _lag(st))
    head.add_row("target commits/s", f"{snap.commits_per_second:,.0f}")
    w = snap.workload
    head.add_row(
        "publisher workload",
        f"{w.committed} committed, {w.prepared} prepared, {w.commit_prepared} commit "
        f"prepared, {w.rollback_prepared} rollback prepared",
    )
    if st.get("last_error"):
        head.add_row("last error", Text(st["last_error"]["message"][:200], style="red"))

    tables = Table(title="tables", expand=False)
    for col in ("table", "state", "rows copied"):
        tables.add_column(col)
    for t in st["tables"]:
        tables.add_row(t["name"], STATE_NAMES.get(t["state"], t["state"]), f"{t['rows']:,}")

    prepared = Table(title="prepared transactions (publisher ↔ target)", expand=False)
    prepared.add_column("publisher GID")
    prepared.add_column("xid")
    prepared.add_column("target GID")
    target = set(snap.target_prepared)
    subid = st["subid"]
    paired: set[str] = set()
    for gid, xid in snap.publisher_prepared:
        local = f"pg_gid_{subid}_{xid}"
        shown = local if local in target else "[dim]not yet prepared[/]"
        paired.add(local)
        prepared.add_row(gid, str(xid), shown)
    for gid in snap.target_prepared:
        if gid not in paired:
            prepared.add_row("[dim]resolved[/]", "", f"{gid} [dim](resolving)[/]")
    if not snap.publisher_prepared and not snap.target_prepared:
        prepared.add_row("[dim]none[/]", "", "[dim]none[/]")
    return Group(Panel(head, title=f"applier demo — {snap.elapsed:.0f}s"), tables, prepared)


def plain_line(snap: Snapshot) -> str:
    st = snap.status
    states = ",".join(sorted({t["state"] for t in st["tables"]}))
    w = snap.workload
    return (
        f"[{snap.elapsed:6.1f}s] two_phase={st['two_phase']} tables={states} lag={_lag(st)} "
        f"target_commits/s={snap.commits_per_second:.0f} publisher_prepared={len(snap.publisher_prepared)} "
        f"target_prepared={len(snap.target_prepared)} workload={w.committed}c/{w.prepared}p/"
        f"{w.commit_prepared}cp/{w.rollback_prepared}rp"
    )
