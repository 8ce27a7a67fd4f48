"""``migrate start``'s following: ``applier run``'s apply loop in the foreground until the migration ends, and what
ends it: the watch (a cutover or an abort decided in another shell) and ``start --cutover``'s own cutover once the
target has caught up.

Apart from the set-up (:mod:`applier.migrate.setup`) because it shares nothing with it but the stop event: a start
resumed after the copy begins here, and the set-up's connections and snapshot are gone by then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from applier.errors import ApplierError
from applier.migrate import store
from applier.migrate.state import Phase

if TYPE_CHECKING:
    from applier.migrate.start import StartOptions

__all__ = ["CAUGHT_UP_BYTES", "Follower", "outcome", "watch"]

#: ``start --cutover`` cuts over once every table is ready and the apply is this close to the source's position.
CAUGHT_UP_BYTES = 1 << 20
#: How often ``start --cutover`` looks whether it may cut over: every look is a few catalog reads on each server,
#: and the wait between the last build and the first look is on the migration's critical path (was 1 s).
CUTOVER_LOOK_S = 0.2


class Follower:
    """The apply loop of one ``start``, and the automatic cutover beside it when ``--cutover`` asks for one."""

    def __init__(self, opts: StartOptions, say: Callable[[str], None], stop: threading.Event) -> None:
        self.opts = opts
        self.say = say
        self.stop = stop
        self.auto_error: str | None = None  # why start --cutover's cutover failed
        self.slot = ""  # the migration's slot on the source (run() sets it)

    def run(self, m: store.Migration) -> int:
        """The apply loop (``applier run``'s) in the foreground until a cutover completes or a signal stops it.

        Signals are ``runner.run``'s while it runs (the same handlers as ``applier run``'s); it takes ``self.stop``
        as its stop event, so a signal that reached start's own handler before, or the migration ending (the watch,
        the automatic cutover), stops the worker as a first signal would, with a clean exit status."""
        from applier import runner

        self.slot = m.slot
        self.summary()
        if (
            self.stop.is_set()
        ):  # a signal, or another shell's cutover or abort, during the set-up's last steps
            with psycopg.connect(self.opts.target, autocommit=True) as target:
                return outcome(target, self.opts.name, 0, self.say)
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
        except ApplierError:
            ended = self._ended()  # an abort in another shell removed the subscription under us
            if ended is None:
                raise
            return ended
        finally:
            finished.set()
            if auto is not None:
                auto.join()
        if self.auto_error is not None:
            self.say(f"ERROR: the cutover failed: {self.auto_error}")
            return 1
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            return outcome(target, self.opts.name, status, self.say)

    def _ended(self) -> int | None:
        """start's exit status when the migration was done or aborted meanwhile (:func:`outcome`), else None."""
        with psycopg.connect(self.opts.target, autocommit=True) as target:
            m = store.load(target, self.opts.name)
            return outcome(target, self.opts.name, 0, self.say) if m is not None and m.phase.ended else None

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
            opts = co.CutoverOptions(
                self.opts.name, self.opts.target, on_done=self.stop.set, cancel=self.stop
            )
            co.cutover(opts, self.say)
        except Exception as exc:  # noqa: BLE001 - reported by run(), start exits 1
            self.auto_error = str(exc)
        self.stop.set()  # done (or failed): the worker stops now, not at its next look at the catalog

    def _wait_caught_up(self, finished: threading.Event) -> int | None:
        """Look every :data:`CUTOVER_LOOK_S` (:meth:`_look`) until the migration may cut over: its lag then, or
        None when following ended first. One connection to each server serves every look (one that fails, e.g. a
        target restarting, is opened again at the next); both are closed before the cutover, whose fence ends the
        source's sessions."""
        conns: dict[str, psycopg.Connection[Any]] = {}
        try:
            while not finished.wait(CUTOVER_LOOK_S):
                try:
                    lag = self._look(conns)
                except Exception:  # noqa: BLE001 - a server may be restarting: try again
                    _close_all(conns)
                    continue
                if lag is not None:
                    return lag
            return None
        finally:
            _close_all(conns)

    def _look(self, conns: dict[str, psycopg.Connection[Any]]) -> int | None:
        """The lag when the migration may cut over now (:func:`~applier.migrate.status.ready_for_cutover`) and the
        worker streams (:func:`_streaming`), else None."""
        from applier.migrate.status import ready_for_cutover

        self._connect(conns)
        lag = ready_for_cutover(conns["target"], conns["source"], self.opts.name, caught_up=CAUGHT_UP_BYTES)
        return lag if lag is not None and _streaming(conns["source"], self.slot) else None

    def _connect(self, conns: dict[str, psycopg.Connection[Any]]) -> None:
        """(Re)open the auto-cutover's connection to the target and to the source where it is missing or lost."""
        for side, dsn in (("target", self.opts.target), ("source", self.opts.source)):
            if side not in conns or conns[side].closed or conns[side].broken:
                conns[side] = psycopg.connect(dsn, autocommit=True, connect_timeout=5)


