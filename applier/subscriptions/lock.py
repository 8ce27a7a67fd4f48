"""Who may run a subscription: a session-level advisory lock on the target, keyed by subid, so that ``drop`` and
``alter --set two_phase`` never act under a running worker, and a worker never starts in their middle. Advisory
locks vanish with the session, so a crashed worker never leaves a stale lock.

A standby (``applier run --standby``) waits for that lock instead of being refused: it polls with
``pg_try_advisory_lock`` (a round trip every :data:`STANDBY_POLL_S` at most; never a blocking
``pg_advisory_lock``, which would sit in the lock manager's wait queue, show in lock-wait monitoring and
``log_lock_waits``, and need a cancel to stop on SIGTERM), and meanwhile holds a *shared* lock
``(STANDBY_NAMESPACE, subid)`` on the same session, by which ``status`` finds it. The session that wins the lock
becomes the lock's session, renamed to the ``run`` name: no moment without the lock between waiting and running.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from applier.catalog.store import Catalog, Subscription
from applier.conninfo import describe, scrub
from applier.subscriptions.common import (
    LOCK_NAMESPACE,
    STANDBY_NAMESPACE,
    SubscriptionBusy,
    SubscriptionError,
)

#: The longest a standby waits between two tries of the lock: with the holder's session gone, the standby has it
#: within this (plus its own round trip). The first tries come faster (0.1 s, doubling).
STANDBY_POLL_S = 0.5
#: The longest a standby waits between attempts to reach a target that is down (a restart, a failover).
STANDBY_RECONNECT_S = 5.0

#: ``applier[<pid>@<host>] <purpose> <subname>``: the application_name of every lock's (and standby's) session
_APPLICATION_NAME = re.compile(r"^applier\[(?P<pid>\d+)@(?P<host>[^\]]*)\] (?P<purpose>\S+)")


@dataclass(frozen=True)
class LockHolder:
    """The session that holds a subscription's lock, as the target sees it."""

    backend_pid: int
    application_name: str
    client: str | None
    since: dt.datetime | None

    def __str__(self) -> str:
        who = self.application_name or "a session without application_name"
        where = f" from {self.client}" if self.client else ""
        since = f", connected since {self.since:%Y-%m-%d %H:%M:%S%z}" if self.since else ""
        return f"{who}{where} (target backend pid {self.backend_pid}{since})"

    def as_dict(self) -> dict[str, Any]:
        """For ``status --json``: the process (``pid``, ``host``, ``purpose``, from its application_name; None for a
        session that is not applier's) and its target session."""
        m = _APPLICATION_NAME.match(self.application_name)
        return {
            "pid": int(m["pid"]) if m else None,
            "host": m["host"] if m else None,
            "purpose": m["purpose"] if m else None,
            "application_name": self.application_name,
            "client": self.client,
            "backend_pid": self.backend_pid,
            "since": None if self.since is None else self.since.isoformat(),
        }


