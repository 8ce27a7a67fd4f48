"""``applier migrate status``, ``cutover`` and ``abort``.

Cutover, in order: fence the source (:mod:`applier.migrate.fence`), wait for its prepared transactions to be
decided (``--prepared wait``), take the source's current WAL position as the end position and wait until the target
has applied it, set every sequence from the source (checking each is past the largest value of the column it
belongs to), put the ``GENERATED ALWAYS`` identity columns back, verify (row counts, or ``full``: ``applier verify``),
then mark the migration ``done`` and the subscription disabled in one target transaction. ``start`` sees that and
exits 0; then the slot and publication are dropped from the source, which stays fenced: it is the old server now.

``--prepared carry`` (:mod:`applier.migrate.carry`) does not wait for the source's prepared transactions: they are
prepared on the target under the same GIDs, and rolled back on the source once its slot is gone. ``--reverse``
(:mod:`applier.migrate.reverse`) leaves the old server subscribed to the new one, from the end position.
Any failure before ``done`` unfences the source, puts the migration back to ``following`` and exits 1 with the
reason: nothing is half switched. The write downtime reported is from the fence to ``done``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from applier import slots, verify
from applier.catalog import sql as catalog_sql
from applier.catalog.store import origin_name
from applier.lsn import parse_lsn
from applier.migrate import carry as carrying
from applier.migrate import counts as counting
from applier.migrate import fence as fencing
from applier.migrate import reverse as reversing
from applier.migrate import sequences as seqs
from applier.migrate import store
from applier.migrate.state import MigrationError
from applier.migrate.steps import CUTOVER_KINDS, StepKind

#: The cutover's steps that its switch runs (the refresh runs before the verification, :mod:`.matviews`).
_SWITCH_KINDS = (StepKind.CUTOVER_IDENTITY, StepKind.CUTOVER_EVENT_TRIGGER)

__all__ = [
    "CutoverOptions",
    "abort",
    "cutover",
    "drop_slot",
    "dumps",
    "format_status",
    "ready_for_cutover",
    "status",
]


def _require(target: psycopg.Connection[Any], name: str) -> store.Migration:
    m = store.load(target, name)
    if m is None:
        raise MigrationError(f'migration "{name}" does not exist on this target (see: applier migrate start)')
    return m


def _subscription(target: psycopg.Connection[Any], m: store.Migration) -> tuple[int, str] | None:
    row = target.execute(catalog_sql.SUBSCRIPTION_ID_AND_SLOT, (m.subname,)).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


# --- status ------------------------------------------------------------------------------------------------------


def status(target_conninfo: str, name: str) -> dict[str, Any]:
    """Phase, tables, post-data progress, lag (``lag_bytes``/``lag_seconds``: None when they cannot be told)."""
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        m = _require(target, name)
        tables = [
            {"name": r[0], "state": r[1], "rows": r[2], "bytes": r[3]}
            for r in target.execute(catalog_sql.SUBSCRIPTION_TABLE_PROGRESS, (m.subname,))
        ]
        done, total = store.post_data_progress(target, name, CUTOVER_KINDS)
        sub = _subscription(target, m)
        origin = _applied(target, sub[0]) if sub is not None else None
        carried = carrying.prepared_on_target(target, sub[0]) if sub is not None else []
        deferred = store.steps_to_run(target, name, _SWITCH_KINDS) if m.phase == "done" else []
        pending = [s for step in deferred for s in step.statements]
    doc: dict[str, Any] = {
        "name": name,
        "phase": m.phase,
        "source": m.source,
        "selection": m.selection,
        "tables": tables,
        "post_data": {"done": done, "total": total},
        "times": m.times,
        "error": m.error,
        # what the user should know afterwards: the cutover's fence (sessions ended, left, held off)
        "notes": m.notes,
        "lag_bytes": None,
        "lag_seconds": None,
        "cutover_estimate_seconds": None,
        # the subscription's transactions prepared on the target: after a cutover --prepared carry, the carried ones,
        # for the application to finish there; and the identity steps that wait for them
        "prepared_on_target": carried,
        "pending_statements": pending,
    }
    if sub is not None and m.phase not in ("done", "schema"):
        _add_lag(doc, target_conninfo, m, sub, origin_lsn=origin)
    return doc


def _add_lag(
    doc: dict[str, Any],
    target_conninfo: str,
    m: store.Migration,
    sub: tuple[int, str],
    *,
    origin_lsn: str | None,
) -> None:
    """The lag (from the source's slot, or its current position against the origin's) and what a cutover would
    cost now, into ``doc``; a source that cannot be reached is ``source_error``, the lag staying unknown."""
    try:
        with psycopg.connect(m.source, autocommit=True, connect_timeout=5) as src:
            doc["lag_bytes"], seconds = _source_lag(src, sub[1], origin_lsn)
    except psycopg.Error as exc:
        doc["source_error"] = str(exc).strip()
        return
    if seconds is not None:
        doc["lag_seconds"] = seconds
    elif doc["lag_bytes"] == 0:
        doc["lag_seconds"] = 0.0
    doc["cutover_estimate"] = _cutover_estimate(target_conninfo, m, origin_name(sub[0]), doc)
    doc["cutover_estimate_seconds"] = (doc["cutover_estimate"] or {}).get("total")


def _applied(target: psycopg.Connection[Any], subid: int) -> str | None:
    """How far the subscription's stream has been applied (its replication origin's progress), if it has begun."""
    row = target.execute(
        "SELECT pg_replication_origin_progress(roname, false)::text FROM pg_replication_origin WHERE roname = %s",
        (origin_name(subid),),
    ).fetchone()
    return row[0] if row else None


def _source_lag(src: psycopg.Connection[Any], slot: str, applied: str | None) -> tuple[int, float | None]:
    """The lag in bytes and, when the walsender reports it, in seconds: the source's position against its slot's
    (the worker's reply), or against ``applied`` (the origin's) when the slot has no row."""
    current = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
    row = src.execute(
        "SELECT (pg_current_wal_lsn() - coalesce(r.replay_lsn, s.confirmed_flush_lsn))::bigint,"
        " extract(epoch FROM r.replay_lag)::float8"
        " FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid"
        " WHERE s.slot_name = %s",
        (slot,),
    ).fetchone()
    lag = (
        row[0]
        if row and row[0] is not None
        else parse_lsn(current) - max(parse_lsn(applied) if applied else 0, 0)
    )
    return max(int(lag), 0), (row[1] if row else None)


def ready_for_cutover(
    target: psycopg.Connection[Any], source: psycopg.Connection[Any], name: str, *, caught_up: int
) -> int | None:
    """The lag in bytes when ``start --cutover`` may cut over now: the migration follows, every table is ready
    (``r``) and the lag is at most ``caught_up``; None while not. The target is read first and the source (the
    caller's connection, kept open between looks) only once the target is ready: :func:`status` opens a new
    source connection and samples the apply rate for its estimate, which a look every second does not need."""
    m = store.load(target, name)
    if m is None or m.phase != "following":
        return None
    states = [r[1] for r in target.execute(catalog_sql.SUBSCRIPTION_TABLE_PROGRESS, (m.subname,))]
    sub = _subscription(target, m)
    if not states or any(s != "r" for s in states) or sub is None:
        return None
    lag, _ = _source_lag(source, sub[1], _applied(target, sub[0]))
    return lag if lag <= caught_up else None


#: ``status`` samples the apply rate over this long, when the lag is over :data:`SAMPLE_OVER_BYTES`.
SAMPLE_SECONDS = 0.5
SAMPLE_OVER_BYTES = 1 << 20


def _cutover_estimate(
    target_conninfo: str, m: store.Migration, origin: str, doc: dict[str, Any]
) -> dict[str, float] | None:
    """What a cutover would cost now (:mod:`applier.migrate.estimate`): sizes read on the target, the apply rate
    sampled from the replication origin's progress when there is a real lag to catch up."""
    from applier.migrate import estimate, largeobjects

    progress = "SELECT pg_replication_origin_progress(%s, false) - '0/0'::pg_lsn FROM pg_replication_origin WHERE roname = %s"
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        tables = target.execute(catalog_sql.SUBSCRIPTION_TABLES_SIZE, (m.subname,)).fetchone()[0]  # type: ignore[index]
        sequences, matviews, los = target.execute(
            "SELECT (SELECT count(*) FROM pg_sequences WHERE schemaname <> 'applier'),"
            " (SELECT coalesce(sum(pg_relation_size(oid)), 0)::int8 FROM pg_class WHERE relkind = 'm'),"
            " pg_table_size('pg_largeobject')"
        ).fetchone()  # type: ignore[misc]
        rate = None
        if (doc["lag_bytes"] or 0) > SAMPLE_OVER_BYTES:
            before = target.execute(progress, (origin, origin)).fetchone()
            time.sleep(SAMPLE_SECONDS)
            after = target.execute(progress, (origin, origin)).fetchone()
            if before and after and before[0] is not None and after[0] is not None:
                rate = float(after[0] - before[0]) / SAMPLE_SECONDS
    inputs = estimate.Inputs(
        doc["lag_bytes"],
        doc["lag_seconds"],
        rate,
        int(sequences),
        int(tables),
        int(los) if largeobjects.selected(m.selection) else 0,
        int(matviews),
    )
    return estimate.cutover_seconds(inputs)


def format_status(doc: dict[str, Any]) -> str:
    lag = "?" if doc["lag_bytes"] is None else f"{doc['lag_bytes']} bytes"
    if doc["lag_seconds"] is not None:
        lag += f", {doc['lag_seconds']:.1f} s"
    lines = [
        f"migration {doc['name']}: phase {doc['phase']}, lag {lag}",
        f"post-data: {doc['post_data']['done']}/{doc['post_data']['total']} step(s) done",
        "times: " + (", ".join(f"{k} {v:.1f}s" for k, v in doc["times"].items()) or "-"),
    ]
    est = doc.get("cutover_estimate")
    if est:
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}s" for k, v in est.items() if k != "total" and v >= 0.05
        )
        lines.append(f"a cutover now: ~{est['total']:.1f}s of write downtime ({parts or 'all steps quick'})")
    if doc.get("error"):
        lines.append(f"error: {doc['error']}")
    if doc.get("prepared_on_target"):
        lines.append("prepared on the target: " + ", ".join(doc["prepared_on_target"]))
    if doc.get("pending_statements"):
        lines.append("to run on the target once they are decided: " + "; ".join(doc["pending_statements"]))
    lines += [f"  {t['name']}: {t['state']}" for t in doc["tables"]]
    return "\n".join(lines)


