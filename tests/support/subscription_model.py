"""A model of one subscription's whole life, composed of the real state machines, for the property tests.

``apply_event(state, event) -> (new_state, actions)`` is pure. It is *not* what the worker, the table sync or the
command line call: they call the rules of :mod:`state.tables`, :mod:`state.twophase` and :mod:`state.skip`
directly, at the points where PostgreSQL's ``worker.c``/``tablesync.c``/``subscriptioncmds.c`` do. This module strings
those same functions together into one event-driven machine, so that ``tests/unit/test_state_machines.py`` (hypothesis
``RuleBasedStateMachine``) can drive a subscription through any order of copies, restarts, transactions, ALTERs and
idle turns against a simulated publisher and check what must hold across the whole life: no change applied twice or
lost, LSNs never going back, two-phase enabled only once every table is ready, every refusal PostgreSQL's. A bug in
how the real rules compose shows up here as a failing sequence; docs/architecture.md ("state") says why it stays a
model rather than driving the worker.

Persistence model. ``SubscriptionState`` holds both what the catalog holds and what only a running worker knows
(the transient table states ``w``/``c``, the position of the running stream). Every change the catalog must see
comes out as an action (``PersistTableState``, ``SetTwoPhaseState``...); anything not persisted is lost when the
process dies. After a restart, and after ``RestartStream`` or ``StopStream``, the caller builds a fresh
``SubscriptionState`` from the catalog rather than reusing the old one: ``WorkerStarted`` refuses a state that
still holds in-memory-only table states, because a catch-up may have persisted progress the old value does not
know about.

Feed events between remote transactions, never while one is being applied: the rule that decides whether a
change is applied (``should_apply_changes_for_rel``) must see the same table states for every change of one
transaction. Tablesync completions that arrive mid-transaction wait until it commits.

A typical life::

    create:  new_subscription(...)                         -> persist the rows it returns
    run:     TablesyncRestarted()                           -> CopyTable(...) for every i/d table
             TableCopyStarted(t), TableCopied(t, Y)          -> f at Y (persisted)
             WorkerStarted(origin_lsn)                      -> f -> s, StartStream(two_phase=...)
             TransactionApplied(end_lsn) / IdleAt(lsn)      -> s -> r, catch-ups, RestartStream for two-phase
    alter:   Enable, Disable, AlterTwoPhase, AlterSkipLsn, RefreshPublication
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from state.errors import IllegalTransition
from state.skip import SkipOutcome, completed_skipping_message, mistaken_skip_warning, on_transaction_end
from state.tables import (
    SyncState,
    TableState,
    begin_catchups,
    initial_sync_state,
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
    restart_for_two_phase_message,
    should_restart_for_two_phase,
    stream_two_phase,
)

# --- state -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscriptionState:
    """Everything the rules need to know about one subscription.

    ``two_phase``, ``tables`` (persisted states, plus ``w``/``c`` while a worker runs), ``enabled`` and
    ``skip_lsn`` (0 = none) mirror the catalog. ``stream_lsn`` is ``None`` unless this process is streaming; then
    it is the position up to which the apply stream has processed the publisher's WAL (the start position, then
    each transaction's end LSN and each idle ``last_received``). ``stream_two_phase`` is whether that stream was
    started with ``two_phase 'on'``.
    """

    name: str
    two_phase: TwoPhaseState
    tables: tuple[TableState, ...] = ()
    enabled: bool = True
    skip_lsn: int = 0
    stream_lsn: int | None = None
    stream_two_phase: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "two_phase", TwoPhaseState(self.two_phase))
        object.__setattr__(self, "tables", tuple(self.tables))
        names = [t.name for t in self.tables]
        if len(names) != len(set(names)):
            raise ValueError(f"subscription {self.name}: a table appears twice in {names}")

    @property
    def streaming(self) -> bool:
        return self.stream_lsn is not None

    def table(self, name: str) -> TableState | None:
        for t in self.tables:
            if t.name == name:
                return t
        return None

    def applies(self, name: str, remote_final_lsn: int) -> bool:
        """Whether a change for table ``name`` in the remote transaction finishing at ``remote_final_lsn`` is
        applied (``should_apply_changes_for_rel``; a table the subscription does not know is not)."""
        t = self.table(name)
        return t is not None and should_apply_changes_for_rel(t.state, t.lsn, remote_final_lsn)

    def _with(self, tables: Iterable[TableState]) -> SubscriptionState:
        """Replace the given tables (by name), keeping the order."""
        new = {t.name: t for t in tables}
        return replace(self, tables=tuple(new.get(t.name, t) for t in self.tables))


def new_subscription(
    name: str,
    table_names: Iterable[str],
    *,
    two_phase: bool,
    copy_data: bool = True,
    create_slot: bool = True,
    enabled: bool = True,
) -> tuple[SubscriptionState, bool]:
    """The state ``create`` writes to the catalog, and whether the slot is created with two-phase.

    Tables start ``i`` (``r`` without copy_data); the tri-state follows ``initial_two_phase``.
    """
    names = list(table_names)
    tp, slot_two_phase = initial_two_phase(two_phase, copy_data, create_slot, has_tables=bool(names))
    tables = tuple(TableState(n, initial_sync_state(copy_data)) for n in names)
    return SubscriptionState(name, tp, tables, enabled=enabled), slot_two_phase


# --- events ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """The worker is about to START_REPLICATION from ``origin_lsn``: the replication origin's progress, or 0 if it
    has none (the publisher then starts at the slot's confirmed position, which precedes every copy snapshot taken
    after the slot was created)."""

    origin_lsn: int


@dataclass(frozen=True, slots=True)
class TablesyncRestarted:
    """The tablesync starts (again) in this process: whatever copy was in flight before is gone. Tables in ``i``
    are to be copied; tables in ``d`` died mid-copy and are copied again from empty."""


@dataclass(frozen=True, slots=True)
class TableCopyStarted:
    """The copy of ``name`` begins (``i``/``d`` -> ``d``, persisted before the first row is written)."""

    name: str


@dataclass(frozen=True, slots=True)
class TableCopied:
    """Every partition of ``name`` is committed; its rows are the publisher's at snapshot point ``lsn``."""

    name: str
    lsn: int


