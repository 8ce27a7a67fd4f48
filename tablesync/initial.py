"""The initial copy of a subscription's tables at one exported snapshot (docs/reference.md, "The life of a
subscription" 2).

Steps, each a method of :class:`InitialCopy` so tests can act between them:

1. :meth:`~InitialCopy.load` — read the subscription and its table states. Tables in ``s``/``r`` are left alone. A
   table in ``f`` finished its copy at its LSN in an earlier run: it becomes ``s`` with that LSN without a copy when
   the subscription's stream has not passed that point (its rows are exactly the publisher's there, and the stream
   applies what came after), and is copied again otherwise. Tables in ``i`` and ``d`` are copied.
2. :meth:`~InitialCopy.open_snapshot` — a replication connection creates a *temporary* slot with
   ``SNAPSHOT 'export'`` at consistent point Y. The connection then stays idle and open: the snapshot lives exactly
   as long as that (behaviour 117), and the temporary slot vanishes with it.
3. :meth:`~InitialCopy.plan` — inside the snapshot, read columns, publication column lists, row filters and sizes;
   cut every table into ctid page ranges.
4. :meth:`~InitialCopy.claim` — one target transaction per run: delete the tables' old partition markers (which
   waits for orphaned tasks of a killed run to finish, see :mod:`tablesync.copy`), empty tables left in ``d`` by
   that run, write this generation's claim row per table and set ``d``.
5. :meth:`~InitialCopy.copy` — the Spark job; the driver polls the markers for progress, writes
   ``srrows``/``srbytes``, and sets a table ``f`` (LSN Y) as soon as all its partitions are in.
6. :meth:`~InitialCopy.complete` — every copied table to ``s`` with LSN Y and its markers removed, in one
   transaction; then the snapshot connection is closed (dropping the temporary slot).

If the process dies anywhere, committed partitions stay committed with their markers, and the next run redoes the
unfinished tables at a new snapshot after emptying them: nothing is copied twice, nothing is lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from applier.catalog.store import Catalog, RelState, Subscription
from applier.errors import ApplierError
from applier.lsn import format_lsn, parse_lsn
from applier.replication import ReplicationConnection, ReplicationConnectionError
from state.tables import SyncState, TableState, settle_finished_copy
from tablesync import job as spark_job
from tablesync.copy import CLAIM_PART, HeadStart, connect
from tablesync.planner import (
    DEFAULT_PARTITION_BYTES,
    PartitionTask,
    PlanError,
    TablePlan,
    effective_columns,
    pack_tasks,
    partition_tasks,
    plan_table,
)
from tablesync.progress import CopyProgress
from tablesync.remote import fetch_remote_table, fetch_target_table

#: Table states whose table is (re)copied; ``s``/``r`` are done.
COPY_STATES = frozenset(s for s in SyncState if s.needs_table_sync)
#: How long a cancelled Spark job may take to end before the copy returns anyway (its tasks' work is rolled back
#: or, if committed, superseded by the next run's claim).
STOP_GRACE = 60.0
#: After this long, creating the slot is probably waiting for open (or prepared) transactions: say so.
SLOT_WAIT_NOTE_AFTER = 3.0


class TablesyncError(ApplierError):
    """The initial copy failed; the message says which table and why. Tables stay ``d``: the next run redoes them.

    ``relation``: the table that failed, when it is known (a plan error, a partition the target refused, a Spark
    job that left one table unfinished), so that ``applier status`` names it like an apply error's relation."""

    def __init__(self, message: str, *, relation: str | None = None) -> None:
        super().__init__(message)
        self.relation = relation


@dataclass(frozen=True)
class TableCopy:
    relname: str
    rows: int
    bytes: int
    partitions: int
    skipped_partitions: int  # partitions found already done (a retried task; only within one run)
    binary: bool
    text_reason: str | None = None


@dataclass(frozen=True)
class CopyResult:
    """What ``run_initial_copy`` did.

    ``snapshot_lsn`` is Y, the temporary slot's consistent point: every table in ``tables`` is now ``s`` with it
    (unless ``stopped``). ``resumed`` lists tables turned ``s`` from an earlier run's ``f`` without copying.
    """

    subname: str
    snapshot_lsn: int | None = None
    snapshot: str | None = None
    tables: dict[str, TableCopy] = field(default_factory=dict)
    resumed: dict[str, int] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # already s/r: left alone
    seconds: float = 0.0
    spark_seconds: float = 0.0
    stopped: bool = False

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tables.values())

    @property
    def completed(self) -> bool:
        return not self.stopped

    def __str__(self) -> str:
        return describe(self)


