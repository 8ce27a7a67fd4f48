"""The migration's state in the target's ``applier`` schema, next to the subscription it uses: every statement on
the migration's own tables is here (``tests/unit/test_catalog_sql_home.py`` checks it).

``applier.migration`` holds one row per migration (its phase, what it created on the source, each phase's time);
``applier.migration_step`` one row per post-data step (its statements, what it waits for, whether it is done). A
step's statements and its ``done`` mark commit in one target transaction, so a killed run never builds anything
twice and never loses a built index.

The tables are the catalog's (created and upgraded by :meth:`applier.catalog.store.Catalog.ensure`, catalog
version 6); their columns are in :data:`applier.catalog.schema.MIGRATION_TABLES`. Why one module: a change to a
column then finds every statement that reads or writes it, and every phase change goes through :func:`set_phase`,
which checks the move (:func:`applier.migrate.state.advance`). The functions run on the caller's psycopg
connection, inside its transaction when it has one (the cutover marks the migration done in the transaction that
disables the subscription).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from applier.catalog import sql as catalog_sql
from applier.lsn import format_lsn
from applier.migrate.state import MigrationError, Phase, advance
from applier.migrate.steps import Step

__all__ = [
    "Migration",
    "add_notes",
    "load",
    "load_steps",
    "mark_publication_created",
    "mark_slot_created",
    "mark_step_done",
    "phase_of",
    "clear_fence",
    "post_data_progress",
    "record_error",
    "record_fence",
    "register",
    "require",
    "save_steps",
    "set_phase",
    "set_snapshot_lsn",
    "statements_of",
    "steps_to_run",
    "subscription_of",
    "upgrade",
]


@dataclass(frozen=True)
class Migration:
    name: str
    subname: str
    source: str  # conninfo without its password
    selection: dict[str, list[str]]
    publication: str
    slot: str
    phase: Phase
    pub_created: bool
    slot_created: bool
    snapshot_lsn: str | None
    times: dict[str, float]
    error: str | None
    notes: dict[str, Any] = field(default_factory=dict)
    #: when this migration fenced its source (ISO text), until it lifted the fence; None: no fence of ours
    fenced_at: str | None = None


# --- the migration -----------------------------------------------------------------------------------------------


def _exists(conn: psycopg.Connection[Any]) -> bool:
    """Whether the target has the tables (a target where no catalog was ever made has none)."""
    return conn.execute("SELECT to_regclass('applier.migration') IS NOT NULL").fetchone()[0]  # type: ignore[index,no-any-return]


def load(conn: psycopg.Connection[Any], name: str) -> Migration | None:
    """The migration ``name``, or None when this target has none of that name."""
    if not _exists(conn):
        return None
    row = conn.execute(
        "SELECT name, subname, source, selection, publication, slot, phase, pub_created, slot_created,"
        " snapshot_lsn::text, times, error, coalesce(to_jsonb(m) -> 'notes', '{}'),"
        " to_jsonb(m) ->> 'fenced_at' FROM applier.migration m WHERE name = %s",
        (name,),
    ).fetchone()
    if row is None:
        return None
    m = Migration(*row)
    return replace(m, phase=Phase(m.phase))


def require(conn: psycopg.Connection[Any], name: str) -> Migration:
    """The migration ``name``; refused with what to do when this target has none of that name."""
    m = load(conn, name)
    if m is None:
        raise MigrationError(f'migration "{name}" does not exist on this target (see: applier migrate start)')
    return m


def subscription_of(conn: psycopg.Connection[Any], m: Migration) -> tuple[int, str] | None:
    """The migration's subscription: its id and slot, once the set-up made it."""
    row = conn.execute(catalog_sql.SUBSCRIPTION_ID_AND_SLOT, (m.subname,)).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


def upgrade(target: str) -> None:
    """The catalog at this release's version (the fence's record needs version 11), for a target whose ``start``
    has not run since an upgrade: what ``cutover`` and ``abort`` do first."""
    from applier.catalog.store import Catalog

    catalog = Catalog.connect(target)
    try:
        catalog.ensure()
    finally:
        catalog.engine.dispose()


def phase_of(conn: psycopg.Connection[Any], name: str) -> Phase | None:
    """Only the phase: what ``start`` polls to see another shell's cutover or abort, cheaply."""
    row = conn.execute("SELECT phase FROM applier.migration WHERE name = %s", (name,)).fetchone()
    return None if row is None else Phase(row[0])


def register(conn: psycopg.Connection[Any], name: str, source: str, selection: dict[str, list[str]]) -> None:
    """The migration's row in phase ``schema``, unless one of that name exists (the caller compares it). The
    subscription, publication and slot take the migration's name."""
    conn.execute(
        "INSERT INTO applier.migration (name, subname, source, selection, publication, slot, phase)"
        " VALUES (%s, %s, %s, %s, %s, %s, 'schema') ON CONFLICT (name) DO NOTHING",
        (name, name, source, json.dumps(selection), name, name),
    )


def set_phase(
    conn: psycopg.Connection[Any],
    name: str,
    phase: Phase,
    *,
    seconds: dict[str, float] | None = None,
    error: str | None = None,
) -> None:
    """Move to ``phase`` (checked by :func:`applier.migrate.state.advance`) with ``error`` (None clears it);
    ``seconds`` are merged into the phases' times. The one way a phase changes."""
    with conn.transaction():
        row = conn.execute(
            "SELECT phase FROM applier.migration WHERE name = %s FOR UPDATE", (name,)
        ).fetchone()
        if row is None:
            raise MigrationError(f'migration "{name}" does not exist on this target')
        advance(row[0], phase)
        conn.execute(
            "UPDATE applier.migration SET phase = %s, error = %s, times = times || %s::jsonb, updated = now()"
            " WHERE name = %s",
            (phase, error, json.dumps(seconds or {}), name),
        )