@dataclass(frozen=True, slots=True)
class TableCaughtUp:
    """The catch-up of ``name`` reached ``lsn`` (at or after its ``c`` LSN) and stopped (``c`` -> ``s``)."""

    name: str
    lsn: int


@dataclass(frozen=True, slots=True)
class TransactionApplied:
    """A remote transaction was committed (or prepared, commit/rollback prepared, stream commit/prepare) locally,
    together with the origin's advance to ``end_lsn``. Runs the sync-state pass."""

    end_lsn: int


@dataclass(frozen=True, slots=True)
class IdleAt:
    """No transaction in progress and everything up to ``lsn`` (last_received) processed. Runs the sync-state
    pass; checking when idle matters, or a quiet publisher leaves tables in ``s`` forever."""

    lsn: int


@dataclass(frozen=True, slots=True)
class TableAdded:
    """A table joins the subscription (REFRESH found it in a publication, or this worker found its new row)."""

    name: str
    copy_data: bool


@dataclass(frozen=True, slots=True)
class TableRemoved:
    """A table leaves the subscription (REFRESH no longer finds it in any publication)."""

    name: str


@dataclass(frozen=True, slots=True)
class RefreshPublication:
    """``alter NAME --refresh-publication``: ``tables`` is what the publications hold now."""

    tables: frozenset[str]
    copy_data: bool = True


@dataclass(frozen=True, slots=True)
class AlterTwoPhase:
    """``alter NAME --set two_phase=...``; the caller supplies the facts the rule needs from outside."""

    two_phase: bool
    worker_running: bool = False
    prepared_xacts: int = 0
    force: bool = False


@dataclass(frozen=True, slots=True)
class AlterSkipLsn:
    """``alter NAME --skip-lsn LSN`` (0 resets); ``origin_lsn`` is the origin's current progress."""

    lsn: int
    origin_lsn: int


@dataclass(frozen=True, slots=True)
class RemoteTransactionEnding:
    """A remote transaction finishing at ``finish_lsn`` is about to be committed (or prepared) locally; feed it
    before the local commit so a skip-LSN can be cleared in the same local transaction."""

    finish_lsn: int
    applied_something: bool


