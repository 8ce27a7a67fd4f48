"""The pure state machines in ``state/``, without a server.

Two hypothesis state machines drive ``apply_event`` (``subscription_model.py``: the real rules of ``state/`` strung
together into one subscription's life) the way the worker does, with a model of everything around it
(the catalog, the publisher's WAL, the copy, the catch-up) and a ``restart`` rule that can fire at every step: the
process dies, and whatever was not persisted is lost. Any event can also be cut short after a few of its actions
(``restart``), so that the order of the actions matters as it does in a real crash.

- ``TableSyncAgainstPublisher`` checks the table states against a publisher model: every remote transaction ends
  up in every subscribed table exactly once, whatever the interleaving of copies, catch-ups, streaming and
  restarts, and each apply decision of ``should_apply_changes_for_rel`` is exactly "not already in the table".
- ``TwoPhaseLifecycle`` checks the tri-state: ``e`` only with every table ready, never left without an ALTER,
  two-phase streams only in ``e``, and the ALTER refusals against an independent statement of the rules.

Plain unit tests below them pin the edges, the messages and the boundaries.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from applier.errors import ApplierError
from state.errors import AlterRefused, IllegalTransition
from state.skip import (
    SkipOutcome,
    completed_skipping_message,
    mistaken_skip_warning,
    on_transaction_end,
    starts_skipping,
)
from state.tables import (
    SyncState,
    TableState,
    all_tables_ready,
    begin_catchups,
    process_syncing_tables,
    settle_finished_copy,
    should_apply_changes_for_rel,
    transition,
)
from state.twophase import (
    TwoPhaseState,
    check_alter_two_phase,
    check_refresh_publication,
    check_skip_lsn,
    initial_two_phase,
    ready_at_slot_snapshot,
    should_restart_for_two_phase,
    stream_two_phase,
)
from tests.support.subscription_model import (
    AlterSkipLsn,
    AlterSlotTwoPhase,
    AlterTwoPhase,
    CatchUpTable,
    ClearSkipLsn,
    CopyTable,
    DeleteTableState,
    Disable,
    DropTableSync,
    Enable,
    IdleAt,
    PersistTableState,
    RefreshPublication,
    RemoteTransactionEnding,
    RestartStream,
    RollbackPreparedTransactions,
    SetEnabled,
    SetSkipLsn,
    SetTwoPhaseState,
    StartStream,
    StopStream,
    SubscriptionState,
    TableAdded,
    TableCaughtUp,
    TableCopied,
    TableCopyStarted,
    TablesyncRestarted,
    TransactionApplied,
    WorkerStarted,
    apply_event,
    new_subscription,
)

S = SyncState
TP = TwoPhaseState
TABLES = ("public.a", "public.b", "public.c")
MACHINE_SETTINGS = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- common harness: the catalog and the crash model -----------------------------------------------------------


class _Harness(RuleBasedStateMachine):
    """The catalog (what survives a crash) and ``feed``, which runs an event's actions until an armed crash."""

    def __init__(self) -> None:
        super().__init__()
        self.cat_tables: dict[str, TableState] = {}
        self.cat_two_phase = TP.DISABLED
        self.cat_enabled = True
        self.cat_skip = 0
        self.sub = SubscriptionState("sub", TP.DISABLED)
        self.crash_after: int | None = None
        self.pending_copy: dict[str, bool] = {}  # CopyTable actions not yet started: name -> from_empty
        self.catchups: dict[str, int] = {}  # name -> until_lsn

    # the catalog, as a new process reads it
    def from_catalog(self) -> SubscriptionState:
        return SubscriptionState(
            "sub", self.cat_two_phase, tuple(self.cat_tables.values()), self.cat_enabled, self.cat_skip
        )

    def die(self) -> None:
        """The process dies: only the catalog (and, in subclasses, the target's rows and origin) survive."""
        self.sub = self.from_catalog()
        self.pending_copy.clear()
        self.catchups.clear()
        self.crash_after = None

    @rule(crash=st.sampled_from([None, None, None, "now", 0, 1, 2]))
    def restart(self, crash: str | int | None) -> None:
        """The process dies now, or during the next event after ``crash`` of its actions. Most draws do nothing,
        so that runs live long enough to get somewhere between crashes."""
        if crash == "now":
            self.die()
        elif isinstance(crash, int):
            self.crash_after = crash

    def feed(self, event) -> list:
        new, actions = apply_event(self.sub, event)
        rebuild = False
        for i, action in enumerate(actions):
            if self.crash_after is not None and i >= self.crash_after:
                self.die()
                return actions
            rebuild |= self.execute(action)
        self.crash_after = None
        self.sub = self.from_catalog() if rebuild else new
        return actions

    def execute(self, action) -> bool:
        """Carry out one action; True when the caller must rebuild the state from the catalog afterwards."""
        match action:
            case PersistTableState(table=t):
                assert t.state.persisted, f"transient state persisted: {t}"
                self.cat_tables[t.name] = t
            case DeleteTableState(name=name):
                del self.cat_tables[name]
            case CopyTable(name=name, from_empty=from_empty):
                self.pending_copy[name] = from_empty
            case CatchUpTable(name=name, start_lsn=start, until_lsn=until):
                assert self.cat_tables[name] == TableState(name, S.FINISHEDCOPY, start)
                assert until >= start
                self.catchups[name] = until
            case DropTableSync(name=name):
                self.drop_sync(name)
            case SetEnabled(enabled=enabled):
                self.cat_enabled = enabled
            case SetSkipLsn(lsn=lsn):
                self.cat_skip = lsn
            case ClearSkipLsn(expected=expected):
                if self.cat_skip == expected:
                    self.cat_skip = 0
            case _:
                return self.execute_stream(action)
        return False

    def drop_sync(self, name: str) -> None:
        self.pending_copy.pop(name, None)
        self.catchups.pop(name, None)

    def execute_stream(self, action) -> bool:
        raise AssertionError(f"unexpected action {action!r}")

    @invariant()
    def memory_agrees_with_catalog(self) -> None:
        """What the running worker believes about each table is what the catalog says, except for the in-memory
        states, for which the catalog keeps the table's ``f`` row."""
        assert {t.name for t in self.sub.tables} == set(self.cat_tables)
        for t in self.sub.tables:
            row = self.cat_tables[t.name]
            if t.state.persisted:
                assert row == t
            else:
                assert row.state is S.FINISHEDCOPY and row.lsn is not None
                if t.state is S.SYNCWAIT:
                    assert row.lsn == t.lsn


