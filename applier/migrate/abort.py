"""``applier migrate abort``: stop the migration and take back from the source everything it put there.

It runs from any phase but ``done`` (a second abort after an interrupted one goes on to the end), and lifts a
fence only when the migration's record names one (:mod:`applier.migrate.ownership`): an old migration's abort never
unfences a newer one's cutover, nor a source its owner made read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from applier.catalog import sql as catalog_sql
from applier.catalog.store import origin_name
from applier.migrate import carry as carrying
from applier.migrate import counts as counting
from applier.migrate import fence as fencing
from applier.migrate import ownership, publications, store
from applier.migrate.leftovers import drop_capture, drop_slot
from applier.migrate.state import MigrationError, Phase

__all__ = ["abort"]


def abort(target_conninfo: str, name: str, say: Callable[[str], None], *, patience: float = 30.0) -> int:
    """Stop the migration (start sees phase ``failed`` and stops), lift its own fence of the source (only its own:
    :mod:`applier.migrate.ownership`), drop the slot, the publication and the DDL capture the migration created
    there, and the subscription's catalog rows and origin on the target. The target's tables and rows stay. Runs
    again to the end after an abort that was interrupted."""
    store.upgrade(target_conninfo)
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        m = store.require(target, name)
        if m.phase is Phase.DONE:
            raise MigrationError(f'migration "{name}" is done; nothing to abort')
        with target.transaction():
            store.set_phase(target, name, Phase.FAILED, error="aborted")
            sub = store.subscription_of(target, m)
            if sub is not None:
                target.execute(catalog_sql.DISABLE_SUBSCRIPTION, (sub[0],))
        running = ownership.start_holder(target, name) is not None
        say(f'migration "{name}" aborted' + ("; stopping start" if running else ""))
        if not ownership.lift_fence(target, m, say):
            say("the source was not fenced by this migration: left as it is")
        with fencing.open_source(m.source) as src:
            drop_capture(src, m.slot, say)
            if m.slot_created:
                drop_slot(src, m.slot, patience=patience, say=say)
            counting.drop_slot(src, counting.slot_name(m.slot))
            if m.pub_created:
                publications.drop(src, m.name, say)
        if sub is not None:
            _roll_back_prepared(target, sub[0], say)
            with target.transaction():
                target.execute(catalog_sql.DELETE_SUBSCRIPTION, (sub[0],))
                target.execute(
                    "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname = %s",
                    (origin_name(sub[0]),),
                )
    return 0


def _roll_back_prepared(target: psycopg.Connection[Any], subid: int, say: Callable[[str], None]) -> None:
    """The subscription's transactions prepared on the target (copies of the source's, still undecided there) are
    rolled back: abandoned, they would hold their locks and the target's xmin horizon for good, and keep its
    database from being dropped. The source's own prepared transactions are not touched (its transaction manager
    decides them there). One that ``start``'s worker decided meanwhile is gone already."""
    for gid in carrying.prepared_on_target(target, subid):
        try:
            target.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        except psycopg.errors.UndefinedObject:
            continue
        say(f"prepared transaction {gid} rolled back on the target (it stays prepared on the source)")
