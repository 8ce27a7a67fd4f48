"""A signal that arrives while the handler of the one before is inside ``Event.set`` must not deadlock.

``applier run``'s worker had ``lambda *_: stop.set()``: a SIGTERM to the process group and the parent's own SIGTERM
to the worker arrive a little apart, the second one inside ``Event.set`` of the first (which holds the event's lock
while it wakes the threads that wait on it), and the worker hung for good (CI, PostgreSQL 16, tap 029; a py-spy dump
showed the handler inside ``Event.set`` inside the handler inside ``Event.set``). Here a child process goes round
after round: a fresh event with three threads waiting on it, as the worker's watchdogs do, and two SIGTERMs a few
microseconds apart for each round. With the plain handler the child hangs within a few dozen rounds
(``APPLIER_SHOW_SIGNAL_DEADLOCK=1`` runs that too); with :func:`applier.signals.set_once` it gets through all."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time

import pytest

from applier.signals import set_once

_CHILD = r"""
import signal, sys, threading
from applier.signals import set_once
sys.setswitchinterval(0.0005)  # as the worker
signal.signal(signal.SIGTERM, lambda *_: None)  # until the first round's handler
for _ in range(ROUNDS):
    stop = threading.Event()
    for _ in range(3):
        threading.Thread(target=stop.wait, daemon=True).start()
    HANDLER
    print("round", flush=True)
    stop.wait()
    sys.stdin.readline()  # both signals of this round were sent: the next handler cannot catch this round's second
signal.signal(signal.SIGTERM, signal.SIG_IGN)
"""


def _rounds(handler: str, rounds: int = 300) -> int:
    """How many rounds the child got through (it hangs at the first one it does not)."""
    code = _CHILD.replace("HANDLER", handler).replace("ROUNDS", str(rounds))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert child.stdout is not None and child.stdin is not None
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    try:
        for done in range(rounds):
            if not sel.select(5) or child.stdout.readline() != "round\n":
                return done
            time.sleep(0.001)  # the child waits in stop.wait()
            os.kill(child.pid, signal.SIGTERM)
            apart = random.uniform(0, 300e-6)
            started = time.perf_counter()
            while time.perf_counter() - started < apart:
                pass
            os.kill(child.pid, signal.SIGTERM)
            child.stdin.write("next\n")
        assert child.wait(timeout=10) == 0
        return rounds
    finally:
        child.kill()
        child.wait()


def test_two_signals_close_together_stop_the_waiter_every_time() -> None:
    assert _rounds("signal.signal(signal.SIGTERM, set_once(stop))") == 300


@pytest.mark.skipif(
    os.environ.get("APPLIER_SHOW_SIGNAL_DEADLOCK") != "1", reason="shows the old deadlock on demand"
)
def test_the_plain_event_set_handler_deadlocks() -> None:
    assert _rounds("signal.signal(signal.SIGTERM, lambda *_: stop.set())") < 300


def test_then_runs_once_after_the_event_is_set_and_what_it_raises_is_dropped() -> None:
    stop = threading.Event()
    calls: list[tuple[int, bool]] = []

    def then(signum: int) -> None:
        calls.append((signum, stop.is_set()))
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    handler = set_once(stop, then)
    handler(signal.SIGTERM, None)
    handler(signal.SIGINT, None)
    assert stop.is_set() and calls == [(signal.SIGTERM, True)]
