"""Is the publisher a session reaches still the history the target has applied? (issue 30, a publisher failover)

A multi-host conninfo (``host=a,b ... target_session_attrs=read-write``) or ``alter --connection`` can take the
worker to another server than the one it streamed from. Resuming there is safe only when that server has the
subscription's slot *and* every transaction the target applied (the origin's progress ``P``): a promoted standby
with a synchronized failover slot (PostgreSQL 17+, ``synchronized_standby_slots`` on the old primary) has both.
Otherwise ``START_REPLICATION`` at ``P`` would either fail (no slot) or, worse, silently skip whatever the new server
wrote between the point where its history left ours and ``P``: a lost transaction nobody sees.

What tells us (decided here, without I/O; :func:`check` gathers the facts):

* ``IDENTIFY_SYSTEM``: a physical standby keeps the system identifier of its primary, and its promotion starts a
  new timeline; ``TIMELINE_HISTORY`` of that timeline says where the previous one ended (the switch point ``S``).
* the slot's row in ``pg_replication_slots``.
* what the worker saw in its previous session (kept for the worker's lifetime, across reconnects).

The verdicts: no slot → stop; a WAL that ends before ``P`` → stop (diverged); the timeline moved on since the last
session and ``P`` is after ``S`` (we applied from the old timeline what the new one does not have) → stop; with no
last session to compare with (a worker started after the failover), ``P`` after the start of the server's timeline
while the slot has confirmed nothing past it → stop; a server of another system identifier whose slot is behind
``P`` → stop. A stop disables the subscription with an error that
says what happened and how to recover (``applier status`` shows it); it never retries in a loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from applier.lsn import format_lsn, parse_lsn

__all__ = ["Facts", "PublisherSeen", "Verdict", "decide", "examine", "parse_timeline_history", "switch_point"]


@dataclass(frozen=True, slots=True)
class PublisherSeen:
    """The publisher a session streamed from: ``IDENTIFY_SYSTEM``'s system identifier and timeline."""

    systemid: str
    timeline: int


@dataclass(frozen=True, slots=True)
class Facts:
    """What a new session learned before ``START_REPLICATION``."""

    slot: str
    now: PublisherSeen
    wal_end: int  # IDENTIFY_SYSTEM's xlogpos: the server's flushed WAL
    applied: int  # the origin's progress on the target (P)
    slot_exists: bool
    slot_confirmed: int | None  # the slot's confirmed_flush_lsn
    before: PublisherSeen | None  # the previous session's publisher, if this worker had one
    #: where ``before.timeline`` ended in the server's history (``TIMELINE_HISTORY``), when the timeline moved on;
    #: without ``before``, where the server's own timeline began (its latest switch point), when it has a history
    switch: int | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """``stop``: the message for the error; ``note``: a line for the log when the session may go on."""

    stop: str | None = None
    note: str | None = None


RECOVER = (
    "to recover, re-create the subscription against this server with a full copy (applier drop NAME, then applier "
    "create NAME ... , or a new subscription beside it); if this is not the server you meant, point the "
    "subscription at the right one (applier alter NAME --connection CONNINFO) and enable it again "
    "(applier alter NAME --enable)"
)


def _what_happened(f: Facts) -> str:
    if f.before is None:
        if f.now.timeline > 1:
            return f" (the publisher is on timeline {f.now.timeline}: it was promoted from a standby at some point)"
        return ""
    if f.before.systemid != f.now.systemid:
        return (
            f" (the publisher is another server: system identifier {f.now.systemid}, the last session streamed "
            f"from {f.before.systemid})"
        )
    if f.before.timeline != f.now.timeline:
        at = f" at {format_lsn(f.switch)}" if f.switch is not None else ""
        return f" (the publisher failed over: timeline {f.before.timeline} ended{at}, it is now on timeline {f.now.timeline})"
    return ""


def decide(f: Facts) -> Verdict:
    """Whether the session may stream from this publisher (see the module's doc)."""
    what = _what_happened(f)
    for reason in (
        _no_slot,
        _wal_ends_before,
        _forked_since_last_session,
        _forked_before_slot,
        _foreign_slot,
    ):
        message = reason(f, what)
        if message is not None:
            return Verdict(stop=message + " The subscription has been disabled; " + RECOVER)
    if what and f.before is not None:
        return Verdict(note=f'resuming at {format_lsn(f.applied)} from slot "{f.slot}"{what}')
    return Verdict()


def _no_slot(f: Facts, what: str) -> str | None:
    if f.slot_exists:
        return None
    return (
        f'replication slot "{f.slot}" does not exist on the publisher{what}: the subscription cannot resume there. '
        "After a failover the slot exists on the promoted standby only if it was a failover slot (applier create "
        "--failover, PostgreSQL 17+) that the standby synchronized (sync_replication_slots)."
    )


