"""``applier migrate cutover`` (its ``status`` and ``abort`` have modules of their own).

In order, once it holds the cutover's lock and a live ``start`` follows (:mod:`applier.migrate.ownership`): fence the source (:mod:`applier.migrate.fence`), wait for its prepared transactions to be
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from applier import verify
from applier.catalog import sql as catalog_sql
from applier.catalog.store import origin_name
from applier.migrate import admission, ownership, publications, store
from applier.migrate import carry as carrying
from applier.migrate import counts as counting
from applier.migrate import fence as fencing
from applier.migrate import reverse as reversing
from applier.migrate import sequences as seqs
from applier.migrate.leftovers import drop_capture, drop_slot
from applier.migrate.state import MigrationError, Phase
from applier.migrate.steps import SWITCH_KINDS, StepKind
from applier.signals import Interrupted

__all__ = ["CutoverOptions", "cutover"]


#: how long the cutover lets the target catch up again after the count before the fence
SETTLE_SECONDS = 10.0
#: how often a wait under the fence looks whether ``start`` still follows (a look is one query on the target)
LIVENESS_S = 1.0
#: how long a cutover waits for a live ``start``'s worker to stream before it refuses (its first stream begins a
#: second or two after phase ``following``)
FOLLOWER_PATIENCE_S = 30.0


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
    #: ``start --cutover``'s stop event: a signal to start ends its own cutover's waits at once (it backs out)
    cancel: threading.Event | None = None


@dataclass
class _Progress:
    """How far a cutover got, for what follows it: the prepared transactions carried to the target, the statements
    left for after they are decided, and whether the reverse subscription was (being) created."""

    carried: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    reversed_: bool = False
    fence: fencing.FenceReport | None = None  # what the fence did with the sessions connected then
    fenced: bool = False  # the fence is recorded (store.record_fence): the back-out lifts it
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
        self.recopied: list[
            str
        ] = []  # insert-only tables copied again under the fence (they got UPDATE/DELETE)

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
        the cutover's timeout. Looked at in slices of :data:`LIVENESS_S`: a ``start`` that stops or dies meanwhile
        (nothing would ever apply ``endpos``) ends the wait at once, and the cutover backs out and unfences,
        instead of holding production read-only until the timeout."""
        while True:
            slice_ = min(LIVENESS_S, self.left())
            if verify.wait_applied(target, src, origin, slot, endpos, timeout=slice_, origin_at=origin_at):
                return
            gone = self.follower_gone(target)
            if gone is not None:
                raise MigrationError(f"{gone}: the target cannot catch up with the fenced source")
            if self.left() <= 0:
                raise MigrationError(
                    f"the target did not apply the source's changes up to {endpos} in time "
                    "(is applier migrate start running?)"
                )

    def follower_gone(self, target: psycopg.Connection[Any]) -> str | None:
        """Why the migration's ``start`` can no longer follow, or None while it can."""
        if self.opts.cancel is not None and self.opts.cancel.is_set():
            return "applier migrate start is stopping"
        if ownership.start_holder(target, self.opts.name) is None:
            return "applier migrate start stopped or died during the cutover"
        return None

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
            src, target, self.tables(target, m.subname), self.baseline, changes, endpos, self.recopied
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
            for step in store.steps_to_run(target, m.name, SWITCH_KINDS):
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
            store.set_phase(target, m.name, Phase.DONE, seconds={"cutover downtime": downtime})
        return downtime

    def run(self) -> int:
        """The cutover, or its refusal before anything is fenced; any failure or signal after the phase moved to
        ``cutover`` backs out (:meth:`_back_out`): the source unfenced, the migration following again."""
        store.upgrade(self.opts.target)
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            ownership.hold_cutover(target, self.opts.name)
            ownership.recover(target, store.require(target, self.opts.name), self.say)
            m, sub = admission.check_can_start(target, self.opts.name, self.opts.prepared, self.opts.reverse)
            src = fencing.open_source(m.source)
            progress = _Progress()
            try:
                admission.wait_for_follower(target, src, m, sub[1], min(FOLLOWER_PATIENCE_S, self.left()))
                admission.refuse_diverging(src, m)
                store.set_phase(target, m.name, Phase.CUTOVER)
            except BaseException:
                src.close()
                raise
            try:
                if self.opts.verify == "counts":
                    self.baseline = counting.before_fence(
                        m.source, self.opts.target, sub[1], self.tables(target, m.subname), self.say
                    )
                    self._settle(target, src, sub)
                downtime = self._fence_and_switch(target, src, m, sub, progress)
            except BaseException as exc:
                progress.release()
                self._note_fence(target, m, progress)
                self._back_out(src, m, _why(exc), progress)
                if isinstance(exc, MigrationError):
                    after = "the source is unfenced" if progress.fenced else "nothing was fenced"
                    raise MigrationError(f"{exc}; {after}, {_what_now(self.opts.target, m.name)}") from None
                raise
            return self._finish(target, src, m, sub, progress, downtime)

    def _recopy(
        self, target: psycopg.Connection[Any], src: psycopg.Connection[Any], m: store.Migration
    ) -> list[str]:
        """Under the fence, the target caught up: the insert-only tables that received UPDATE or DELETE
        (:mod:`applier.migrate.publications`) copied again from the source, which no longer changes. One that grew
        past the limit since the look before the fence is refused now (the cutover backs out)."""
        tables = publications.diverging(src, m)
        refusal = publications.refuse_before_fence(tables)
        if refusal is not None:
            raise MigrationError(refusal)
        return list(publications.recopy(src, target, tables, self.say))

    def _finish(
        self,
        target: psycopg.Connection[Any],
        src: psycopg.Connection[Any],
        m: store.Migration,
        sub: tuple[int, str],
        progress: _Progress,
        downtime: float,
    ) -> int:
        """After ``done``: stop start's worker, drop the slots and the publication from the old server, release the
        lock on its tables, and finish the carried prepared transactions there."""
        if self.opts.on_done is not None:
            self.opts.on_done()
        self._note_fence(target, m, progress)
        self.say(f"cutover done: write downtime {downtime:.2f}s (from the fence); the source stays read-only")
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

    def _settle(
        self, target: psycopg.Connection[Any], src: psycopg.Connection[Any], sub: tuple[int, str]
    ) -> None:
        """Before the fence, after the count (the target may have fallen behind while both servers counted): let it
        apply the source's current position again, for up to :data:`SETTLE_SECONDS`, so that the catch-up under the
        fence has little left to do. On the cutover's own source session: one opened here and closed just before
        the fence could still be on its way out when the fence looks, and be counted among the sessions it ended."""
        with contextlib.suppress(psycopg.Error):
            now = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
            timeout = min(SETTLE_SECONDS, self.left())
            verify.wait_applied(target, src, origin_name(sub[0]), sub[1], now, timeout=timeout)

    @staticmethod
    def _note_fence(target: psycopg.Connection[Any], m: store.Migration, progress: _Progress) -> None:
        """The fence's report into the migration's record (``status --json``'s ``notes``)."""
        if progress.fence is not None:
            with contextlib.suppress(Exception):
                store.add_notes(target, m.name, {"fence": progress.fence.to_json()})

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
        changes = counting.read_changes(src, self.baseline, ",".join(publications.existing(src, m.name)))
        values = seqs.read_values(src, self.owned.seqs)
        self._catch_up(target, src, sub, progress, endpos, changes)
        self.recopied = self._recopy(target, src, m)
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
        store.record_fence(target, m.name)  # committed first: a kill -9 from here on leaves the record
        progress.fenced = True
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
            open_gids = fencing.wait_prepared(
                src, self.deadline, self.say, gone=lambda: self.follower_gone(target)
            )
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

    def _back_out(
        self,
        src: psycopg.Connection[Any],
        m: store.Migration,
        error: str,
        progress: _Progress,
    ) -> None:
        """After a failure or a signal before ``done``: undo the reverse subscription if one was made, lift the
        fence if this cutover recorded one, and put the migration back to ``following`` with the error; each step
        is tried even if one before failed (a source that cannot be reached keeps the fence's record, and the next
        verb of the migration lifts it: :func:`applier.migrate.ownership.recover`). On new sessions: a signal may
        have come while the cutover's own sessions waited for a statement's result, which leaves them unusable."""
        old = 0 if src.closed else src.info.backend_pid
        src.close()
        with contextlib.ExitStack() as stack:
            try:
                target = stack.enter_context(psycopg.connect(self.opts.target, autocommit=True))
                fresh = stack.enter_context(fencing.open_source(m.source))
            except psycopg.Error:
                return  # the record stays: the next cutover, start or abort lifts the fence
            # the old session's last statement (the fence itself, maybe) is over before the fence is lifted
            fencing.wait_gone(fresh, {old}, time.monotonic() + 10.0)
            if progress.reversed_:
                with contextlib.suppress(Exception):
                    reversing.undo(target, fresh, m.name)
            if progress.fenced:
                with contextlib.suppress(Exception):
                    fencing.unfence(fresh)
                    store.clear_fence(target, m.name)
            counting.drop_slot(fresh, counting.slot_name(m.slot))
            with contextlib.suppress(Exception):
                if store.phase_of(target, m.name) is Phase.CUTOVER:  # not after an abort meanwhile
                    store.set_phase(target, m.name, Phase.FOLLOWING, error=error)

    def _drop_on_source(self, src: psycopg.Connection[Any], m: store.Migration, slot: str) -> bool:
        """The DDL capture, the slot (once start has let go of it) and the publication: the old server keeps no WAL
        and no event trigger for us. Whether the slot is gone (nothing decodes the source any more)."""
        drop_capture(src, m.slot, self.say)
        gone = drop_slot(src, slot, patience=max(self.left(), 10.0), say=self.say)
        if m.pub_created:
            publications.drop(src, m.name, self.say)
        return gone


def _what_now(target: str, name: str) -> str:
    """What became of the migration after a failed cutover: following again, or aborted meanwhile."""
    with contextlib.suppress(psycopg.Error), psycopg.connect(target, autocommit=True) as conn:
        if store.phase_of(conn, name) is Phase.FAILED:
            return "the migration was aborted meanwhile"
    return "the migration goes on following"


def _why(exc: BaseException) -> str:
    """The error a failed cutover leaves in the migration's record (``status`` shows it)."""
    if isinstance(exc, Interrupted):
        return f"the cutover was interrupted by {exc.name}"
    if isinstance(exc, KeyboardInterrupt):
        return "the cutover was interrupted by SIGINT"
    return str(exc) or type(exc).__name__


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


def cutover(opts: CutoverOptions, say: Callable[[str], None]) -> int:
    return _Cutover(opts, say).run()