# --- cutover -------------------------------------------------------------------------------------------------


#: how long the cutover lets the target catch up again after the count before the fence
SETTLE_SECONDS = 10.0


@dataclass(frozen=True)
class CutoverOptions:
    name: str
    target: str
    timeout: float = 60.0
    verify: str = "counts"  # counts | full | none
    prepared: str = "wait"  # wait | carry
    reverse: bool = False
    #: called once the migration is done, before the slot is dropped: ``start --cutover`` stops its worker then
    #: (the slot is dropped once the worker has let go of it), not when its watch next looks at the phase
    on_done: Callable[[], None] | None = None


@dataclass
class _Progress:
    """How far a cutover got, for what follows it: the prepared transactions carried to the target, the statements
    left for after they are decided, and whether the reverse subscription was (being) created."""

    carried: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    reversed_: bool = False
    fence: fencing.FenceReport | None = None  # what the fence did with the sessions connected then
    lock: psycopg.Connection[Any] | None = None  # holds the migrated tables (fence.hold_off) until done

    def release(self) -> None:
        if self.lock is not None:
            with contextlib.suppress(Exception):
                self.lock.close()
            self.lock = None


class _Cutover:
    def __init__(self, opts: CutoverOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.deadline = time.monotonic() + opts.timeout
        self.baseline: counting.Baseline | None = None  # the counts before the fence (--verify counts)
        self.owned = seqs.Owned([])  # the sequences to set, read before the fence
        self.extremes: seqs.Extremes | None = None  # their owning columns' extremes before the fence

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def wait_applied(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        origin: str,
        slot: str,
        endpos: str,
        origin_at: str | None = None,
    ) -> None:
        """Until the target has applied the source up to ``endpos`` (:func:`applier.verify.wait_applied`), within
        the cutover's timeout."""
        if not verify.wait_applied(
            target, src, origin, slot, endpos, timeout=self.left(), origin_at=origin_at
        ):
            raise MigrationError(
                f"the target did not apply the source's changes up to {endpos} in time "
                "(is applier migrate start running?)"
            )

    def sequences_before(
        self, target: psycopg.Connection[Any], src: psycopg.Connection[Any], m: store.Migration
    ) -> None:
        """Before the fence: the migrated schemas' sequences and the columns that own them, and (with a count
        before the fence) those columns' extremes on the target (:mod:`applier.migrate.sequences`)."""
        from applier.migrate.selection import Selection

        sel = Selection.of(m.selection["schemas"], m.selection["tables"], m.selection["exclude_tables"])
        self.owned = seqs.list_source(src, sel.covers_schema)
        self.extremes = seqs.extremes(target, self.owned) if self.baseline is not None else None

    def sequences(
        self,
        target: psycopg.Connection[Any],
        values: list[tuple[str, int, bool, int]],
        changes: counting.Changes | None,
    ) -> None:
        """Every sequence of the migrated schemas set from the source's ``values``; each must be past its column's
        largest value, read again only for the tables ``changes`` says changed since the count."""
        changed = changes.tables if changes is not None and changes.error is None else None
        seqs.set_on_target(target, self.owned, values, self.extremes, changed)
        self.say(f"sequences: {len(values)} set from the source")

    @staticmethod
    def tables(target: psycopg.Connection[Any], subname: str) -> list[str]:
        """The migrated tables, schema-qualified and quoted."""
        return [r[0] for r in target.execute(catalog_sql.SUBSCRIPTION_TABLE_NAMES, (subname,))]

    def counts(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        m: store.Migration,
        changes: counting.Changes | None,
        endpos: str,
    ) -> None:
        """Row counts of every table (:mod:`applier.migrate.counts`): those unchanged since the count before the
        fence as counted then, the others counted again now; what was counted when goes into the notes."""
        verified, wrong = counting.after_fence(
            src, target, self.tables(target, m.subname), self.baseline, changes, endpos
        )
        with contextlib.suppress(Exception):
            store.add_notes(target, m.name, {"verify": verified.to_json()})
        if wrong:
            raise MigrationError("verification failed: " + "; ".join(wrong))
        self.say(verified.line())

    def objects(
        self, target: psycopg.Connection[Any], src: psycopg.Connection[Any], m: store.Migration
    ) -> None:
        """What the stream does not carry, before the verification: large objects brought up to date
        (:mod:`applier.migrate.largeobjects`), materialized views refreshed (:mod:`applier.migrate.matviews`)."""
        from applier.migrate import largeobjects, matviews

        if largeobjects.selected(m.selection):
            largeobjects.sync(src, target, self.say)
        matviews.refresh_at_cutover(target, m.name, self.say)

    def full(self, m: store.Migration) -> None:
        report = verify.verify(self.opts.target, m.subname, settle_timeout=max(self.left(), 1.0))
        if not report.equal:
            raise MigrationError("verification failed: " + verify.format_report(report).replace("\n", "; "))
        self.say("verify: every table equal (checksums)")

    def switch(
        self,
        target: psycopg.Connection[Any],
        m: store.Migration,
        subid: int,
        fenced_at: float,
        carried: list[str],
        deferred: list[str],
    ) -> float:
        """One target transaction: identity columns back to ``ALWAYS`` (those on tables a carried prepared
        transaction locks are left for later, into ``deferred``: the ``ACCESS EXCLUSIVE`` lock would wait for it),
        then the event triggers (last: they would fire on the DDL before them; after a deferred statement, deferred
        too), the subscription disabled, the migration ``done``. Returns the write downtime."""
        with target.transaction():
            for step in store.steps_to_run(target, m.name, _SWITCH_KINDS):
                if (step.kind == StepKind.CUTOVER_EVENT_TRIGGER and deferred) or (
                    carried and carrying.locked_by_prepared(target, list(step.relnames))
                ):
                    deferred.extend(step.statements)
                    continue
                for s in step.statements:
                    target.execute(s)
                store.mark_step_done(target, m.name, step.step)
            downtime = time.monotonic() - fenced_at
            target.execute(catalog_sql.DISABLE_SUBSCRIPTION, (subid,))
            store.set_phase(target, m.name, "done", seconds={"cutover downtime": downtime})
        return downtime

    def run(self) -> int:
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            m, sub = self._check_can_start(target)
            store.set_phase(target, m.name, "cutover")
            if self.opts.verify == "counts":
                self.baseline = counting.before_fence(
                    m.source, self.opts.target, sub[1], self.tables(target, m.subname), self.say
                )
                self._settle(target, m, sub)
            src = fencing.open_source(m.source)
            progress = _Progress()
            try:
                downtime = self._fence_and_switch(target, src, m, sub, progress)
            except BaseException as exc:
                progress.release()
                self._note_fence(target, m, progress)
                self._back_out(target, src, m, str(exc), reversed_=progress.reversed_)
                if isinstance(exc, MigrationError):
                    raise MigrationError(
                        f"{exc}; the source is unfenced, the migration goes on following"
                    ) from None
                raise
            if self.opts.on_done is not None:
                self.opts.on_done()
            self._note_fence(target, m, progress)
            self.say(
                f"cutover done: write downtime {downtime:.2f}s (from the fence); the source stays read-only"
            )
            slot_gone = self._drop_on_source(src, m, sub[1])
            counting.drop_slot(src, counting.slot_name(sub[1]))
            # only now: until start has stopped streaming, a write let through would still reach the new server
            progress.release()
            if progress.fence is not None and progress.fence.held_off:
                self.say(
                    "WARNING: the lock on the migrated tables is released: these sessions on the old server could "
                    "write to it again (and those writes are not migrated): "
                    + ", ".join(s.describe() for s in progress.fence.held_off)
                    + "; end them (as a role that may: SELECT pg_terminate_backend(pid))"
                )
            if progress.carried:
                carrying.finish_on_source(src, progress.carried, slot_gone, self.say)
                for line in carrying.after_cutover_lines(progress.carried, progress.deferred):
                    self.say(line)
            src.close()
        return 0

    def _settle(self, target: psycopg.Connection[Any], m: store.Migration, sub: tuple[int, str]) -> None:
        """Before the fence, after the count (the target may have fallen behind while both servers counted): let it
        apply the source's current position again, for up to :data:`SETTLE_SECONDS`, so that the catch-up under the
        fence has little left to do."""
        with contextlib.suppress(psycopg.Error), psycopg.connect(m.source, autocommit=True) as src:
            now = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
            timeout = min(SETTLE_SECONDS, self.left())
            verify.wait_applied(target, src, origin_name(sub[0]), sub[1], now, timeout=timeout)

    @staticmethod
    def _note_fence(target: psycopg.Connection[Any], m: store.Migration, progress: _Progress) -> None:
        """The fence's report into the migration's record (``status --json``'s ``notes``)."""
        if progress.fence is not None:
            with contextlib.suppress(Exception):
                store.add_notes(target, m.name, {"fence": progress.fence.to_json()})

    def _check_can_start(self, target: psycopg.Connection[Any]) -> tuple[store.Migration, tuple[int, str]]:
        """The migration and its subscription (id, slot), refused before anything is fenced when a cutover cannot
        succeed: not following yet, GIDs that cannot be carried, a new server that cannot be reversed."""
        m = _require(target, self.opts.name)
        if m.phase != "following":
            raise MigrationError(
                f'migration "{m.name}" is in phase {m.phase}: a cutover needs phase following '
                "(post-data complete, the apply loop running)"
            )
        sub = _subscription(target, m)
        assert sub is not None
        if self.opts.prepared == "carry":
            carrying.check_two_phase(target, sub[0], m.source)
            carrying.check_gid_format(target, sub[0])
        if self.opts.reverse:
            reversing.check_new_server(target, m.name)
        return m, sub

    def _fence_and_switch(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        m: store.Migration,
        sub: tuple[int, str],
        progress: _Progress,
    ) -> float:
        """Everything between the fence and ``done``, in order; any exception leaves it to :meth:`_back_out`
        (``progress`` tells it how far this got). Returns the write downtime."""
        self.sequences_before(target, src, m)
        fenced_at = self._fence(target, src, m, progress)
        endpos = str(src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        # read while the target catches up: what changed since the count (and so the last event to wait for),
        # the sequences (frozen: nextval is refused in a read-only transaction)
        changes = counting.read_changes(src, self.baseline, m.publication)
        values = seqs.read_values(src, self.owned.seqs)
        self._catch_up(target, src, sub, progress, endpos, changes)
        self.sequences(target, values, changes)
        self.objects(target, src, m)
        if self.opts.verify == "counts":
            self.counts(target, src, m, changes, endpos)
        elif self.opts.verify == "full":
            self.full(m)
        if self.opts.reverse:
            progress.reversed_ = True
            reversing.create(target, src, m.name, self.tables(target, m.subname), self.say)
        return self.switch(target, m, sub[0], fenced_at, progress.carried, progress.deferred)

    def _fence(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        m: store.Migration,
        progress: _Progress,
    ) -> float:
        """Fence the source, end the sessions that could still write, (``--prepared wait``) wait for its prepared
        transactions to be decided, and lock the migrated tables against the sessions that could write them but
        cannot be ended (:mod:`applier.migrate.fence`). Returns when the fence went up (the downtime counts from
        there)."""
        opts = self.opts
        fenced_clock = fencing.fence(src)
        fenced_at = time.monotonic()
        self.say("fence: the source's new transactions are read-only")
        tables = self.tables(target, m.subname)
        progress.fence = report = fencing.end_sessions(src, self.deadline, self.say, tables, fenced_clock)
        self.say(f"fence: {len(report.ended)} session(s) ended")
        for line in report.lines():
            self.say(line)
        if opts.reverse and opts.prepared == "carry" and carrying.source_prepared(src):
            raise MigrationError(
                "--reverse cannot be combined with prepared transactions to carry: the reverse slot on the "
                "new server can only be created once every transaction open there is decided, and the "
                "carried ones are decided by the application after the cutover; use --prepared wait with "
                "--reverse, or carry without --reverse"
            )
        if opts.prepared == "wait":
            open_gids = fencing.wait_prepared(src, self.deadline, self.say)
            if open_gids:
                raise MigrationError(
                    f"{len(open_gids)} prepared transaction(s) on the source were not "
                    f"decided within the timeout: {', '.join(open_gids[:5])}"
                )
        if report.held_off:
            try:
                progress.lock = fencing.hold_off(m.source, tables, self.deadline)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.InsufficientPrivilege) as exc:
                raise MigrationError(_cannot_hold_off(src, report.held_off, exc)) from None
            self.say(f"fence: {len(tables)} migrated table(s) locked IN SHARE MODE on the source until done")
        return fenced_at

    def _catch_up(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        sub: tuple[int, str],
        progress: _Progress,
        endpos: str,
        changes: counting.Changes | None,
    ) -> None:
        """Wait until the target has applied the fenced source's last position ``endpos`` (``--prepared carry``:
        and its prepared transactions are prepared on the target, into ``progress.carried``). With the changes
        since the count, the wait is for the origin to reach the stream's last event since then (nothing since:
        the target had confirmed the count's point already)."""
        origin = origin_name(sub[0])
        last_event = changes.last_event if changes is not None else None
        self.say(f"end position {endpos}: waiting for the target to apply it")
        self.wait_applied(target, src, origin, sub[1], endpos, last_event)
        if self.opts.prepared == "carry":
            progress.carried = carrying.settle(
                target,
                src,
                sub[0],
                self.left,
                lambda pos: self.wait_applied(target, src, origin, sub[1], pos),
            )
            self.say(carrying.carried_message(progress.carried))

    @staticmethod
    def _back_out(
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        m: store.Migration,
        error: str,
        *,
        reversed_: bool,
    ) -> None:
        """After a failure before ``done``: undo the reverse subscription if one was made, unfence the source, and
        put the migration back to ``following`` with the error; each step is tried even if one before failed."""
        if reversed_:
            with contextlib.suppress(Exception):
                reversing.undo(target, src, m.name)
        with contextlib.suppress(Exception):
            fencing.unfence(src)
        counting.drop_slot(src, counting.slot_name(m.slot))
        with contextlib.suppress(Exception):
            store.set_phase(target, m.name, "following", error=error)
        src.close()

    def _drop_on_source(self, src: psycopg.Connection[Any], m: store.Migration, slot: str) -> bool:
        """The slot (once start has let go of it) and the publication: the old server keeps no WAL for us. Whether
        the slot is gone (nothing decodes the source any more)."""
        gone = drop_slot(src, slot, patience=max(self.left(), 10.0), say=self.say)
        if m.pub_created:
            src.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(m.publication)))
            self.say(f"publication {m.publication} dropped from the source")
        return gone


