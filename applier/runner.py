"""``applier run``: one worker process per subscription, each holding its subscription's lock for its whole life.

Why processes (``spawn``) and not threads: a worker decodes and applies in Python, so subscriptions side by side
only use more than one core as separate processes; one that dies (or leaks) cannot take the others with it; and
``spawn`` starts each from a clean interpreter, so no connection or lock is ever inherited across a fork. (``migrate
start`` forks its worker from a fork server instead, a clean interpreter that has only imported this module:
:func:`prefork`.)

Each worker first takes the subscription's advisory lock on the target (:class:`~applier.subscriptions.SubscriptionLock`)
and keeps it until it exits, so a second ``run`` of the same subscription is refused with the holder's name, and
``drop`` / ``alter --set two_phase`` never act under it. It then runs the initial copy if any table still needs one
(``i``/``d``/``f``) and streams with :class:`~applier.apply.worker.ApplyWorker` until told to stop, the subscription is
disabled, or an error it cannot recover from.

Standby (``run --standby``): a worker whose subscription's lock is held waits for it instead of being refused
(:meth:`~applier.subscriptions.SubscriptionLock.wait`) and, once it has it, runs exactly as ``run`` does; the
replication origin makes the hand-over exactly once. Every worker re-reads its subscription under the lock: the
holder it waited behind may have been a ``drop`` (the subscription is gone) or the subscription disabled meanwhile,
and then the worker ends cleanly, as a running worker does when its subscription is dropped or disabled.

Signals: SIGTERM, SIGINT (Ctrl-C) or SIGHUP in the parent sets one shared stop event; the workers finish what
they are doing and exit; ``run`` exits 0. A second signal terminates workers that have not stopped yet. Workers
ignore SIGINT and SIGHUP (the terminal sends them to the whole process group, and the parent coordinates); a
SIGTERM sent to a worker directly stops just that worker, cleanly.

Exit status: 0 when every worker stopped cleanly (signal, or subscription disabled), 1 if any failed; each failure
is logged as it happens and summed up at the end. A failed worker does not stop the others: subscriptions are
independent, as in PostgreSQL.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import psycopg

from applier.apply.worker import ApplyWorker
from applier.catalog.store import Catalog, Subscription
from applier.conninfo import scrub
from applier.errors import ApplierError
from applier.logs import configure_logging
from applier.metrics import WorkerMetrics
from applier.retry import max_retry_interval_default, retry_delay
from applier.signals import STOP_SIGNALS, set_once
from applier.subscriptions import (
    SubscriptionBusy,
    SubscriptionError,
    SubscriptionLock,
    open_catalog,
    require_subscription,
    target_errors,
    warn_if_superuser,
)
from tablesync import TablesyncError, run_initial_copy
from tablesync.live import LiveSyncCoordinator
from tablesync.progress import CopyProgress

__all__ = ["WorkerOutcome", "configure_logging", "prefork", "run", "worker_main"]

#: How often a worker checks that its lock's session is still alive (it dies with a target restart).
LOCK_CHECK_INTERVAL = 5.0

#: The worker process's GIL hand-off (CPython's default is 5 ms): the apply loop sleeps in ``poll`` and must get the
#: interpreter back at once when a change arrives, not after a helper thread (the catalog watch, the lock watchdog)
#: ran its Python for up to 5 ms; that wait showed as a millisecond-scale tail in the live lag (bench/live_bench.py).
SWITCH_INTERVAL_S = 0.0005

#: How long ``run`` waits for a target that is down or still starting before it gives up (``--wait-target``).
WAIT_TARGET = 60.0

#: What a server says while it cannot take connections for a while (starting, recovering, shutting down), and
#: what libpq says when nothing listens yet: worth waiting for. Anything else (a wrong password, no such database)
#: fails at once.
_TRANSIENT_SQLSTATES = ("57P01", "57P02", "57P03")
_TRANSIENT_MESSAGES = (
    "not yet accepting connections",
    "is starting up",
    "is shutting down",
    "in recovery mode",
    "connection refused",
    "server closed the connection unexpectedly",
    "no such file or directory",
)

_SPAWN = multiprocessing.get_context("spawn")
#: How workers start: ``spawn``, or the fork server :func:`prefork` started.
_context: Any = _SPAWN
log = logging.getLogger("applier.run")


@dataclass(frozen=True)
class WorkerOutcome:
    """What a worker reports to the parent as it exits."""

    subname: str
    ok: bool
    message: str


# --- the parent --------------------------------------------------------------------------------------------------


def _select(catalog: Catalog, names: Sequence[str]) -> list[Subscription]:
    """The named subscriptions (each must exist and be enabled), or every enabled one."""
    if names:
        subs = [require_subscription(catalog, n) for n in dict.fromkeys(names)]
        disabled = [s.subname for s in subs if not s.subenabled]
        if disabled:
            raise SubscriptionError(
                f"subscription {', '.join(disabled)} is disabled, so it is not run",
                f"enable it first: applier alter {disabled[0]} --enable",
            )
        return subs
    subs = [s for s in catalog.list() if s.subenabled]
    if not subs:
        raise SubscriptionError(
            "nothing to run: the target has no enabled subscription",
            "create one (applier create NAME --publisher ... --publication ...) or enable one "
            "(applier alter NAME --enable)",
        )
    return subs


def _transient(exc: psycopg.Error) -> bool:
    if exc.sqlstate is not None:
        return exc.sqlstate in _TRANSIENT_SQLSTATES
    text = str(exc).lower()
    return any(m in text for m in _TRANSIENT_MESSAGES)


def prefork() -> None:
    """Have the workers of this process's later :func:`run` start from a fork server that has imported this module
    (``multiprocessing``'s ``forkserver``, its preload), started now. ``migrate start`` calls it while the copy's
    last index builds run: a spawned worker spends 1.2-1.5 s importing (numpy, SQLAlchemy, psycopg, the apply
    core) before it connects, on the migration's critical path; one forked from the server starts at once. What
    ``spawn`` is chosen for holds: the server is a fresh interpreter that has only imported modules (no connection,
    no thread, no lock to inherit), and each worker is forked from it, not from the caller."""
    global _context
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["applier.runner"])
    from multiprocessing import forkserver

    # The server lives in our process group: a SIGTERM or SIGHUP to the group (systemd's stop, a closed terminal)
    # would kill it, and with it the parent's view of every worker it forked ("exited with status 255"). Started
    # with those two blocked (a mask survives fork and exec; it ignores SIGINT itself), it outlives them; each
    # worker unblocks them first thing (worker_main), so a worker still stops on its own SIGTERM.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _context = ctx


def wait_for_target(
    target: str, timeout: float, *, stop: threading.Event | None = None, logger: logging.Logger = log
) -> None:
    """Wait until the target takes connections, for up to ``timeout`` seconds.

    ``run`` is a service: it may start before its target at boot, or while the target recovers from a crash. Those
    states pass, so they are waited out (with a warning a second or so apart) instead of failing the process that a
    supervisor would only restart; a target that is wrong rather than late fails at once, by the usual message.
    """
    deadline = time.monotonic() + timeout
    delay = 0.25
    while True:
        try:
            psycopg.connect(target, connect_timeout=10).close()
            return
        except psycopg.Error as exc:
            if (
                not _transient(exc)
                or time.monotonic() + delay > deadline
                or (stop is not None and stop.is_set())
            ):
                return  # the caller's own connection attempt reports it
            logger.warning(
                "the target is not taking connections yet, retrying in %.1f s: %s",
                delay,
                scrub(str(exc), target).strip().splitlines()[0],
            )
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
        delay = min(delay * 2, 2.0)


def run(
    target: str,
    names: Sequence[str] = (),
    *,
    metrics_port: int | None = None,
    wait_target: float = WAIT_TARGET,
    stop: threading.Event | None = None,
    standby: bool = False,
) -> int:
    """Run the subscriptions until SIGTERM/SIGINT or until every worker has stopped; return the exit status.

    ``metrics_port``: serve Prometheus metrics (:mod:`applier.metrics`) on 127.0.0.1:PORT for as long as this runs.
    ``wait_target``: seconds to wait for a target that is down or starting up (:func:`wait_for_target`).
    ``stop``: setting it stops the workers as SIGTERM does. ``migrate start`` sets it once its migration is done:
    the disabled subscription would stop the worker too, but only at its next re-read of the catalog (1-2 s).
    ``standby``: a subscription another process runs is waited for, and taken over when that process ends.
    """
    wait_for_target(target, wait_target)
    catalog = open_catalog(target)
    with target_errors(target):
        if catalog.exists():  # upgraded before any worker reads it; a target without one has nothing to run
            catalog.ensure()
        subs = _select(catalog, names)
        warn_if_superuser(catalog, log.warning)
    catalog.engine.dispose()
    if metrics_port is not None:
        _serve_metrics(metrics_port, target, [s.subname for s in subs])

    workers = _Workers(target, wait_target, standby=standby)
    # installed before the first worker starts, so that no signal can end us and orphan a worker
    previous = {s: signal.signal(s, workers.on_signal) for s in STOP_SIGNALS}
    ended = threading.Event()
    if stop is not None:
        threading.Thread(
            target=_stop_when, args=(stop, ended, workers), name="stop-when", daemon=True
        ).start()
    try:
        for sub in subs:
            if workers.stopping:
                break
            workers.start(sub.subname)
        note = " (each waits while another process runs it)" if standby else ""
        log.info("running %d subscription(s)%s: %s", len(subs), note, ", ".join(s.subname for s in subs))
        outcomes = workers.wait_all()
    finally:
        ended.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    failed = [o for o in outcomes if not o.ok]
    if failed:  # each was logged as it ended; a last record names them all (a log record: stderr is the log)
        log.error(
            "%d of %d worker(s) failed: %s",
            len(failed),
            len(outcomes),
            "; ".join(f'subscription "{o.subname}": {o.message}' for o in failed),
        )
        return 1
    log.info("all workers stopped")
    return 0


class _Workers:
    """The worker processes of one ``applier run`` (one per subscription), and the SIGTERM/SIGINT handler that
    stops them: the first signal asks each worker to stop, a second one kills them."""

    def __init__(self, target: str, wait_target: float, *, standby: bool = False) -> None:
        self.target = target
        self.wait_target = wait_target
        self.standby = standby
        self.running: dict[Any, tuple[str, Any, multiprocessing.connection.Connection]] = {}
        self.signals_seen = 0
        self.asked = False  # stopped by the caller's event, not a signal (run's ``stop``)

    @property
    def stopping(self) -> bool:
        return self.signals_seen > 0 or self.asked

    def ask_to_stop(self) -> None:
        """Stop the workers as a first signal would, from another thread (nothing to kill them after it)."""
        self.asked = True  # before the loop: a worker start()ed meanwhile is told by start() itself
        log.info("stopping the workers")
        for _, proc, _ in list(self.running.values()):
            _signal_worker(proc, signal.SIGTERM)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Workers are told by a signal of their own, not through a shared multiprocessing.Event: setting one waits
        # for every process that sleeps in its wait() to wake, and a worker that exited while waiting never does,
        # so the handler (and applier run) hung for good.
        self.signals_seen += 1
        if self.signals_seen == 1:
            log.info("%s received: stopping the workers", signal.Signals(signum).name)
            for _, proc, _ in self.running.values():
                _signal_worker(proc, signal.SIGTERM)
        else:
            log.warning("%s received again: killing the workers", signal.Signals(signum).name)
            for _, proc, _ in self.running.values():
                _signal_worker(proc, signal.SIGKILL)

    def start(self, subname: str) -> None:
        receiver, sender = _context.Pipe(duplex=False)
        proc = _context.Process(
            target=worker_main,
            args=(self.target, subname, sender, logging.getLogger().level, self.wait_target, self.standby),
            name=f"applier:{subname}",
        )
        proc.start()
        sender.close()
        self.running[proc.sentinel] = (subname, proc, receiver)
        # a signal that came while this worker was starting did not reach it: the handler did not know it yet
        if self.stopping:
            _signal_worker(proc, signal.SIGTERM)

    def wait_all(self) -> list[WorkerOutcome]:
        """Each worker's outcome, as it ends (a failure is logged at once); returns once all have ended."""
        outcomes: list[WorkerOutcome] = []
        while self.running:
            for sentinel in multiprocessing.connection.wait(list(self.running)):
                subname, proc, receiver = self.running.pop(sentinel)  # type: ignore[call-overload]
                proc.join()
                outcome = _outcome(subname, proc.exitcode, receiver, stopping=self.stopping)
                outcomes.append(outcome)
                if not outcome.ok:
                    log.error('worker for subscription "%s" failed: %s', subname, outcome.message)
        return outcomes


def _stop_when(stop: threading.Event, ended: threading.Event, workers: _Workers) -> None:
    while not ended.is_set():
        if stop.wait(0.05):
            workers.ask_to_stop()
            return


def _serve_metrics(port: int, target: str, names: list[str]) -> None:
    from applier import metrics

    metrics.enable_multiprocess()  # before the workers start: they count into its directory
    try:
        metrics.serve(port, target, names)
    except OSError as exc:
        raise SubscriptionError(
            f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}",
            "choose another --metrics-port",
        ) from None


