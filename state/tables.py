"""Per-table synchronisation states and the rule that decides whether a change for a table is applied.

The states and their letters are PostgreSQL's ``pg_subscription_rel.srsubstate`` (behaviour 74), so anyone who knows
``pg_subscription_rel`` can read ``applier.subscription_rel``::

    i INIT --> d DATASYNC --> f FINISHEDCOPY ---------------------------> s SYNCDONE --> r READY
               ^        |     |   ^                                      ^
               +--------+     |   +-- catch-up progress (f -> f)         |
               re-copy        +--> w SYNCWAIT --> c CATCHUP -------------+
                                   (w and c live in memory only, never in the catalog)

LSNs (``srsublsn``), and why each is what it is:

- ``i``, ``d``: none. A ``d`` table whose copy died (process restart, Spark job lost) is copied again from empty:
  the exported snapshot the partial copy used is gone, so its partitions cannot be completed consistently.
- ``f``: the position up to which the table's rows are complete: first the copy's snapshot point (the consistent
  point of the slot that exported the snapshot); a catch-up advances it, committing the new LSN in the same local
  transaction as the caught-up rows. PostgreSQL keeps ``f`` without an LSN because each tablesync has its own
  replication origin; our initial copy has no per-table origin, so the row carries the position itself. ``f``
  never goes back to ``d``: its rows are committed and exactly the snapshot's.
- ``w``/``c``: only for a table whose copy finished after the apply stream had already passed its snapshot point
  (a table added while streaming). ``w`` holds the snapshot point, ``c`` the apply position the catch-up must reach.
- ``s``: from this LSN on the apply stream owns the table: changes of transactions whose final LSN is at or after
  it are applied, earlier ones are already in the table (behaviour 75).
- ``r``: the apply position when the table became ready (``None`` for a table added with ``copy_data = false``).

Everything here is pure: values in, values out. The catalog persists what these functions return.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from applier.lsn import MAX_LSN, format_lsn

from .errors import IllegalTransition


class SyncState(StrEnum):
    """``srsubstate``; the values are the catalog's ``"char"`` letters."""

    INIT = "i"
    DATASYNC = "d"
    FINISHEDCOPY = "f"
    SYNCWAIT = "w"
    CATCHUP = "c"
    SYNCDONE = "s"
    READY = "r"

    @property
    def persisted(self) -> bool:
        """Whether this state is ever written to the catalog (``w`` and ``c`` live only in the running worker, as
        in PostgreSQL's shared memory; after a restart the table is back in ``f``)."""
        return self not in (SyncState.SYNCWAIT, SyncState.CATCHUP)

    @property
    def needs_table_sync(self) -> bool:
        """Whether a table sync still has to run for a table in this (catalog) state: ``i`` and ``d`` need their
        copy, ``f`` its catch-up to the apply stream (PostgreSQL starts a tablesync worker for these)."""
        return self in (SyncState.INIT, SyncState.DATASYNC, SyncState.FINISHEDCOPY)


_NO_LSN = frozenset({SyncState.INIT, SyncState.DATASYNC})
_NEEDS_LSN = frozenset({SyncState.FINISHEDCOPY, SyncState.SYNCWAIT, SyncState.CATCHUP, SyncState.SYNCDONE})


@dataclass(frozen=True, slots=True)
class TableState:
    """One table's sync state.

    ``name`` is the target table as ``regclass`` text (``"public.t"``), the catalog's key; the state machines never
    look inside it. ``state`` accepts the catalog letter and is normalised to ``SyncState``.
    """

    name: str
    state: SyncState
    lsn: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", SyncState(self.state))
        if self.lsn is not None and not 0 < self.lsn <= MAX_LSN:
            raise ValueError(
                f"table {self.name}: invalid LSN {self.lsn} (LSNs are 1..2^64-1; use None for none)"
            )
        if self.state in _NO_LSN and self.lsn is not None:
            raise ValueError(
                f"table {self.name}: state {self.state.value!r} has no LSN, got {format_lsn(self.lsn)}"
            )
        if self.state in _NEEDS_LSN and self.lsn is None:
            raise ValueError(f"table {self.name}: state {self.state.value!r} needs an LSN")

    def __str__(self) -> str:
        lsn = "" if self.lsn is None else f" at {format_lsn(self.lsn)}"
        return f"{self.name} {self.state.value}{lsn}"


