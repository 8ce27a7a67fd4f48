"""Who may run a subscription: a session-level advisory lock on the target, keyed by subid, so that ``drop`` and
``alter --set two_phase`` never act under a running worker, and a worker never starts in their middle. Advisory
locks vanish with the session, so a crashed worker never leaves a stale lock."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
from dataclasses import dataclass
from typing import Any

import psycopg

from applier.catalog.store import Catalog, Subscription
from applier.conninfo import describe, scrub
from applier.subscriptions.common import LOCK_NAMESPACE, SubscriptionBusy, SubscriptionError


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
        self.application_name = (
            f"applier[{pid or os.getpid()}@{socket.gethostname()}] {purpose} {sub.subname}"[:63]
        )
        self._conn: psycopg.Connection[Any] | None = None

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(
                self.target, autocommit=True, application_name=self.application_name, connect_timeout=10
            )
        except psycopg.Error as exc:
            raise SubscriptionError(
                f"could not connect to the target ({describe(self.target)}): {scrub(str(exc), self.target).strip()}"
            ) from None

    def acquire(self) -> None:
        """Take the lock or raise :class:`SubscriptionBusy` naming the holder."""
        conn = self._connect()
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s::int4, %s::int4)", (LOCK_NAMESPACE, self.sub.subid)
        )
        if not row.fetchone()[0]:  # type: ignore[index]
            holder = lock_holder(conn, self.sub.subid)
            conn.close()
            raise SubscriptionBusy(
                f'subscription "{self.sub.subname}" is in use by another applier process: {holder or "unknown"}',
                "stop that process first (SIGTERM or Ctrl-C stops applier run cleanly), or wait until it is done",
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


def _holder(catalog: Catalog, subid: int) -> LockHolder | None:
    raw = catalog.engine.raw_connection()
    try:
        return lock_holder(raw.driver_connection, subid)  # type: ignore[arg-type]
    finally:
        raw.rollback()
        raw.close()