@dataclass
class ExportedSnapshot:
    """A snapshot exported by a slot's creation, alive while ``conn`` stays open and idle.

    :meth:`InitialCopy.open_snapshot` makes one with a temporary slot; a caller that already holds one (``applier
    migrate start``, whose subscription slot's snapshot also dumped the schema) passes it to :class:`InitialCopy`
    so the rows are read at that same point. Either way the copy closes ``conn`` when it is over."""

    conn: ReplicationConnection
    slot_name: str
    lsn: int
    snapshot: str


def _spark_error_summary(exc: BaseException) -> str:
    """The useful line of a Spark job failure (the Python exception raised in the task), not the JVM trace."""
    text = str(exc)
    found = re.findall(
        r"^((?:psycopg\.[\w.]+|tablesync\.[\w.]+|[\w.]*(?:Error|Exception))(?::[^\n]*)?)$", text, re.M
    )
    useful = [f for f in found if not f.startswith(("py4j", "org.apache", "java."))]
    if useful:
        return useful[-1].strip()
    return text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__


class InitialCopy:
    """One run of the initial copy for one subscription; see the module docstring for the steps."""

    def __init__(
        self,
        target_conninfo: str,
        subname: str,
        *,
        stop: threading.Event | None = None,
        reporter: CopyProgress | None = None,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
        poll_interval: float = 0.5,
        snapshot: ExportedSnapshot | None = None,
        weights: Mapping[str, float] | None = None,
        head_start: int | None = None,
    ) -> None:
        """``snapshot``: copy at this exported snapshot instead of taking one (closed with the copy). ``weights``:
        each table's share of the work behind it; the heaviest table's partitions go first. ``head_start``: the
        driver's streams while Spark starts, unless ``APPLIER_TABLESYNC_HEAD_START`` says (None: 2 with a local
        Spark, 0 with a cluster)."""
        self.target_conninfo = target_conninfo
        self.subname = subname
        self.stop = stop or threading.Event()
        self.reporter = reporter or CopyProgress("off")
        self.partition_bytes = partition_bytes
        self.poll_interval = poll_interval
        self.catalog = Catalog.connect(target_conninfo)
        self.sub: Subscription | None = None
        self.to_copy: list[RelState] = []
        self.skipped: list[str] = []
        self.resumed: dict[str, int] = {}
        self.slot: ExportedSnapshot | None = None
        self.given_snapshot, self.weights, self.head_start_streams = snapshot, weights, head_start
        self.plans: dict[str, TablePlan] = {}
        self.tasks: list[PartitionTask] = []
        self._started = time.monotonic()
        self._finished_tables: set[str] = set()
        self._skipped_parts: dict[str, int] = {}
        self.spark_seconds = 0.0
        self.head_start: HeadStart | None = None  # partitions the driver copies while Spark starts
        self._reporting = False  # the progress display has been started

    # 1 ----------------------------------------------------------------------------------------------------------
    def load(self) -> list[RelState]:
        """Read the subscription; settle tables an earlier run left in ``f``; return the tables to copy.

        An ``f`` table's rows are exactly the publisher's at its LSN. If the subscription's stream has not passed
        that point (the usual case: the copy runs before streaming), it becomes ``s`` there
        (:func:`state.tables.settle_finished_copy`). If the stream has gone past it — changes to the table were
        skipped while it was not yet ``s`` — it would need a catch-up from its LSN, which only a running live sync
        (:mod:`tablesync.live`) can do, with its temporary slot, gone by now: it is emptied and copied again
        instead, which is always correct.
        """
        self.catalog.ensure()
        self.sub = self.catalog.require(self.subname)
        states = self.catalog.table_states(self.sub.subid)
        stream_lsn = (
            _stream_position(self.catalog, self.sub, self.subname)
            if any(rs.state == SyncState.FINISHEDCOPY for rs in states)
            else 0
        )
        recopy: set[str] = set()
        with self.catalog.engine.begin() as c:
            for rs in states:
                if rs.state != SyncState.FINISHEDCOPY:
                    continue
                if rs.lsn is not None and self._settle(rs, stream_lsn, c):
                    continue
                recopy.add(rs.name)
                self.reporter.note(
                    f"{rs.name}: copied at {format_lsn(rs.lsn) if rs.lsn else '?'} but the stream is at "
                    f"{format_lsn(stream_lsn)}: copying it again"
                )
        self.skipped = [rs.name for rs in states if rs.state not in COPY_STATES]
        self.to_copy = [
            rs for rs in states if rs.state in (SyncState.INIT, SyncState.DATASYNC) or rs.name in recopy
        ]
        return self.to_copy

    def _settle(self, rs: RelState, stream_lsn: int, c: Any) -> bool:
        """An ``f`` table the stream has not passed becomes ``s`` (in ``c``, the caller's transaction), its markers
        gone; whether it did."""
        assert self.sub is not None and rs.lsn is not None
        settled = settle_finished_copy(TableState(rs.name, SyncState.FINISHEDCOPY, rs.lsn), stream_lsn)
        if settled.state is not SyncState.SYNCDONE:
            return False
        self.catalog.set_table_state(self.sub.subid, rs.relid, SyncState.SYNCDONE, settled.lsn, conn=c)
        self.catalog.delete_partition_markers(self.sub.subid, rs.name, c)
        self.resumed[rs.name] = rs.lsn
        return True

    @property
    def subid(self) -> int:
        assert self.sub is not None, "load() first"
        return self.sub.subid

    @property
    def publisher_conninfo(self) -> str:
        assert self.sub is not None, "load() first"
        return self.sub.subconninfo

    # 2 ----------------------------------------------------------------------------------------------------------
    def open_snapshot(self) -> ExportedSnapshot:
        """Create the temporary slot with an exported snapshot; keep its connection idle until :meth:`close`. A
        snapshot given to the constructor is used instead (once: a second call takes a new one)."""
        if self.given_snapshot is not None:
            self.slot, self.given_snapshot = self.given_snapshot, None
            self.reporter.note(
                f"copying at the given snapshot {self.slot.snapshot} ({format_lsn(self.slot.lsn)})"
            )
            return self.slot
        name = f"applier_{self.subid}_sync_{os.getpid()}_{secrets.token_hex(3)}"
        try:
            conn = ReplicationConnection.open(
                self.publisher_conninfo, application_name=f"{self.subname}_tablesync"
            )
        except ReplicationConnectionError as exc:
            raise TablesyncError(f"initial copy of {self.subname!r}: {exc}") from exc
        done = threading.Event()
        watcher = threading.Thread(
            target=_explain_slot_wait, args=(self.publisher_conninfo, self.reporter, done), daemon=True
        )
        watcher.start()
        try:
            info = conn.create_slot(name, temporary=True, snapshot="export")
        except BaseException as exc:
            conn.close()
            if isinstance(exc, ReplicationConnectionError):
                raise TablesyncError(f"initial copy of {self.subname!r}: {exc}") from exc
            raise
        finally:
            done.set()
        assert info.snapshot_name is not None
        self.slot = ExportedSnapshot(conn, info.slot_name, info.consistent_point, info.snapshot_name)
        self.reporter.note(
            f"snapshot {info.snapshot_name} taken at {format_lsn(info.consistent_point)} "
            f"(temporary slot {info.slot_name})"
        )
        return self.slot

    # 3 ----------------------------------------------------------------------------------------------------------
    def plan(self) -> list[PartitionTask]:
        """Read the tables' facts inside the snapshot and cut them into partition tasks."""
        assert self.slot is not None and self.sub is not None
        publications = list(self.sub.subpublications)
        plans: dict[str, TablePlan] = {}
        with (
            connect(self.publisher_conninfo, autocommit=True) as pconn,
            connect(self.target_conninfo, autocommit=True) as tconn,
        ):
            pconn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            pconn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self.slot.snapshot)))
            for rs in self.to_copy:
                try:
                    remote = fetch_remote_table(pconn, rs.remote_name, publications)
                    # the published columns only, as the native check (logicalrep_rel_open) sees them
                    cols = effective_columns(remote)
                    schema, table, ttypes = fetch_target_table(tconn, rs.relid, cols)
                    plans[rs.name] = plan_table(
                        relid=rs.relid, target_schema=schema, target_name=table, relname=rs.name,
                        remote=remote, target_types=ttypes, partition_bytes=self.partition_bytes,
                    )  # fmt: skip
                except PlanError as exc:
                    raise TablesyncError(f"cannot copy {rs.name}: {exc}", relation=rs.name) from exc
            pconn.execute("COMMIT")
        self.plans = plans
        for p in plans.values():
            if not p.binary:
                self.reporter.note(f"{p.relname}: text format ({p.text_reason})")
        self.tasks = _ordered(partition_tasks(
            list(plans.values()), subid=self.subid, snapshot=self.slot.snapshot,
            run_as_owner=self.sub is not None and self.sub.subrunasowner,
        ), self.weights)  # fmt: skip
        return self.tasks

    # 4 ----------------------------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the tables for this copy generation (see the module docstring, step 4)."""
        assert self.slot is not None
        with self.catalog.engine.begin() as c:
            raw = c.connection.driver_connection
            assert raw is not None
            for rs in self.to_copy:
                plan = self.plans[rs.name]
                # Only rows a copy of ours committed are removed: a whole earlier copy (``f``: copied again because
                # the stream had moved past it), or the partitions an interrupted attempt committed with their
                # markers (``d``). Rows that were on the target before any copy stay, so a copy that failed on them
                # (a unique violation) fails again on the retry, as PostgreSQL's table sync does, until the user
                # deals with them.
                ours = rs.state == SyncState.FINISHEDCOPY or (
                    rs.state == SyncState.DATASYNC
                    and self.catalog.has_partition_markers(self.subid, rs.name, c)
                )
                # Deleting the old markers waits for any task of a killed run that still holds its claim row.
                self.catalog.delete_partition_markers(self.subid, rs.name, c)
                if ours:
                    _empty(raw, plan)
                self.catalog.claim_partitions(self.subid, rs.name, self.slot.snapshot, CLAIM_PART, c)
                self.catalog.set_table_state(self.subid, rs.relid, SyncState.DATASYNC, None, conn=c)
                self.catalog.set_table_progress(self.subid, rs.relid, 0, 0, conn=c)

    # 5 ----------------------------------------------------------------------------------------------------------
    def markers(self) -> dict[str, dict[int, tuple[int, int]]]:
        """This generation's committed partitions: ``{relname: {part: (rows, bytes)}}``."""
        assert self.slot is not None
        return self.catalog.partition_markers(self.subid, self.slot.snapshot)

    def _record_progress(self, markers: Mapping[str, Mapping[int, tuple[int, int]]]) -> None:
        """Write srrows/srbytes for ``applier status``, and turn finished tables ``f`` (LSN Y) at once."""
        assert self.slot is not None
        with self.catalog.engine.begin() as c:
            for relname, parts in markers.items():
                plan = self.plans.get(relname)
                if plan is None or relname in self._finished_tables:
                    continue
                rows = sum(r for r, _ in parts.values())
                nbytes = sum(b for _, b in parts.values())
                self.catalog.set_table_progress(self.subid, plan.relid, rows, nbytes, conn=c)
                if len(parts) >= len(plan.ranges):
                    self.catalog.set_table_state(
                        self.subid, plan.relid, SyncState.FINISHEDCOPY, self.slot.lsn, conn=c
                    )
                    self._finished_tables.add(relname)

    def copy(self, session: Any, *, leave_rest: bool = False) -> bool:
        """Run the Spark job, polling progress; return False if ``stop`` interrupted it.

        Without a session, nothing is left for Spark: this waits for the driver's head start to end instead (it
        may be copying everything, see :meth:`run`), with the same progress; ``leave_rest`` then lets it end with
        partitions still missing (those it failed, which the caller hands to Spark)."""
        assert self.slot is not None
        self._start_reporting()
        tag = f"applier-tablesync-{self.subid}-{secrets.token_hex(4)}"
        outcome: dict[str, Any] = {}

        head_done = self.head_start.done if self.head_start is not None else frozenset()
        tasks = [t for t in self.tasks if t.task_id not in head_done]
        started = time.monotonic()
        worker = self._job_thread(session, tasks, tag, outcome)
        worker.start()
        stopped = self._follow(worker, session, tag)
        if session is not None:
            self.spark_seconds = time.monotonic() - started
        if self.head_start is not None:
            head_done = self.head_start.join()
        final = self.markers()
        self._record_progress(final)
        self.reporter.update(final)
        missing = [name for name, plan in self.plans.items() if len(final.get(name, {})) < len(plan.ranges)]
        if stopped and ("error" in outcome or missing):
            return False  # (a stop that came too late to interrupt anything lets the copy complete)
        for r in outcome.get("results", []):
            if r.skipped and r.task_id not in head_done:  # (not a retry: the driver's head start copied it)
                self._skipped_parts[r.relname] = self._skipped_parts.get(r.relname, 0) + 1
        self._raise_if_incomplete(outcome, missing, may_leave_rest=leave_rest and session is None)
        return True

    def _start_reporting(self) -> None:
        if not self._reporting:
            self._reporting = True
            self.reporter.start(
                {name: {i: t.pages for i, t in enumerate(_tasks_of(self.tasks, name))} for name in self.plans}
            )

    def _job_thread(self, session: Any, tasks: list[PartitionTask], tag: str,
                    outcome: dict[str, Any]) -> threading.Thread:  # fmt: skip
        """The thread (not started) that runs the Spark job over ``tasks``, its results or error into ``outcome``;
        without a session, it waits for the driver's head start instead."""

        def run() -> None:
            if session is None:
                if self.head_start is not None:
                    self.head_start.wait()
                return
            try:
                bins = pack_tasks(
                    tasks, target_bytes=self.partition_bytes,
                    min_bins=2 * spark_job.default_parallelism(session),
                )  # fmt: skip
                outcome["results"] = spark_job.run_partition_tasks(
                    session, tasks, self.publisher_conninfo, self.target_conninfo, bins=bins, tag=tag
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the driver thread
                outcome["error"] = exc

        return threading.Thread(target=run, name="tablesync-spark-job", daemon=True)

    def _follow(self, worker: threading.Thread, session: Any, tag: str) -> bool:
        """Record and show the progress while ``worker`` runs; on ``stop``, cancel the job (or the head start) and
        wait :data:`STOP_GRACE` at most. Whether a stop was asked for."""
        last: dict[str, dict[int, tuple[int, int]]] = {}
        stopped = False
        stopped_at = 0.0
        while worker.is_alive():
            worker.join(self.poll_interval)
            if stopped and time.monotonic() - stopped_at > STOP_GRACE:
                self.reporter.note(f"the Spark job did not stop within {STOP_GRACE:.0f}s; leaving it behind")
                break
            if self.stop.is_set() and not stopped:
                stopped, stopped_at = True, time.monotonic()
                self.reporter.note("stop requested: cancelling the copy (finished partitions are kept)")
                if session is None and self.head_start is not None:
                    self.head_start.stop()
                with contextlib.suppress(Exception):
                    spark_job.cancel_job(session, tag)
            with contextlib.suppress(Exception):
                m = self.markers()
                if m != last:
                    last = m
                    self._record_progress(m)
                    self.reporter.update(m)
        return stopped

    def _raise_if_incomplete(
        self, outcome: dict[str, Any], missing: list[str], *, may_leave_rest: bool
    ) -> None:
        """Fail the copy if the job failed, or if partitions are missing (unless the driver's head start may leave
        some for Spark); the failing table is known when it is the only one left unfinished."""
        unfinished = missing[0] if len(missing) == 1 else None
        if "error" in outcome:
            raise TablesyncError(
                f"initial copy of subscription {self.subname!r} failed: {_spark_error_summary(outcome['error'])}",
                relation=getattr(outcome["error"], "relname", None) or unfinished,
            ) from outcome["error"]
        if missing and not may_leave_rest:
            raise TablesyncError(
                f"initial copy finished without every partition of: {', '.join(missing)}", relation=unfinished
            )

    # 6 ----------------------------------------------------------------------------------------------------------
    def complete(self) -> CopyResult:
        """Every copied table to ``s`` with LSN Y, markers removed, in one transaction."""
        return self.finish_tables(SyncState.SYNCDONE)

    def finish_tables(self, state: SyncState) -> CopyResult:
        """Every copied table to ``state`` (``s``; or ``f`` for a live sync, which joins the apply stream later)
        with LSN Y, markers removed, in one transaction."""
        assert self.slot is not None
        final = self.markers()
        tables: dict[str, TableCopy] = {}
        with self.catalog.engine.begin() as c:
            for relname, plan in self.plans.items():
                parts = final.get(relname, {})
                rows = sum(r for r, _ in parts.values())
                nbytes = sum(b for _, b in parts.values())
                self.catalog.set_table_state(self.subid, plan.relid, state, self.slot.lsn, conn=c)
                self.catalog.set_table_progress(self.subid, plan.relid, rows, nbytes, conn=c)
                self.catalog.delete_partition_markers(self.subid, relname, c)
                tables[relname] = TableCopy(
                    relname, rows, nbytes, len(plan.ranges), self._skipped_parts.get(relname, 0), plan.binary,
                    plan.text_reason,
                )  # fmt: skip
        self.reporter.finish()
        return self.result(tables)

    def result(self, tables: dict[str, TableCopy] | None = None, *, stopped: bool = False) -> CopyResult:
        return CopyResult(
            subname=self.subname, snapshot_lsn=self.slot.lsn if self.slot else None,
            snapshot=self.slot.snapshot if self.slot else None, tables=tables or {}, resumed=dict(self.resumed),
            skipped=tuple(self.skipped), seconds=time.monotonic() - self._started,
            spark_seconds=self.spark_seconds, stopped=stopped,
        )  # fmt: skip

    def close(self) -> None:
        """Close the snapshot connection: the snapshot ends and a temporary slot is dropped (a given snapshot
        that was not used is closed too: the caller handed it over)."""
        for held in (self.slot, self.given_snapshot):
            if held is not None:
                with contextlib.suppress(Exception):
                    held.conn.close()
        self.catalog.engine.dispose()

    # all --------------------------------------------------------------------------------------------------------
    def run(
        self, *, spark_master: str | None = None, spark_conf: Mapping[str, str] | None = None
    ) -> CopyResult:
        try:
            if not self.load():
                return self.result()
            if self.stop.is_set():
                return self.result(stopped=True)
            return _copy_at_snapshot(self, spark_master, dict(spark_conf or {}))
        finally:
            self.close()


# The steps' helpers that need nothing of a copier but what they are given (module functions keep the class to
# its steps, which subclasses override: tablesync.live.LiveCopy, and the migration's copy at its own snapshot).


def _stream_position(catalog: Catalog, sub: Subscription, subname: str) -> int:
    """Where the subscription's stream resumes: the latest of its origin's progress, the slot's start X and the
    slot's ``confirmed_flush_lsn`` on the publisher.

    The last one matters after a live table sync (:mod:`tablesync.live`): while a table is copied, the stream
    skips its changes and reports them flushed, so the publisher moves the slot past them and a restart resumes
    there (behaviour 5), beyond the origin; those transactions are never sent again.
    """
    confirmed = 0
    if sub.subslotname:
        try:
            with connect(sub.subconninfo, autocommit=True) as pconn:
                row = pconn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = %s",
                    (sub.subslotname,),
                ).fetchone()
        except psycopg.Error as exc:
            raise TablesyncError(
                f"initial copy of {subname!r}: cannot read the position of slot "
                f"{sub.subslotname!r} on the publisher: {' '.join(str(exc).split())}"
            ) from exc
        if row and row[0]:
            confirmed = parse_lsn(row[0])
    with catalog.engine.connect() as c:
        progress = c.execute(
            sa.text(
                "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_replication_origin WHERE roname = :o)"
                " THEN pg_replication_origin_progress(:o, false)::text END"
            ),
            {"o": sub.origin_name},
        ).scalar()
    lsn = parse_lsn(progress) if progress else 0
    return max(lsn, sub.subslotconsistentlsn or 0, confirmed)