def _signal_worker(proc: Any, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):  # gone already / not started (pid None)
        os.kill(proc.pid, signum)


def _outcome(
    subname: str,
    exitcode: int | None,
    receiver: multiprocessing.connection.Connection,
    *,
    stopping: bool = False,
) -> WorkerOutcome:
    try:
        if receiver.poll():
            result: WorkerOutcome = receiver.recv()
            return result
    except (EOFError, OSError):
        pass
    finally:
        receiver.close()
    if stopping and exitcode == -signal.SIGTERM:  # stopped before its own handler was installed
        return WorkerOutcome(subname, True, "stopped before it started")
    return WorkerOutcome(subname, False, f"the worker process exited with status {exitcode} without a report")


# --- the worker --------------------------------------------------------------------------------------------------


def worker_main(
    target: str,
    subname: str,
    report: multiprocessing.connection.Connection,
    log_level: int,
    wait_target: float = WAIT_TARGET,
    standby: bool = False,
) -> None:
    """Entry point of a worker process (spawned: it imports everything afresh)."""
    configure_logging(target, log_level)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the parent stops us, as for SIGINT
    signal.signal(signal.SIGTERM, set_once(stop))  # a second SIGTERM inside the first must not deadlock
    signal.pthread_sigmask(
        signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP}
    )  # blocked in a fork server: prefork
    _wake_on_signals()
    threading.Thread(target=_orphan_watch, args=(stop,), name="orphan-watch", daemon=True).start()
    wlog = logging.getLogger(f"applier.worker.{subname}")
    try:
        wait_for_target(
            target, wait_target, stop=stop, logger=wlog
        )  # the target may have gone since run started
        message = _serve(target, subname, stop, wlog, standby=standby)
        outcome = WorkerOutcome(subname, True, message)
    except SubscriptionBusy as exc:
        outcome = WorkerOutcome(subname, False, str(exc))
    except ApplierError as exc:
        wlog.error('subscription "%s": %s', subname, str(exc).replace("\n", " "))
        outcome = WorkerOutcome(subname, False, str(exc))
    except Exception as exc:  # a bug: keep the traceback in the log, give the parent one line
        wlog.exception('worker for subscription "%s" failed unexpectedly', subname)
        outcome = WorkerOutcome(subname, False, f"internal error: {type(exc).__name__}: {exc}")
    report.send(outcome)
    report.close()
    _exit(0 if outcome.ok else 1)


