"""Read pacing: when the apply loop waits a moment before reading on, and how long it waits for data at all.

The walsender sends each message with its own ``send()``: cheap while the socket is full, about 1.3 µs more per
message while the reader keeps up (ReplicationConnection's receive buffer). So a read that emptied the socket in the
middle of a remote transaction (the walsender is still sending it: it only sends committed ones, or a streamed
chunk), or after a read of at least ``after`` messages (a backlog), is followed by a ``pause`` before reading on: the
walsender's output queues up again, and the worker reads large batches. The cost is at most that much latency, and
only while a transaction is arriving or traffic is heavy (bench/history/apply_bench.md, "The fix has three parts").

The pause adapts to what the reads show: mid-transaction it is taken only after a read of at least ``in_txn_after``
messages (a large transaction arriving). A small transaction that a steady load's read caught half-sent (a few
messages; the rest follows within microseconds) is read on at once: there the pause was pure latency
(bench/live_bench.py). If the socket is then empty, the loop waits for the rest (``rest_wait``, once per round:
the wait ends as soon as it arrives) instead of ending the round: ending it cost a pass through the housekeeping
and the read path more for that transaction (one round in eight under a steady load of small transactions), and
applied nothing sooner, since the transaction cannot commit before its rest is there.

**Status pacing** (:class:`StatusPacer`): when the housekeeping sends a standby status update. Once per loop
iteration whose positions changed was one ``send()`` per remote transaction under a steady load of small ones
(16 % of the worker's busy time at 400 prepared transactions a second), plus a wake-up of the walsender. Now: at
once after a quiet spell or when a keepalive asks, else at most one per ``STATUS_MIN_INTERVAL``; an update held back
shortens the loop's next read wait (:meth:`StatusPacer.timeout`), so it still goes out on time. The publisher gains
nothing from updates closer together: ``confirmed_flush_lsn`` only bounds the WAL it keeps. Under synchronous
replication waiting for this subscriber a commit waits at most that much longer, only under load.

Pure: :class:`ReadPacer` and :class:`StatusPacer` only answer, on the caller's clock; the loop sleeps and sends.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a read of at least this many messages that emptied the socket is a backlog: pause
READ_PAUSE_AFTER = 200
#: inside a remote transaction, a read of at least this many messages is a large transaction arriving: pause
READ_PAUSE_IN_TXN_AFTER = 32
#: the pause, seconds
READ_PAUSE = 0.002
#: mid-transaction, a read found the socket empty: how long to wait for the rest of the transaction (once per
#: round; it is on its way, since the walsender sends only committed transactions or a whole streamed chunk)
READ_REST_WAIT = 0.002
#: how long the first read of a round waits for data: shorter while commits wait to be confirmed durable
WAIT_IDLE = 1.0
WAIT_FLUSH_PENDING = 0.2


@dataclass(frozen=True, slots=True)
class ReadPacer:
    """The read pacing of one loop (the defaults are the measured ones)."""

    after: int = READ_PAUSE_AFTER
    in_txn_after: int = READ_PAUSE_IN_TXN_AFTER
    pause: float = READ_PAUSE
    rest_wait: float = READ_REST_WAIT

    def pause_after(self, got: int, ran_dry: bool, in_transaction: bool) -> float:
        """Seconds to wait after a read of ``got`` messages that ended the batch (``ran_dry``: it emptied the
        socket; otherwise a limit ended it and more is there already), ``in_transaction``: a remote transaction is
        open in the core."""
        if not ran_dry:
            return 0.0
        if got >= self.after or (in_transaction and got >= self.in_txn_after):
            return self.pause
        return 0.0

    @staticmethod
    def wait_for_data(flush_pending: bool, first_read: bool) -> float:
        """How long a read waits on the socket: only the first read of a round waits at all, and not for long when
        commits wait for their flush to be reported (``flush_pending``)."""
        if not first_read:
            return 0.0
        return WAIT_FLUSH_PENDING if flush_pending else WAIT_IDLE


#: The shortest time between two status updates that nobody asked for (the loop's own, on changed positions).
STATUS_MIN_INTERVAL = 0.01


class StatusPacer:
    """Decides whether this iteration of the apply loop computes and sends the positions.

    Use::

        if pacer.due(now, force):            # else the update is owed, and pacer.timeout() says how long to wait
            pos = tracker.positions(...)
            if changed: send(pos); pacer.sent(now)
            else: pacer.settled()
    """

    __slots__ = ("_last", "_owed", "min_interval")

    def __init__(self, min_interval: float = STATUS_MIN_INTERVAL) -> None:
        self.min_interval = min_interval
        self._last = float("-inf")
        self._owed = False

    def due(self, now: float, force: bool = False) -> bool:
        """True when an update may go out now (a reply was requested, or the last one is ``min_interval`` old);
        else the update is owed and :meth:`timeout` bounds the loop's next wait."""
        if force or now - self._last >= self.min_interval:
            return True
        self._owed = True
        return False

    def sent(self, now: float) -> None:
        """An update went out at ``now``."""
        self._last = now
        self._owed = False

    def settled(self) -> None:
        """The positions were computed and had not changed: nothing is owed."""
        self._owed = False

    @property
    def owed(self) -> bool:
        return self._owed

    def timeout(self, now: float, wait: float) -> float:
        """The loop's next wait: ``wait``, or less while an update is owed (never negative)."""
        if not self._owed:
            return wait
        return max(0.0, min(wait, self._last + self.min_interval - now))
