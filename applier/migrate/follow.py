"""``migrate start``'s following: ``applier run``'s apply loop in the foreground until the migration ends, and what
ends it: the watch (a cutover or an abort decided in another shell) and ``start --cutover``'s own cutover once the
target has caught up.

Apart from the set-up (:mod:`applier.migrate.setup`) because it shares nothing with it but the stop event: a start
resumed after the copy begins here, and the set-up's connections and snapshot are gone by then.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from applier.migrate import store

if TYPE_CHECKING:
    from applier.migrate.start import StartOptions

__all__ = ["CAUGHT_UP_BYTES", "Follower", "outcome", "watch"]

#: ``start --cutover`` cuts over once every table is ready and the apply is this close to the source's position.
CAUGHT_UP_BYTES = 1 << 20


class Follower:
    """The apply loop of one ``start``, and the automatic cutover beside it when ``--cutover`` asks for one."""

    def __init__(self, opts: StartOptions, say: Callable[[str], None], stop: threading.Event) -> None:
        self.opts = opts
        self.say = say
        self.stop = stop
        self.auto_error: str | None = None  # why start --cutover's cutover failed

    def run(self, m: store.Migration) -> int:
        """The apply loop (``applier run``'s) in the foreground until a cutover completes or a signal stops it.

        Signals are ``runner.run``'s while it runs (the same handlers as ``applier run``'s); it takes ``self.stop``
        as its stop event, so a signal that reached start's own handler before, or the migration ending (the watch,
        the automatic cutover), stops the worker as a first signal would, with a clean exit status."""
        from applier import runner

        self.summary()
        if self.stop.is_set():
            return 0
        self.say(
            f'following the source (subscription "{m.subname}") until a cutover; Ctrl-C stops, start resumes'
        )
        runner.configure_logging(self.opts.target)
        finished = threading.Event()
        auto = None
        if self.opts.cutover:
            auto = threading.Thread(
                target=self._auto_cutover, args=(finished,), name="auto-cutover", daemon=True
            )
            auto.start()
        try:
            status = runner.run(self.opts.target, [m.subname], wait_target=runner.WAIT_TARGET, stop=self.stop)
        finally:
            finished.set()
            if auto is not None:
                auto.join()
        if self.auto_error is not None:
            self.say(f"ERROR: the cutover failed: {self.auto_error}")
            return 1
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            return outcome(target, self.opts.name, status, self.say)

    def summary(self) -> None:
        """The time each phase took, as recorded by this start or the ones it resumed."""
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            m = store.load(target, self.opts.name)
        times = m.times if m is not None else {}
        order = ["schema", "copy", "post-data"]
        keys = sorted(times, key=lambda k: order.index(k) if k in order else len(order))
        self.say("summary: " + ", ".join(f"{k} {times[k]:.1f}s" for k in keys))

    def _auto_cutover(self, finished: threading.Event) -> None:
        """``start --cutover``: once every table is ready and the lag is under :data:`CAUGHT_UP_BYTES`, cut over
        (as ``applier migrate cutover`` would); a failure stops start with its reason (the source is unfenced)."""
        from applier.migrate import cutover as co

        lag = self._wait_caught_up(finished)
        if lag is None:
            return
        self.say(f"caught up (lag {lag} bytes): cutting over")
        try:
            co.cutover(co.CutoverOptions(self.opts.name, self.opts.target, on_done=self.stop.set), self.say)
        except Exception as exc:  # noqa: BLE001 - reported by run(), start exits 1
            self.auto_error = str(exc)
        self.stop.set()  # done (or failed): the worker stops now, not at its next look at the catalog

    def _wait_caught_up(self, finished: threading.Event) -> int | None:
        """Look once a second (:func:`~applier.migrate.cutover.ready_for_cutover`) until the migration may cut
        over: its lag then, or None when following ended first. One connection to each server serves every look
        (one that fails, e.g. a target restarting, is opened again at the next); both are closed before the
        cutover, whose fence ends the source's sessions."""
        from applier.migrate.cutover import ready_for_cutover

        conns: dict[str, psycopg.Connection[Any]] = {}
        try:
            while not finished.wait(1.0):
                try:
                    self._connect(conns)
                    lag = ready_for_cutover(
                        conns["target"], conns["source"], self.opts.name, caught_up=CAUGHT_UP_BYTES
                    )
                except Exception:  # noqa: BLE001 - a server may be restarting: try again
                    _close_all(conns)
                    continue
                if lag is not None:
                    return lag
            return None
        finally:
            _close_all(conns)

    def _connect(self, conns: dict[str, psycopg.Connection[Any]]) -> None:
        """(Re)open the auto-cutover's connection to the target and to the source where it is missing or lost."""
        for side, dsn in (("target", self.opts.target), ("source", self.opts.source)):
            if side not in conns or conns[side].closed or conns[side].broken:
                conns[side] = psycopg.connect(dsn, autocommit=True, connect_timeout=5)


def _close_all(conns: dict[str, psycopg.Connection[Any]]) -> None:
    """Close and forget ``conns`` (the next look opens them again)."""
    for c in conns.values():
        c.close()
    conns.clear()


def outcome(target: psycopg.Connection[Any], name: str, status: int, say: Callable[[str], None]) -> int:
    """What start says and returns once it stops (in the set-up or while following): the migration's phase
    decides, then the apply loop's status."""
    m = store.load(target, name)
    phase = m.phase if m is not None else None
    if phase == "done":
        say(f'migration "{name}" done: the target has taken over')
        return 0
    if phase == "failed":
        say(f'migration "{name}" was aborted')
        return 1
    if status == 0:
        say("stopped; applier migrate start again resumes")
    return status


def watch(target: str, name: str, stop: threading.Event, finished: threading.Event) -> None:
    """Set ``stop`` when the migration is done (a cutover completed) or failed (aborted), as another shell decides;
    return when ``finished`` is set first. Runs through the set-up too: an abort during the copy stops it."""
    while not finished.wait(0.5):
        with contextlib.suppress(Exception), psycopg.connect(target, autocommit=True) as c:
            if store.phase_of(c, name) in ("done", "failed"):
                stop.set()
                return