def _explain_slot_wait(publisher_conninfo: str, reporter: CopyProgress, done: threading.Event) -> None:
    """Creating a slot waits for every transaction open on the publisher, prepared ones included (they can
    stay open for ever): if it takes long, tell the user what it waits for."""
    if done.wait(SLOT_WAIT_NOTE_AFTER):
        return
    detail = ""
    with contextlib.suppress(Exception), psycopg.connect(publisher_conninfo, autocommit=True) as c:
        open_x, prepared = c.execute(
            "SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
            " AND pid <> pg_backend_pid()), (SELECT count(*) FROM pg_prepared_xacts)"
        ).fetchone()  # type: ignore[misc]
        detail = f" ({open_x} open, {prepared} prepared: COMMIT/ROLLBACK PREPARED ends those)"
    if not done.is_set():
        reporter.note(
            "waiting for the transactions open on the publisher to finish before the snapshot can be taken"
            + detail
        )


def _empty(raw: Any, plan: TablePlan) -> None:
    """Remove what an interrupted copy left: TRUNCATE, or DELETE (replica role: no FK triggers) when other
    tables' foreign keys forbid TRUNCATE."""
    tbl = sql.Identifier(plan.target_schema, plan.target_name)
    raw.execute("SAVEPOINT applier_empty")
    try:
        raw.execute(sql.SQL("TRUNCATE ONLY {}").format(tbl))
    except psycopg.errors.FeatureNotSupported:
        raw.execute("ROLLBACK TO SAVEPOINT applier_empty")
        raw.execute("SET LOCAL session_replication_role = replica")
        raw.execute(sql.SQL("DELETE FROM ONLY {}").format(tbl))
    raw.execute("RELEASE SAVEPOINT applier_empty")