# --- tables against a publisher model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Txn:
    id: int
    final: int  # LSN of the commit record (Begin.final_lsn)
    end: int  # end of the commit record (Commit.end_lsn): the origin moves here
    tables: frozenset[str]


@dataclass
class CopyJob:
    snapshot: int
    remaining: list[int]


class TableSyncAgainstPublisher(_Harness):
    """Copies, catch-ups, streaming and crashes against a publisher whose history is known, two-phase off."""

    def __init__(self) -> None:
        super().__init__()
        self.pub_lsn = 1000
        self.txns: list[Txn] = []
        self.slot_lsn = 0  # where the subscription's slot was created
        self.origin = 0  # replication origin progress on the target (persisted with each local commit)
        self.content: dict[str, Counter[int]] = {}  # target rows, as the remote transactions they came from
        self.copies: dict[str, CopyJob] = {}
        self.next_txn = 0  # the main stream's position in self.txns

    # publisher
    def commit(self, tables: frozenset[str], gap: int) -> None:
        final = self.pub_lsn + gap
        self.pub_lsn = final + 16
        self.txns.append(Txn(len(self.txns), final, self.pub_lsn, tables))

    def touching(self, name: str, since: int = 0, until: int | None = None) -> list[Txn]:
        return [
            t
            for t in self.txns
            if name in t.tables and t.final >= since and (until is None or t.end <= until)
        ]

    @initialize(
        before=st.lists(st.frozensets(st.sampled_from(TABLES), min_size=1), max_size=4),
        tables=st.sets(st.sampled_from(TABLES), min_size=1),
    )
    def create(self, before: list[frozenset[str]], tables: set[str]) -> None:
        for t in before:
            self.commit(t, 0)
        self.slot_lsn = self.pub_lsn
        self.sub, slot_two_phase = new_subscription("sub", sorted(tables), two_phase=False)
        assert not slot_two_phase and self.sub.two_phase is TP.DISABLED
        self.cat_tables = {t.name: t for t in self.sub.tables}
        self.content = {name: Counter() for name in tables}

    def die(self) -> None:
        super().die()
        self.copies.clear()
        self.next_txn = 0

    def drop_sync(self, name: str) -> None:
        super().drop_sync(name)
        self.copies.pop(name, None)

    def execute_stream(self, action) -> bool:
        match action:
            case StartStream(start_lsn=start, two_phase=two_phase):
                assert not two_phase
                start = max(start, self.slot_lsn)
                self.next_txn = next((i for i, t in enumerate(self.txns) if t.final >= start), len(self.txns))
                return False
        raise AssertionError(f"unexpected action {action!r}")

    # --- publisher rules
    @rule(
        txns=st.lists(
            st.tuples(st.frozensets(st.sampled_from(TABLES), min_size=1), st.sampled_from([0, 0, 8, 100])),
            min_size=1,
            max_size=3,
        )
    )
    def remote_commits(self, txns: list[tuple[frozenset[str], int]]) -> None:
        for tables, gap in txns:
            self.commit(tables, gap)

    # --- tablesync: one step of it per rule, so that copies make progress between everything else
    def tablesync_options(self) -> list[str]:
        options = []
        if not self.copies and not self.pending_copy:
            options.append("restart")  # TablesyncRestarted once no copy runs (after a crash or a failed copy)
        if self.pending_copy:
            options.append("start")
        if any(job.remaining for job in self.copies.values()):
            options.append("partition")
        if any(not job.remaining for job in self.copies.values()):
            options.append("finish")
        return options

    @rule(data=st.data(), steps=st.integers(1, 4))
    def tablesync_steps(self, data, steps: int) -> None:
        for _ in range(steps):
            self.tablesync_step(data)

    def tablesync_step(self, data) -> None:
        match data.draw(st.sampled_from(self.tablesync_options())):
            case "restart":
                self.pending_copy.clear()
                self.feed(TablesyncRestarted())
            case "start":
                self.copy_starts(data.draw(st.sampled_from(sorted(self.pending_copy))), data)
            case "partition":
                name = data.draw(
                    st.sampled_from(sorted(n for n, job in self.copies.items() if job.remaining))
                )
                job = self.copies[name]
                k = data.draw(st.integers(1, len(job.remaining)))
                for txn_id in job.remaining[:k]:  # one partition, committed with its marker
                    self.content[name][txn_id] += 1
                del job.remaining[:k]
            case "finish":
                name = data.draw(
                    st.sampled_from(sorted(n for n, job in self.copies.items() if not job.remaining))
                )
                self.feed(TableCopied(name, self.copies.pop(name).snapshot))

    def copy_starts(self, name: str, data) -> None:
        from_empty = self.pending_copy.pop(name)
        if from_empty:
            self.content[name] = Counter()  # the partial copy of an earlier attempt is emptied
        self.feed(TableCopyStarted(name))
        t = self.sub.table(name)
        if t is not None and t.state is S.DATASYNC:
            # A fresh exported snapshot at a record boundary: usually now, but drawn from anywhere after the
            # subscription's slot was created, as if the copy had started earlier (the stream may be past it).
            snapshot = data.draw(st.integers(self.slot_lsn, self.pub_lsn))
            for txn in self.txns:
                if txn.final < snapshot < txn.end:
                    snapshot = txn.end
            self.copies[name] = CopyJob(snapshot, [t.id for t in self.touching(name, until=snapshot)])

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def copy_fails(self, data) -> None:
        """A copy dies in a process that lives on (its Spark job failed); the partitions it committed stay."""
        del self.copies[data.draw(st.sampled_from(sorted(self.copies)))]

    # --- catch-up of a table whose copy finished behind the stream
    def catchup_position(self, name: str) -> int:
        row = self.cat_tables[name]
        assert row.state is S.FINISHEDCOPY and row.lsn is not None
        return row.lsn

    def catchup_next(self, name: str) -> Txn | None:
        pos = self.catchup_position(name)
        return next((t for t in self.txns if t.final >= pos), None)

    def catchup_applies(self, name: str) -> None:
        """The catch-up applies the next remote transaction for its own table, and persists its progress in the
        table's ``f`` row in the same local transaction."""
        txn = self.catchup_next(name)
        if name in txn.tables:
            assert txn.id not in self.content[name], "catch-up re-applies a transaction already in the table"
            self.content[name][txn.id] += 1
        self.cat_tables[name] = transition(self.cat_tables[name], S.FINISHEDCOPY, txn.end)

    def catchup_can_stop(self, name: str) -> tuple[int, int] | None:
        """The range of positions the catch-up may stop at (it has processed everything before them), or None."""
        pos = self.catchup_position(name)
        nxt = self.catchup_next(name)
        hi = nxt.final if nxt is not None else self.pub_lsn
        lo = max(pos, self.catchups[name])
        return (lo, hi) if lo <= hi else None

    # --- the apply stream (and the catch-ups it waits for): one step per rule
    def waiting_for_catchup(self) -> bool:
        return any(t.state is S.CATCHUP for t in self.sub.tables)

    @rule(data=st.data(), steps=st.integers(1, 4))
    def stream_steps(self, data, steps: int) -> None:
        for _ in range(steps):
            self.stream_step(data)

    def stream_step(self, data) -> None:
        if not self.sub.streaming:
            self.feed(WorkerStarted(self.origin))
        elif self.waiting_for_catchup():
            name = data.draw(st.sampled_from(sorted(self.catchups)))
            stop = self.catchup_can_stop(name)
            if stop is not None and (self.catchup_next(name) is None or data.draw(st.booleans())):
                del self.catchups[name]
                self.feed(TableCaughtUp(name, data.draw(st.integers(*stop))))
            else:
                self.catchup_applies(name)
        elif self.next_txn < len(self.txns) and data.draw(st.booleans()):
            self.apply_transaction()
        else:
            lo = self.sub.stream_lsn
            hi = self.txns[self.next_txn].final if self.next_txn < len(self.txns) else self.pub_lsn
            assert lo <= hi, "the stream is ahead of the next transaction it has not seen"
            self.feed(IdleAt(data.draw(st.integers(lo, hi))))

    def apply_transaction(self) -> None:
        txn = self.txns[self.next_txn]
        self.next_txn += 1
        for name in sorted(txn.tables):
            t = self.sub.table(name)
            applies = self.sub.applies(name, txn.final)
            if t is not None and t.state in (S.SYNCDONE, S.READY):
                # the table's contents are complete up to its LSN: apply iff the change is not in it yet
                assert applies == (txn.id not in self.content[name]), (
                    f"{t}: transaction {txn} {'applied twice' if applies else 'lost'}"
                )
            else:
                assert not applies, f"{t}: still syncing, yet a change is applied"
            if applies:
                self.content[name][txn.id] += 1
        # one local transaction: the rows and the origin (even when every change was filtered out, as
        # PostgreSQL does: begin_replication_step opens the transaction before the relation check)
        self.origin = txn.end
        self.feed(TransactionApplied(txn.end))

    # --- publication changes
    @precondition(lambda self: len(self.cat_tables) < len(TABLES))
    @rule(data=st.data())
    def table_added(self, data) -> None:
        name = data.draw(st.sampled_from([n for n in TABLES if n not in self.cat_tables]))
        self.content[name] = Counter()  # a re-added table starts empty (the user truncated it)
        self.feed(TableAdded(name, copy_data=True))

    @precondition(lambda self: len(self.cat_tables) > 1)
    @rule(data=st.data())
    def table_removed(self, data) -> None:
        gone = data.draw(st.sampled_from(sorted(self.cat_tables)))
        self.feed(RefreshPublication(frozenset(self.cat_tables) - {gone}))

    # --- checks
    @invariant()
    def nothing_applied_twice(self) -> None:
        for name in self.cat_tables:
            doubled = [i for i, n in self.content[name].items() if n > 1]
            assert not doubled, f"{name}: transactions {doubled} applied twice"

    @invariant()
    def synced_tables_have_everything_up_to_the_origin(self) -> None:
        for name, row in self.cat_tables.items():
            if row.state in (S.SYNCDONE, S.READY):
                missing = [
                    t.id for t in self.touching(name, until=self.origin) if t.id not in self.content[name]
                ]
                assert not missing, f"{row}: transactions {missing} lost (origin {self.origin})"

    def teardown(self) -> None:
        """Run to quiescence without crashes; then every table is ready and holds each transaction once."""
        if not self.cat_tables and not self.txns:
            return
        self.crash_after = None
        self.copies.clear()
        self.pending_copy.clear()
        self.feed(TablesyncRestarted())
        for name in list(self.pending_copy):
            from_empty = self.pending_copy.pop(name)
            if from_empty:
                self.content[name] = Counter()
            self.feed(TableCopyStarted(name))
            for t in self.touching(name, until=self.pub_lsn):
                self.content[name][t.id] += 1
            self.feed(TableCopied(name, self.pub_lsn))
        if not self.sub.streaming:
            self.feed(WorkerStarted(self.origin))
        for _ in range(1000):
            if self.catchups:
                name = min(self.catchups)
                while self.catchup_can_stop(name) is None:
                    self.catchup_applies(name)
                self.feed(TableCaughtUp(name, self.catchup_can_stop(name)[1]))
                self.catchups.pop(name, None)
            elif self.next_txn < len(self.txns):
                self.apply_transaction()
            else:
                self.feed(IdleAt(self.pub_lsn))
                if all(t.state is S.READY for t in self.sub.tables):
                    break
        assert all(t.state is S.READY for t in self.sub.tables), self.sub.tables
        for name in self.cat_tables:
            assert self.content[name] == Counter(t.id for t in self.touching(name)), name


