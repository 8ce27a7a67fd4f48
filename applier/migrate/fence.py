"""Fencing the source for a cutover: new transactions read-only, sessions ended, prepared ones decided.

``ALTER DATABASE … SET default_transaction_read_only = on`` makes every *new* session's transactions read-only;
sessions already connected keep their setting, so they are ended: at once, unless inside a transaction that has
written (it has an xid), which is let finish (or ended at the timeout), looked at every 10 ms: a session that
commits one transaction after another is ended between two of them. Prepared transactions are not sessions and need no write permission to be
decided: ``COMMIT PREPARED``/``ROLLBACK PREPARED`` still work under the fence, so ``--prepared wait`` can wait for
the application's transaction manager to finish them.

Limits: a client that explicitly turns ``default_transaction_read_only`` off (or says ``BEGIN READ WRITE``) can still
write; the cutover's verification then finds the difference and the cutover fails (and unfences). Our own sessions
turn it off, for the few writes the migration itself makes (dropping its publication and slot).

**Without superuser** (managed services: docs/security.md, "Managed services") some sessions cannot be ended: a
superuser's (the provider's own, RDS's ``rdsadmin``, Cloud SQL's ``cloudsqladmin``) when we are not one, and other
roles' when we lack ``pg_signal_backend``. They are told in advance (:func:`sessions`), or found when
``pg_terminate_backend`` refuses. The rule, per session that cannot be ended:

- its role cannot write any migrated table (``has_table_privilege(role, table, 'INSERT,UPDATE,DELETE,TRUNCATE')``
  is false for each): left connected, and listed;
- it could (a superuser can write everything): the migrated tables are locked ``IN SHARE MODE`` by a session of
  ours (:func:`hold_off`) from then until the cutover is done and the slot dropped, so that no session, superuser or not, writes them
  while the target catches up and is verified; listed as held off. When that lock does not come within the
  cutover's timeout (such a session is inside a transaction that wrote a migrated table, or holds a prepared one)
  the cutover refuses, naming the sessions and what ends them, and unfences. The lock is released once the
  migration is done and the slot dropped (while ``start`` still streams, a write let through would reach the new
  server): those sessions could then write to the old server again, and the cutover says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate.state import MigrationError

__all__ = [
    "FenceReport",
    "Session",
    "end_sessions",
    "fence",
    "hold_off",
    "open_source",
    "sessions",
    "unfence",
    "wait_gone",
    "wait_prepared",
]


def open_source(conninfo: str) -> psycopg.Connection[Any]:
    """A source session that may write even under the fence."""
    conn = psycopg.connect(conninfo, autocommit=True)
    conn.execute("SET default_transaction_read_only = off")
    return conn


def _db(conn: psycopg.Connection[Any]) -> sql.Identifier:
    return sql.Identifier(conn.info.dbname)


def fence(conn: psycopg.Connection[Any]) -> datetime:
    """Fence the source (``conn`` autocommits, so the setting is committed on return). Returns the server's clock
    once it is: a session that started later read the setting at its start and is read-only, so it is not ended
    (the application's transaction manager connecting to decide a prepared transaction, under ``--prepared wait``).
    The clock is read one round trip after the commit, never before it: a session that connects within that round
    trip is read-only and may still be ended, which loses nothing; none that could write is left connected."""
    conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(_db(conn)))
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index,no-any-return]


def unfence(conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(_db(conn)))


@dataclass(frozen=True)
class Session:
    """A client session of the source's database, other than ours."""

    pid: int
    role: str
    busy: bool  # inside a transaction
    superuser: bool
    can_end: bool  # we may pg_terminate_backend it (told in advance; a refusal also makes it False)
    can_write: bool  # its role may write a migrated table (a superuser always may)

    def describe(self) -> str:
        return f"pid {self.pid} (role {self.role}{', superuser' if self.superuser else ''})"


@dataclass
class FenceReport:
    """What the fence did with each session connected at the fence: ended, left connected (it cannot write the
    migrated tables), or held off by the lock on them (it could write, and cannot be ended)."""

    ended: list[Session] = field(default_factory=list)
    left: list[Session] = field(default_factory=list)
    held_off: list[Session] = field(default_factory=list)

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        return {
            "ended": [asdict(s) for s in self.ended],
            "left": [asdict(s) for s in self.left],
            "held_off": [asdict(s) for s in self.held_off],
        }

    def lines(self) -> list[str]:
        out = []
        if self.left:
            out.append(
                f"fence: left {len(self.left)} session(s) connected that cannot be ended and cannot write the "
                "migrated tables: " + ", ".join(s.describe() for s in self.left)
            )
        if self.held_off:
            out.append(
                f"fence: {len(self.held_off)} session(s) that could write the migrated tables cannot be ended: "
                + ", ".join(s.describe() for s in self.held_off)
                + "; they are to be kept from the migrated tables by a lock until the cutover is done"
            )
        return out


# a session's role, whether we may end it (PostgreSQL's rule in pg_signal_backend: only a superuser ends a
# superuser's session; otherwise the caller needs the privileges of the session's role or of pg_signal_backend),
# and whether its role may write any of the tables in %s (to_regclass: a name the source does not know is skipped)
_SESSIONS = """
SELECT a.pid, coalesce(r.rolname, a.usename, '?'), a.xact_start IS NOT NULL, coalesce(r.rolsuper, false),
       current_setting('is_superuser')::bool
         OR (NOT coalesce(r.rolsuper, false) AND (coalesce(pg_has_role(current_user, a.usesysid, 'USAGE'), false)
             OR pg_has_role(current_user, 'pg_signal_backend', 'USAGE'))),
       coalesce(r.rolsuper, false) OR EXISTS (
         SELECT FROM unnest(%s::text[]) t WHERE to_regclass(t) IS NOT NULL AND a.usesysid IS NOT NULL
           AND has_table_privilege(a.usesysid, to_regclass(t), 'INSERT,UPDATE,DELETE,TRUNCATE'))
FROM pg_stat_activity a LEFT JOIN pg_roles r ON r.oid = a.usesysid
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND a.backend_type = 'client backend'
  AND (%s::timestamptz IS NULL OR a.backend_start < %s::timestamptz)
ORDER BY 1
"""


def sessions(
    conn: psycopg.Connection[Any], tables: Sequence[str] = (), started_before: datetime | None = None
) -> list[Session]:
    """Client sessions of this database other than ours; ``tables``: the migrated tables (quoted, qualified);
    ``started_before``: only those that started before then (by the server's clock)."""
    return [Session(*r) for r in conn.execute(_SESSIONS, (list(tables), started_before, started_before))]


def end_sessions(
    conn: psycopg.Connection[Any],
    deadline: float,
    say: Callable[[str], None],
    tables: Sequence[str] = (),
    fenced_at: datetime | None = None,
) -> FenceReport:
    """End the sessions connected before the fence (``fenced_at``, :func:`fence`'s clock; ``None``: every
    session): at once, unless inside a transaction that has written (an xid), which is let finish (its commit
    reaches the target) and then ended, or ended at ``deadline`` (``time.monotonic()``); then wait until they
    have exited. Sessions that cannot be ended are not waited for: they are sorted into the
    report's ``left`` (cannot write ``tables``) and ``held_off`` (could: the caller locks the tables,
    :func:`hold_off`)."""
    report = FenceReport()
    refused: set[int] = set()
    writing: dict[int, str] = {}  # a busy session's transaction that has written: its xid, when first seen
    told = False
    while True:
        found = sessions(conn, tables, fenced_at)
        done = {s.pid for s in report.ended}  # ended, maybe still on its way out
        endable = [s for s in found if s.can_end and s.pid not in refused and s.pid not in done]
        still = _still_writing(conn, [s.pid for s in endable if s.busy], writing)
        busy = [s for s in endable if s.pid in still]
        ready = [s for s in endable if s not in busy] + (busy if time.monotonic() >= deadline else [])
        for s in ready:
            try:
                conn.execute("SELECT pg_terminate_backend(%s)", (s.pid,))
            except psycopg.errors.InsufficientPrivilege:
                refused.add(s.pid)
                continue
            report.ended.append(s)
        busy = [s for s in busy if s not in ready]
        if not busy:
            break
        if not told:
            say(f"fence: waiting for {len(busy)} transaction(s) in progress on the source")
            told = True
        time.sleep(0.01)
    ended = {s.pid for s in report.ended}
    wait_gone(conn, ended, deadline)
    for s in sessions(conn, tables):
        if s.pid in ended or (s.can_end and s.pid not in refused):
            continue  # still on its way out, or connected since (read-only: the fence is up)
        s = Session(s.pid, s.role, s.busy, s.superuser, False, s.can_write)
        (report.held_off if s.can_write else report.left).append(s)
    return report


def _still_writing(conn: psycopg.Connection[Any], pids: list[int], seen: dict[int, str]) -> set[int]:
    """Of ``pids`` (sessions inside a transaction), those still inside the transaction first seen writing
    (``seen``: pid to that transaction's xid, kept from one look to the next). The others may be ended at once:
    a transaction that has written nothing yet loses nothing, and one that began after the first seen has not
    committed (ending it rolls it back, as the fence would refuse its writes anyway)."""
    if not pids:
        return set()
    rows = conn.execute(
        "SELECT pid, backend_xid::text FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
    ).fetchall()
    return {pid for pid, xid in rows if xid is not None and seen.setdefault(pid, xid) == xid}


def wait_gone(conn: psycopg.Connection[Any], pids: set[int], deadline: float) -> None:
    """Until the ended sessions have exited (a commit in flight when it was ended is then over, before the
    cutover reads its end position), or ``deadline``."""
    while pids and time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)
        ).fetchone()
        if not row or not row[0]:
            return
        time.sleep(0.005)


