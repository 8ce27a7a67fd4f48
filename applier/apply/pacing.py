"""When the apply loop sends a standby status update: at once when the loop has been quiet, at most every
``min_interval`` under a steady load. Pure bookkeeping on the caller's clock; no I/O.

Why: the loop used to send one update per iteration in which the positions changed. Under a steady load of small
transactions that is one update per remote transaction (800 a second at 400 prepared transactions a second, each
PREPARE and each COMMIT PREPARED moving the positions), and a py-spy profile of the worker put 16 % of its busy
time in that one ``send()``: a syscall, plus a wake-up of the walsender that, on a loaded machine, takes the CPU
from the worker. The publisher gains nothing from updates closer together than a few milliseconds: the slot's
``confirmed_flush_lsn`` only bounds how much WAL it keeps, and ``pg_stat_replication`` shows the same figures a few
milliseconds later.

What does not change:

- A quiet loop (no update for ``min_interval``) sends at once, so a lone transaction at a low rate is reported as
  soon as before. Under synchronous replication that waits for this subscriber, a commit waits at most
  ``min_interval`` longer, and only while several transactions a ``min_interval`` arrive.
- A keepalive that asks for a reply (``force``) is answered at once, as the native worker does.
- An update that was held back is not lost: :meth:`StatusPacer.timeout` shortens the loop's next wait so that the
  update goes out ``min_interval`` after the previous one, even if nothing else arrives. Before, the loop learned
  that a commit was confirmed only at its next wake-up (up to 200 ms while commits were pending), so a lone
  transaction's apply position now reaches the publisher sooner than it did.
"""

from __future__ import annotations

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