TableSyncAgainstPublisher.TestCase.settings = MACHINE_SETTINGS
TestTableSyncAgainstPublisher = TableSyncAgainstPublisher.TestCase


# --- the two-phase tri-state --------------------------------------------------------------------------------------


def expected_alter_refusal(
    current: TP, new: bool, *, enabled: bool, worker_running: bool, prepared: int, force: bool
) -> str | None:
    """The ALTER two_phase rules, stated independently of ``check_alter_two_phase``; the message fragment of the
    refusal, or None when allowed."""
    if (current is not TP.DISABLED) == new:
        return None
    if enabled:
        return "for enabled subscription"
    if worker_running:
        return "still running"
    if not new and prepared and not force:
        return "prepared transactions are present"
    return None


class TwoPhaseLifecycle(_Harness):
    """The tri-state through creation, copies, streams, ALTERs, enable/disable, prepared transactions and crashes."""

    def __init__(self) -> None:
        super().__init__()
        self.wal = 100
        self.origin = 0
        self.slot_two_phase = False
        self.prepared = 0  # prepared transactions of this subscription on the target
        self.altering = False
        self.just_synced = False

    @initialize(
        two_phase=st.booleans(),
        copy_data=st.booleans(),
        create_slot=st.booleans(),
        tables=st.sets(st.sampled_from(TABLES)),
        enabled=st.sampled_from([True, True, False]),
    )
    def create(
        self, two_phase: bool, copy_data: bool, create_slot: bool, tables: set[str], enabled: bool
    ) -> None:
        self.sub, self.slot_two_phase = new_subscription(
            "sub",
            sorted(tables),
            two_phase=two_phase,
            copy_data=copy_data,
            create_slot=create_slot,
            enabled=enabled,
        )
        self.cat_tables = {t.name: t for t in self.sub.tables}
        self.cat_two_phase, self.cat_enabled = self.sub.two_phase, enabled
        if self.sub.two_phase is TP.ENABLED:
            assert self.slot_two_phase and all_tables_ready(self.cat_tables.values())
            assert not copy_data and create_slot
        else:
            assert not self.slot_two_phase
        assert self.sub.two_phase.requested == two_phase

    def feed(self, event) -> list:
        self.just_synced = isinstance(event, (TransactionApplied, IdleAt))
        return super().feed(event)

    def execute_stream(self, action) -> bool:
        match action:
            case StartStream(two_phase=two_phase):
                if two_phase:
                    assert self.cat_two_phase is TP.ENABLED or (
                        self.cat_two_phase is TP.PENDING and all_tables_ready(self.cat_tables.values())
                    )
                    self.slot_two_phase = True
                return False
            case SetTwoPhaseState(state=new):
                if new is TP.ENABLED:
                    assert all_tables_ready(self.cat_tables.values()), "e with a table not ready"
                    assert self.slot_two_phase, "e recorded before the stream enabled two-phase on the slot"
                if self.cat_two_phase is TP.ENABLED and new is not TP.ENABLED:
                    assert self.altering, "left e without an ALTER"
                self.cat_two_phase = new
                return False
            case RestartStream(two_phase=two_phase, message=message):
                assert two_phase and "will restart so that two_phase can be enabled" in message
                assert self.cat_two_phase is TP.PENDING and all_tables_ready(self.cat_tables.values())
                return True
            case StopStream():
                return True
            case AlterSlotTwoPhase(two_phase=value):
                assert self.altering
                self.slot_two_phase = value
                return False
            case RollbackPreparedTransactions():
                assert self.altering
                self.prepared = 0
                return False
        raise AssertionError(f"unexpected action {action!r}")

    # --- the worker, the tablesync and the publisher: one step per draw, a few steps per rule
    def step_options(self) -> list[str]:
        options = ["copy"] if self.pending_copy else ["tablesync"]
        if self.catchups:
            options.append("catch up")  # the apply stream waits meanwhile
        elif self.sub.streaming:
            options += ["transaction", "idle"]
        elif self.sub.enabled:
            options.append("start worker")
        if self.sub.stream_two_phase:
            options.append("remote prepare")
        if self.prepared:
            options.append("remote commit prepared")
        return options

    @rule(data=st.data(), steps=st.integers(1, 6))
    def worker_steps(self, data, steps: int) -> None:
        for _ in range(steps):
            self.worker_step(data)

    def worker_step(self, data) -> None:
        match data.draw(st.sampled_from(self.step_options())):
            case "tablesync":
                self.feed(TablesyncRestarted())
            case "copy":
                name = data.draw(st.sampled_from(sorted(self.pending_copy)))
                del self.pending_copy[name]
                self.feed(TableCopyStarted(name))
                t = self.sub.table(name)
                if t is not None and t.state is S.DATASYNC:
                    self.feed(TableCopied(name, max(1, self.wal - data.draw(st.integers(0, 50)))))
            case "catch up":
                name = data.draw(st.sampled_from(sorted(self.catchups)))
                until = self.catchups.pop(name)
                self.feed(TableCaughtUp(name, until + data.draw(st.integers(0, 20))))
            case "start worker":
                self.feed(WorkerStarted(self.origin))
            case "transaction":
                self.wal += data.draw(st.integers(0, 40))
                self.origin = self.wal
                self.feed(TransactionApplied(self.wal))
            case "idle":
                self.wal += data.draw(st.integers(0, 40))
                self.feed(IdleAt(self.wal))
            case "remote prepare":
                self.prepared += 1
            case "remote commit prepared":
                self.prepared -= 1

    # --- alter
    @rule(table=st.sampled_from(TABLES), copy_data=st.booleans())
    def refresh(self, table: str, copy_data: bool) -> None:
        """A table joins or leaves the publication, then REFRESH PUBLICATION."""
        published = frozenset(self.cat_tables) ^ {table}
        added = published - set(self.cat_tables)
        if self.sub.two_phase is TP.ENABLED and copy_data:
            with pytest.raises(AlterRefused, match="copy_data is not allowed when two_phase is enabled"):
                self.feed(RefreshPublication(published, copy_data))
            return
        self.feed(RefreshPublication(published, copy_data))
        for name in added:
            if name in self.cat_tables:
                assert self.cat_tables[name].state is (S.INIT if copy_data else S.READY)

    @rule(enable=st.booleans())
    def enable_or_disable(self, enable: bool) -> None:
        self.feed(Enable() if enable else Disable())

    @rule(new=st.booleans(), other_worker=st.booleans(), force=st.booleans())
    def alter_two_phase(self, new: bool, other_worker: bool, force: bool) -> None:
        current = self.sub.two_phase
        refusal = expected_alter_refusal(
            current,
            new,
            enabled=self.sub.enabled,
            worker_running=other_worker or self.sub.streaming,
            prepared=self.prepared,
            force=force,
        )
        event = AlterTwoPhase(new, worker_running=other_worker, prepared_xacts=self.prepared, force=force)
        self.altering = True
        try:
            if refusal is not None:
                with pytest.raises(AlterRefused, match=refusal):
                    self.feed(event)
                return
            crashes = self.crash_after is not None
            self.feed(event)
            if not crashes:
                expected = current if current.requested == new else (TP.PENDING if new else TP.DISABLED)
                assert self.cat_two_phase is expected and self.sub.two_phase is expected
                if not new and current.requested:
                    assert self.prepared == 0 and not self.slot_two_phase
        finally:
            self.altering = False

    def teardown(self) -> None:
        """Liveness: enabled and left alone, every table becomes ready and a two-phase subscription with tables
        ends in ``e`` with a two-phase stream."""
        self.crash_after = None
        self.feed(Enable())
        for _ in range(100):
            if self.catchups:
                name = min(self.catchups)
                self.feed(TableCaughtUp(name, self.catchups.pop(name)))
            elif self.pending_copy:
                name = min(self.pending_copy)
                del self.pending_copy[name]
                self.feed(TableCopyStarted(name))
                self.feed(TableCopied(name, self.wal))
            elif any(t.state in (S.INIT, S.DATASYNC) for t in self.sub.tables):
                self.feed(TablesyncRestarted())
            elif not self.sub.streaming:
                self.feed(WorkerStarted(self.origin))
            elif all(t.state is S.READY for t in self.sub.tables) and self.sub.two_phase is not TP.PENDING:
                break
            else:
                self.wal += 10
                self.feed(IdleAt(self.wal))
        assert all(t.state is S.READY for t in self.sub.tables), self.sub.tables
        if self.cat_two_phase.requested and self.cat_tables:
            assert self.cat_two_phase is TP.ENABLED and self.sub.stream_two_phase

    # --- invariants
    @invariant()
    def enabled_only_with_every_table_ready(self) -> None:
        for state, tables in (
            (self.sub.two_phase, self.sub.tables),
            (self.cat_two_phase, self.cat_tables.values()),
        ):
            if state is TP.ENABLED:
                assert all(t.state is S.READY for t in tables), (state, tables)

    @invariant()
    def two_phase_stream_only_in_e(self) -> None:
        if self.sub.stream_two_phase:
            assert (
                self.sub.streaming and self.sub.two_phase is TP.ENABLED and self.cat_two_phase is TP.ENABLED
            )

    @invariant()
    def prepared_transactions_only_in_e(self) -> None:
        if self.prepared:
            assert self.cat_two_phase is TP.ENABLED

    @invariant()
    def no_missed_restart(self) -> None:
        """After a sync-state pass, a stream without two-phase never goes on in ``p`` with every table ready."""
        if self.just_synced and self.sub.streaming and not self.sub.stream_two_phase:
            assert not should_restart_for_two_phase(self.sub.two_phase, self.sub.tables)