def _streaming(source: psycopg.Connection[Any], slot: str) -> bool:
    """Whether the apply worker streams from the migration's slot (a walsender holds it). Every table may be ready
    before the worker has started (two-phase from the start, :func:`applier.migrate.setup.two_phase_from_the_start`),
    and the lag then reads small against the slot's position on an idle source: a fence then would wait for the
    worker's start within the write downtime."""
    row = source.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return bool(row and row[0])


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
    if phase is Phase.DONE:
        say(f'migration "{name}" done: the target has taken over')
        return 0
    if phase is Phase.FAILED:
        say(f'migration "{name}" was aborted')
        return 1
    if status == 0:
        say("stopped; applier migrate start again resumes")
    return status


#: How often the watch looks at the migration's phase. A cutover marks the migration done and then waits for the
#: worker to let go of the slot, which it does once told to stop by this look (or at its next catalog re-read, up
#: to a second later): that wait is on ``start --cutover``'s path to its exit. One kept connection serves the looks.
WATCH_S = 0.1


def watch(
    target: str,
    name: str,
    stop: threading.Event,
    finished: threading.Event,
    lock: psycopg.Connection[Any] | None = None,
    say: Callable[[str], None] | None = None,
) -> None:
    """Set ``stop`` when the migration is done (a cutover completed) or failed (aborted), as another shell decides;
    return when ``finished`` is set first. Runs through the set-up too: an abort during the copy stops it.

    ``lock``: the session that holds ``start``'s lock (:func:`applier.migrate.ownership.hold_start`); the looks
    use it, so it stays alive and is closed when the watch ends. Lost with a restart of the target, the lock is
    taken again on the next session (a cutover meanwhile sees no ``start`` and fences nothing). With ``say``, every
    :data:`DEAD_CUTOVER_S` it also undoes what a cutover that died left (its fence, phase ``cutover``:
    :func:`applier.migrate.ownership.recover`), so that a ``kill -9`` of a cutover never leaves the source read-only
    while ``start`` follows."""
    conns: dict[str, psycopg.Connection[Any]] = {} if lock is None else {"target": lock}
    looked = time.monotonic()
    try:
        while not finished.wait(WATCH_S):
            phase = _phase(conns, target, name, relock=lock is not None)
            if phase is None:
                finished.wait(0.5)  # the target may be restarting: look again a little later
            elif phase.ended:
                stop.set()
                return
            elif say is not None and time.monotonic() - looked >= DEAD_CUTOVER_S:
                looked = time.monotonic()
                _undo_dead_cutover(conns, name, say)
    finally:
        _close_all(conns)


#: How often a following ``start`` looks for what a dead cutover left (one read of the migration's row).
DEAD_CUTOVER_S = 1.0


def _undo_dead_cutover(
    conns: dict[str, psycopg.Connection[Any]], name: str, say: Callable[[str], None]
) -> None:
    """A cutover that died (no cutover holds its lock) yet left phase ``cutover`` or its fence: undone."""
    from applier.migrate import ownership

    try:
        m = store.load(conns["target"], name)
        if m is not None and not m.phase.ended and (m.phase is Phase.CUTOVER or m.fenced_at is not None):
            ownership.recover(conns["target"], m, say)
    except Exception as exc:  # noqa: BLE001 - looked at again in a second; said so the user knows
        say(f"WARNING: could not undo what an interrupted cutover left: {exc}")


def _phase(
    conns: dict[str, psycopg.Connection[Any]], target: str, name: str, *, relock: bool
) -> Phase | None:
    """The migration's phase, read through the kept connection (opened again when missing or lost, and then given
    ``start``'s lock again when ``relock``); None when the target cannot be read now."""
    from applier.migrate import ownership

    try:
        conn = conns.get("target")
        if conn is None or conn.closed or conn.broken:
            conn = conns["target"] = psycopg.connect(target, autocommit=True, connect_timeout=5)
            if relock:
                ownership.retake_start(conn, name)
        return store.phase_of(conn, name)
    except Exception:  # noqa: BLE001
        _close_all(conns)
        return None
