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
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["set_once"]


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