TwoPhaseLifecycle.TestCase.settings = MACHINE_SETTINGS
TestTwoPhaseLifecycle = TwoPhaseLifecycle.TestCase


# --- unit tests: tables -----------------------------------------------------------------------------------------

LEGAL = {
    (S.INIT, S.DATASYNC),
    (S.DATASYNC, S.DATASYNC),
    (S.DATASYNC, S.FINISHEDCOPY),
    (S.FINISHEDCOPY, S.FINISHEDCOPY),
    (S.FINISHEDCOPY, S.SYNCWAIT),
    (S.FINISHEDCOPY, S.SYNCDONE),
    (S.SYNCWAIT, S.CATCHUP),
    (S.CATCHUP, S.SYNCDONE),
    (S.SYNCDONE, S.READY),
}
NEEDS_LSN = {S.FINISHEDCOPY, S.SYNCWAIT, S.CATCHUP, S.SYNCDONE}


@pytest.mark.parametrize("old", list(S))
@pytest.mark.parametrize("new", list(S))
def test_transition_edges(old: SyncState, new: SyncState) -> None:
    table = TableState("public.t", old, 10 if old in NEEDS_LSN or old is S.READY else None)
    if (old, new) in LEGAL:
        moved = transition(table, new, 20)
        assert moved.state is new and moved.name == "public.t"
        assert moved.lsn == (None if new in (S.INIT, S.DATASYNC) else 20)
    else:
        with pytest.raises(IllegalTransition, match=f"from '{old.value}' to '{new.value}'"):
            transition(table, new, 20)


