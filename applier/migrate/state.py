"""The migration's state in the target's ``applier`` schema, next to the subscription it uses.

``applier.migration`` holds one row per migration (its phase, what it created on the source, each phase's time);
``applier.migration_step`` one row per post-data step (its statements, what it waits for, whether it is done). A
step's statements and its ``done`` mark commit in one target transaction, so a killed run never builds anything
twice and never loses a built index.

The phases (``status --json``'s ``phase``) move forward only (:func:`advance`, pure): ``schema`` → ``copy`` →
``following`` → ``cutover`` → ``done``; ``failed`` from anywhere but ``done``; a failed cutover goes back to
``following``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import psycopg

from applier.errors import ApplierError

__all__ = ["PHASES", "Migration", "MigrationError", "advance", "ensure", "load", "set_phase"]

PHASES = ("schema", "copy", "following", "cutover", "done", "failed")

_ALLOWED = {
    "schema": {"schema", "copy", "failed"},
    "copy": {"copy", "following", "failed"},
    "following": {"following", "cutover", "failed"},
    "cutover": {"cutover", "following", "done", "failed"},
    "done": {"done"},
    "failed": {"failed", "schema", "copy", "following"},  # start again resumes where it was
}


class MigrationError(ApplierError):
    """A migration command refused or failed; the message says why and what to do."""


def advance(current: str, new: str) -> str:
    """The phase after moving from ``current`` to ``new``; raises if the move is not allowed."""
    if current not in _ALLOWED or new not in PHASES or new not in _ALLOWED[current]:
        raise MigrationError(f"a migration in phase {current!r} cannot move to {new!r}")
    return new


DDL = """
CREATE TABLE IF NOT EXISTS applier.migration (
    name text PRIMARY KEY,
    subname text NOT NULL,
    source text NOT NULL,
    selection jsonb NOT NULL,
    publication text NOT NULL,
    slot text NOT NULL,
    phase text NOT NULL,
    pub_created bool NOT NULL DEFAULT false,
    slot_created bool NOT NULL DEFAULT false,
    snapshot_lsn pg_lsn,
    times jsonb NOT NULL DEFAULT '{}',
    error text,
    created timestamptz NOT NULL DEFAULT now(),
    updated timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS applier.migration_step (
    name text NOT NULL REFERENCES applier.migration ON DELETE CASCADE,
    step text NOT NULL,
    ord int NOT NULL,
    kind text NOT NULL,
    relnames text[] NOT NULL,
    after text[] NOT NULL,
    statements text[] NOT NULL,
    done bool NOT NULL DEFAULT false,
    seconds float8,
    finished timestamptz,
    PRIMARY KEY (name, step)
);
"""


@dataclass(frozen=True)
class Migration:
    name: str
    subname: str
    source: str  # conninfo without its password
    selection: dict[str, list[str]]
    publication: str
    slot: str
    phase: str
    pub_created: bool
    slot_created: bool
    snapshot_lsn: str | None
    times: dict[str, float]
    error: str | None


def ensure(conn: psycopg.Connection[Any]) -> None:
    """Create the tables (the ``applier`` schema exists: the subscription catalog made it)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('applier.migration'))")
        conn.execute(DDL)


def load(conn: psycopg.Connection[Any], name: str) -> Migration | None:
    if conn.execute("SELECT to_regclass('applier.migration')").fetchone()[0] is None:  # type: ignore[index]
        return None
    row = conn.execute(
        "SELECT name, subname, source, selection, publication, slot, phase, pub_created, slot_created,"
        " snapshot_lsn::text, times, error FROM applier.migration WHERE name = %s",
        (name,),
    ).fetchone()
    return None if row is None else Migration(*row)


def set_phase(conn: psycopg.Connection[Any], name: str, phase: str, *, seconds: dict[str, float] | None = None,
              error: str | None = None) -> None:  # fmt: skip
    """Move to ``phase`` (checked by :func:`advance`); ``seconds`` are merged into the phases' times."""
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
