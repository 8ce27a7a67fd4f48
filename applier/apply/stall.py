"""The stall watchdog: "behind, and no progress for N seconds", with what the apply worker is waiting on.

Why: a worker that waits forever without an error looks, from the outside, like a healthy one under load (issue 30:
a subscription stayed 150 kB behind for minutes, ``last_error`` null, the walsender ``streaming``). The watchdog
turns that into a WARNING record, once per stall, naming the side the worker waits on, and into two counters
(:mod:`applier.metrics`): ``applier_apply_stalls_total{waiting_on}`` and ``applier_apply_stalled_seconds_total``.

Why a thread of its own: the apply loop blocks in more than one place (its wait for the publisher, and within a round
the pipeline's waits for the target: a full pipeline, a drain, a flush, a COPY), so a check in the loop's
housekeeping would not run while it is blocked in one of them, exactly when it matters. The thread only reads figures
the loop keeps anyway (a few ints and a queue's length, read without a lock), once a second: nothing is added to the
per-message path.

*Behind*: more was received from the publisher than the worker has reported applied, or the target owes results.
*Progress*: the applied position moved, or the target answered statements (fewer unanswered than before). Waiting
on the *target* while statements are unanswered or output is unsent, on the *publisher* otherwise (an open remote
transaction whose rest has not arrived).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from applier.lsn import format_lsn

#: seconds behind without progress before a stall is reported (``APPLIER_STALL_AFTER``)
STALL_AFTER = 30.0
#: how often the watchdog looks
CHECK_INTERVAL = 1.0


def stall_after_default() -> float:
    """``APPLIER_STALL_AFTER`` in seconds, else :data:`STALL_AFTER` (a value that is not a positive number too)."""
    try:
        value = float(os.environ.get("APPLIER_STALL_AFTER", ""))
    except ValueError:
        return STALL_AFTER
    return value if value > 0 else STALL_AFTER


@dataclass(frozen=True, slots=True)
class Progress:
    """What the apply worker has got to, as the watchdog reads it."""

    received: int  #: the last LSN received from the publisher
    applied: int  #: the apply position last reported to it
    unanswered: int  #: statements queued on the target whose results have not come back
    unsent: bool  #: libpq holds output for the target that is not written yet

    @property
    def behind(self) -> bool:
        return self.received > self.applied or self.unanswered > 0

    @property
    def waiting_on(self) -> str:
        return "target" if self.unanswered or self.unsent else "publisher"


@dataclass(frozen=True, slots=True)
class Stall:
    """A stall: since when (``time.monotonic()``) no progress was seen, and the figures when it was reported."""

    since: float
    progress: Progress

    @property
    def waiting_on(self) -> str:
        return self.progress.waiting_on


class StallWatch:
    """The decision, pure and on the caller's clock: :meth:`observe` answers whether a stall begins or ends."""

    def __init__(self, after: float = STALL_AFTER) -> None:
        self.after = after
        self._last: Progress | None = None
        self._since = 0.0  # when progress was last seen (or the worker was last not behind)
        #: the stall going on, once reported
        self.stall: Stall | None = None

    def observe(self, now: float, p: Progress) -> tuple[str, Stall] | None:
        """``("stalled", stall)`` when one begins, ``("resumed", stall)`` when it ends, else None."""
        last, self._last = self._last, p
        moved = last is None or p.applied > last.applied or p.unanswered < last.unanswered
        if moved or not p.behind:
            self._since = now
            ended, self.stall = self.stall, None
            return ("resumed", ended) if ended is not None else None
        if self.stall is None and now - self._since >= self.after:
            self.stall = Stall(self._since, p)
            return "stalled", self.stall
        return None


class StallWatchdog(threading.Thread):
    """Runs a :class:`StallWatch` over ``probe()`` every :data:`CHECK_INTERVAL` and hands what it answers to
    ``report(event, stall, now)``; while stalled, ``tick(seconds)`` gets the time stalled since the last look (the
    stalled-seconds counter; the first call covers the stall from its start)."""

    def __init__(self, name: str, probe: Callable[[], Progress], report: Callable[[str, Stall, float], None],
                 tick: Callable[[float], None], *, after: float = STALL_AFTER,
                 interval: float = CHECK_INTERVAL) -> None:  # fmt: skip
        super().__init__(daemon=True, name=f"applier-stall-watchdog {name}")
        self.watch = StallWatch(after)
        self.probe, self.report, self.tick, self.interval = probe, report, tick, interval
        self._stop_event = threading.Event()
        self.on_close: Callable[[], None] | None = None
        #: how many looks it has taken (tests wait on it instead of on the clock)
        self.looks = 0

    def run(self) -> None:
        last = time.monotonic()
        while not self._stop_event.wait(self.interval):
            now = time.monotonic()
            event = self.watch.observe(now, self.probe())
            self.looks += 1
            if event is not None:
                self.report(event[0], event[1], now)
            stall = self.watch.stall
            if stall is not None:  # counted from the stall's start, then from the last look
                self.tick(now - (stall.since if event is not None else last))
            last = now

    def close(self) -> None:
        self._stop_event.set()
        self.join(5)
        if self.on_close is not None:  # a session that ends stalled leaves no stall behind
            self.on_close()


def start_watchdog(name: str, tracker: Any, pipeline: Any, metrics: Any, log: logging.Logger | logging.LoggerAdapter[Any],
                   *, after: float, record: Callable[[dict[str, Any] | None], None] | None = None) -> StallWatchdog:  # fmt: skip
    """Start the watchdog of apply worker ``name``'s session: it reads the feedback ``tracker``'s positions and the
    target ``pipeline``'s queue, which the loop keeps anyway; a stall is a WARNING once, with what the worker waits
    on, and the metrics' counters (``metrics.stalled``, ``metrics.stalled_for``); a line when it moves again.
    ``record`` (for ``applier status``) gets the stall's figures when it begins and at each look while it lasts,
    and None when it ends; a failure there is only logged."""

    def keep(stall: Stall | None, now: float) -> None:
        if record is None:
            return
        p = None if stall is None else stall.progress
        try:
            record(None if stall is None or p is None else {
                "since": now - stall.since, "waiting_on": p.waiting_on, "received_lsn": p.received,
                "applied_lsn": p.applied, "unanswered": p.unanswered,
            })  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - status loses the figure, the watchdog goes on
            log.debug("could not record the stall for status: %s", exc)

    def probe() -> Progress:
        return Progress(
            tracker.last_received, tracker.last_sent.apply, pipeline.pending, pipeline.unflushed > 0
        )

    def report(event: str, stall: Stall, now: float) -> None:
        p = stall.progress
        if event == "stalled":
            metrics.stalled(p.waiting_on)
            keep(stall, now)
            log.warning(
                'logical replication apply worker for subscription "%s" has made no progress for %.0f s while '
                "behind (received %s, applied %s): waiting on the %s (%d statements unanswered%s)",
                name, now - stall.since, format_lsn(p.received), format_lsn(p.applied), p.waiting_on, p.unanswered,
                ", output unsent" if p.unsent else "",
            )  # fmt: skip
        else:
            keep(None, now)
            log.info('logical replication apply worker for subscription "%s" is making progress again after a '
                     "stall of %.0f s", name, now - stall.since)  # fmt: skip

    def tick(seconds: float) -> None:
        metrics.stalled_for(seconds)
        keep(dog.watch.stall, time.monotonic())  # refreshed while it lasts: status shows fresh rows only

    dog = StallWatchdog(name, probe, report, tick, after=after)
    dog.on_close = lambda: keep(None, 0.0) if dog.watch.stall is not None else None
    dog.start()
    return dog