def _cannot_hold_off(src: psycopg.Connection[Any], held: list[fencing.Session], exc: psycopg.Error) -> str:
    """Why the cutover refuses when sessions that could write cannot be ended nor locked out, and what fixes it."""
    me = str(src.execute("SELECT current_user").fetchone()[0])  # type: ignore[index]
    why = (
        f"{me} may not lock the migrated tables IN SHARE MODE (it needs to own them, or UPDATE, DELETE or "
        "TRUNCATE on them)"
        if isinstance(exc, psycopg.errors.InsufficientPrivilege)
        else "a transaction of theirs (or a prepared one) holds a migrated table: the lock that would keep them "
        "from writing did not come within the timeout"
    )
    fixes = [
        "end them (SELECT pg_terminate_backend(pid) as a role that may) or let their transactions finish"
    ]
    if any(not s.superuser for s in held):
        fixes.append(
            f"GRANT pg_signal_backend TO {sql.Identifier(me).as_string(src)} (other roles' sessions)"
        )
    if any(s.superuser for s in held):
        fixes.append("a superuser's session only a superuser (or the service's provider) can end")
    return (
        f"{len(held)} session(s) on the source could write the migrated tables and {me} cannot end them: "
        + ", ".join(s.describe() for s in held)
        + f"; {why}. Fix: "
        + "; ".join(fixes)
        + "; then run the cutover again"
    )


