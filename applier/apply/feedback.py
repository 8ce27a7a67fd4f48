"""Which positions to report to the publisher: pure bookkeeping, no I/O (behaviours 7-9, 115-116).

The publisher's slot may only advance (``confirmed_flush_lsn``) past a remote transaction once its effects are
*durable* on the target; otherwise a target crash after an asynchronous commit would lose a transaction that the
publisher will never send again. The native worker keeps a list of (local commit end LSN, remote end LSN) pairs and
reports, as *flush*, the remote end of the newest pair whose local end the target has flushed. We do the same, with
one twist: our commits are pipelined, so when a COMMIT is queued we neither know that it will succeed nor where its
commit record ends. Such an entry is *unconfirmed* and never counts; once the target confirms it, it waits for
:meth:`FeedbackTracker.resolve`, which gives every confirmed commit the target's ``pg_current_wal_insert_lsn()`` read
after the confirmation: an upper bound of its commit end, so it can delay the report, never make it early.

Entries for two-phase records (PREPARE, COMMIT/ROLLBACK PREPARED) are flushed as soon as they are confirmed:
PostgreSQL flushes those records synchronously whatever ``synchronous_commit`` says (behaviour 8). Entries are
released oldest first and never past one that is not flushed itself (stricter than ``get_flush_position``, which
lets a later entry without a local record, such as a skipped ROLLBACK PREPARED, report past an older commit that
is not yet flushed).

The mapping of the standby status update is the native worker's (behaviour 7): *write* = last received, *flush* =
newest durably applied, *apply* = newest applied. When nothing is pending, all three are the last received LSN, which
lets the slot move past WAL that held nothing for us (behaviour 8; the TAP ``wait_for_catchup`` relies on it).
No position ever goes backwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Local-end states of an entry; real LSNs are > 0.
_UNCONFIRMED = -1  # commit queued, result not back yet
_UNCONFIRMED_2PC = -2  # 2PC record queued, result not back yet
_CONFIRMED = -3  # commit done, local LSN not read yet
_FLUSHED = 0  # durable (2PC record, or local LSN known to be flushed)


@dataclass(slots=True, eq=False)
class CommitToken:
    """One entry of the flush map; handed back to :meth:`FeedbackTracker.confirmed`."""

    remote_end: int
    local_end: int


@dataclass(frozen=True, slots=True)
class Positions:
    """One standby status update's worth of LSNs (wire mapping of behaviour 7)."""

    write: int
    flush: int
    apply: int


class FeedbackTracker:
    """The flush map plus the never-backwards clamps of ``send_feedback``.

    Typical use by the apply loop::

        tracker.received(lsn)                        # every XLogData / keepalive
        token = tracker.queued(end_lsn)              # COMMIT sent down the pipeline
        tracker.confirmed(token)                     # its result came back OK
        tracker.resolve(insert_lsn)                  # the target's pg_current_wal_insert_lsn() after that
        pos = tracker.positions(flush_lsn)           # the target's pg_current_wal_flush_lsn()
    """

    def __init__(self, start_lsn: int = 0) -> None:
        self.last_received = start_lsn
        self._entries: deque[CommitToken] = deque()
        self._last = Positions(start_lsn, start_lsn, start_lsn)
        #: set while remote transactions are applied but their (group) commit is not queued yet: then "nothing
        #: pending" does not mean "everything received is applied", and flush/apply must not move to last_received
        #: (the slot would skip those transactions after a restart)
        self.holding = False

    # --- events ----------------------------------------------------------------------------------------------
    def received(self, lsn: int) -> None:
        """An XLogData's dataStart/walEnd or a keepalive's walEnd arrived (behaviour 6)."""
        if lsn > self.last_received:
            self.last_received = lsn

    def queued(self, remote_end: int, *, two_phase: bool = False) -> CommitToken:
        """A local commit (``two_phase``: a PREPARE / COMMIT PREPARED / ROLLBACK PREPARED) of the remote
        transaction ending at ``remote_end`` was sent to the target."""
        token = CommitToken(remote_end, _UNCONFIRMED_2PC if two_phase else _UNCONFIRMED)
        self._entries.append(token)
        return token

    def confirmed(self, token: CommitToken) -> None:
        """The target reported that commit as done."""
        token.local_end = _FLUSHED if token.local_end == _UNCONFIRMED_2PC else _CONFIRMED

    def resolve(self, insert_lsn: int) -> None:
        """Every confirmed commit ends at or before ``insert_lsn`` (read from the target after confirmation)."""
        for e in self._entries:
            if e.local_end == _CONFIRMED:
                e.local_end = insert_lsn

    @property
    def pending(self) -> int:
        """Entries not yet known to be flushed: while > 0 the loop polls the target's flush position."""
        return len(self._entries)

    def forget_unconfirmed(self) -> None:
        """After an error: a queued commit that never confirmed may not have happened. Drop those entries; the
        stream restarts from the replication origin, which is exactly consistent with what did commit."""
        self._entries = deque(e for e in self._entries if e.local_end not in (_UNCONFIRMED, _UNCONFIRMED_2PC))

    # --- the update ------------------------------------------------------------------------------------------
    def positions(self, local_flush_lsn: int | None = None) -> Positions:
        """Positions to send now (``get_flush_position`` + ``send_feedback``); flushed entries are removed.

        ``local_flush_lsn`` is the target's ``pg_current_wal_flush_lsn()``, or ``None`` when not read (then only
        two-phase entries can be released).
        """
        write = 0
        flush = 0
        # Only commits the target has confirmed count as applied: a COMMIT still queued in the pipeline is not
        # visible yet, and pg_stat_replication.replay_lsn (what wait_for_catchup polls) shows this value. Entries
        # are queued in stream order (remote ends ascending), so the newest confirmed one has the highest: looked
        # for from the newest end, past the few still in flight, rather than over the whole map, which holds a
        # tenth of a second of commits between two reads of the flush position (160 at 1,600 tps).
        for e in reversed(self._entries):
            if e.local_end != _UNCONFIRMED and e.local_end != _UNCONFIRMED_2PC:
                write = e.remote_end
                break
        # Release the oldest entries while each is flushed on its own. Not past one that is not: a later
        # entry's record may not even exist (a skipped ROLLBACK PREPARED writes nothing), so it proves nothing
        # about the WAL before it, and an unconfirmed commit before it may still fail.
        entries = self._entries
        while entries:
            local = entries[0].local_end
            if local == _FLUSHED or (local > 0 and local_flush_lsn is not None and local <= local_flush_lsn):
                flush = max(flush, entries.popleft().remote_end)
            else:
                break
        if not self._entries and not self.holding:
            write = flush = self.last_received
        last = self._last
        pos = Positions(
            write=max(self.last_received, last.write),
            flush=max(flush, last.flush),
            apply=max(write, last.apply),
        )
        self._last = pos
        return pos

    @property
    def last_sent(self) -> Positions:
        """The positions of the previous :meth:`positions` call."""
        return self._last
