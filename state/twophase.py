"""The two-phase tri-state ``subtwophasestate``: ``d`` disabled, ``p`` pending, ``e`` enabled (behaviours 55-59, 71-72).

Why three states and not a flag: the slot decodes prepared transactions at PREPARE time only once START_REPLICATION
asks for ``two_phase 'on'``, and from then on the publisher sends a transaction prepared after that point at PREPARE
and not again at COMMIT PREPARED. A table that is still being copied cannot take such a prepared transaction (its
copy runs at a snapshot and a catch-up that never do two-phase, behaviour 70), so while any table is not ready the
subscription waits in ``p``, streaming as if two-phase were off (a prepared transaction arrives whole at COMMIT
PREPARED). Once every table is ready the worker restarts its stream with two-phase on and records ``e``.

This module also holds the ALTER rules that touch the tri-state. They are pure checks: the caller gathers the facts
(is a worker running, how many prepared transactions of this subscription exist on the target) and acts on the
result.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from applier.errors import ApplierError
from applier.lsn import format_lsn

from .errors import AlterRefused
from .tables import SyncState, TableState, all_tables_ready

__all__ = [
    "GID_FORMATS",
    "TwoPhaseState",
    "all_tables_ready",
    "check_alter_gid_format",
    "check_alter_two_phase",
    "check_refresh_publication",
    "check_skip_lsn",
    "gid_for",
    "initial_two_phase",
    "ready_at_slot_snapshot",
    "restart_for_two_phase_message",
    "should_restart_for_two_phase",
    "stream_two_phase",
]


#: ``subgidformat``: ``subscription`` names a local prepared transaction ``pg_gid_<subid>_<remote xid>`` as
#: PostgreSQL does (behaviour 62, the default, fixed in docs/reference.md, "Prepared transaction names");
#: ``original`` keeps the publisher's GID, so that an application's transaction manager can finish it on the target
#: after a migration's cutover (``applier migrate cutover --prepared carry``). Opt-in, because two publishers (or the target's own
#: applications) may use the same GID, which then fails to prepare here.
GID_FORMATS = ("subscription", "original")

#: PostgreSQL's limit on a GID (``GIDSIZE`` is 200 bytes with the terminating zero).
_GID_MAX_BYTES = 199


def gid_for(subid: int, remote_xid: int, original: str | None = None) -> str:
    """The local GID of a remote prepared transaction: ``pg_gid_<subid>_<xid>`` (behaviour 62: never the
    publisher's GID), or the publisher's GID ``original`` itself when the subscription's ``gid_format`` is
    ``original`` (the caller passes it only then)."""
    if remote_xid == 0:
        raise ApplierError("invalid two-phase transaction: remote xid is 0")
    if original is not None:
        if not original or len(original.encode()) > _GID_MAX_BYTES:
            raise ApplierError(
                f"invalid two-phase transaction: the publisher's GID {original!r} is empty or too long"
            )
        return original
    return f"pg_gid_{subid}_{remote_xid}"


def check_alter_gid_format(current: str, new: str, *, prepared_xacts: int, subname: str | None = None) -> str:
    """``alter NAME --set gid_format=...``: refused while the subscription has prepared transactions on the target,
    whose COMMIT/ROLLBACK PREPARED would then look for them under the other name."""
    if new not in GID_FORMATS:
        raise AlterRefused(
            f'unrecognized gid_format value: "{new}"', "use gid_format=subscription or original"
        )
    if new != current and prepared_xacts > 0:
        raise AlterRefused(
            f"cannot change gid_format while {prepared_xacts} prepared transaction(s) of {_sub(subname)} exist on "
            "the target",
            "let the publisher decide them first (applier status shows them), then alter gid_format",
        )
    return new


class TwoPhaseState(StrEnum):
    """``subtwophasestate``; the values are the catalog's ``"char"`` letters."""

    DISABLED = "d"
    PENDING = "p"
    ENABLED = "e"

    @property
    def requested(self) -> bool:
        """Whether the user asked for two-phase (``p`` or ``e``)."""
        return self is not TwoPhaseState.DISABLED


def initial_two_phase(
    two_phase: bool, copy_data: bool, create_slot: bool, *, has_tables: bool
) -> tuple[TwoPhaseState, bool]:
    """The tri-state a new subscription starts in, and whether its slot is created with two-phase.

    ``p`` when two-phase is asked for, with the slot created without it, so that nothing prepared reaches a table
    before it is ready. The one exception is PostgreSQL's (``CreateSubscription``): with ``copy_data = false`` every
    table starts ready at once, so if we also create the slot ourselves and the publication has at least one table,
    the slot is created with two-phase and the state is ``e`` immediately. Without tables it stays ``p``, so that a
    later REFRESH with copy_data is still allowed (it is refused in ``e``, see ``check_refresh_publication``); the
    first worker start then moves it to ``e`` once a table exists and is ready.
    """
    if not two_phase:
        return TwoPhaseState.DISABLED, False
    if not copy_data and create_slot and has_tables:
        return TwoPhaseState.ENABLED, True
    return TwoPhaseState.PENDING, False


def ready_at_slot_snapshot(
    tables: Iterable[tuple[SyncState | str, int | None]], slot_lsn: int | None
) -> bool:
    """Whether every table, given as (state, LSN), was copied at the slot's own exported snapshot: each is ``s``
    at exactly the slot's consistent point ``slot_lsn``. Then the tables may become ``r`` and two-phase ``e``
    before any stream starts (``applier migrate start``; docs/differences.md, "Two-phase from the start of a
    migration's stream").

    Why that is safe, against the reasons for ``p`` (behaviours 55-59): ``p`` exists because each native table
    sync copies its table at its own LSN and catches up without two-phase (behaviour 70), so a transaction
    prepared before a table is ready would reach that table at PREPARE, where the table skips it, and never
    again. Here no table has its own LSN: every row was read at the snapshot of the slot the stream starts from,
    so every change the stream sends is one the copy did not see. A transaction committed before the point is in
    the copy and is never sent; one prepared after it arrives at PREPARE and applies to every table, as it does
    in ``e``; one prepared before the point and committed after is not in the copy (it was still open) and
    arrives once, whole, at its COMMIT PREPARED (behaviour 59: Begin Prepare with its earlier prepare LSN, then
    Commit Prepared). That last one is why the tables must be ``r`` and not ``s`` at the point: a ``s`` table
    would skip a prepare LSN before its own (behaviour 75). Any other table (copied again at a later snapshot
    after a resume, not yet copied) says no: then ``p`` and the restart of behaviour 57, as before."""
    listed = list(tables)
    return (
        slot_lsn is not None
        and slot_lsn > 0
        and bool(listed)
        and all(SyncState(state) is SyncState.SYNCDONE and lsn == slot_lsn for state, lsn in listed)
    )


def stream_two_phase(state: TwoPhaseState | str, tables: Iterable[TableState | SyncState | str]) -> bool:
    """Whether START_REPLICATION may ask for ``two_phase 'on'`` (behaviour 56).

    In ``e`` always. In ``p`` only when every table is ready, and then the caller records ``e`` right after the
    stream has started (``run_apply_worker`` does it in that order: a crash between the two leaves ``p`` with all
    tables ready, which simply enables again on the next start).
    """
    state = TwoPhaseState(state)
    if state is TwoPhaseState.ENABLED:
        return True
    return state is TwoPhaseState.PENDING and all_tables_ready(tables)


def should_restart_for_two_phase(
    state: TwoPhaseState | str, tables: Iterable[TableState | SyncState | str]
) -> bool:
    """Whether a running worker must restart its stream so that two-phase can be enabled (behaviour 57).

    Asked at the end of each sync-state pass: a stream started while some table was not ready runs without
    two-phase; once the tri-state is ``p`` and every table is ready, the stream is restarted and
    ``stream_two_phase`` then says yes.
    """
    return TwoPhaseState(state) is TwoPhaseState.PENDING and all_tables_ready(tables)


def restart_for_two_phase_message(subname: str) -> str:
    """PostgreSQL's LOG line for the restart of behaviour 57."""
    return f'logical replication apply worker for subscription "{subname}" will restart so that two_phase can be enabled'


def _sub(subname: str | None) -> str:
    return f'subscription "{subname}"' if subname else "this subscription"


def _name(subname: str | None) -> str:
    return subname or "NAME"


def check_alter_two_phase(
    current: TwoPhaseState | str,
    new: bool,
    *,
    enabled: bool,
    worker_running: bool,
    prepared_xacts: int,
    force: bool,
    subname: str | None = None,
) -> TwoPhaseState:
    """The tri-state after ``alter NAME --set two_phase=<new>``, or ``AlterRefused`` (PostgreSQL 18's rules,
    behaviour 71).

    - Asking for the value the subscription already has changes nothing and is always allowed.
    - Only on a disabled subscription, and only once its worker has exited: the slot's two-phase setting cannot be
      changed while a walsender holds the slot, and a worker still streaming would carry on under the old mode.
    - Turning it off while prepared transactions of this subscription (``pg_gid_<subid>_*``) exist on the target
      is refused: the publisher would re-send those transactions in full at COMMIT PREPARED, and the local
      prepared ones would hold their locks and never be resolved. With ``force`` the caller rolls them back first
      (they are re-sent whole, so nothing is lost). PostgreSQL only checks in ``e``; we check in ``p`` too, where
      such transactions can only be leftovers, because the consequence is the same.
    - off -> on gives ``p`` (the worker enables it when every table is ready); on -> off gives ``d`` and the caller
      runs ``ALTER_REPLICATION_SLOT ... (TWO_PHASE false)`` on the publisher.
    """
    current = TwoPhaseState(current)
    if current.requested == new:
        return current
    name = _name(subname)
    if enabled:
        raise AlterRefused(
            'cannot set option "two_phase" for enabled subscription' + (f' "{subname}"' if subname else ""),
            f"disable it first (applier alter {name} --disable), wait for its worker to exit, then run this again "
            f"and re-enable it with applier alter {name} --enable",
        )
    if worker_running:
        raise AlterRefused(
            f"cannot alter two_phase when the apply worker of {_sub(subname)} is still running",
            "the subscription is disabled but its worker has not exited yet; try again after some time, "
            "or stop the applier run process (SIGTERM stops it cleanly)",
        )
    if not new and prepared_xacts > 0 and not force:
        raise AlterRefused(
            f"cannot disable two_phase when prepared transactions are present: {prepared_xacts} prepared "
            f"transaction(s) of {_sub(subname)} exist on the target",
            "resolve them first (see pg_prepared_xacts for gids pg_gid_<subid>_*: COMMIT PREPARED or ROLLBACK "
            "PREPARED them, as the publisher did), or pass --force to roll them back; the publisher re-sends "
            "those transactions whole at COMMIT PREPARED once two-phase is off",
        )
    return TwoPhaseState.PENDING if new else TwoPhaseState.DISABLED


def check_refresh_publication(
    state: TwoPhaseState | str, copy_data: bool, *, subname: str | None = None
) -> None:
    """Refuse a REFRESH PUBLICATION that would copy tables while two-phase is enabled (behaviour 72).

    New tables would be copied and caught up without two-phase while the subscription's stream already sends
    prepared transactions at PREPARE: a transaction prepared before a new table is ready would be missed for that
    table (or applied twice). In ``p`` the stream does not do two-phase yet, so the refresh is allowed.
    """
    if TwoPhaseState(state) is TwoPhaseState.ENABLED and copy_data:
        name = _name(subname)
        raise AlterRefused(
            f"refreshing the publications of {_sub(subname)} with copy_data is not allowed when two_phase is "
            "enabled",
            f"use applier alter {name} --refresh-publication --no-copy-data (new tables then start ready and "
            f"empty), or drop and create the subscription, or disable two-phase first (applier alter {name} "
            f"--disable, then --set two_phase=false), refresh, and set it back on: it is enabled again once "
            "every table is ready",
        )


def check_skip_lsn(skip_lsn: int, origin_lsn: int, *, subname: str | None = None) -> None:
    """Refuse ``alter NAME --skip-lsn`` with an LSN behind the subscription's origin (behaviour 97).

    The origin's LSN is the end of the last transaction applied; a transaction finishing before it has already
    been applied (or skipped) and will never arrive again, so such a skip-LSN would only linger and then be cleared
    by the next transaction with a warning. ``0`` (``NONE``) resets the skip-LSN and is always allowed, and so is
    any LSN while the origin has no progress yet. As in PostgreSQL an LSN equal to the origin's passes.
    """
    if skip_lsn and origin_lsn and skip_lsn < origin_lsn:
        raise AlterRefused(
            f"skip WAL location (LSN {format_lsn(skip_lsn)}) must be greater than origin LSN "
            f"{format_lsn(origin_lsn)}",
            "the transaction at that LSN has already been applied; take the finish LSN of the failing transaction "
            f"from the worker's error message (applier status {_name(subname)} shows the origin's position)",
        )