def test_transition_messages_say_why() -> None:
    with pytest.raises(IllegalTransition, match="never copied again"):
        transition(TableState("public.t", "f", 5), "d")
    with pytest.raises(IllegalTransition, match="only by being removed"):
        transition(TableState("public.t", "r", 5), "s", 6)
    with pytest.raises(IllegalTransition, match="'s' needs an LSN"):
        transition(TableState("public.t", "f", 5), "s")
    with pytest.raises(IllegalTransition, match="records the apply position"):
        transition(TableState("public.t", "s", 5), "r")
    with pytest.raises(IllegalTransition, match="backwards"):
        transition(TableState("public.t", "s", 5), "r", 4)
    assert transition(TableState("public.t", "d"), "d") == TableState("public.t", "d")
    assert isinstance(IllegalTransition("x"), ApplierError)


def test_table_state_validates_lsn() -> None:
    assert TableState("public.t", "r").state is S.READY  # copy_data = false: ready without an LSN
    with pytest.raises(ValueError, match="needs an LSN"):
        TableState("public.t", "s")
    with pytest.raises(ValueError, match="has no LSN"):
        TableState("public.t", "d", 5)
    with pytest.raises(ValueError, match="invalid LSN"):
        TableState("public.t", "r", 0)
    assert str(TableState("public.t", "s", 0x1_0000_0010)) == "public.t s at 1/10"


@given(state_lsn=st.integers(1, 1000), final=st.integers(1, 1000))
def test_should_apply_changes_for_rel(state_lsn: int, final: int) -> None:
    assert should_apply_changes_for_rel(S.READY, state_lsn, final)
    assert should_apply_changes_for_rel("r", None, final)
    assert should_apply_changes_for_rel(S.SYNCDONE, state_lsn, final) == (state_lsn <= final)
    for other in (S.INIT, S.DATASYNC, S.FINISHEDCOPY, S.SYNCWAIT, S.CATCHUP, None):
        assert not should_apply_changes_for_rel(other, state_lsn, final)


def test_should_apply_boundary_is_inclusive() -> None:
    # the s LSN can be exactly where the next commit record starts: that transaction is not in the table
    assert should_apply_changes_for_rel("s", 100, 100)
    assert not should_apply_changes_for_rel("s", 100, 99)