def _exit(status: int) -> None:
    """End the worker process without the interpreter's teardown (0.1-0.3 s of collecting a worker's heap, while
    ``migrate start`` waits for the worker to exit, and ``applier run`` on SIGTERM): the non-daemon threads are
    joined, and the exit handlers (logging's flush, the metrics directory's removal, multiprocessing's) and the
    standard streams' flush still run."""
    import atexit

    for thread in threading.enumerate():  # as the interpreter would: its non-daemon threads end first
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _wake_on_signals() -> None:
    """A signal (SIGTERM) also ends the stream's wait for the publisher (:func:`applier.replication.set_wakeup_fd`):
    the loop sees the stop event at once, not after its idle wait of up to a second (``migrate start`` stops its
    worker this way once the cutover is done)."""
    from applier import replication

    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    replication.set_wakeup_fd(read)


def _orphan_watch(stop: threading.Event) -> None:
    """Stop this worker if the parent dies (``kill -9``), rather than go on as an orphan holding the
    subscription's lock that nobody can stop with ``applier run``'s signals. (The parent's SIGTERM, sent on its own
    SIGTERM/SIGINT, stops the worker through its handler.)"""
    parent = multiprocessing.parent_process()
    while not stop.wait(timeout=1.0):
        if parent is not None and not parent.is_alive():
            logging.getLogger("applier.run").warning("the applier run process has gone: stopping this worker")
            stop.set()


