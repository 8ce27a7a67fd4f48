"""Dropping a replication slot with patience: the walsender of a worker that has just stopped may hold the slot
for a moment (until ``wal_sender_timeout`` at worst), so a held slot is looked at again until it is free or the
caller's patience runs out.

One rule for ``applier drop``/``alter`` (:mod:`applier.subscriptions`, over a replication connection) and for
``applier migrate cutover``/``abort`` (over an ordinary session on a fenced source): each passes how it looks at the
slot and how it drops it, and says what a slot still held means for it (an error, or a warning).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SlotDrop", "drop_when_idle"]

#: what ``look`` returns for a slot that does not exist
ABSENT = -1


@dataclass(frozen=True)
class SlotDrop:
    """How a :func:`drop_when_idle` ended: ``dropped`` by this call, ``absent`` (there was no slot), or still held by
    the process ``holder`` when the patience ran out."""

    dropped: bool = False
    absent: bool = False
    holder: int | None = None


def drop_when_idle(look: Callable[[], int | None], drop: Callable[[], bool], *, patience: float,
                   poll: float = 0.2) -> SlotDrop:  # fmt: skip
    """Drop the slot once nobody holds it, waiting up to ``patience`` seconds. ``look()`` returns the pid of the
    process that holds it, None when it is idle, :data:`ABSENT` when there is none; ``drop()`` drops an idle slot and
    returns False when someone took it meanwhile (then it is looked at again)."""
    deadline = time.monotonic() + patience
    while True:
        holder = look()
        if holder == ABSENT:
            return SlotDrop(absent=True)
        if holder is None and drop():
            return SlotDrop(dropped=True)
        if holder is not None and time.monotonic() >= deadline:
            return SlotDrop(holder=holder)
        time.sleep(poll)
