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
import os
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["WakingEvent", "set_once"]


class WakingEvent(threading.Event):
    """An event that can also be waited on with ``select``: once set, :attr:`wake_fd` is readable (a byte in a
    pipe). A worker's stop event is one, so that the apply loop's wait for the publisher (up to a second while the
    stream is idle) ends at once when the worker is told to stop, instead of at its timeout: that wait was on
    ``migrate start --cutover``'s critical path between the cutover and start's exit (0.8 s)."""

    def __init__(self) -> None:
        super().__init__()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    @property
    def wake_fd(self) -> int:
        return self._read

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # full (set before) or closed: readable already, or nobody waits
            os.write(self._write, b"x")


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