def drop_slot(
    src: psycopg.Connection[Any], slot: str, *, patience: float, say: Callable[[str], None]
) -> bool:
    """Drop ``slot`` once nobody streams from it (waiting up to ``patience`` seconds, :mod:`applier.slots`); whether
    it is gone. Still held: a warning, not an error (the cutover is done; the user drops it once start stops)."""

    def look() -> int | None:
        row = src.execute(
            "SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        return slots.ABSENT if row is None else (row[1] or 0) if row[0] else None

    def drop() -> bool:
        try:
            src.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        except psycopg.errors.ObjectInUse:
            return False
        say(f"slot {slot} dropped from the source")
        return True

    done = slots.drop_when_idle(look, drop, patience=patience, poll=0.02)
    if done.holder is not None:
        say(
            f"WARNING: slot {slot} is still in use on the source; drop it once start has stopped: "
            f"SELECT pg_drop_replication_slot('{slot}')"
        )
    return done.holder is None


def cutover(opts: CutoverOptions, say: Callable[[str], None]) -> int:
    return _Cutover(opts, say).run()


# --- abort ---------------------------------------------------------------------------------------------------


def abort(target_conninfo: str, name: str, say: Callable[[str], None], *, patience: float = 30.0) -> int:
    """Stop the migration (start sees phase ``failed`` and stops), unfence the source, drop the slot and the
    publication the migration created there, and the subscription's catalog rows and origin on the target. The
    target's tables and rows stay."""
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        m = _require(target, name)
        if m.phase == "done":
            raise MigrationError(f'migration "{name}" is done; nothing to abort')
        with target.transaction():
            store.set_phase(target, name, "failed", error="aborted")
            sub = _subscription(target, m)
            if sub is not None:
                target.execute(catalog_sql.DISABLE_SUBSCRIPTION, (sub[0],))
        say(f'migration "{name}" aborted; stopping start')
        with fencing.open_source(m.source) as src:
            fencing.unfence(src)
            say("source unfenced")
            if m.slot_created:
                drop_slot(src, m.slot, patience=patience, say=say)
            counting.drop_slot(src, counting.slot_name(m.slot))
            if m.pub_created:
                src.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(m.publication)))
                say(f"publication {m.publication} dropped from the source")
        if sub is not None:
            with target.transaction():
                target.execute(catalog_sql.DELETE_SUBSCRIPTION, (sub[0],))
                target.execute(
                    "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname = %s",
                    (origin_name(sub[0]),),
                )
    return 0


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str)