def test_process_syncing_tables() -> None:
    tables = [
        TableState("public.a", "s", 100),
        TableState("public.b", "s", 101),
        TableState("public.c", "f", 50),
        TableState("public.d", "r", 10),
    ]
    assert process_syncing_tables(tables, 100) == [TableState("public.a", "r", 100)]
    assert process_syncing_tables(tables, 200) == [
        TableState("public.a", "r", 200),
        TableState("public.b", "r", 200),
    ]
    assert process_syncing_tables(tables, 99) == []


def test_catchups_and_settling() -> None:
    assert begin_catchups([TableState("public.a", "w", 50), TableState("public.b", "s", 1)], 80) == [
        TableState("public.a", "c", 80)
    ]
    assert begin_catchups([TableState("public.a", "w", 90)], 80) == [TableState("public.a", "c", 90)]
    copied = TableState("public.a", "f", 100)
    assert settle_finished_copy(copied, 100) == TableState("public.a", "s", 100)
    assert settle_finished_copy(copied, 0) == TableState("public.a", "s", 100)
    assert settle_finished_copy(copied, 101) == TableState("public.a", "w", 100)
    with pytest.raises(IllegalTransition, match="only a table in 'f'"):
        settle_finished_copy(TableState("public.a", "s", 100), 0)


def test_all_tables_ready() -> None:
    assert not all_tables_ready([])
    assert all_tables_ready([TableState("public.a", "r"), "r", S.READY])
    assert not all_tables_ready([TableState("public.a", "r"), TableState("public.b", "s", 1)])


# --- unit tests: two-phase ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("two_phase", "copy_data", "create_slot", "has_tables", "expected"),
    [
        (False, True, True, True, (TP.DISABLED, False)),
        (False, False, True, True, (TP.DISABLED, False)),
        (True, True, True, True, (TP.PENDING, False)),
        (True, False, True, True, (TP.ENABLED, True)),
        (True, False, True, False, (TP.PENDING, False)),  # no tables: stays p so REFRESH stays legal
        (True, False, False, True, (TP.PENDING, False)),  # someone else's slot: enabled at the first start
        (True, True, False, True, (TP.PENDING, False)),
    ],
)
def test_initial_two_phase(two_phase, copy_data, create_slot, has_tables, expected) -> None:
    assert initial_two_phase(two_phase, copy_data, create_slot, has_tables=has_tables) == expected


def test_stream_two_phase_and_restart() -> None:
    ready = [TableState("public.a", "r", 5)]
    syncing = [TableState("public.a", "s", 5)]
    assert stream_two_phase("e", syncing)
    assert (
        stream_two_phase("p", ready) and not stream_two_phase("p", syncing) and not stream_two_phase("p", [])
    )
    assert not stream_two_phase("d", ready)
    assert should_restart_for_two_phase("p", ready)
    assert not should_restart_for_two_phase("p", syncing)
    assert not should_restart_for_two_phase("p", [])
    assert not should_restart_for_two_phase("e", ready)
    assert TP("p") is TP.PENDING and TP.PENDING == "p"


def alter(current="d", new=True, **kw):
    args = {
        "enabled": False,
        "worker_running": False,
        "prepared_xacts": 0,
        "force": False,
        "subname": "s1",
    } | kw
    return check_alter_two_phase(current, new, **args)


def test_alter_two_phase_allowed() -> None:
    assert alter("d", True) is TP.PENDING
    assert alter("e", False) is TP.DISABLED
    assert alter("p", False) is TP.DISABLED
    assert alter("e", False, prepared_xacts=3, force=True) is TP.DISABLED
    # asking for what it already is changes nothing, whatever the circumstances
    assert alter("e", True, enabled=True, worker_running=True) is TP.ENABLED
    assert alter("p", True, enabled=True) is TP.PENDING
    assert alter("d", False, enabled=True, prepared_xacts=2) is TP.DISABLED


def test_alter_two_phase_refused_while_enabled() -> None:
    with pytest.raises(AlterRefused) as e:
        alter("d", True, enabled=True)
    assert e.value.message == 'cannot set option "two_phase" for enabled subscription "s1"'
    assert "applier alter s1 --disable" in e.value.hint and "--enable" in e.value.hint
    assert str(e.value) == f"{e.value.message}\nHINT: {e.value.hint}"
    assert isinstance(e.value, ApplierError)


def test_alter_two_phase_refused_while_worker_runs() -> None:
    with pytest.raises(AlterRefused) as e:
        alter("e", False, worker_running=True)
    assert (
        e.value.message
        == 'cannot alter two_phase when the apply worker of subscription "s1" is still running'
    )
    assert "try again after some time" in e.value.hint


def test_alter_two_phase_refused_with_prepared_transactions() -> None:
    with pytest.raises(AlterRefused) as e:
        alter("e", False, prepared_xacts=2)
    assert e.value.message.startswith("cannot disable two_phase when prepared transactions are present")
    assert "2 prepared transaction(s)" in e.value.message
    assert "pg_gid_" in e.value.hint and "--force" in e.value.hint
    with pytest.raises(AlterRefused, match="prepared transactions are present"):
        alter("p", False, prepared_xacts=1)


def test_alter_message_without_a_name() -> None:
    with pytest.raises(AlterRefused, match='^cannot set option "two_phase" for enabled subscription\n'):
        check_alter_two_phase("d", True, enabled=True, worker_running=False, prepared_xacts=0, force=False)


def test_refresh_publication_refused_with_copy_data_in_e() -> None:
    check_refresh_publication("p", True)
    check_refresh_publication("d", True)
    check_refresh_publication("e", False)
    with pytest.raises(AlterRefused) as e:
        check_refresh_publication("e", True, subname="s1")
    assert "with copy_data is not allowed when two_phase is enabled" in e.value.message
    hint = e.value.hint
    assert "applier alter s1 --refresh-publication --no-copy-data" in hint
    assert "drop and create the subscription" in hint
    assert "two_phase=false" in hint


def test_skip_lsn_check() -> None:
    check_skip_lsn(0x20, 0x20)  # equal passes, as in PostgreSQL
    check_skip_lsn(0x30, 0x20)
    check_skip_lsn(0x10, 0)  # no origin progress yet
    check_skip_lsn(0, 0x20)  # NONE resets
    with pytest.raises(AlterRefused) as e:
        check_skip_lsn(0x10, 0x1_0000_0020, subname="s1")
    assert e.value.message == "skip WAL location (LSN 0/10) must be greater than origin LSN 1/20"
    assert "already been applied" in e.value.hint and "applier status s1" in e.value.hint