class SubscriptionLock:
    """A session-level advisory lock ``(LOCK_NAMESPACE, subid)`` on the target, on a connection of its own.

    The session's ``application_name`` names the process (``applier[<pid>@<host>] run <subname>``) so that whoever
    is refused can be told who holds it. Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, target: str, sub: Subscription, purpose: str, *, pid: int | None = None) -> None:
        """``pid`` is the process to name to others (default: this one; a run worker names its ``applier run``
        parent, the process a user would stop)."""
        self.target = target
        self.sub = sub
        self.purpose = purpose
        self.application_name = _application_name(pid, purpose, sub.subname)
        self.standby_name = _application_name(pid, "standby", sub.subname)
        self._conn: psycopg.Connection[Any] | None = None

    def _connect(self, application_name: str | None = None) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(
                self.target,
                autocommit=True,
                application_name=application_name or self.application_name,
                connect_timeout=10,
            )
        except psycopg.Error as exc:
            raise SubscriptionError(
                f"could not connect to the target ({describe(self.target)}): {scrub(str(exc), self.target).strip()}"
            ) from None

    def acquire(self) -> None:
        """Take the lock or raise :class:`SubscriptionBusy` naming the holder."""
        conn = self._connect()
        if not self._try_lock(conn):
            holder = lock_holder(conn, self.sub.subid)
            conn.close()
            raise SubscriptionBusy(
                f'subscription "{self.sub.subname}" is in use by another applier process: {holder or "unknown"}',
                "stop that process first (SIGTERM or Ctrl-C stops applier run cleanly), or wait until it is done",
            )
        self._conn = conn

    def wait(self, stop: threading.Event, log: logging.Logger) -> bool:
        """As a standby: wait until this process holds the lock (True) or ``stop`` is set (False).

        Says once which process holds it (again after an outage of the target, when the holder may have changed).
        A target that cannot be reached is tried again with backoff, and the outage logged once: a standby outlives
        target restarts as a worker does. The caller must re-read the subscription once it holds the lock: a
        ``drop`` may have been the holder.
        """
        poll = _StandbyPoll(self, log)
        try:
            while not stop.is_set():
                if poll.step():
                    return True
                stop.wait(poll.delay)
            return False
        finally:
            poll.close()

    @property
    def _standby_key(self) -> tuple[int, int]:
        return (STANDBY_NAMESPACE, self.sub.subid)

    def _try_lock(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s::int4, %s::int4)", (LOCK_NAMESPACE, self.sub.subid)
        ).fetchone()
        return bool(row and row[0])

    def _take_over(self, conn: psycopg.Connection[Any]) -> None:
        """The standby's session holds the lock now: it stops being a standby and takes the ``run`` name, the one
        ``status`` and a refused second ``run`` show."""
        conn.execute(
            "SELECT pg_advisory_unlock_shared(%s::int4, %s::int4), set_config('application_name', %s, false)",
            (*self._standby_key, self.application_name),
        )
        self._conn = conn

    def holds(self) -> bool:
        """Whether our session still holds the lock: a session-level advisory lock is only released by its own
        session (which never unlocks it while the worker runs) or with the session, so the session being alive is
        the answer (``release`` ends the session). A round trip proves that (the lock is lost if the target
        restarts or drops the connection); it does not read ``pg_locks``, which takes every lock-manager partition
        lock and could, every few seconds, hold up the apply backend's own locking."""
        conn = self._conn
        if conn is None or conn.closed:
            return False
        try:
            conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def reacquire(self) -> None:
        """After the lock's session was lost: connect again and take it again, or raise SubscriptionBusy."""
        self.release()
        self.acquire()

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()  # ending the session releases the lock
            self._conn = None

    def __enter__(self) -> SubscriptionLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _StandbyPoll:
    """One standby's tries of the lock (:meth:`SubscriptionLock.wait`): its session (holding the shared standby
    lock), whether the holder was logged, and the wait before the next try."""

    def __init__(self, lock: SubscriptionLock, log: logging.Logger) -> None:
        self.lock, self.log = lock, log
        self.conn: psycopg.Connection[Any] | None = None
        self.told = False
        self.delay, self.failures = 0.1, 0

    def step(self) -> bool:
        """One try: True once the lock is ours (the session is then the lock's)."""
        try:
            return self._try()
        except (psycopg.Error, SubscriptionError) as exc:
            self._unreachable(exc)
            return False

    def _try(self) -> bool:
        lock = self.lock
        if self.conn is None:
            self.conn = lock._connect(lock.standby_name)
            self.conn.execute("SELECT pg_advisory_lock_shared(%s::int4, %s::int4)", lock._standby_key)
        if lock._try_lock(self.conn):
            lock._take_over(self.conn)
            self.conn = None  # it is the lock's session now
            return True
        if not self.told:
            holder = lock_holder(self.conn, lock.sub.subid)
            self.log.info('subscription "%s" is held by %s: standing by', lock.sub.subname,
                          holder or "a process that just ended")  # fmt: skip
            self.told = True
        self.failures = 0
        self.delay = min(self.delay * 2, STANDBY_POLL_S)
        return False

    def _unreachable(self, exc: Exception) -> None:
        self.close()
        self.failures += 1
        self.told = False
        self.delay = min(0.25 * 2**self.failures, STANDBY_RECONNECT_S)
        if self.failures == 1:
            self.log.warning(
                'standby for subscription "%s": the target cannot be reached, retrying: %s',
                self.lock.sub.subname, scrub(str(exc), self.lock.target).strip().splitlines()[0],
            )  # fmt: skip

    def close(self) -> None:
        _close(self.conn)
        self.conn = None


def _application_name(pid: int | None, purpose: str, subname: str) -> str:
    return f"applier[{pid or os.getpid()}@{socket.gethostname()}] {purpose} {subname}"[:63]


def _close(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(psycopg.Error):
            conn.close()


def lock_holder(conn: psycopg.Connection[Any], subid: int) -> LockHolder | None:
    """Who holds subscription ``subid``'s lock in ``conn``'s database, if anyone."""
    row = conn.execute(
        "SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start"
        " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid AND l.objid = %s::oid"
        " AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (LOCK_NAMESPACE, subid),
    ).fetchone()
    if row is None:
        return None
    return LockHolder(row[0], row[1] or "", row[2], row[3])


def standbys(conn: psycopg.Connection[Any], subid: int) -> list[LockHolder]:
    """The standbys (``run --standby``) waiting for subscription ``subid`` in ``conn``'s database, oldest first."""
    rows = conn.execute(
        "SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ShareLock' AND l.classid = %s::oid"
        " AND l.objid = %s::oid AND l.objsubid = 2"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " ORDER BY a.backend_start",
        (STANDBY_NAMESPACE, subid),
    ).fetchall()
    return [LockHolder(r[0], r[1] or "", r[2], r[3]) for r in rows]


_T = TypeVar("_T")


def _on_catalog(catalog: Catalog, read: Callable[[psycopg.Connection[Any], int], _T], subid: int) -> _T:
    """``read`` on a pooled catalog connection (psycopg's own, for the pg_locks queries), rolled back after."""
    raw = catalog.engine.raw_connection()
    try:
        return read(raw.driver_connection, subid)  # type: ignore[arg-type]
    finally:
        raw.rollback()
        raw.close()


def _holder(catalog: Catalog, subid: int) -> LockHolder | None:
    return _on_catalog(catalog, lock_holder, subid)


def _standbys(catalog: Catalog, subid: int) -> list[LockHolder]:
    return _on_catalog(catalog, standbys, subid)
