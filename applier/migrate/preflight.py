"""``migrate start``'s guard of the source: plan's blockers before anything is created there, and what a failed
set-up created there taken back.

Do no harm (docs/migrate.md, "What happens when it fails"): a ``start`` that would fail, or would break the source,
is refused before its first change (:func:`check`); one that fails after it, while still in phase ``schema``,
drops the slot and the publication it made (nothing keeps WAL or changes the source's behaviour while nobody
follows) and records the error with what to do (:func:`undo`). From phase ``copy`` on, the slot is what a resumed
``start`` continues from, so it stays, and the recorded error says that it keeps WAL until ``start`` resumes or
``abort`` removes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from applier.conninfo import describe, has_password, without_password
from applier.migrate import fence as fencing
from applier.migrate import publications, store
from applier.migrate.leftovers import drop_capture, drop_slot
from applier.migrate.state import MigrationError
from applier.migrate.tools import find_dump_tools

if TYPE_CHECKING:
    from applier.migrate.start import StartOptions

__all__ = ["START_FAILED", "check", "check_source_password", "undo"]

#: How a failed start's error begins in the migration's record: the next start clears it (and no other error).
START_FAILED = "start failed: "


def check(opts: StartOptions) -> None:
    """``plan``'s blockers (:func:`applier.migrate.plan.assess`), refused with each one and its fix, before
    anything is created anywhere: no catalog row, no publication, no slot."""
    from applier.migrate import plan as planning
    from applier.migrate import survey

    source = survey.gather_source(opts.source, opts.selection)
    target = survey.gather_target(opts.target, source.tables, source.schemas)
    tools, found = find_dump_tools(source.major)
    result = planning.assess(source, target, opts.selection, tools, found)
    if result.blockers:
        each = "".join(
            f"\n  - {b.message}" + (f"\n    HINT: {b.hint}" if b.hint else "") for b in result.blockers
        )
        raise MigrationError(
            f"{len(result.blockers)} blocker(s), nothing was created (applier migrate plan shows them too):{each}"
        )


#: libpq's words when the server wants a password the connection string does not give
_NO_PASSWORD = ("no password supplied", "password authentication failed")


def check_source_password(source: str) -> None:
    """A password given in ``--source`` is used by ``start``'s own sessions, but never kept: the migration's record
    and its subscription (which the copy and the apply read) hold the connection string without it, as every
    catalog of ours does (docs/security.md). When the source refuses that string, the copy would fail after the
    slot is made; refused here instead, before anything is created, with the ways to give the password."""
    if not has_password(source):
        return
    try:
        psycopg.connect(without_password(source, "source"), connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        if any(words in str(exc) for words in _NO_PASSWORD):
            raise MigrationError(
                f"the source ({describe(source)}) asks for a password, and the one in --source is never kept: the "
                "copy and the apply connect with the connection string the migration records, without it; put "
                "the password in ~/.pgpass (or the file PGPASSFILE names), then start again; nothing was created"
            ) from None


def undo(
    target: psycopg.Connection[Any],
    source: str,
    m: store.Migration,
    exc: BaseException | None,
    say: Callable[[str], None],
) -> None:
    """Drop what the migration's record says it created on the source (its slot, its publication; never one it
    found there) and its DDL capture, then record ``exc`` with what is left and what to do (None: a stop, not a
    failure, recorded only when something is left). Best effort: a source that cannot be reached is named in the record, and ``abort``
    removes what is left."""
    left: list[str] = []
    try:
        with fencing.open_source(source) as src:
            now = store.load(target, m.name) or m
            drop_capture(src, m.slot, say)
            if now.slot_created and not drop_slot(src, m.slot, patience=10.0, say=say):
                left.append(f"slot {m.slot}")
            if now.pub_created:
                publications.drop(src, m.name, say)
    except Exception as undo_exc:  # noqa: BLE001 - said, and recorded with the error
        left.append(f"what it created there ({undo_exc})")
    after = (
        f"; left on the source: {', '.join(left)} (applier migrate abort removes it)"
        if left
        else "; nothing of it is left on the source"
    )
    if exc is None and not left:
        return
    why = "stopped" if exc is None else "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
    with contextlib.suppress(Exception):
        store.record_error(target, m.name, f"{START_FAILED}{why}{after}; fix it and run start again")