# --- unit tests: skip ------------------------------------------------------------------------------------------


def test_skip_rules() -> None:
    assert starts_skipping(0x10, 0x10)
    assert not starts_skipping(0x10, 0x11)
    assert not starts_skipping(0, 0)
    assert on_transaction_end(0, 0x10, True) is SkipOutcome.KEEP
    assert on_transaction_end(0x10, 0x10, False) is SkipOutcome.CLEAR
    assert on_transaction_end(0x10, 0x20, True) is SkipOutcome.CLEAR_WITH_WARNING
    assert on_transaction_end(0x10, 0x20, False) is SkipOutcome.KEEP
    assert SkipOutcome.CLEAR.clears and not SkipOutcome.KEEP.clears


def test_skip_messages_are_postgresqls() -> None:
    assert mistaken_skip_warning("s1", 0x10, 0x1_0000_0020) == (
        'skip-LSN of subscription "s1" cleared',
        "Remote transaction's finish WAL location (LSN) 1/20 did not match skip-LSN 0/10.",
    )
    assert (
        completed_skipping_message(0x10) == "logical replication completed skipping transaction at LSN 0/10"
    )


def test_skip_through_the_machine() -> None:
    state, _ = new_subscription("s1", ["public.a"], two_phase=False, copy_data=False)
    with pytest.raises(AlterRefused, match="must be greater than origin LSN"):
        apply_event(state, AlterSkipLsn(0x10, 0x20))
    state, actions = apply_event(state, AlterSkipLsn(0x30, 0x20))
    assert actions == [SetSkipLsn(0x30)] and state.skip_lsn == 0x30
    assert apply_event(state, RemoteTransactionEnding(0x28, applied_something=False)) == (state, [])
    cleared, actions = apply_event(state, RemoteTransactionEnding(0x40, applied_something=True))
    assert cleared.skip_lsn == 0
    assert actions == [
        ClearSkipLsn(0x30, SkipOutcome.CLEAR_WITH_WARNING, warning=mistaken_skip_warning("s1", 0x30, 0x40))
    ]
    cleared, actions = apply_event(state, RemoteTransactionEnding(0x30, applied_something=False))
    assert actions == [ClearSkipLsn(0x30, SkipOutcome.CLEAR, log=completed_skipping_message(0x30))]


# --- unit tests: the machine ---------------------------------------------------------------------------------------


def test_life_of_a_two_phase_subscription() -> None:
    """docs/reference.md's "The life of a subscription", step by step."""
    state, slot_two_phase = new_subscription("s1", ["public.a", "public.b"], two_phase=True)
    assert state.two_phase is TP.PENDING and not slot_two_phase
    state, actions = apply_event(state, TablesyncRestarted())
    assert actions == [CopyTable("public.a", False), CopyTable("public.b", False)]
    for name in ("public.a", "public.b"):
        state, actions = apply_event(state, TableCopyStarted(name))
        assert actions == [PersistTableState(TableState(name, "d"))]
        state, actions = apply_event(state, TableCopied(name, 500))
        assert actions == [PersistTableState(TableState(name, "f", 500))]
    state, actions = apply_event(state, WorkerStarted(0))
    assert actions == [
        PersistTableState(TableState("public.a", "s", 500)),
        PersistTableState(TableState("public.b", "s", 500)),
        StartStream(0, two_phase=False),
    ]
    assert not state.applies("public.a", 499) and state.applies("public.a", 500)
    state, actions = apply_event(state, TransactionApplied(450))
    assert actions == []
    state, actions = apply_event(state, IdleAt(520))
    assert actions == [
        PersistTableState(TableState("public.a", "r", 520)),
        PersistTableState(TableState("public.b", "r", 520)),
        RestartStream(
            True,
            'logical replication apply worker for subscription "s1" will restart so that two_phase can be enabled',
        ),
    ]
    assert not state.streaming
    state, actions = apply_event(state, WorkerStarted(450))
    assert actions == [StartStream(450, two_phase=True), SetTwoPhaseState(TP.ENABLED)]
    assert state.two_phase is TP.ENABLED and state.stream_two_phase


def test_no_copy_data_starts_enabled() -> None:
    state, slot_two_phase = new_subscription("s1", ["public.a"], two_phase=True, copy_data=False)
    assert state.two_phase is TP.ENABLED and slot_two_phase
    assert state.tables == (TableState("public.a", "r"),)
    state, actions = apply_event(state, WorkerStarted(0))
    assert actions == [StartStream(0, two_phase=True)]


def test_table_added_while_streaming_catches_up() -> None:
    state = SubscriptionState("s1", TP.DISABLED, (TableState("public.a", "r", 10),))
    state, _ = apply_event(state, WorkerStarted(100))
    state, actions = apply_event(state, TableAdded("public.b", copy_data=True))
    assert actions == [PersistTableState(TableState("public.b", "i")), CopyTable("public.b", False)]
    state, _ = apply_event(state, TableCopyStarted("public.b"))
    state, _ = apply_event(state, TransactionApplied(300))
    state, actions = apply_event(state, TableCopied("public.b", 200))  # the stream went past the snapshot
    assert actions == [PersistTableState(TableState("public.b", "f", 200))]
    assert state.table("public.b") == TableState("public.b", "w", 200)
    state, actions = apply_event(state, IdleAt(310))
    assert actions == [CatchUpTable("public.b", start_lsn=200, until_lsn=310)]
    with pytest.raises(IllegalTransition, match="must wait"):
        apply_event(state, TransactionApplied(400))
    state, actions = apply_event(state, TableCaughtUp("public.b", 320))
    assert actions == [PersistTableState(TableState("public.b", "s", 320))]
    state, actions = apply_event(state, IdleAt(320))
    assert actions == [PersistTableState(TableState("public.b", "r", 320))]


def test_copy_ahead_of_the_stream_joins_directly() -> None:
    state = SubscriptionState("s1", TP.DISABLED, (TableState("public.b", "d"),))
    state, _ = apply_event(state, WorkerStarted(100))
    state, actions = apply_event(state, TableCopied("public.b", 150))
    assert actions == [PersistTableState(TableState("public.b", "s", 150))]