def _wal_ends_before(f: Facts, what: str) -> str | None:
    if f.wal_end >= f.applied:
        return None
    return (
        f"the publisher{what} has WAL up to {format_lsn(f.wal_end)}, but the target has applied changes up to "
        f"{format_lsn(f.applied)}: it lacks transactions that the target holds (a failover that lost them: set "
        "synchronized_standby_slots on the primary to prevent it), so the two have diverged."
    )


def _forked_since_last_session(f: Facts, what: str) -> str | None:
    """The timeline moved on since the last session, and we applied past the point where ours ended."""
    b = f.before
    if b is None or b.systemid != f.now.systemid or b.timeline == f.now.timeline:
        return None
    if f.switch is None or f.applied <= f.switch:
        return None
    applied = format_lsn(f.applied)
    return (
        f"the target has applied changes up to {applied} from timeline {b.timeline}, but on the publisher{what} "
        f"that timeline ended at {format_lsn(f.switch)}: the target holds transactions the new primary never had, "
        f"and resuming would skip the new primary's own up to {applied} (a failover without "
        "synchronized_standby_slots), so the two have diverged."
    )


def _forked_before_slot(f: Facts, what: str) -> str | None:
    """No previous session to compare with (the worker started anew): the slot tells. It has confirmed nothing
    past the start of the server's timeline, so nothing of this timeline after it reached us; what we applied after
    it came from the old timeline. (A worker that applied this timeline's first transactions and was killed before
    its next status update could see the same; its own sessions are compared directly instead.)"""
    if f.before is not None or f.switch is None or f.applied <= f.switch:
        return None
    if f.slot_confirmed is None or f.slot_confirmed > f.switch:
        return None
    switch, applied = format_lsn(f.switch), format_lsn(f.applied)
    return (
        f"the target has applied changes up to {applied}, but the publisher{what} began its timeline at {switch} "
        f'and slot "{f.slot}" there has confirmed only up to {format_lsn(f.slot_confirmed)}: what the target '
        f"applied after {switch} came from the old primary, which this server never had, and resuming would skip "
        f"this server's own transactions up to {applied} (a failover without synchronized_standby_slots), so the "
        "two have diverged."
    )


def _foreign_slot(f: Facts, what: str) -> str | None:
    """Another server: a slot behind what we applied counts positions that are not ours."""
    if f.before is None or f.before.systemid == f.now.systemid:
        return None
    if f.slot_confirmed is None or f.slot_confirmed >= f.applied:
        return None
    return (
        f'replication slot "{f.slot}" on the publisher{what} has confirmed changes only up to '
        f"{format_lsn(f.slot_confirmed)}, behind what the target has applied ({format_lsn(f.applied)}): its "
        "positions are not ours, and resuming there could skip or repeat transactions."
    )


def examine(
    repl: Any,
    slot: str,
    systemid: str,
    timeline: int,
    wal_end: int,
    applied: int,
    before: PublisherSeen | None,
) -> tuple[Verdict, PublisherSeen]:
    """Gather the :class:`Facts` on ``repl`` (a :class:`~applier.replication.ReplicationConnection` after
    ``IDENTIFY_SYSTEM``: its slot, and its timeline history when it matters) and :func:`decide`; also returns the
    publisher as this session sees it, the next session's ``before``."""
    now = PublisherSeen(systemid, timeline)
    exists, confirmed = repl.slot_confirmed_flush(slot)
    switch = None
    if before is not None and before.systemid == now.systemid and before.timeline < now.timeline:
        switch = switch_point(parse_timeline_history(repl.timeline_history(now.timeline)), before.timeline)
    elif before is None and now.timeline > 1:  # a worker new to this publisher: where its timeline began
        switch = switch_point(parse_timeline_history(repl.timeline_history(now.timeline)), None)
    facts = Facts(slot=slot, now=now, wal_end=wal_end, applied=applied, slot_exists=exists,
                  slot_confirmed=confirmed, before=before, switch=switch)  # fmt: skip
    return decide(facts), now


def parse_timeline_history(content: str) -> dict[int, int]:
    """A ``.history`` file's text (``TIMELINE_HISTORY``'s content): each earlier timeline and where it ended."""
    ends: dict[int, int] = {}
    for line in content.splitlines():
        fields = line.strip().split()
        if len(fields) < 2 or not fields[0].isdigit():
            continue  # a comment or an empty line
        ends[int(fields[0])] = parse_lsn(fields[1])
    return ends


def switch_point(history: dict[int, int], timeline: int | None) -> int | None:
    """Where ``timeline`` ended in a server's history (None: not an ancestor of its timeline); ``None``: where
    the server's current timeline began (the latest switch point)."""
    if timeline is None:
        return history[max(history)] if history else None
    return history.get(timeline)
