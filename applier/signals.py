"""Signal handlers that set a ``threading.Event``, safe against a second signal arriving inside the first.

Python runs a handler in the main thread between two bytecodes, so a signal that arrives while a handler is inside
``Event.set`` (which holds the event's non-reentrant lock) runs the handler again right there, and its
``Event.set`` waits for that lock forever. ``applier run``'s worker met exactly this: a test (and an operator's
``kill -TERM -PGID``) signals the whole process group, and the parent passes its own SIGTERM on to the worker, so the
worker can get two SIGTERMs a few microseconds apart. It then hung for good (a py-spy dump showed the handler inside
``Event.set`` inside the handler inside ``Event.set``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["STOP_SIGNALS", "Interrupted", "interrupt_once", "set_once"]


def set_once(
    event: threading.Event, then: Callable[[int], None] | None = None
) -> Callable[[int, FrameType | None], None]:
    """A handler that sets ``event`` once, then calls ``then(signum)`` (to say so); a signal that comes while it
    runs, or after, returns at once. What ``then`` raises is dropped: printing from a handler can meet the main
    thread's own print (``RuntimeError: reentrant call``), and the stop must not turn into a crash."""
    seen = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal seen
        if seen:
            return
        seen = True  # before anything that takes a lock: a nested call returns above
        event.set()
        if then is not None:
            with contextlib.suppress(Exception):
                then(signum)

    return handler


#: The signals every long ``migrate`` verb treats as Ctrl-C (what systemd, Kubernetes and ``timeout`` send, and a
#: closed terminal): docs/migrate.md, "What happens when it fails".
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A stop signal reached a verb that cleans up by unwinding (``migrate cutover``, ``abort``): raised in the main
    thread like ``KeyboardInterrupt``, so every ``finally`` and ``except BaseException`` on the way out runs (the
    cutover unfences there). A :class:`BaseException`, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, the shells' convention (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
        return 128 + self.signum


@contextlib.contextmanager
def interrupt_once(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, the first of ``signals`` raises :class:`Interrupted` in the main thread; the ones after it
    are ignored, so that the clean-up the first one started (unfencing the source, dropping a slot) is not cut short
    by a second ``kill`` or an impatient Ctrl-C. The previous handlers come back on exit."""
    seen = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal seen
        if seen:
            return
        seen = True
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
