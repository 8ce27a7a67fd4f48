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

from applier.lsn import format_lsn, parse_lsn

__all__ = ["Facts", "PublisherSeen", "Verdict", "decide", "parse_timeline_history", "switch_point"]


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
    applied = format_lsn(f.applied)
    if not f.slot_exists:
        return Verdict(
            stop=f'replication slot "{f.slot}" does not exist on the publisher{what}: the subscription cannot resume '
            "there. After a failover the slot exists on the promoted standby only if it was a failover slot "
            "(applier create --failover, PostgreSQL 17+) that the standby synchronized (sync_replication_slots). "
            "The subscription has been disabled; " + RECOVER
        )
    if f.wal_end < f.applied:
        return Verdict(
            stop=f"the publisher{what} has WAL up to {format_lsn(f.wal_end)}, but the target has applied changes up to "
            f"{applied}: it lacks transactions that the target holds (a failover that lost them: set "
            "synchronized_standby_slots on the primary to prevent it), so the two have diverged. The subscription "
            "has been disabled; " + RECOVER
        )
    if (
        f.before is not None
        and f.before.systemid == f.now.systemid
        and f.before.timeline != f.now.timeline
        and f.switch is not None
        and f.applied > f.switch
    ):
        return Verdict(
            stop=f"the target has applied changes up to {applied} from timeline {f.before.timeline}, but on the "
            f"publisher{what} that timeline ended at {format_lsn(f.switch)}: the target holds transactions the "
            "new primary never had, and resuming would skip the new primary's own up to "
            f"{applied} (a failover without synchronized_standby_slots), so the two have diverged. The "
            "subscription has been disabled; " + RECOVER
        )
    if (
        f.before is None
        and f.switch is not None
        and f.applied > f.switch
        and f.slot_confirmed is not None
        and f.slot_confirmed <= f.switch
    ):
        # No previous session to compare with (the worker started anew): the slot tells. It has confirmed nothing
        # past the switch point, so nothing of this timeline after it reached us; what we applied after it came
        # from the old timeline. (A worker that applied this timeline's first transactions and was killed before
        # its next status update could see the same; its own sessions are compared directly instead.)
        return Verdict(
            stop=f"the target has applied changes up to {applied}, but the publisher{what} began its timeline at "
            f'{format_lsn(f.switch)} and slot "{f.slot}" there has confirmed only up to '
            f"{format_lsn(f.slot_confirmed)}: what the target applied after {format_lsn(f.switch)} came from the old "
            "primary, which this server never had, and resuming would skip this server's own transactions up to "
            f"{applied} (a failover without synchronized_standby_slots), so the two have diverged. The "
            "subscription has been disabled; " + RECOVER
        )
    if (
        f.before is not None
        and f.before.systemid != f.now.systemid
        and f.slot_confirmed is not None
        and f.slot_confirmed < f.applied
    ):
        return Verdict(
            stop=f'replication slot "{f.slot}" on the publisher{what} has confirmed changes only up to '
            f"{format_lsn(f.slot_confirmed)}, behind what the target has applied ({applied}): its positions are "
            "not ours, and resuming there could skip or repeat transactions. The subscription has been disabled; "
            + RECOVER
        )
    if what and f.before is not None:
        return Verdict(note=f'resuming at {applied} from slot "{f.slot}"{what}')
    return Verdict()


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