def _serve(
    target: str, subname: str, stop: threading.Event, wlog: logging.Logger, *, standby: bool = False
) -> str:
    """Take the lock (as a standby: wait for it), copy what needs copying, stream; return why it stopped."""
    catalog = open_catalog(target)
    try:
        with target_errors(target):
            sub = require_subscription(catalog, subname)
        parent = multiprocessing.parent_process()  # the `applier run` users see (not a fork server: prefork)
        lock = SubscriptionLock(target, sub, "run", pid=parent.pid if parent is not None else os.getppid())
        if not _take_lock(lock, stop, wlog, standby=standby):
            wlog.info('standby for subscription "%s" stopped: asked to stop', subname)
            return "asked to stop while standing by"
        try:
            with target_errors(
                target
            ):  # under the lock: what we waited behind may have dropped or disabled it
                current = catalog.get_by_id(sub.subid)
            if current is None or not current.subenabled:
                reason = _gone(current, standby=standby)
                wlog.info('worker for subscription "%s" not started: %s', subname, reason)
                return reason
            _stream(target, catalog, lock, sub, stop, wlog)
        finally:
            lock.release()
    finally:
        catalog.engine.dispose()
    return _stopped(target, catalog, subname, wlog)


def _take_lock(lock: SubscriptionLock, stop: threading.Event, wlog: logging.Logger, *, standby: bool) -> bool:
    """Hold the subscription's lock: take it (refused with SubscriptionBusy when held), or as a standby wait for it;
    False when stopped while waiting."""
    if not standby:
        lock.acquire()
        return True
    waited = time.monotonic()
    if not lock.wait(stop, wlog):
        return False
    wlog.info(
        'standby took over subscription "%s" after waiting %.1f s',
        lock.sub.subname,
        time.monotonic() - waited,
    )
    return True