# Where the partitions are copied (the driver's head start, Spark, or both): :meth:`InitialCopy.run`'s policy
# over the steps. It calls each step on the copier, so a subclass's override of a step still applies.


def _tasks_of(tasks: list[PartitionTask], relname: str) -> list[PartitionTask]:
    return sorted((t for t in tasks if t.relname == relname), key=lambda t: t.part)


def _ordered(tasks: list[PartitionTask], weights: Mapping[str, float] | None) -> list[PartitionTask]:
    """The heaviest table's partitions first when ``weights`` are given (its later work, e.g. index builds, then
    overlaps the copy of the others). The driver's streams (:class:`~tablesync.copy.HeadStart`) take tasks from the
    *end* of the list (meant to take the smallest while a Spark job takes the biggest), so the order is reversed
    here; a Spark job packs the tasks by size itself and ignores it."""
    if weights is None:
        return tasks
    first = sorted(tasks, key=lambda t: (-weights.get(t.relname, 0.0), t.relname, t.part))
    return first[::-1]


def _copy_at_snapshot(
    copier: InitialCopy, spark_master: str | None, spark_conf: dict[str, str]
) -> CopyResult:
    """Take the snapshot, plan and claim the partitions, and copy them (:func:`copy_claimed`)."""
    # Unless Spark would add nothing (see copy_claimed), it starts in the background now: the JVM takes seconds,
    # and the next three steps need none.
    spark_later = _spark_adds_nothing(*_driver_streams(copier, spark_master))
    starter = None if spark_later else spark_job.SessionStarter(spark_master, spark_conf)
    try:
        copier.open_snapshot()
        copier.plan()
        copier.claim()
    except BaseException:
        if starter is not None:
            starter.release()
        raise
    if copier.stop.is_set():
        if starter is not None:
            starter.abandon()
            starter.release()
        return copier.result(stopped=True)
    return copy_claimed(copier, spark_master, spark_conf, starter)


