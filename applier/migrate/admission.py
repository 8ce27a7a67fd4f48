"""Whether a cutover may fence the source now: every refusal it makes before anything is fenced.

Do no harm (docs/migrate.md, "What happens when it fails"): a cutover that cannot succeed must say so while the
source still takes writes, not after fencing production. It is refused when the migration does not follow yet,
when the prepared transactions cannot be carried or the new server cannot be reversed, when no ``start`` holds the
migration or its worker does not stream from the slot, and when a keyless table published insert-only received
UPDATE/DELETE and is too large to copy again under the fence.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from applier.migrate import carry as carrying
from applier.migrate import ownership, publications, store
from applier.migrate import reverse as reversing
from applier.migrate.state import MigrationError, Phase

__all__ = ["check_can_start", "refuse_diverging", "wait_for_follower"]


def check_can_start(
    target: psycopg.Connection[Any], name: str, prepared: str, reverse: bool
) -> tuple[store.Migration, tuple[int, str]]:
    """The migration and its subscription (id, slot), refused when a cutover cannot succeed: not following yet,
    GIDs that cannot be carried (``prepared`` is ``carry``), a new server that cannot be ``reverse``-d."""
    m = store.require(target, name)
    if m.phase is not Phase.FOLLOWING:
        raise MigrationError(
            f'migration "{m.name}" is in phase {m.phase}: a cutover needs phase following '
            "(post-data complete, the apply loop running)"
        )
    sub = store.subscription_of(target, m)
    assert sub is not None
    if prepared == "carry":
        carrying.check_two_phase(target, sub[0], m.source)
        carrying.check_gid_format(target, sub[0])
    if reverse:
        reversing.check_new_server(target, m.name)
    return m, sub


def wait_for_follower(
    target: psycopg.Connection[Any],
    src: psycopg.Connection[Any],
    m: store.Migration,
    slot: str,
    patience: float,
) -> None:
    """Refused unless a ``start`` holds the migration and its worker streams from the slot
    (:func:`applier.migrate.ownership.follower_problem`). A ``start`` that is alive but whose worker does not stream
    yet (it has just reached phase ``following``; it reconnects) is waited for, up to ``patience`` seconds."""
    until = time.monotonic() + patience
    while True:
        problem = ownership.follower_problem(target, src, m.name, slot)
        if problem is None:
            return
        if ownership.start_holder(target, m.name) is None or time.monotonic() >= until:
            raise MigrationError(f"{problem} (nothing was fenced)")
        time.sleep(0.1)


def refuse_diverging(src: psycopg.Connection[Any], m: store.Migration) -> None:
    """Refused when an insert-only table received UPDATE/DELETE and is too large to copy again under the fence
    (:func:`applier.migrate.publications.refuse_before_fence` names it and the ways out)."""
    refusal = publications.refuse_before_fence(publications.diverging(src, m))
    if refusal is not None:
        raise MigrationError(f"{refusal} (nothing was fenced)")