def initial_sync_state(copy_data: bool) -> SyncState:
    """State of a table when CREATE or REFRESH adds it: ``i`` to be copied, ``r`` when copy_data is false
    (``CreateSubscription``, ``AlterSubscription_refresh``)."""
    return SyncState.INIT if copy_data else SyncState.READY


# Legal edges. d -> d is the re-copy after a failed copy; f -> f a catch-up persisting its progress.
_EDGES: dict[SyncState, frozenset[SyncState]] = {
    SyncState.INIT: frozenset({SyncState.DATASYNC}),
    SyncState.DATASYNC: frozenset({SyncState.DATASYNC, SyncState.FINISHEDCOPY}),
    SyncState.FINISHEDCOPY: frozenset({SyncState.FINISHEDCOPY, SyncState.SYNCWAIT, SyncState.SYNCDONE}),
    SyncState.SYNCWAIT: frozenset({SyncState.CATCHUP}),
    SyncState.CATCHUP: frozenset({SyncState.SYNCDONE}),
    SyncState.SYNCDONE: frozenset({SyncState.READY}),
    SyncState.READY: frozenset(),
}


def transition(table: TableState, new_state: SyncState | str, lsn: int | None = None) -> TableState:
    """Return ``table`` moved to ``new_state`` (with ``lsn``), or raise ``IllegalTransition``.

    Besides the edges above, an LSN never moves backwards along a table's life: every LSN is a position in the
    publisher's WAL that the table's contents are known to be complete up to, and going back would re-apply
    changes that are already in the table.
    """
    new_state = SyncState(new_state)
    old = table.state
    if new_state not in _EDGES[old]:
        if old is SyncState.READY:
            why = "a ready table leaves that state only by being removed from the subscription"
        elif old is SyncState.FINISHEDCOPY and new_state is SyncState.DATASYNC:
            why = "its copy is committed (state f), so it is never copied again; it continues with catch-up"
        else:
            why = "not an edge of i -> d -> f -> [w -> c ->] s -> r"
        raise IllegalTransition(
            f"table {table.name}: cannot go from {old.value!r} to {new_state.value!r}: {why}"
        )
    if new_state in _NEEDS_LSN and lsn is None:
        raise IllegalTransition(f"table {table.name}: state {new_state.value!r} needs an LSN")
    if new_state is SyncState.READY and lsn is None:
        raise IllegalTransition(
            f"table {table.name}: becoming ready records the apply position; no LSN given"
        )
    if new_state in _NO_LSN:
        lsn = None
    if lsn is not None and table.lsn is not None and lsn < table.lsn:
        raise IllegalTransition(
            f"table {table.name}: LSN may not go backwards ({old.value!r} at {format_lsn(table.lsn)} -> "
            f"{new_state.value!r} at {format_lsn(lsn)})"
        )
    return TableState(table.name, new_state, lsn)


def should_apply_changes_for_rel(
    state: SyncState | str | None, state_lsn: int | None, remote_final_lsn: int
) -> bool:
    """Whether the apply stream applies a change for a table in ``state`` (behaviour 75, the leader's rule).

    ``remote_final_lsn`` is the final LSN of the remote transaction the change belongs to: Begin.final_lsn, Begin
    Prepare.prepare_lsn, or the Stream Commit / Stream Prepare LSN. A ready table takes everything. A table in
    ``s`` takes a change only when its transaction finishes at or after the table's LSN: every earlier transaction
    is already in the table (by the copy or a catch-up). ``<=`` and not ``<`` because the ``s`` LSN can be exactly
    where the next commit record starts. Any other state (or ``None``: a table the subscription does not know) is
    still being copied, and the copy or the catch-up will bring the change.
    """
    if state is None:
        return False
    state = SyncState(state)
    if state is SyncState.READY:
        return True
    if state is SyncState.SYNCDONE:
        return state_lsn is not None and state_lsn <= remote_final_lsn
    return False