def _driver_streams(copier: InitialCopy, spark_master: str | None) -> tuple[int, int | None]:
    """The driver's head-start streams and the tasks a local Spark would run at once (None: not local)."""
    # The driver copies while a local Spark starts (tablesync.copy.HeadStart): on one machine its processes
    # and Spark's local executors share the same cores anyway; a cluster does the copying.
    default_streams = copier.head_start_streams
    if default_streams is None:
        default_streams = 2 if spark_job.runs_locally(spark_master) else 0
    streams = int(os.environ.get("APPLIER_TABLESYNC_HEAD_START", str(default_streams)) or 0)
    return streams, spark_job.local_parallelism(spark_master)


def _spark_adds_nothing(streams: int, parallelism: int | None) -> bool:
    """A local Spark would run no more tasks at once than the driver's streams copy."""
    return streams > 0 and parallelism is not None and parallelism <= streams


def copy_claimed(
    copier: InitialCopy,
    spark_master: str | None,
    spark_conf: Mapping[str, str] | None,
    starter: spark_job.SessionStarter | None = None,
) -> CopyResult:
    """Copy the partitions the copier has claimed, ending with :meth:`InitialCopy.complete`: on the driver first,
    with Spark for what is left.

    A local Spark that would run no more tasks at once than the driver's streams adds nothing but its start-up
    (several CPU-seconds of JVM on the cores the copy needs): it is started only if the driver leaves partitions
    over (one failed), to copy those. Otherwise Spark starts (or ``starter`` has started it) while the driver
    copies, and takes over what is left once it is ready."""
    streams, parallelism = _driver_streams(copier, spark_master)
    try:
        _start_head_start(copier, streams)
        if starter is None and copier.head_start is not None and _spark_adds_nothing(streams, parallelism):
            done = _copy_on_driver(copier, streams, parallelism)
            if done is not None:
                return done
        if starter is None:
            starter = spark_job.SessionStarter(spark_master, dict(spark_conf or {}))
        return _copy_with_spark(copier, starter, streams)
    finally:
        if copier.head_start is not None:
            copier.head_start.join()
        if starter is not None:
            starter.release()