def test_tablesync_restart_recopies_from_empty() -> None:
    state = SubscriptionState(
        "s1",
        TP.PENDING,
        (TableState("public.a", "i"), TableState("public.b", "d"), TableState("public.c", "f", 9)),
    )
    _, actions = apply_event(state, TablesyncRestarted())
    assert actions == [CopyTable("public.a", from_empty=False), CopyTable("public.b", from_empty=True)]


def test_worker_start_refuses_stale_state() -> None:
    state = SubscriptionState("s1", TP.DISABLED, (TableState("public.a", "w", 5),))
    with pytest.raises(IllegalTransition, match="afresh from the catalog"):
        apply_event(state, WorkerStarted(1))
    with pytest.raises(IllegalTransition, match="disabled"):
        apply_event(replace(state, enabled=False, tables=()), WorkerStarted(1))
    with pytest.raises(IllegalTransition, match="needs a running stream"):
        apply_event(replace(state, tables=()), IdleAt(1))


def test_removal_drops_sync_and_refresh_rules() -> None:
    state = SubscriptionState("s1", TP.ENABLED, (TableState("public.a", "r", 5),), enabled=False)
    with pytest.raises(AlterRefused, match="not allowed when two_phase is enabled"):
        apply_event(state, RefreshPublication(frozenset({"public.a", "public.b"}), copy_data=True))
    state, actions = apply_event(state, RefreshPublication(frozenset({"public.b"}), copy_data=False))
    assert actions == [DeleteTableState("public.a"), PersistTableState(TableState("public.b", "r"))]
    syncing = SubscriptionState("s1", TP.DISABLED, (TableState("public.a", "d"), TableState("public.b", "i")))
    _, actions = apply_event(syncing, RefreshPublication(frozenset()))
    assert actions == [
        DropTableSync("public.a"),
        DeleteTableState("public.a"),
        DropTableSync("public.b"),
        DeleteTableState("public.b"),
    ]
    with pytest.raises(IllegalTransition, match="already part of it"):
        apply_event(state, TableAdded("public.b", copy_data=True))
    # events for a table removed meanwhile are moot
    assert apply_event(syncing, TableCopied("public.z", 5)) == (syncing, [])


def test_alter_two_phase_through_the_machine() -> None:
    state = SubscriptionState("s1", TP.ENABLED, (TableState("public.a", "r", 5),), enabled=False)
    state2, actions = apply_event(state, AlterTwoPhase(False, prepared_xacts=2, force=True))
    assert actions == [
        RollbackPreparedTransactions(),
        AlterSlotTwoPhase(False),
        SetTwoPhaseState(TP.DISABLED),
    ]
    state3, actions = apply_event(state2, AlterTwoPhase(True))
    assert actions == [SetTwoPhaseState(TP.PENDING)] and state3.two_phase is TP.PENDING
    assert apply_event(state, AlterTwoPhase(True)) == (state, [])
    running, _ = apply_event(replace(state, enabled=True), WorkerStarted(10))
    running, actions = apply_event(running, Disable())
    assert actions == [SetEnabled(False), StopStream()]
    assert apply_event(running, Enable())[1] == [SetEnabled(True)]


def test_a_filtered_transaction_must_still_advance_the_origin() -> None:
    """Why the worker commits (with the origin's advance) every remote transaction that carried a change, even
    when the rule filtered out all of its changes, as PostgreSQL does: the table may turn ready at a later idle
    LSN, and a transaction re-sent after a crash would then be applied on top of the copy that already holds it."""
    state = SubscriptionState("s1", TP.DISABLED, (TableState("public.a", "f", 500),))
    state, _ = apply_event(state, WorkerStarted(0))
    assert not state.applies("public.a", 400)  # in the copy: filtered out
    state, actions = apply_event(state, IdleAt(520))
    assert actions == [PersistTableState(TableState("public.a", "r", 520))]
    # crash; the new process reads r. Had the origin stayed before 400, the publisher would re-send that
    # transaction, and now nothing stops it:
    restarted, _ = apply_event(replace(state, stream_lsn=None), WorkerStarted(0))
    assert restarted.applies("public.a", 400)


def test_gid_for_the_two_formats() -> None:
    from applier.errors import ApplierError
    from state.twophase import GID_FORMATS, check_alter_gid_format, gid_for

    assert gid_for(7, 42) == "pg_gid_7_42" and gid_for(7, 42, "app 'x'") == "app 'x'"
    with pytest.raises(ApplierError, match="empty or too long"):
        gid_for(7, 42, "x" * 200)
    with pytest.raises(ApplierError, match="remote xid is 0"):
        gid_for(7, 0, "x")
    for fmt in GID_FORMATS:  # every format the catalog may hold is one alter accepts
        assert check_alter_gid_format("subscription", fmt, prepared_xacts=0) == fmt
    assert check_alter_gid_format("subscription", "original", prepared_xacts=0) == "original"
    assert check_alter_gid_format("original", "original", prepared_xacts=3) == "original"
    with pytest.raises(AlterRefused, match="cannot change gid_format while 2 prepared"):
        check_alter_gid_format("subscription", "original", prepared_xacts=2, subname="s")
    with pytest.raises(AlterRefused, match="unrecognized gid_format"):
        check_alter_gid_format("subscription", "pg", prepared_xacts=0)


def test_set_gid_format_is_parsed_and_checked() -> None:
    from applier.subscriptions import SubscriptionError, parse_set_options

    assert parse_set_options(["gid_format=Original"]) == {"gid_format": "original"}
    with pytest.raises(SubscriptionError, match='unrecognized gid_format value: "pub"'):
        parse_set_options(["gid_format=pub"])


def test_ready_at_slot_snapshot_only_when_every_table_was_copied_at_the_slots_own_point() -> None:
    """applier migrate start: two-phase on from the stream's start only when no table has an LSN of its own."""
    x = 0x9DF5A90
    assert ready_at_slot_snapshot([("s", x), (SyncState.SYNCDONE, x)], x)
    assert not ready_at_slot_snapshot([("s", x), ("s", x + 8)], x)  # one copied again at a later snapshot
    assert not ready_at_slot_snapshot([("s", x), ("f", None)], x)  # one not settled
    assert not ready_at_slot_snapshot([("s", x), ("r", x)], x)  # already streaming: behaviour 57's restart
    assert not ready_at_slot_snapshot([("s", x)], None)  # no slot point known
    assert not ready_at_slot_snapshot([], x)  # no table: stays pending (behaviour 55)
