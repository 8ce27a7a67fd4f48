"""``applier migrate abort``: stop the migration and take back from the source everything it put there.

It runs from any phase but ``done`` (a second abort after an interrupted one goes on to the end), and lifts a
fence only when the migration's record names one (:mod:`applier.migrate.ownership`): an old migration's abort never
unfences a newer one's cutover, nor a source its owner made read-only.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from applier.catalog import sql as catalog_sql
from applier.catalog.store import origin_name
from applier.migrate import counts as counting
from applier.migrate import fence as fencing
from applier.migrate import ownership, publications, store
from applier.migrate.leftovers import drop_slot
from applier.migrate.state import MigrationError

__all__ = ["abort"]


def abort(target_conninfo: str, name: str, say: Callable[[str], None], *, patience: float = 30.0) -> int:
    """Stop the migration (start sees phase ``failed`` and stops), lift its own fence of the source (only its own:
    :mod:`applier.migrate.ownership`), drop the slot and the publication the migration created there, and the
    subscription's catalog rows and origin on the target. The target's tables and rows stay. Runs again to the end
    after an abort that was interrupted."""
    store.upgrade(target_conninfo)
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        m = store.require(target, name)
        if m.phase == "done":
            raise MigrationError(f'migration "{name}" is done; nothing to abort')
        with target.transaction():
            store.set_phase(target, name, "failed", error="aborted")
            sub = store.subscription_of(target, m)
            if sub is not None:
                target.execute(catalog_sql.DISABLE_SUBSCRIPTION, (sub[0],))
        say(f'migration "{name}" aborted; stopping start')
        if not ownership.lift_fence(target, m, say):
            say("the source was not fenced by this migration: left as it is")
        with fencing.open_source(m.source) as src:
            if m.slot_created:
                drop_slot(src, m.slot, patience=patience, say=say)
            counting.drop_slot(src, counting.slot_name(m.slot))
            if m.pub_created:
                publications.drop(src, m.name, say)
        if sub is not None:
            with target.transaction():
                target.execute(catalog_sql.DELETE_SUBSCRIPTION, (sub[0],))
                target.execute(
                    "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname = %s",
                    (origin_name(sub[0]),),
                )
    return 0