def _start_head_start(copier: InitialCopy, streams: int) -> None:
    if streams <= 0:
        return
    try:
        copier.head_start = HeadStart(
            copier.tasks, copier.publisher_conninfo, copier.target_conninfo, streams=streams
        )
    except Exception as exc:  # noqa: BLE001 - e.g. a daemonic process may not start children
        copier.reporter.note(f"copying with Spark only ({exc})")


def _copy_on_driver(copier: InitialCopy, streams: int, parallelism: int | None) -> CopyResult | None:
    """Spark not started yet: the driver copies everything it can; the result if that was all (or a stop),
    None when partitions are left over for Spark."""
    assert copier.head_start is not None
    copier.reporter.note(
        f"copying on the driver with {streams} stream(s): a local Spark would run {parallelism} "
        "task(s) at once on the same cores, and is started only for partitions left over"
    )
    if not copier.copy(None, leave_rest=True):
        return copier.result(stopped=True)
    _raise_head_start_failure(copier)
    left = len(copier.tasks) - len(copier.head_start.done)
    if not left:
        return copier.complete()
    copier.reporter.note(f"the driver left {left} partition(s): starting Spark to copy them")
    return None


def _copy_with_spark(copier: InitialCopy, starter: spark_job.SessionStarter, streams: int) -> CopyResult:
    """Wait for Spark, unless the driver's head start copies everything first (then Spark is not needed), and
    run the job over what the driver has not copied."""
    while copier.head_start is not None and not starter.ready(0.1):
        if copier.stop.is_set():
            starter.abandon()
            return copier.result(stopped=True)
        if copier.head_start.failure is not None:
            starter.abandon()
            _raise_head_start_failure(copier)
        if len(copier.head_start.done) == len(copier.tasks):
            return _finished_by_driver(copier, starter, "every partition before Spark was ready")
    handle = starter.handle()
    if copier.head_start is not None and len(copier.tasks) - len(copier.head_start.done) <= streams:
        # what is left is already under way in the driver: a Spark job would only wait for it
        if len(copier.head_start.wait()) == len(copier.tasks):
            return _finished_by_driver(copier, starter, "the last partitions as Spark got ready")
    if copier.head_start is not None:
        copier.head_start.stop()
        # a refusal the driver met while Spark got ready: the job would only meet it again
        _raise_head_start_failure(copier)
        copier.reporter.note(
            f"Spark ready after {starter.ready_after or 0:.1f}s; meanwhile the driver copied "
            f"{len(copier.head_start.done)}/{len(copier.tasks)} partition(s)"
        )
    if handle.ui_url:
        copier.reporter.note(f"Spark UI: {handle.ui_url}")
    elif handle.remote:
        copier.reporter.note(f"Spark Connect: {handle.remote}")
    if not copier.copy(handle.session):
        return copier.result(stopped=True)
    return copier.complete()  # before stopping Spark: the tables are ready a little sooner