def hold_off(conninfo: str, tables: Sequence[str], deadline: float) -> psycopg.Connection[Any]:
    """A session of ours, inside a transaction that holds ``tables`` locked ``IN SHARE MODE`` (which no INSERT,
    UPDATE, DELETE or TRUNCATE passes, whoever runs it) until the connection is closed. Waits for the lock until
    ``deadline``; raises :class:`psycopg.errors.LockNotAvailable` past it, or ``InsufficientPrivilege`` (the lock
    needs ownership, or UPDATE, DELETE or TRUNCATE on each table)."""
    conn = open_source(conninfo)
    try:
        ms = max(1, int((deadline - time.monotonic()) * 1000))
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(ms)))
        conn.execute("BEGIN")
        conn.execute(
            sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.SQL(", ").join(sql.SQL(t) for t in tables))
        )
    except BaseException:
        conn.close()
        raise
    return conn


def wait_prepared(
    conn: psycopg.Connection[Any],
    deadline: float,
    say: Callable[[str], None],
    gone: Callable[[], str | None] | None = None,
) -> list[str]:
    """Wait for the database's prepared transactions to be decided; return the GIDs still open at ``deadline``.
    ``gone``, looked at about once a second: why the wait must end now (the migration's ``start`` stopped), raised
    as the error; None while it may go on."""
    told = False
    looked = time.monotonic()
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
        if gone is not None and time.monotonic() - looked >= 1.0:
            looked = time.monotonic()
            why = gone()
            if why is not None:
                raise MigrationError(f"{why}: the wait for prepared transactions ends")
        time.sleep(0.05)
