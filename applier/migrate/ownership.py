"""Who holds a migration: its ``start`` (alive and following), its cutover, and its fence of the source.

Do no harm (docs/migrate.md, "What happens when it fails"): a verb that dies must never leave the production source
fenced with nobody to lift the fence, and a verb must never lift a fence that is not its migration's. Three facts,
each kept where it survives a ``kill -9``:

- **start is alive**: ``start`` holds a session-level advisory lock ``(START_NAMESPACE, hashtext(name))`` on the
  target for its whole life (:func:`hold_start`). PostgreSQL drops it with the session, so a killed ``start`` never
  leaves a stale one; a second ``start`` of the same migration is refused instead of racing the first. A cutover
  fences nothing unless the lock is held and the migration's slot streams (:func:`follower_problem`).
- **a cutover runs**: the cutover holds ``(CUTOVER_NAMESPACE, hashtext(name))`` the same way (:func:`hold_cutover`);
  a second cutover is refused while it is held, and once it is not held, phase ``cutover`` means the one that set
  it died (:func:`recover`).
- **the fence is ours**: ``applier.migration.fenced_at`` is committed *before* the source is fenced and cleared once
  the fence is lifted (:func:`applier.migrate.store.record_fence`). ``abort``, ``cutover`` and ``start`` lift a fence
  only when their migration's record names one, so an old migration never unfences a newer one's cutover (nor a
  source its owner made read-only by hand).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psycopg

from applier.migrate import fence as fencing
from applier.migrate import store
from applier.migrate.state import MigrationError, Phase

__all__ = [
    "CUTOVER_NAMESPACE",
    "START_NAMESPACE",
    "cutover_running",
    "follower_problem",
    "hold_cutover",
    "hold_start",
    "lift_fence",
    "recover",
    "retake_start",
    "start_holder",
]

#: First keys of the two-key advisory locks ("amst", "amcu"); the second is ``hashtext(name)``. Distinct from the
#: subscription lock's namespace (:data:`applier.subscriptions.common.LOCK_NAMESPACE`).
START_NAMESPACE = 0x616D7374
CUTOVER_NAMESPACE = 0x616D6375

_TRY = "SELECT pg_try_advisory_lock(%s::int4, hashtext(%s))"
# the session holding the lock, other than the caller's (classid/objid are the two keys, objid as an oid)
_HOLDER = (
    "SELECT a.pid, coalesce(a.application_name, ''), a.client_addr::text, a.backend_start"
    " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = %s::int8::oid"
    " AND l.objid = hashtext(%s)::oid AND l.database = (SELECT oid FROM pg_database WHERE datname ="
    " current_database()) AND l.pid <> pg_backend_pid()"
)


def _take(conn: psycopg.Connection[Any], namespace: int, name: str) -> bool:
    return bool(conn.execute(_TRY, (namespace, name)).fetchone()[0])  # type: ignore[index]


def _holder(conn: psycopg.Connection[Any], namespace: int, name: str) -> str | None:
    row = conn.execute(_HOLDER, (namespace, name)).fetchone()
    if row is None:
        return None
    where = f" from {row[2]}" if row[2] else ""
    return f"{row[1] or 'a session'}{where} (target backend pid {row[0]}, connected since {row[3]:%Y-%m-%d %H:%M:%S%z})"


def hold_start(target: str, name: str) -> psycopg.Connection[Any]:
    """A target session holding ``start``'s lock for ``name``; refused (:class:`MigrationError`) when another
    process holds it. Keep the connection open as long as ``start`` runs (closing it releases the lock)."""
    conn = psycopg.connect(target, autocommit=True, application_name=f"applier migrate start {name}")
    try:
        if not _take(conn, START_NAMESPACE, name):
            holder = _holder(conn, START_NAMESPACE, name)
            raise MigrationError(
                f'migration "{name}" is already run by another applier migrate start: {holder}; stop that one '
                "first (it resumes where it stopped), or leave it running"
            )
    except BaseException:
        conn.close()
        raise
    return conn


def retake_start(conn: psycopg.Connection[Any], name: str) -> bool:
    """Take ``start``'s lock again on a new session (the one that held it was lost with the target's restart);
    whether it is ours now."""
    return _take(conn, START_NAMESPACE, name)


def start_holder(conn: psycopg.Connection[Any], name: str) -> str | None:
    """Who runs ``start`` for ``name`` (its target session), or None when no ``start`` is alive."""
    return _holder(conn, START_NAMESPACE, name)


def hold_cutover(conn: psycopg.Connection[Any], name: str) -> None:
    """Take the cutover's lock on ``conn`` (the cutover's own target session, held until it closes); refused when
    another cutover of ``name`` runs."""
    if not _take(conn, CUTOVER_NAMESPACE, name):
        raise MigrationError(
            f'another cutover of migration "{name}" is running: {_holder(conn, CUTOVER_NAMESPACE, name)}; wait for '
            "it to end (or stop it: it unfences the source), then look at applier migrate status"
        )


def cutover_running(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether a cutover of ``name`` holds its lock (in another session than ``conn``'s)."""
    return _holder(conn, CUTOVER_NAMESPACE, name) is not None


