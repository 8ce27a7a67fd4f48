"""The migration's DDL capture (issue 39, docs/migrate.md "Schema changes while following"): installed on the source
by ``start`` before its slot exists, so that every DDL committed after the slot's snapshot is in the stream, and
recorded in the migration's notes (``ddl``), which ``status`` shows and the subscription's ``subddl`` follows.

Where the source refuses it (the role may not create event triggers), ``start`` follows without it: the refusal is
the note, not an error (``plan`` warned of it already). The capture is removed where the slot is
(:func:`applier.migrate.leftovers.drop_capture`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from applier.ddl import capture
from applier.migrate import publications, store
from applier.migrate.selection import Selection
from applier.migrate.state import Phase

__all__ = ["NOTE", "captured", "install", "why_not"]

#: The key of the migration's notes: ``{"capture": bool, "why": str | None}``.
NOTE = "ddl"
#: Why not, when ``start --no-ddl`` turned it off.
TURNED_OFF = "turned off (start --no-ddl)"


def captured(m: store.Migration) -> bool:
    """Whether the migration's source has its DDL capture (the subscription then asks for the messages)."""
    return bool((m.notes.get(NOTE) or {}).get("capture"))


def why_not(m: store.Migration) -> str | None:
    """Why schema changes are not captured (None: they are); a migration started before the capture existed has
    no note, and none."""
    note = m.notes.get(NOTE)
    if note is None:
        return "the migration was started by a release without the DDL capture"
    return None if note.get("capture") else str(note.get("why"))


def install(
    source: str,
    target: psycopg.Connection[Any],
    m: store.Migration,
    selection: Selection,
    enabled: bool,
    say: Callable[[str], None],
) -> None:
    """In phase ``schema`` (before the slot): install the capture unless ``enabled`` is false or the source
    refuses it, and note which. Later (a start resumed after its slot was made): installed again only when it was
    (the same function, replaced: harmless), never for the first time (DDL since the slot would be missing)."""
    if m.phase is not Phase.SCHEMA:
        if captured(m):
            with psycopg.connect(source, autocommit=True) as src:
                capture.install(src, m.slot, selection, _pubs(m))
        return
    if not enabled:
        _note(target, m, False, TURNED_OFF, say)
        return
    with psycopg.connect(source, autocommit=True) as src:
        ok, why = capture.can_capture(src)
        if ok:
            try:
                capture.install(src, m.slot, selection, _pubs(m))
            except psycopg.Error as exc:
                ok, why = False, f"the source refused it: {str(exc).splitlines()[0]}"
    _note(target, m, ok, None if ok else why, say)


def _pubs(m: store.Migration) -> tuple[str, str]:
    main, ins = publications.names(m.name)
    return main, ins


def _note(
    target: psycopg.Connection[Any], m: store.Migration, ok: bool, why: str | None, say: Callable[[str], None]
) -> None:
    store.add_notes(target, m.name, {NOTE: {"capture": ok, "why": why}})
    if ok:
        say(f"DDL capture installed on the source (schema applier_capture, event triggers of {m.slot})")
    else:
        say(f"note: schema changes (DDL) on the source are not replayed: {why}")
