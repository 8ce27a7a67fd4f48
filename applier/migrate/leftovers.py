"""What a migration leaves on its source, and the one place it is removed from there: its slot (dropped once
nobody streams from it) and its DDL capture (:mod:`applier.ddl.capture`: event triggers, functions, and our schema
once no other capture uses it). The cutover, ``abort`` and a ``start`` that failed in its set-up all remove them
here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from applier import slots
from applier.ddl import capture

__all__ = ["drop_capture", "drop_slot"]


def drop_capture(src: psycopg.Connection[Any], slot: str, say: Callable[[str], None]) -> None:
    """Remove the DDL capture of ``slot`` from the source (``src`` allowed to write: under a fence,
    :func:`applier.migrate.fence.open_source`); nothing there, nothing done (a migration with ``--no-ddl``, or whose
    source refused it). A role that may not remove it (not the one that installed it): a warning naming what to
    drop, never an error that would keep the slot and publications from going too."""
    try:
        removed = capture.remove(src, slot)
    except psycopg.Error as exc:
        say(
            f"WARNING: the DDL capture of {slot} could not be removed from the source ({str(exc).splitlines()[0]});"
            f" as a superuser: {capture.manual_removal(slot)}"
        )
        return
    if removed:
        say(f"DDL capture of {slot} removed from the source (event triggers, functions, key)")


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
