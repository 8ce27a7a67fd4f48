"""Fencing the source for a cutover: new transactions read-only, sessions ended, prepared ones decided.

``ALTER DATABASE … SET default_transaction_read_only = on`` makes every *new* session's transactions read-only;
sessions already connected keep their setting, so they are ended: idle ones at once, ones inside a transaction
when it finishes or at the timeout. Prepared transactions are not sessions and need no write permission to be
decided: ``COMMIT PREPARED``/``ROLLBACK PREPARED`` still work under the fence, so ``--prepared wait`` can wait for
the application's transaction manager to finish them.

Limits: a client that explicitly turns ``default_transaction_read_only`` off (or says ``BEGIN READ WRITE``) can still
write; the cutover's verification then finds the difference and the cutover fails (and unfences). Our own sessions
turn it off, for the few writes the migration itself makes (dropping its publication and slot).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["fence", "open_source", "sessions", "unfence", "wait_prepared"]


def open_source(conninfo: str) -> psycopg.Connection[Any]:
    """A source session that may write even under the fence."""
    conn = psycopg.connect(conninfo, autocommit=True)
    conn.execute("SET default_transaction_read_only = off")
    return conn


def _db(conn: psycopg.Connection[Any]) -> sql.Identifier:
    return sql.Identifier(conn.info.dbname)


def fence(conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(_db(conn)))


def unfence(conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(_db(conn)))


def sessions(conn: psycopg.Connection[Any]) -> list[tuple[int, bool]]:
    """Client sessions of this database other than ours: (pid, inside a transaction)."""
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT pid, xact_start IS NOT NULL FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
    ]


def end_sessions(conn: psycopg.Connection[Any], deadline: float, say: Callable[[str], None]) -> None:
    """End the sessions connected before the fence: idle ones now, the others when their transaction is over or at
    ``deadline`` (``time.monotonic()``)."""
    told = False
    while True:
        found = sessions(conn)
        idle = [pid for pid, busy in found if not busy]
        busy = [pid for pid, busy in found if busy]
        if time.monotonic() >= deadline:
            idle += busy
            busy = []
        for pid in idle:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        if not busy:
            return
        if not told:
            say(f"fence: waiting for {len(busy)} transaction(s) in progress on the source")
            told = True
        time.sleep(0.05)


def wait_prepared(conn: psycopg.Connection[Any], deadline: float, say: Callable[[str], None]) -> list[str]:
    """Wait for the database's prepared transactions to be decided; return the GIDs still open at ``deadline``."""
    told = False
    while True:
        gids = [
            r[0]
            for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        ]
        if not gids or time.monotonic() >= deadline:
            return gids
        if not told:
            say(
                f"fence: waiting for {len(gids)} prepared transaction(s) on the source to be committed or rolled back"
            )
            told = True
        time.sleep(0.05)
