"""The target's ``GENERATED ALWAYS`` identity columns while the migration follows: ``BY DEFAULT`` until the cutover,
which puts them back (its steps of kind ``cutover_identity``).

Its own module because it is a rule of the migration's life (made in the set-up, undone by the cutover), not a step
of the set-up itself.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from applier.migrate.steps import Step, StepKind

__all__ = ["by_default_until_cutover"]


def by_default_until_cutover(target: psycopg.Connection[Any], tables: list[str]) -> list[Step]:
    """Make the target's ``GENERATED ALWAYS`` identity columns ``BY DEFAULT`` until the cutover, which puts them
    back (steps of kind ``cutover_identity``): the apply loop can write an ALWAYS column, but an UPDATE that may
    change one switches it for each statement under an ACCESS EXCLUSIVE lock (docs/differences.md); while only
    the migration writes to the target, BY DEFAULT costs nothing."""
    rows = target.execute(
        "SELECT format('%%I.%%I', n.nspname, c.relname), a.attname FROM pg_attribute a"
        " JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE a.attidentity = 'a' AND NOT a.attisdropped AND NOT c.relispartition"
        " AND format('%%I.%%I', n.nspname, c.relname) = ANY(%s)"
        " ORDER BY 1, 2",
        (tables,),
    ).fetchall()
    steps = []
    for table, column in rows:
        alter = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET GENERATED ").format(
            sql.SQL(table), sql.Identifier(column)
        )
        target.execute(alter + sql.SQL("BY DEFAULT"))
        always = (alter + sql.SQL("ALWAYS")).as_string(target)
        steps.append(
            Step.of(
                StepKind.CUTOVER_IDENTITY,
                f"{table}.{column}",
                (table,),
                (),
                (always,),
                10_000 + len(steps),
            )
        )
    return steps
