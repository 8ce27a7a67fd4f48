"""Materialized views: pre-data creates them ``WITH NO DATA``; they are filled on the target, not replicated.

Two post-data steps, read from the source inside the migration's snapshot (:func:`steps`):

- ``matview``: once every migrated table is copied, ``REFRESH MATERIALIZED VIEW`` of each view populated on the
  source (an unpopulated one stays unpopulated, as on the source), in creation order (a view over another view
  comes after it), then the views' indexes (pg_dump's post-data; :mod:`applier.migrate.postdata` builds only the
  tables'). One transaction with its done mark, like every step: a kill redoes it whole or not at all. The ``CLUSTER
  ON`` of a view's index and the comments on its indexes are :mod:`applier.migrate.objects`' steps after this one.
- ``cutover_refresh``: the same refreshes again at the cutover, under the fence and before the verification, so the
  views hold what the source's last rows give. This costs write downtime: each view's query runs once on the
  target (``applier migrate plan`` lists the views; a big one is cheaper refreshed after the cutover by hand).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate import store
from applier.migrate.steps import Step, StepKind, step_name

__all__ = ["STEP", "refresh_at_cutover", "steps"]

#: The name of the step that refreshes the views and builds their indexes: the ``CLUSTER ON`` of a view's index
#: and the comments on its indexes (:mod:`applier.migrate.objects`) come after it.
STEP = step_name(StepKind.MATVIEW, "refresh")

_MATVIEWS = """
SELECT c.oid, format('%%I.%%I', n.nspname, c.relname), c.relispopulated
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'm' AND n.nspname = ANY(%s) ORDER BY c.oid
"""


def steps(
    src: psycopg.Connection[Any], schemas: Sequence[str], tables: Sequence[str], first: int
) -> list[Step]:
    """The ``matview`` and ``cutover_refresh`` steps for the materialized views of ``schemas`` (``src`` inside the
    snapshot, ``search_path`` empty); ``tables``: every migrated table, quoted; ``first``: the first step ``ord``."""
    views = src.execute(_MATVIEWS, (list(schemas),)).fetchall()
    if not views:
        return []
    refresh = [
        sql.SQL("REFRESH MATERIALIZED VIEW {}").format(sql.SQL(name)).as_string(src)
        for _, name, populated in views
        if populated
    ]
    indexes = [
        r[0]
        for r in src.execute(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = ANY(%s::oid[]) ORDER BY indexrelid",
            ([oid for oid, _, _ in views],),
        )
    ]
    out = [Step(STEP, StepKind.MATVIEW, tuple(tables), (), (*refresh, *indexes), first)]
    if refresh:
        out.append(Step.of(StepKind.CUTOVER_REFRESH, "matviews", (), (), tuple(refresh), first + 1))
    return out


def refresh_at_cutover(target: psycopg.Connection[Any], name: str, say: Callable[[str], None]) -> None:
    """Run the ``cutover_refresh`` step's statements (every cutover attempt: a failed one may be tried again)."""
    statements = store.statements_of(target, name, (StepKind.CUTOVER_REFRESH,))
    if not statements:
        return
    with target.transaction():
        for statement in statements:
            target.execute(statement)
    say(f"materialized views: {len(statements)} refreshed")