@dataclass(frozen=True, slots=True)
class Enable:
    pass


@dataclass(frozen=True, slots=True)
class Disable:
    pass


Event = (
    WorkerStarted
    | TablesyncRestarted
    | TableCopyStarted
    | TableCopied
    | TableCaughtUp
    | TransactionApplied
    | IdleAt
    | TableAdded
    | TableRemoved
    | RefreshPublication
    | AlterTwoPhase
    | AlterSkipLsn
    | RemoteTransactionEnding
    | Enable
    | Disable
)

# --- actions -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartStream:
    """START_REPLICATION from ``start_lsn``, with ``two_phase 'on'`` iff ``two_phase``."""

    start_lsn: int
    two_phase: bool


@dataclass(frozen=True, slots=True)
class RestartStream:
    """End the running stream (everything applied is already persisted), rebuild the state from the catalog and
    feed ``WorkerStarted`` again; ``two_phase`` says why: the new stream can enable two-phase. ``message`` is the
    LOG line."""

    two_phase: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class StopStream:
    """End the running stream and do not start another (the subscription was disabled)."""


@dataclass(frozen=True, slots=True)
class SetTwoPhaseState:
    """Persist ``subtwophasestate``."""

    state: TwoPhaseState


@dataclass(frozen=True, slots=True)
class AlterSlotTwoPhase:
    """``ALTER_REPLICATION_SLOT <slot> (TWO_PHASE <two_phase>)`` on the publisher (outside any transaction)."""

    two_phase: bool


@dataclass(frozen=True, slots=True)
class RollbackPreparedTransactions:
    """ROLLBACK PREPARED every ``pg_gid_<subid>_*`` transaction on the target (two-phase turned off by force)."""


@dataclass(frozen=True, slots=True)
class PersistTableState:
    """Upsert the table's ``subscription_rel`` row (state and LSN)."""

    table: TableState


@dataclass(frozen=True, slots=True)
class DeleteTableState:
    """Delete the table's ``subscription_rel`` row."""

    name: str


@dataclass(frozen=True, slots=True)
class CopyTable:
    """Start the table's copy (with its own exported snapshot if the stream is already running). ``from_empty``:
    a partial copy of an earlier attempt may be in the table; empty it (rows and partition markers) first."""

    name: str
    from_empty: bool


@dataclass(frozen=True, slots=True)
class CatchUpTable:
    """Stream the table's own changes from ``start_lsn`` (or from its ``f`` row's LSN if a catch-up persisted
    progress there) until at least ``until_lsn``, then feed ``TableCaughtUp``. The apply stream processes nothing
    meanwhile."""

    name: str
    start_lsn: int
    until_lsn: int


@dataclass(frozen=True, slots=True)
class DropTableSync:
    """Cancel the table's copy if one is queued, stop its copy or catch-up if one runs, and drop what it left on
    the publisher (slot) and target (partition markers). A cancelled copy must not report back: its table may be
    added again meanwhile, and ``TableCopyStarted`` for a table no longer in ``i``/``d`` is an error."""

    name: str


@dataclass(frozen=True, slots=True)
class SetEnabled:
    """Persist ``subenabled``."""

    enabled: bool


@dataclass(frozen=True, slots=True)
class SetSkipLsn:
    """Persist ``subskiplsn`` (0 = NONE)."""

    lsn: int


@dataclass(frozen=True, slots=True)
class ClearSkipLsn:
    """Clear ``subskiplsn`` in the local transaction about to commit, only if it still holds ``expected``.
    ``log`` is a LOG line, ``warning`` a (WARNING, DETAIL) pair; either may be absent."""

    expected: int
    outcome: SkipOutcome
    log: str | None = None
    warning: tuple[str, str] | None = field(default=None)


Action = (
    StartStream
    | RestartStream
    | StopStream
    | SetTwoPhaseState
    | AlterSlotTwoPhase
    | RollbackPreparedTransactions
    | PersistTableState
    | DeleteTableState
    | CopyTable
    | CatchUpTable
    | DropTableSync
    | SetEnabled
    | SetSkipLsn
    | ClearSkipLsn
)