def follower_problem(
    target: psycopg.Connection[Any], source: psycopg.Connection[Any], name: str, slot: str
) -> str | None:
    """Why no cutover may fence the source now, or None: a ``start`` must hold the migration and its worker stream
    from the slot (a cutover without it would fence production and then wait for a catch-up that never comes)."""
    if start_holder(target, name) is None:
        return (
            f'no applier migrate start is running for migration "{name}": a cutover needs it following the '
            "source; run applier migrate start again (it resumes), wait for phase following, then cut over"
        )
    row = source.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return f'the migration\'s slot "{slot}" is missing on the source: abort the migration and start again'
    if not row[0]:
        return (
            f'applier migrate start runs, but nothing streams from the slot "{slot}" (its worker is starting or '
            "reconnecting, or fails: see applier migrate status); try the cutover again in a moment"
        )
    return None


def lift_fence(target: psycopg.Connection[Any], m: store.Migration, say: Callable[[str], None]) -> bool:
    """Lift ``m``'s own fence (its record names one) and clear the record; whether there was one. A source that
    cannot be reached leaves the record, so that the next verb tries again."""
    if m.fenced_at is None:
        return False
    with fencing.open_source(m.source) as src:
        fencing.unfence(src)
    store.clear_fence(target, m.name)
    say(f"source unfenced (fenced by this migration at {m.fenced_at})")
    return True


def recover(
    target: psycopg.Connection[Any], m: store.Migration, say: Callable[[str], None]
) -> store.Migration:
    """After a cutover that died (``kill -9``, a lost machine): no cutover holds the lock, yet the migration is in
    phase ``cutover`` or its fence is up (not ``done``: the old server stays fenced then, on purpose). Lift the
    fence, put the migration back to ``following`` with the reason, and return it as it is now. Called by
    ``cutover``, ``start`` and ``abort`` before anything else they do (a following ``start`` every second).

    It holds the cutover's lock while it looks and acts (taken again by a cutover that holds it already: advisory
    locks count per session), so that no cutover can begin, or end and back out, between the look and the act,
    and it acts on the migration as read under that lock, never on ``m`` as the caller read it before."""
    if m.phase is Phase.DONE or not _take(target, CUTOVER_NAMESPACE, m.name):
        return m
    try:
        now = store.load(target, m.name) or m
        if now.phase is Phase.DONE or (now.fenced_at is None and now.phase is not Phase.CUTOVER):
            return now
        say(f'a cutover of migration "{now.name}" was interrupted: undoing what it left')
        lift_fence(target, now, say)
        with contextlib.suppress(MigrationError):
            if now.phase is Phase.CUTOVER:
                store.set_phase(
                    target,
                    now.name,
                    Phase.FOLLOWING,
                    error="a cutover was interrupted; the source was unfenced",
                )
    finally:
        target.execute("SELECT pg_advisory_unlock(%s::int4, hashtext(%s))", (CUTOVER_NAMESPACE, m.name))
    again = store.load(target, m.name)
    assert again is not None
    return again