def _gone(current: Subscription | None, *, standby: bool) -> str:
    """Why a worker that holds the lock does not start: the subscription was dropped or disabled meanwhile."""
    if current is None:
        return "the subscription was dropped" + (" while this standby waited" if standby else "")
    return "the subscription is disabled"


def _stream(
    target: str,
    catalog: Catalog,
    lock: SubscriptionLock,
    sub: Subscription,
    stop: threading.Event,
    wlog: logging.Logger,
) -> None:
    """Under the lock (kept by the watchdog): the initial copy if any table needs one, then the apply worker."""
    watchdog = _LockWatchdog(lock, stop, wlog)
    watchdog.start()
    try:
        wlog.info('worker for subscription "%s" (subid %d) started', sub.subname, sub.subid)
        if _initial_copy(target, catalog, sub.subname, stop, wlog) and not stop.is_set():
            ApplyWorker(target, sub.subname, stop=stop, logger=wlog, table_sync=LiveSyncCoordinator()).run()
    finally:
        watchdog.finish()
    if watchdog.lost is not None:
        raise SubscriptionError(watchdog.lost)


def _stopped(target: str, catalog: Catalog, subname: str, wlog: logging.Logger) -> str:
    """Why the worker stopped, as logged and reported."""
    with target_errors(target):
        current = catalog.get(subname)
    if current is None:
        reason = "the subscription was dropped"
    elif not current.subenabled:
        reason = "the subscription is disabled"
    else:
        reason = "asked to stop"
    wlog.info('worker for subscription "%s" stopped: %s', subname, reason)
    return reason