Result = tuple[SubscriptionState, list[Action]]

# --- the machine -------------------------------------------------------------------------------------------------


def apply_event(state: SubscriptionState, event: Event) -> Result:
    """Return the state after ``event`` and the actions to carry out, in order.

    Raises ``AlterRefused`` for an ALTER the rules refuse (nothing changes then) and ``IllegalTransition`` for an
    event that cannot happen in this state (a caller bug).
    """
    match event:
        case WorkerStarted():
            return _worker_started(state, event.origin_lsn)
        case TablesyncRestarted():
            return state, [
                CopyTable(t.name, from_empty=t.state is SyncState.DATASYNC)
                for t in state.tables
                if t.state in (SyncState.INIT, SyncState.DATASYNC)
            ]
        case TableCopyStarted():
            t = state.table(event.name)
            if t is None:  # removed meanwhile; its copy is moot
                return state, []
            new = transition(t, SyncState.DATASYNC)
            return state._with([new]), [] if t == new else [PersistTableState(new)]
        case TableCopied():
            return _table_copied(state, event.name, event.lsn)
        case TableCaughtUp():
            t = state.table(event.name)
            if t is None:
                return state, []
            new = transition(t, SyncState.SYNCDONE, event.lsn)
            return state._with([new]), [PersistTableState(new)]
        case TransactionApplied():
            return _sync_pass(state, event.end_lsn)
        case IdleAt():
            return _sync_pass(state, event.lsn)
        case TableAdded():
            return _table_added(state, event.name, event.copy_data)
        case TableRemoved():
            return _table_removed(state, event.name)
        case RefreshPublication():
            check_refresh_publication(state.two_phase, event.copy_data, subname=state.name)
            actions: list[Action] = []
            current = {t.name for t in state.tables}
            for name in [t.name for t in state.tables if t.name not in event.tables]:
                state, more = _table_removed(state, name)
                actions += more
            for name in sorted(event.tables - current):
                state, more = _table_added(state, name, event.copy_data)
                actions += more
            return state, actions
        case AlterTwoPhase():
            return _alter_two_phase(state, event)
        case AlterSkipLsn():
            check_skip_lsn(event.lsn, event.origin_lsn, subname=state.name)
            return replace(state, skip_lsn=event.lsn), [SetSkipLsn(event.lsn)]
        case RemoteTransactionEnding():
            return _transaction_ending(state, event.finish_lsn, event.applied_something)
        case Enable():
            if state.enabled:
                return state, []
            return replace(state, enabled=True), [SetEnabled(True)]
        case Disable():
            if not state.enabled:
                return state, []
            actions = [SetEnabled(False)]
            if state.streaming:
                actions.append(StopStream())
            return replace(state, enabled=False, stream_lsn=None, stream_two_phase=False), actions
    raise TypeError(f"not a subscription event: {event!r}")


def _worker_started(state: SubscriptionState, origin_lsn: int) -> Result:
    if not state.enabled:
        raise IllegalTransition(f"subscription {state.name} is disabled; its worker does not start")
    if state.streaming:
        raise IllegalTransition(f"subscription {state.name}: a stream is already running in this process")
    transient = [str(t) for t in state.tables if not t.state.persisted]
    if transient:
        raise IllegalTransition(
            f"subscription {state.name}: tables {transient} are in in-memory-only states; "
            "build the state afresh from the catalog before starting the worker"
        )
    actions: list[Action] = []
    settled = [settle_finished_copy(t, origin_lsn) for t in state.tables if t.state is SyncState.FINISHEDCOPY]
    state = state._with(settled)
    actions += [PersistTableState(t) for t in settled if t.state.persisted]
    two_phase = stream_two_phase(state.two_phase, state.tables)
    actions.append(StartStream(origin_lsn, two_phase))
    if two_phase and state.two_phase is TwoPhaseState.PENDING:
        state = replace(state, two_phase=TwoPhaseState.ENABLED)
        actions.append(SetTwoPhaseState(TwoPhaseState.ENABLED))
    return replace(state, stream_lsn=origin_lsn, stream_two_phase=two_phase), actions