def all_tables_ready(tables: Iterable[TableState | SyncState | str]) -> bool:
    """At least one table and every table ``r`` (``AllTablesyncsReady``).

    With no table at all the answer is False, so that a two-phase subscription without tables stays ``p`` and a
    REFRESH that adds tables with copy_data remains allowed (behaviour 55).
    """
    seen = False
    for t in tables:
        state = t.state if isinstance(t, TableState) else SyncState(t)
        if state is not SyncState.READY:
            return False
        seen = True
    return seen


def process_syncing_tables(tables: Iterable[TableState], current_lsn: int) -> list[TableState]:
    """The apply side's sync-state pass, without sync workers (behaviour 76): every ``s`` table whose LSN is at or
    before ``current_lsn`` becomes ``r`` at ``current_lsn``.

    Run it after every commit, prepare, commit/rollback prepared, stream commit and stream prepare with their end
    LSN, and when idle with the last received LSN. Returns only the changed tables; the caller persists them, then
    asks ``twophase.should_restart_for_two_phase``.
    """
    return [
        transition(t, SyncState.READY, current_lsn)
        for t in tables
        if t.state is SyncState.SYNCDONE and t.lsn is not None and t.lsn <= current_lsn
    ]


def begin_catchups(tables: Iterable[TableState], current_lsn: int) -> list[TableState]:
    """Every ``w`` table moves to ``c`` with the position its catch-up must reach: the later of its snapshot point
    and the apply stream's ``current_lsn`` (behaviour 76). The apply stream then waits for each to reach ``s``."""
    return [
        transition(t, SyncState.CATCHUP, max(t.lsn or 0, current_lsn))
        for t in tables
        if t.state is SyncState.SYNCWAIT
    ]


def settle_finished_copy(table: TableState, stream_lsn: int) -> TableState:
    """Decide how an ``f`` table joins the apply stream, which has processed (or will restart from) ``stream_lsn``.

    If the table's rows are complete up to a point at or after ``stream_lsn``, the apply stream has not yet seen
    any transaction finishing at or after that point, so it can take over directly: ``s`` at the table's LSN (the
    usual case after the initial copy, which runs before streaming starts). Otherwise transactions between the
    table's LSN and ``stream_lsn`` went by while the table was being copied and must be caught up: ``w``.
    """
    if table.state is not SyncState.FINISHEDCOPY or table.lsn is None:
        raise IllegalTransition(
            f"table {table.name}: only a table in 'f' joins the apply stream, it is {table}"
        )
    if table.lsn >= stream_lsn:
        return transition(table, SyncState.SYNCDONE, table.lsn)
    return transition(table, SyncState.SYNCWAIT, table.lsn)


def join_apply_stream(table: TableState, current_lsn: int) -> TableState:
    """How a table in ``w`` (its copy done at snapshot point C = its LSN) joins an apply stream that has processed
    everything up to ``current_lsn`` (P).

    P <= C: the stream has not yet seen any transaction finishing at or after C, and those before C are in the
    copy: ``s`` at C, no catch-up. P > C: transactions between C and P went by while the table was being copied
    (the stream skipped them): ``c`` at P, and a catch-up from C must apply them up to the first commit ending at or
    after P, then set ``s`` there (behaviour 76-78; PostgreSQL always catches up to max(C, P), which for P <= C
    only moves work from the stream to the catch-up).
    """
    if table.state is not SyncState.SYNCWAIT or table.lsn is None:
        raise IllegalTransition(
            f"table {table.name}: only a table in 'w' joins the apply stream, it is {table}"
        )
    if current_lsn <= table.lsn:
        return TableState(table.name, SyncState.SYNCDONE, table.lsn)
    return transition(table, SyncState.CATCHUP, current_lsn)
