"""Read pacing: when the apply loop waits a moment before reading on, and how long it waits for data at all.

The walsender sends each message with its own ``send()``: cheap while the socket is full, about 1.3 µs more per
message while the reader keeps up (ReplicationConnection's receive buffer). So a read that emptied the socket in the
middle of a remote transaction (the walsender is still sending it: it only sends committed ones, or a streamed
chunk), or after a read of at least ``after`` messages (a backlog), is followed by a ``pause`` before reading on: the
walsender's output queues up again, and the worker reads large batches. The cost is at most that much latency, and
only while a transaction is arriving or traffic is heavy (bench/RESULTS.md, "The fix has three parts").

The pause adapts to what the reads show: mid-transaction it is taken only after a read of at least ``in_txn_after``
messages (a large transaction arriving). A small transaction that a steady load's read caught half-sent (a few
messages; the rest follows within microseconds) is read on at once: there the pause was pure latency
(bench/live_bench.py).

Pure: :class:`ReadPacer` only answers; the loop sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a read of at least this many messages that emptied the socket is a backlog: pause
READ_PAUSE_AFTER = 200
#: inside a remote transaction, a read of at least this many messages is a large transaction arriving: pause
READ_PAUSE_IN_TXN_AFTER = 32
#: the pause, seconds
READ_PAUSE = 0.002
#: how long the first read of a round waits for data: shorter while commits wait to be confirmed durable
WAIT_IDLE = 1.0
WAIT_FLUSH_PENDING = 0.2


@dataclass(frozen=True, slots=True)
class ReadPacer:
    """The read pacing of one loop (the defaults are the measured ones)."""

    after: int = READ_PAUSE_AFTER
    in_txn_after: int = READ_PAUSE_IN_TXN_AFTER
    pause: float = READ_PAUSE

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