def _table_copied(state: SubscriptionState, name: str, lsn: int) -> Result:
    t = state.table(name)
    if t is None:
        return state, []
    finished = transition(t, SyncState.FINISHEDCOPY, lsn)
    if state.stream_lsn is None:
        return state._with([finished]), [PersistTableState(finished)]
    settled = settle_finished_copy(finished, state.stream_lsn)
    persisted = settled if settled.state.persisted else finished
    return state._with([settled]), [PersistTableState(persisted)]


def _sync_pass(state: SubscriptionState, current_lsn: int) -> Result:
    if state.stream_lsn is None:
        raise IllegalTransition(f"subscription {state.name}: a sync-state pass needs a running stream")
    waiting = [t.name for t in state.tables if t.state is SyncState.CATCHUP]
    if waiting:
        raise IllegalTransition(
            f"subscription {state.name}: the apply stream must wait while {waiting} catch up (behaviour 76)"
        )
    state = replace(state, stream_lsn=max(state.stream_lsn, current_lsn))
    ready = process_syncing_tables(state.tables, current_lsn)
    catching_up = begin_catchups(state.tables, current_lsn)
    actions: list[Action] = [PersistTableState(t) for t in ready]
    actions += [
        CatchUpTable(t.name, start_lsn=_lsn(state.table(t.name)), until_lsn=_lsn(t)) for t in catching_up
    ]
    state = state._with(ready + catching_up)
    if not state.stream_two_phase and should_restart_for_two_phase(state.two_phase, state.tables):
        actions.append(RestartStream(two_phase=True, message=restart_for_two_phase_message(state.name)))
        state = replace(state, stream_lsn=None, stream_two_phase=False)
    return state, actions


def _lsn(t: TableState | None) -> int:
    assert t is not None and t.lsn is not None
    return t.lsn


def _table_added(state: SubscriptionState, name: str, copy_data: bool) -> Result:
    if state.table(name) is not None:
        raise IllegalTransition(f"subscription {state.name}: table {name} is already part of it")
    t = TableState(name, initial_sync_state(copy_data))
    actions: list[Action] = [PersistTableState(t)]
    if copy_data and state.streaming:
        actions.append(CopyTable(name, from_empty=False))
    return replace(state, tables=(*state.tables, t)), actions


def _table_removed(state: SubscriptionState, name: str) -> Result:
    t = state.table(name)
    if t is None:
        return state, []
    actions: list[Action] = []
    if t.state not in (SyncState.SYNCDONE, SyncState.READY):  # a copy may be queued, running or catching up
        actions.append(DropTableSync(name))
    actions.append(DeleteTableState(name))
    return replace(state, tables=tuple(x for x in state.tables if x.name != name)), actions


def _alter_two_phase(state: SubscriptionState, event: AlterTwoPhase) -> Result:
    new = check_alter_two_phase(
        state.two_phase,
        event.two_phase,
        enabled=state.enabled,
        worker_running=event.worker_running or state.streaming,
        prepared_xacts=event.prepared_xacts,
        force=event.force,
        subname=state.name,
    )
    if new is state.two_phase:
        return state, []
    actions: list[Action] = []
    if new is TwoPhaseState.DISABLED:
        if event.prepared_xacts > 0:
            actions.append(RollbackPreparedTransactions())
        actions.append(AlterSlotTwoPhase(False))
    actions.append(SetTwoPhaseState(new))
    return replace(state, two_phase=new), actions


def _transaction_ending(state: SubscriptionState, finish_lsn: int, applied_something: bool) -> Result:
    outcome = on_transaction_end(state.skip_lsn, finish_lsn, applied_something)
    if not outcome.clears:
        return state, []
    if outcome is SkipOutcome.CLEAR:
        action = ClearSkipLsn(state.skip_lsn, outcome, log=completed_skipping_message(finish_lsn))
    else:
        action = ClearSkipLsn(
            state.skip_lsn, outcome, warning=mistaken_skip_warning(state.name, state.skip_lsn, finish_lsn)
        )
    return replace(state, skip_lsn=0), [action]