def add_notes(conn: psycopg.Connection[Any], name: str, notes: dict[str, Any]) -> None:
    """Merge ``notes`` into the migration's record (what the user should know afterwards: the cutover's fence, the
    objects skipped). A catalog older than version 10 (its ``start`` not restarted since the upgrade) has no
    column for them: they are then only printed."""
    if conn.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = 'applier.migration'::regclass AND attname = 'notes'"
    ).fetchone():
        conn.execute(
            "UPDATE applier.migration SET notes = notes || %s::jsonb WHERE name = %s",
            (json.dumps(notes), name),
        )


def record_error(conn: psycopg.Connection[Any], name: str, error: str | None) -> None:
    """The error ``status`` shows for the migration (None clears it), its phase unchanged: a failed start records
    why it stopped, and what to do, where the next reader looks."""
    conn.execute("UPDATE applier.migration SET error = %s, updated = now() WHERE name = %s", (error, name))


def record_fence(conn: psycopg.Connection[Any], name: str) -> None:
    """Before the source is fenced (committed first: a cutover killed right after the fence leaves this record,
    and the next verb of the migration lifts the fence it names)."""
    conn.execute("UPDATE applier.migration SET fenced_at = clock_timestamp() WHERE name = %s", (name,))


def clear_fence(conn: psycopg.Connection[Any], name: str) -> None:
    """Once the fence is lifted: the source holds no fence of this migration."""
    conn.execute("UPDATE applier.migration SET fenced_at = NULL WHERE name = %s", (name,))


def mark_publication_created(conn: psycopg.Connection[Any], name: str) -> None:
    """Before the publication is created: abort and a new start then know it is the migration's to drop."""
    conn.execute("UPDATE applier.migration SET pub_created = true WHERE name = %s", (name,))


def mark_slot_created(conn: psycopg.Connection[Any], name: str) -> None:
    """Before the slot is created: abort and a new start then know it is the migration's to drop."""
    conn.execute("UPDATE applier.migration SET slot_created = true WHERE name = %s", (name,))


def set_snapshot_lsn(conn: psycopg.Connection[Any], name: str, lsn: int) -> None:
    """Where the pre-data's snapshot is (in the pre-data's transaction: set means the pre-data is restored)."""
    conn.execute(
        "UPDATE applier.migration SET snapshot_lsn = %s::pg_lsn WHERE name = %s", (format_lsn(lsn), name)
    )


# --- its steps ---------------------------------------------------------------------------------------------------


def _step(row: Sequence[Any]) -> Step:
    """A step from its row (``step, kind, relnames, after, statements, ord, done``)."""
    return Step(row[0], row[1], tuple(row[2]), tuple(row[3]), tuple(row[4]), row[5], row[6])


def save_steps(conn: psycopg.Connection[Any], name: str, steps: Sequence[Step]) -> None:
    """Store the steps (inside the caller's transaction; a step stored before is kept as it is)."""
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO applier.migration_step (name, step, ord, kind, relnames, after, statements)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            [
                (name, s.step, s.ord, str(s.kind), list(s.relnames), list(s.after), list(s.statements))
                for s in steps
            ],
        )


def load_steps(conn: psycopg.Connection[Any], name: str) -> list[Step]:
    """Every step of the migration, in ``ord`` order."""
    rows = conn.execute(
        "SELECT step, kind, relnames, after, statements, ord, done FROM applier.migration_step WHERE name = %s"
        " ORDER BY ord",
        (name,),
    ).fetchall()
    return [_step(r) for r in rows]


def steps_to_run(conn: psycopg.Connection[Any], name: str, kinds: Collection[str]) -> list[Step]:
    """The steps of ``kinds`` not done yet, in ``ord`` order (the cutover's own)."""
    rows = conn.execute(
        "SELECT step, kind, relnames, after, statements, ord, done FROM applier.migration_step"
        " WHERE name = %s AND NOT done AND kind = ANY(%s) ORDER BY ord",
        (name, [str(k) for k in kinds]),
    ).fetchall()
    return [_step(r) for r in rows]


def statements_of(conn: psycopg.Connection[Any], name: str, kinds: Collection[str]) -> list[str]:
    """The statements of every step of ``kinds``, done or not, in ``ord`` order (run again at each cutover)."""
    rows = conn.execute(
        "SELECT statements FROM applier.migration_step WHERE name = %s AND kind = ANY(%s) ORDER BY ord",
        (name, [str(k) for k in kinds]),
    ).fetchall()
    return [s for (group,) in rows for s in group]


def mark_step_done(conn: psycopg.Connection[Any], name: str, step: str, seconds: float | None = None) -> None:
    """Mark ``step`` done, in the transaction that ran its statements (both or neither survive a kill)."""
    conn.execute(
        "UPDATE applier.migration_step SET done = true, seconds = %s, finished = clock_timestamp()"
        " WHERE name = %s AND step = %s",
        (seconds, name, step),
    )


def post_data_progress(
    conn: psycopg.Connection[Any], name: str, cutover_kinds: Collection[str]
) -> tuple[int, int]:
    """(done, total) of the post-data steps: every step but the cutover's (``cutover_kinds``)."""
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE done), count(*) FROM applier.migration_step"
        " WHERE name = %s AND kind <> ALL(%s)",
        (name, [str(k) for k in cutover_kinds]),
    ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))