def _raise_head_start_failure(copier: InitialCopy) -> None:
    """Fail the copy with the error of a partition the target refused outright (a unique or check constraint
    violation, a value it cannot take): Spark would only meet it again, after starting a JVM."""
    failure = copier.head_start.failure if copier.head_start is not None else None
    if failure is not None:
        raise TablesyncError(
            f"initial copy of subscription {copier.subname!r} failed: {failure}",
            relation=copier.head_start.failure_relation if copier.head_start is not None else None,
        )


def _finished_by_driver(copier: InitialCopy, starter: spark_job.SessionStarter, what: str) -> CopyResult:
    """The driver's head start copied everything: Spark (still starting, or just ready) is let go."""
    copier.reporter.note(f"the driver copied {what}: Spark not needed")
    starter.abandon()
    return copier.complete() if copier.copy(None) else copier.result(stopped=True)


def describe(result: CopyResult) -> str:
    """One line for logs: what was copied at which snapshot point."""
    if result.stopped:
        return f"initial copy of {result.subname} stopped; unfinished tables are redone on the next run"
    if not result.tables and result.resumed:
        return f"initial copy of {result.subname}: {len(result.resumed)} table(s) finished by an earlier run"
    if not result.tables:
        return f"initial copy of {result.subname}: nothing to copy"
    lsn = format_lsn(result.snapshot_lsn) if result.snapshot_lsn is not None else "?"
    text = (
        f"initial copy of {result.subname}: {len(result.tables)} table(s), {result.rows:,} rows, "
        f"{result.bytes / 1e6:.1f} MB at {lsn} in {result.seconds:.1f}s "
        + (f"(Spark job {result.spark_seconds:.1f}s)" if result.spark_seconds else "(copied by the driver)")
    )
    if result.resumed:
        text += f"; {len(result.resumed)} table(s) finished by an earlier run"
    return text