def _initial_copy(
    target: str, catalog: Catalog, subname: str, stop: threading.Event, wlog: logging.Logger
) -> bool:
    """Copy the tables that need it; True when streaming may follow, False when the subscription was disabled.

    A failed copy (a row already on the target, a table missing there...) never ends ``run``: like PostgreSQL's
    table sync worker, it is recorded (``applier status`` shows it) and, with ``disable_on_error``, disables the
    subscription (behaviour 101, TAP 029); otherwise it is tried again, the wait growing while it keeps failing,
    up to ``--max-retry-interval`` (applier.retry). The tables stay ``d``: each attempt copies them afresh.
    """
    cap = max_retry_interval_default()
    failures = 0
    while not stop.is_set():
        try:
            # returns at once, without starting Spark, when every table is already s or r
            copied = run_initial_copy(
                target, subname, stop=stop, reporter=CopyProgress.to_log(wlog, f'subscription "{subname}": ')
            )
        except TablesyncError as exc:
            failures += 1
            delay = _copy_failed(target, catalog, subname, exc, failures, cap, wlog)
            if delay is None:
                return False
            stop.wait(delay)
            continue
        if copied.tables or copied.resumed:
            wlog.info(
                'subscription "%s": initial copy of %d table(s) done: %d rows, %d bytes in %.1f s',
                subname,
                len(copied.tables) + len(copied.resumed),
                copied.rows,
                copied.bytes,
                copied.seconds,
            )
        return True
    return False


def _copy_failed(
    target: str,
    catalog: Catalog,
    subname: str,
    exc: TablesyncError,
    failures: int,
    cap: float,
    wlog: logging.Logger,
) -> float | None:
    """Record the initial copy's ``failures``-th failure in a row (the error row ``applier status`` shows, the
    metric) and log it; the wait before the next attempt, or None when ``disable_on_error`` disabled the
    subscription."""
    delay = retry_delay(failures, cap=cap)
    with target_errors(target):
        sub = require_subscription(catalog, subname)
        WorkerMetrics(subname, catalog, sub.subid).sync_error()  # Prometheus and sync_error_count
        disable = sub.subdisableonerr
        catalog.record_error(
            sub.subid,
            str(exc),
            message_type="COPY",
            relation=exc.relation,
            retry_count=failures,
            retry_in=None if disable else delay,
        )
        if disable:
            catalog.update_subscription(sub.subid, subenabled=False)
    if disable:
        wlog.error(
            'subscription "%s": %s\nthe subscription has been disabled because of this error '
            "(disable_on_error); fix the cause, then: applier alter %s --enable",
            subname,
            exc,
            subname,
        )
        return None
    wlog.error(
        'subscription "%s": %s\nfailure %d of the initial copy; next attempt in %.1f s',
        subname,
        exc,
        failures,
        delay,
    )
    return delay


class _LockWatchdog(threading.Thread):
    """Keeps the worker's lock: an advisory lock dies with its session, e.g. when the target restarts, while the
    worker itself reconnects and carries on. Then take it again; if another process got it first, stop this worker
    (two workers must never apply the same subscription) and say who has it."""

    def __init__(self, lock: SubscriptionLock, stop: threading.Event, wlog: logging.Logger) -> None:
        super().__init__(name="lock-watchdog", daemon=True)
        self.lock = lock
        self.stop = stop
        self.log = wlog
        self.lost: str | None = None
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(LOCK_CHECK_INTERVAL):
            if self.lock.holds():
                continue
            self.log.warning(
                'lost the session holding the lock of subscription "%s"; taking it again',
                self.lock.sub.subname,
            )
            backoff = 1.0
            while not self._done.is_set():
                try:
                    self.lock.reacquire()
                    self.log.info('lock of subscription "%s" taken again', self.lock.sub.subname)
                    break
                except SubscriptionBusy as exc:
                    self.lost = (
                        f"another process took over while the target connection was down: {exc.message}"
                    )
                    self.stop.set()
                    return
                except SubscriptionError:
                    self._done.wait(backoff)
                    backoff = min(backoff * 2, 30.0)

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=10)
