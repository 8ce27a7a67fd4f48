"""Create, alter, drop and inspect subscriptions: what ``applier create|alter|drop|status`` do, apart from parsing.

Each command checks everything it can *before* it changes anything, and says what is wrong and what to do
(:class:`SubscriptionError` carries a message and a hint, printed as psql prints ``ERROR``/``HINT``). Where a command
must change two servers (a catalog row on the target and a slot on the publisher) it orders the steps so that a
failure leaves nothing half-made: ``create`` undoes its catalog row and origin if the slot cannot be created, and
``drop`` removes the slot before the local state, so it can simply be run again.

Who may run a subscription is decided by a session-level advisory lock on the target, keyed by subid
(:class:`SubscriptionLock`): ``applier run`` holds it for the life of the worker, and ``drop`` and
``alter --set two_phase`` take it for their duration, so they never act under a running worker and a worker never
starts in their middle. Advisory locks vanish with the session, so a crashed worker never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from applier import slots
from applier.catalog.store import Catalog, CatalogError, RelState, Subscription
from applier.conninfo import describe, has_password, scrub, without_password
from applier.errors import ApplierError
from applier.lsn import format_lsn, parse_lsn
from applier.privileges import (
    ORIGIN_FUNCTIONS,
    SET_PARAMETER_VERSION,
    TABLE_PRIVILEGES,
    TableFacts,
    TargetFacts,
    missing_grants,
)
from applier.replication import ReplicationConnection, ReplicationConnectionError
from state.tables import SyncState, initial_sync_state
from state.twophase import (
    GID_FORMATS,
    TwoPhaseState,
    check_alter_gid_format,
    check_alter_two_phase,
    check_refresh_publication,
    check_skip_lsn,
    initial_two_phase,
)

__all__ = [
    "LOCK_NAMESPACE",
    "Console",
    "CreateOptions",
    "SubscriptionBusy",
    "SubscriptionError",
    "SubscriptionLock",
    "alter_options",
    "create",
    "drop",
    "format_status",
    "open_catalog",
    "refresh_publication",
    "require_subscription",
    "set_enabled",
    "set_skip_lsn",
    "status",
]

#: First key of the two-key advisory lock ``(LOCK_NAMESPACE, subid)`` that marks a subscription as in use ("appl").
LOCK_NAMESPACE = 0x6170706C

#: Slots of the initial copy are named ``applier_<subid>_sync...``; ``drop`` removes leftovers.
SYNC_SLOT_PATTERN = "applier\\_{subid}\\_sync%"

MIN_PUBLISHER_VERSION = 150000
#: ``ALTER_REPLICATION_SLOT ... (TWO_PHASE false)`` arrived in PostgreSQL 18 (17 only knows FAILOVER).
ALTER_SLOT_TWO_PHASE_VERSION = 180000

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


class SubscriptionError(ApplierError):
    """A command refused or failed: ``message`` says what is wrong, ``hint`` what to do (psql's layout)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nHINT: {hint}")


class SubscriptionBusy(SubscriptionError):
    """Another process holds the subscription's lock (a running ``applier run``, or a drop/alter in progress)."""


@dataclass(frozen=True)
class Console:
    """Where a command reports progress (``info``) and things the user should know (``warn``)."""

    info: Callable[[str], None]
    warn: Callable[[str], None]


def _quiet(_: str) -> None:
    pass


QUIET = Console(_quiet, _quiet)


# --- the target --------------------------------------------------------------------------------------------------


def _db_error(exc: BaseException) -> BaseException:
    """The psycopg error inside a SQLAlchemy one."""
    return getattr(exc, "orig", None) or exc


def _is_connection_failure(exc: BaseException) -> bool:
    """libpq's own failures carry no SQLSTATE; the server's connection errors are class 08 (57P0x: shutting down)."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))


@contextlib.contextmanager
def target_errors(target: str) -> Iterator[None]:
    """Turn a failure to reach or use the target into a message that says which target and what to check."""
    try:
        yield
    except sa.exc.OperationalError as exc:
        if not _is_connection_failure(_db_error(exc)):
            raise SubscriptionError(
                f"the target failed: {scrub(str(_db_error(exc)), target).strip()}"
            ) from None
        raise SubscriptionError(
            f"could not connect to the target ({describe(target)}): {scrub(str(_db_error(exc)), target).strip()}",
            "pass --target CONNINFO, or set PGHOST, PGPORT, PGDATABASE, PGUSER (and PGPASSWORD or ~/.pgpass) "
            "as for psql",
        ) from None
    except sa.exc.DBAPIError as exc:
        orig = _db_error(exc)
        if isinstance(orig, psycopg.errors.InsufficientPrivilege):
            raise SubscriptionError(
                f"permission denied on the target: {str(orig).strip()}",
                "applier keeps its catalog in schema applier of the target database; docs/security.md lists "
                "the grants its role needs there (applier create names the missing ones)",
            ) from None
        raise SubscriptionError(f"the target failed: {scrub(str(orig), target).strip()}") from None


def open_catalog(target: str, *, create: bool = False) -> Catalog:
    """The target's catalog, connected (so a wrong ``--target`` fails here, with a clear message); ``create``
    creates or upgrades it."""
    catalog = Catalog.connect(target)
    with target_errors(target):
        if create:
            catalog.ensure()
        else:
            with catalog.engine.connect():
                pass
    return catalog


def require_subscription(catalog: Catalog, name: str) -> Subscription:
    try:
        return catalog.require(name)
    except CatalogError as exc:
        raise SubscriptionError(str(exc), "applier status lists the subscriptions of this target") from None
    except sa.exc.ProgrammingError:  # no catalog at all
        raise SubscriptionError(
            f'subscription "{name}" does not exist: the target has no applier catalog yet',
            "check --target; applier create makes the first subscription",
        ) from None


def _scalar(catalog: Catalog, query: str, **params: Any) -> Any:
    with catalog.engine.connect() as c:
        return c.execute(sa.text(query), params).scalar()


def origin_progress(catalog: Catalog, sub: Subscription) -> int:
    """The remote LSN up to which the subscription's origin says the target has applied (0 when none yet)."""
    # pg_replication_origin_progress, not the pg_replication_origin_status view: the apply role is granted the
    # function anyway, the view would be one more grant (docs/security.md)
    lsn = _scalar(
        catalog,
        "SELECT CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_replication_origin WHERE roname = :o)"
        " THEN pg_catalog.pg_replication_origin_progress(:o, false)::text END",
        o=sub.origin_name,
    )
    return parse_lsn(lsn) if lsn else 0


def rollback_prepared(catalog: Catalog, sub: Subscription, console: Console) -> list[str]:
    """ROLLBACK PREPARED every transaction this subscription prepared on the target; return their GIDs."""
    gids = [gid for gid, _ in catalog.pending_prepared(sub.subid)]
    for gid in gids:
        with catalog.engine.connect() as c:
            c.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)).as_string()
            )
        catalog.forget_prepared(gid)
        console.info(f"rolled back prepared transaction {gid} on the target")
    return gids


# --- the per-subscription lock ----------------------------------------------------------------------------------


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


# --- the publisher ---------------------------------------------------------------------------------------------


def connect_publisher(conninfo: str, command: str, subname: str, *, doing: str) -> ReplicationConnection:
    """A replication connection to the publisher (it also answers SQL); ``doing`` says in the error what could not
    be done without it. Its application_name is ``applier <command> <subname>``, not the subscription's own name,
    which belongs to the worker's stream (pg_stat_replication and synchronous_standby_names match on it)."""
    try:
        return ReplicationConnection.open(conninfo, application_name=f"applier {command} {subname}"[:63])
    except ReplicationConnectionError as exc:
        raise SubscriptionError(
            f"{exc} (needed to {doing})",
            "check the publisher connection string (host, port, dbname, user); the role needs the REPLICATION "
            "attribute (or superuser) and pg_hba.conf must let it connect; a password comes from ~/.pgpass, "
            "PGPASSFILE or PGPASSWORD, because applier does not store it",
        ) from None


def _pub_query(pub: ReplicationConnection, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """SQL on a replication connection: walsenders speak only the simple query protocol, so values are bound
    client-side."""
    with psycopg.ClientCursor(pub.connection) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def published_tables(pub: ReplicationConnection, publications: Sequence[str]) -> list[str]:
    """The tables the publications publish, schema-qualified and quoted (``public.t``, ``"My"."T"``)."""
    rows = _pub_query(
        pub,
        "SELECT DISTINCT quote_ident(schemaname) || '.' || quote_ident(tablename)"
        " FROM pg_catalog.pg_publication_tables WHERE pubname = ANY(%s) ORDER BY 1",
        (list(publications),),
    )
    return [r[0] for r in rows]


def _slot_row(pub: ReplicationConnection, slot: str) -> tuple[Any, ...] | None:
    rows = _pub_query(
        pub,
        "SELECT active_pid, two_phase, database, plugin FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return rows[0] if rows else None


def _drop_slot(pub: ReplicationConnection, slot: str, *, patience: float = 10.0) -> bool:
    """Drop ``slot`` if it exists; return whether it existed. A walsender of a worker that has just stopped may
    still hold it for a moment, so an active slot is waited for, briefly."""

    def look() -> int | None:
        row = _slot_row(pub, slot)
        return slots.ABSENT if row is None else row[0]

    done = slots.drop_when_idle(look, lambda: _drop_idle_slot(pub, slot), patience=patience)
    if done.holder is not None:
        raise SubscriptionError(
            f'replication slot "{slot}" on the publisher is in use by walsender pid {done.holder}',
            "a worker that stopped moments ago releases it within wal_sender_timeout; if no applier process "
            f"runs this subscription, end it on the publisher: SELECT pg_terminate_backend({done.holder})",
        )
    return done.dropped


def _drop_idle_slot(pub: ReplicationConnection, slot: str) -> bool:
    """Drop a slot nobody held a moment ago; False when someone took it meanwhile (look again)."""
    try:
        pub.drop_slot(slot, wait=False)
        return True
    except ReplicationConnectionError as exc:
        if exc.sqlstate != "55006":  # object_in_use: taken meanwhile; look again
            raise SubscriptionError(
                f'could not drop replication slot "{slot}" on the publisher: {exc}'
            ) from None
        return False


# --- create ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateOptions:
    """``applier create``'s options, named as CREATE SUBSCRIPTION names them."""

    name: str
    publisher: str
    publications: tuple[str, ...]
    two_phase: bool = False
    streaming: str = "off"
    copy_data: bool = True
    binary: bool = False
    origin: str = "any"
    disable_on_error: bool = False
    slot_name: str | None = None  # default: the subscription's name
    create_slot: bool = True
    enabled: bool = True
    run_as_owner: bool = False  # PostgreSQL 16's: trust the tables' owners (docs/security.md)

    @property
    def slot(self) -> str:
        return self.slot_name or self.name


def _check_slot_name(slot: str, *, default: bool) -> None:
    if not _SLOT_NAME.match(slot):
        raise SubscriptionError(
            f'replication slot name "{slot}" is not valid: slot names are 1-63 characters of lower case letters, '
            "digits and the underscore",
            "choose one with --slot-name" if default else "choose another slot name",
        )


def create(target: str, opts: CreateOptions, console: Console = QUIET) -> Subscription:
    """Create a subscription: check, write the catalog, create the slot; on any failure undo what was done."""
    if not opts.name.strip():
        raise SubscriptionError("the subscription name must not be empty")
    if not opts.publications:
        raise SubscriptionError("at least one --publication is needed")
    _check_slot_name(opts.slot, default=opts.slot_name is None)
    stored_conninfo = without_password(opts.publisher)

    catalog = open_catalog(target)
    with target_errors(target):
        facts = _check_target(catalog, opts, console)

    with connect_publisher(opts.publisher, "create", opts.name, doing="create the subscription") as pub:
        tables = _check_publisher(pub, opts)
        with target_errors(target):
            relids = _target_tables(catalog, tables)
            _require_grants(catalog, facts, relids)  # everything is checked: only now is anything written
            catalog.ensure()
            if catalog.get(opts.name) is not None:
                raise SubscriptionError(
                    f'subscription "{opts.name}" already exists on this target',
                    "choose another name, or remove the old one first: applier drop " + opts.name,
                )
        two_phase, slot_two_phase = initial_two_phase(
            opts.two_phase, opts.copy_data, opts.create_slot, has_tables=bool(tables)
        )
        with target_errors(target):
            sub = catalog.create_subscription(
                subname=opts.name, conninfo=stored_conninfo, publications=list(opts.publications),
                two_phase_state=two_phase, streaming=opts.streaming, binary=opts.binary,
                disable_on_error=opts.disable_on_error, origin=opts.origin, slot_name=opts.slot,
                enabled=opts.enabled, copy_data=opts.copy_data, run_as_owner=opts.run_as_owner,
            )  # fmt: skip
        state = _add_tables_and_slot(catalog, target, pub, sub, opts, tables, relids, slot_two_phase, console)

    if has_password(opts.publisher):
        console.warn(
            "the publisher's password is not stored: applier run takes it from ~/.pgpass, PGPASSFILE or "
            "PGPASSWORD, as psql does"
        )
    created = catalog.require(opts.name)
    console.info(
        f'created subscription "{created.subname}" (subid {created.subid}): {len(tables)} table(s) in state '
        f"{state.value}, two-phase state {created.subtwophasestate.value}"
        + (
            f', slot "{opts.slot}" at {format_lsn(created.subslotconsistentlsn)}'
            if created.subslotconsistentlsn
            else ""
        )
    )
    return created


def _add_tables_and_slot(catalog: Catalog, target: str, pub: ReplicationConnection, sub: Subscription,
                         opts: CreateOptions, tables: Sequence[str], relids: dict[str, int], slot_two_phase: bool,
                         console: Console) -> SyncState:  # fmt: skip
    """The new subscription's tables, in their first state (returned), then its slot; on any failure (Ctrl-C
    included) the slot, the rows and the origin go: no half-created subscription."""
    slot_created = False
    try:
        state = initial_sync_state(opts.copy_data)
        with target_errors(target), catalog.engine.begin() as c:
            for name in tables:
                catalog.add_table(sub.subid, relids[name], name, state, conn=c)
        if opts.create_slot:
            lsn = _create_slot(pub, opts.slot, slot_two_phase, console)
            slot_created = True
            with target_errors(target):
                catalog.update_subscription(sub.subid, subslotconsistentlsn=lsn)
    except BaseException:
        with contextlib.suppress(Exception):
            if slot_created:
                _drop_slot(pub, opts.slot)
        with contextlib.suppress(Exception):
            catalog.delete_subscription(sub.subid)
        raise
    return state


def _check_target(catalog: Catalog, opts: CreateOptions, console: Console) -> TargetFacts:
    """What the target must allow, read before anything is written: the role's privileges (returned, completed
    with the tables' once the publisher has named them), and prepared transactions if two-phase is asked."""
    with catalog.engine.connect() as c:
        facts = read_target_facts(c)
        max_prepared = c.execute(sa.text("SELECT current_setting('max_prepared_transactions')::int")).scalar()
    if facts.superuser:
        warn_superuser_once(facts.role, console.warn)
    if opts.two_phase and max_prepared == 0:
        raise SubscriptionError(
            "two-phase needs prepared transactions on the target, but its max_prepared_transactions is 0",
            "set max_prepared_transactions on the target (e.g. to max_connections) and restart it, or create "
            "the subscription without --two-phase",
        )
    return facts


_FACTS = """
SELECT current_setting('server_version_num')::int AS version, quote_ident(current_user) AS role,
       quote_ident(current_database()) AS database, current_setting('is_superuser') = 'on' AS superuser,
       has_database_privilege(current_database(), 'CREATE') AS create_db, n.oid IS NOT NULL AS schema_exists,
       coalesce(has_schema_privilege(n.oid, 'CREATE'), false) AS create_schema,
       coalesce(has_schema_privilege(n.oid, 'USAGE'), false) AS use_schema,
       EXISTS (SELECT FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'catalog_version') AS catalog,
       NOT EXISTS (SELECT FROM pg_class c WHERE c.relnamespace = n.oid AND c.relkind = 'r'
                   AND NOT (has_table_privilege(c.oid, 'SELECT') AND has_table_privilege(c.oid, 'INSERT')
                            AND has_table_privilege(c.oid, 'UPDATE') AND has_table_privilege(c.oid, 'DELETE')))
         AS catalog_writable,
       ARRAY(SELECT f FROM unnest(CAST(:functions AS text[])) f WHERE NOT has_function_privilege(f, 'EXECUTE'))
         AS missing_functions
FROM (SELECT) AS one LEFT JOIN pg_namespace n ON n.nspname = 'applier'
"""


def read_target_facts(c: sa.Connection) -> TargetFacts:
    """The privileges of the connected role that :func:`applier.privileges.missing_grants` judges, in two
    queries and without reading anything a non-superuser may not (no pg_authid: ``is_superuser`` says it)."""
    r = c.execute(sa.text(_FACTS), {"functions": list(ORIGIN_FUNCTIONS)}).one()
    may_set = r.superuser or (
        r.version >= SET_PARAMETER_VERSION
        and bool(
            c.execute(sa.text("SELECT has_parameter_privilege('session_replication_role', 'SET')")).scalar()
        )
    )
    return TargetFacts(
        server_version=r.version, role=r.role, database=r.database, superuser=r.superuser,
        may_create_in_database=r.create_db, schema_exists=r.schema_exists, may_create_in_schema=r.create_schema,
        may_use_schema=r.use_schema, catalog_exists=r.catalog, catalog_writable=r.catalog_writable,
        may_set_replication_role=may_set, missing_functions=tuple(r.missing_functions),
    )  # fmt: skip


def _require_grants(catalog: Catalog, facts: TargetFacts, relids: dict[str, int]) -> None:
    """Refuse with every missing grant, ready to paste, rather than fail halfway through the first copy."""
    with catalog.engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS name,"
                " ARRAY(SELECT p FROM unnest(CAST(:privs AS text[])) p WHERE NOT has_table_privilege(c.oid, p))"
                " AS missing, quote_ident(n.nspname) AS schema, has_schema_privilege(n.oid, 'USAGE') AS usable"
                " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE c.oid = ANY(CAST(:relids AS oid[])) ORDER BY 1"
            ),
            {"privs": list(TABLE_PRIVILEGES), "relids": sorted(set(relids.values()))},
        ).all()
    facts = dataclasses.replace(
        facts,
        tables=tuple(TableFacts(r.name, tuple(r.missing)) for r in rows),
        unusable_schemas=tuple(sorted({r.schema for r in rows if not r.usable})),
    )
    lines = missing_grants(facts)
    if lines:
        raise SubscriptionError(
            f"role {facts.role} lacks privileges on the target that a subscription needs; nothing was written. "
            "As a superuser, run on the target database:\n" + "\n".join(lines),
            "docs/security.md lists every grant and what it is for; or connect to the target as a superuser",
        )


_superuser_warned = False


def warn_if_superuser(catalog: Catalog, warn: Callable[[str], None]) -> None:
    """:func:`warn_superuser_once` for ``applier run``, which has no facts read yet."""
    if _superuser_warned:
        return
    with catalog.engine.connect() as c:
        role, superuser = c.execute(
            sa.text("SELECT quote_ident(current_user), current_setting('is_superuser') = 'on'")
        ).one()
    if superuser:
        warn_superuser_once(role, warn)


def warn_superuser_once(role: str, warn: Callable[[str], None]) -> None:
    """Say once per process that the apply role need not be a superuser: a superuser bypasses every check the
    target would otherwise make of what replication writes (docs/security.md)."""
    global _superuser_warned
    if _superuser_warned:
        return
    _superuser_warned = True
    warn(
        f"the target role {role} is a superuser; applier does not need one. A role with only the grants listed in "
        'docs/security.md ("Least privilege: the apply role on the target") runs create, run and drop: '
        "connect as such a role"
    )


def _check_publisher(pub: ReplicationConnection, opts: CreateOptions) -> list[str]:
    """Version, wal_level, publications and slot; returns the published tables."""
    version = pub.server_version
    if version < MIN_PUBLISHER_VERSION:
        raise SubscriptionError(
            f"the publisher runs PostgreSQL {version // 10000}, applier needs 15 or later",
            "upgrade the publisher",
        )
    ((wal_level, dbname),) = _pub_query(pub, "SELECT current_setting('wal_level'), current_database()")
    if wal_level != "logical":
        raise SubscriptionError(
            f'wal_level on the publisher is "{wal_level}"; logical replication needs "logical"',
            "on the publisher run ALTER SYSTEM SET wal_level = logical, then restart it",
        )
    found = {r[0] for r in _pub_query(pub, "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)",
                                      (list(opts.publications),))}  # fmt: skip
    missing = [p for p in opts.publications if p not in found]
    if missing:
        names = ", ".join(f'"{p}"' for p in missing)
        raise SubscriptionError(
            f"publication {names} does not exist on the publisher (database {dbname})"
            if len(missing) == 1
            else f"publications {names} do not exist on the publisher (database {dbname})",
            "create it on the publisher (CREATE PUBLICATION name FOR TABLE ...), or check the name and the "
            "publisher's dbname",
        )
    if opts.create_slot:
        if _slot_row(pub, opts.slot) is not None:
            raise _slot_exists(opts.slot)
    else:
        row = _slot_row(pub, opts.slot)
        if row is None:
            raise SubscriptionError(
                f'replication slot "{opts.slot}" does not exist on the publisher, and --no-create-slot says not to '
                "create it",
                "create it there first (SELECT pg_create_logical_replication_slot('"
                f"{opts.slot}', 'pgoutput')), or leave out --no-create-slot",
            )
        if (row[2], row[3]) != (dbname, "pgoutput"):
            raise SubscriptionError(
                f'replication slot "{opts.slot}" cannot serve this subscription: it is a '
                f"{row[3] or 'physical'} slot of database {row[2] or '(none)'}, not a pgoutput slot of {dbname}",
                "name a logical pgoutput slot of the publisher's database with --slot-name, or let create make one",
            )
    return published_tables(pub, opts.publications)


def _slot_exists(slot: str) -> SubscriptionError:
    return SubscriptionError(
        f'replication slot "{slot}" already exists on the publisher',
        "choose another name with --slot-name; or, if nothing uses it, drop it on the publisher "
        f"(SELECT pg_drop_replication_slot('{slot}')); or reuse it with --no-create-slot",
    )


def _target_tables(catalog: Catalog, tables: Sequence[str]) -> dict[str, int]:
    """The target's OID of each published table (same schema-qualified name); refuse if any is missing."""
    if not tables:
        return {}
    with catalog.engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT n, c.oid, c.relkind FROM unnest(CAST(:names AS text[])) AS n"
                " LEFT JOIN pg_class c ON c.oid = to_regclass(n)"
            ),
            {"names": list(tables)},
        ).all()
    missing = [r.n for r in rows if r.oid is None]
    if missing:
        raise SubscriptionError(
            f"published table(s) missing on the target: {', '.join(missing)}",
            "create them on the target with the same schema and name first, e.g. "
            "pg_dump --schema-only --table=NAME PUBLISHER | psql TARGET",
        )
    wrong = [r.n for r in rows if r.relkind not in ("r", "p")]
    if wrong:
        raise SubscriptionError(
            f"cannot replicate into {', '.join(wrong)} on the target: not a table",
            "the target needs ordinary or partitioned tables of the same names",
        )
    return {r.n: r.oid for r in rows}


def _create_slot(pub: ReplicationConnection, slot: str, two_phase: bool, console: Console) -> int:
    """Create the subscription's slot and return its consistent point. Creating a slot waits for every
    transaction open on the publisher, prepared ones included, so say so if it takes a while."""
    notice = threading.Timer(
        5.0,
        console.warn,
        (
            f'still creating replication slot "{slot}": the publisher first waits for every transaction open '
            "there to finish, prepared ones included (see pg_stat_activity and pg_prepared_xacts on the publisher)",
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        info = pub.create_slot(slot, two_phase=two_phase)
    except ReplicationConnectionError as exc:
        if exc.sqlstate == "42710":  # duplicate_object: created by someone else since we looked
            raise _slot_exists(slot) from None
        raise SubscriptionError(
            f'could not create replication slot "{slot}" on the publisher: {exc}'
        ) from None
    finally:
        notice.cancel()
    return info.consistent_point


# --- alter -------------------------------------------------------------------------------------------------------

_TRUE = {"true", "on", "yes", "1", "t", "y"}
_FALSE = {"false", "off", "no", "0", "f", "n"}
SETTABLE = (
    "two_phase", "streaming", "binary", "disable_on_error", "origin", "slot_name", "gid_format", "run_as_owner",
)  # fmt: skip


def _bool(option: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SubscriptionError(
        f'{option} requires a Boolean value, not "{value}"', f"use {option}=true or {option}=false"
    )


def parse_set_options(items: Sequence[str]) -> dict[str, Any]:
    """``["streaming=on", "binary=false"]`` -> ``{"streaming": "on", "binary": False}``, validated."""
    result: dict[str, Any] = {}
    for item in items:
        option, sep, value = item.partition("=")
        option = option.strip().lower()
        if not sep:
            raise SubscriptionError(f'--set needs OPTION=VALUE, not "{item}"', "e.g. --set streaming=on")
        if option not in SETTABLE:
            raise SubscriptionError(
                f'unrecognized subscription option "{option}"', f"settable options: {', '.join(SETTABLE)}"
            )
        if option in result:
            raise SubscriptionError(f'option "{option}" given twice')
        v = value.strip()
        if option in ("two_phase", "binary", "disable_on_error", "run_as_owner"):
            result[option] = _bool(option, v)
        elif option == "streaming":
            if v.lower() == "parallel":
                result[option] = "parallel"
            else:
                result[option] = "on" if _bool(option, v) else "off"
        elif option == "origin":
            if v.lower() not in ("any", "none"):
                raise SubscriptionError(f'unrecognized origin value: "{v}"', "use origin=any or origin=none")
            result[option] = v.lower()
        elif option == "gid_format":
            if v.lower() not in GID_FORMATS:
                raise SubscriptionError(
                    f'unrecognized gid_format value: "{v}"',
                    "use gid_format=subscription or gid_format=original",
                )
            result[option] = v.lower()
        else:  # slot_name
            if v.upper() == "NONE":
                result[option] = None
            else:
                _check_slot_name(v, default=False)
                result[option] = v
    if "two_phase" in result and "slot_name" in result:
        raise SubscriptionError(
            "slot_name and two_phase cannot be altered at the same time", "run two separate alter commands"
        )
    return result


_COLUMNS = {"streaming": "substream", "binary": "subbinary", "disable_on_error": "subdisableonerr",
            "origin": "suborigin", "slot_name": "subslotname", "gid_format": "subgidformat",
            "run_as_owner": "subrunasowner"}  # fmt: skip


def set_enabled(target: str, name: str, enabled: bool, console: Console = QUIET) -> None:
    """``alter --enable`` / ``--disable``. A running worker notices a disable and exits; ``applier run`` starts an
    enabled one."""
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
        if enabled and sub.subslotname is None:
            raise SubscriptionError(
                f'cannot enable subscription "{name}": it has no slot name',
                f"set one first: applier alter {name} --set slot_name=SLOT",
            )
        catalog.update_subscription(sub.subid, subenabled=enabled)
        holder = _holder(catalog, sub.subid)
    console.info(f'subscription "{name}" {"enabled" if enabled else "disabled"}')
    if not enabled and holder is not None:
        console.info(f"its worker ({holder}) stops by itself shortly")


def alter_options(target: str, name: str, items: Sequence[str], *, force: bool = False,
                  console: Console = QUIET) -> None:  # fmt: skip
    """``alter --set OPTION=VALUE ...``: all options validated before any is changed, then changed together."""
    options = parse_set_options(items)
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    if "slot_name" in options and options["slot_name"] is None and sub.subenabled:
        raise SubscriptionError(
            f'cannot set slot_name = NONE for enabled subscription "{name}"',
            f"disable it first: applier alter {name} --disable",
        )
    if force and options.get("two_phase") is not False:
        raise SubscriptionError(
            "--force only applies to --set two_phase=off (it rolls back prepared transactions)"
        )
    if "gid_format" in options:
        _check_gid_format(catalog, sub, target, options["gid_format"])
    values = {_COLUMNS[k]: v for k, v in options.items() if k != "two_phase"}
    if "two_phase" not in options:
        with target_errors(target):
            catalog.update_subscription(sub.subid, **values)
        console.info(f'subscription "{name}" altered: ' + ", ".join(items))
        return
    # two_phase: only with no worker running, which holding the lock ourselves guarantees for the duration
    lock = SubscriptionLock(target, sub, "alter")
    try:
        lock.acquire()
        worker_running = False
    except SubscriptionBusy:
        worker_running = True
    try:
        with target_errors(target):
            pending = catalog.pending_prepared(sub.subid)
        new_state = check_alter_two_phase(
            sub.subtwophasestate, options["two_phase"], enabled=sub.subenabled, worker_running=worker_running,
            prepared_xacts=len(pending), force=force, subname=name,
        )  # fmt: skip
        if new_state == sub.subtwophasestate:
            with target_errors(target):
                catalog.update_subscription(sub.subid, **values)
            console.info(f'subscription "{name}" altered: two_phase unchanged ({new_state.value})')
            return
        if new_state is TwoPhaseState.DISABLED:
            _two_phase_off(catalog, sub, target, values, force=force, console=console)
        else:
            with target_errors(target):
                catalog.update_subscription(sub.subid, subtwophasestate=new_state, **values)
        console.info(f'subscription "{name}" altered: two-phase state {new_state.value}')
    finally:
        lock.release()


def _check_gid_format(catalog: Catalog, sub: Subscription, target: str, new: str) -> None:
    """``--set gid_format``: a running worker names its prepared transactions as it started, so only on a disabled
    subscription, and never while some are prepared under the current names (state.twophase)."""
    if new != sub.subgidformat and sub.subenabled:
        raise SubscriptionError(
            f'cannot set option "gid_format" for enabled subscription "{sub.subname}"',
            f"disable it first (applier alter {sub.subname} --disable), then run this again and re-enable it",
        )
    with target_errors(target):
        pending = catalog.pending_prepared(sub.subid)
    check_alter_gid_format(sub.subgidformat, new, prepared_xacts=len(pending), subname=sub.subname)


def _two_phase_off(catalog: Catalog, sub: Subscription, target: str, values: dict[str, Any], *, force: bool,
                   console: Console) -> None:  # fmt: skip
    """on -> off: roll back our prepared transactions if forced, turn two-phase off on the slot (PostgreSQL 18+),
    and record ``d``. The catalog change commits only after the slot was altered."""
    slot = sub.subslotname
    with contextlib.ExitStack() as stack:
        pub: ReplicationConnection | None = None
        slot_two_phase = False
        if slot is not None:
            pub = stack.enter_context(
                connect_publisher(
                    sub.subconninfo, "alter", sub.subname, doing=f'turn two-phase off on slot "{slot}"'
                )
            )
            row = _slot_row(pub, slot)
            slot_two_phase = bool(row and row[1])
            if slot_two_phase and pub.server_version < ALTER_SLOT_TWO_PHASE_VERSION:
                raise SubscriptionError(
                    f'cannot turn two-phase off: slot "{slot}" decodes prepared transactions, and the publisher '
                    f"(PostgreSQL {pub.server_version // 10000}) cannot change that on an existing slot "
                    "(ALTER_REPLICATION_SLOT ... TWO_PHASE needs PostgreSQL 18)",
                    f"drop and create the subscription again without --two-phase (applier drop {sub.subname}; "
                    "applier create ...), or upgrade the publisher",
                )
        if force:
            with target_errors(target):
                rollback_prepared(catalog, sub, console)
        with target_errors(target), catalog.engine.begin() as c:
            catalog.update_subscription(sub.subid, c, subtwophasestate=TwoPhaseState.DISABLED, **values)
            if pub is not None and slot_two_phase:
                _slot_two_phase_off(pub, slot, console)  # type: ignore[arg-type]


def _slot_two_phase_off(pub: ReplicationConnection, slot: str, console: Console) -> None:
    """``ALTER_REPLICATION_SLOT ... (TWO_PHASE false)`` (PostgreSQL 18+), inside the caller's catalog transaction,
    which commits only if this succeeded."""
    try:
        pub.connection.execute(
            sql.SQL("ALTER_REPLICATION_SLOT {} ( TWO_PHASE false )").format(sql.Identifier(slot))  # type: ignore[arg-type]
        )
    except psycopg.Error as exc:
        raise SubscriptionError(
            f'could not turn two-phase off on slot "{slot}" on the publisher: {str(exc).strip()}'
        ) from None
    console.info(f'two-phase turned off on slot "{slot}" on the publisher')


def set_skip_lsn(target: str, name: str, value: str, console: Console = QUIET) -> None:
    """``alter --skip-lsn LSN|NONE``: skip the remote transaction finishing at LSN (behaviours 97-100)."""
    if value.strip().upper() == "NONE":
        lsn = 0
    else:
        try:
            lsn = parse_lsn(value)
        except ValueError as exc:
            raise SubscriptionError(
                str(exc), "give the finish LSN from the worker's error message, or NONE"
            ) from None
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
        check_skip_lsn(lsn, origin_progress(catalog, sub), subname=name)
        catalog.update_subscription(sub.subid, subskiplsn=lsn or None)
    console.info(
        f'subscription "{name}" will skip the transaction finishing at {format_lsn(lsn)}'
        if lsn
        else f'subscription "{name}": skip-LSN cleared'
    )


def refresh_publication(target: str, name: str, *, copy_data: bool = True, console: Console = QUIET) -> None:
    """``alter --refresh-publication``: start replicating newly published tables, stop replicating unpublished ones."""
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    check_refresh_publication(sub.subtwophasestate, copy_data, subname=name)
    with connect_publisher(sub.subconninfo, "refresh", sub.subname, doing="read the publications") as pub:
        published = published_tables(pub, sub.subpublications)
    with target_errors(target):
        current = {t.remote_name: t for t in catalog.table_states(sub.subid)}
        added = [t for t in published if t not in current]
        removed = [t for name_, t in current.items() if name_ not in set(published)]
        relids = _target_tables(catalog, added)
        state = initial_sync_state(copy_data)
        with catalog.engine.begin() as c:
            for t in added:
                catalog.add_table(sub.subid, relids[t], t, state, conn=c)
            for t in removed:
                catalog.remove_table(sub.subid, t.relid, conn=c)
    console.info(
        f'subscription "{name}" refreshed: '
        + (f"added {', '.join(added)} (state {state.value})" if added else "no table added")
        + (f"; removed {', '.join(t.name for t in removed)}" if removed else "; no table removed")
    )
    if added and copy_data:
        holder = _holder(catalog, sub.subid)
        # a running worker copies and catches them up live (tablesync.live); otherwise the next applier run does
        console.info(
            f"the new tables are being copied and caught up by the running worker ({holder})"
            if holder
            else "the new tables are copied when applier run next starts this subscription"
        )


# --- drop --------------------------------------------------------------------------------------------------------


def drop(target: str, name: str, *, force: bool = False, console: Console = QUIET) -> None:
    """Drop the slot(s) on the publisher, then the origin and the catalog rows on the target.

    Unlike PostgreSQL (behaviour 73), prepared transactions this subscription left on the target are not silently
    orphaned: they hold locks and, once the subid is gone, nobody would ever finish them. So drop refuses while they
    exist, and ``force`` rolls them back. ``force`` also lets drop proceed without the publisher, dropping the local
    state only and printing the slot to drop there by hand.
    """
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    with SubscriptionLock(target, sub, "drop"):
        with target_errors(target):
            pending = catalog.pending_prepared(sub.subid)
        if pending and not force:
            raise SubscriptionError(
                f'subscription "{name}" has {len(pending)} prepared transaction(s) on the target: '
                + ", ".join(gid for gid, _ in pending),
                "finish them as the publisher did (COMMIT PREPARED or ROLLBACK PREPARED on the target), or pass "
                "--force to roll them back (PostgreSQL's DROP SUBSCRIPTION would leave them behind)",
            )
        _drop_publisher_slots(sub, force=force, console=console)
        with target_errors(target):
            if force:
                rollback_prepared(catalog, sub, console)
            _delete_with_patience(catalog, sub)
    console.info(f'dropped subscription "{name}"')


def _drop_publisher_slots(sub: Subscription, *, force: bool, console: Console) -> None:
    slot = sub.subslotname
    try:
        pub = connect_publisher(sub.subconninfo, "drop", sub.subname, doing="drop its slot")
    except SubscriptionError as exc:
        manual = (
            f"SELECT pg_drop_replication_slot('{slot}') on the publisher"
            if slot
            else "nothing (the subscription has no slot)"
        )
        if not force:
            raise SubscriptionError(
                exc.message + "; nothing was dropped",
                f"make the publisher reachable and run this again, or pass --force to drop only the local state "
                f"and then run {manual}; meanwhile the slot keeps WAL on the publisher",
            ) from None
        console.warn(f"{exc.message}\nthe publisher's slot is left behind: drop it by hand with {manual}")
        return
    with pub:
        names = [r[0] for r in _pub_query(
            pub, "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s AND database = current_database()",
            (SYNC_SLOT_PATTERN.format(subid=sub.subid),),
        )]  # fmt: skip
        if slot is not None:
            names.insert(0, slot)
        for name in names:
            if _drop_slot(pub, name):
                console.info(f'dropped replication slot "{name}" on the publisher')
            elif name == slot:
                console.warn(f'replication slot "{name}" did not exist on the publisher')


def _delete_with_patience(catalog: Catalog, sub: Subscription, patience: float = 10.0) -> None:
    """The origin cannot be dropped while a session still has it set up; the backend of a worker that has just
    exited may need a moment to go."""
    deadline = time.monotonic() + patience
    while True:
        try:
            catalog.delete_subscription(sub.subid)
            return
        except sa.exc.OperationalError as exc:
            if not isinstance(_db_error(exc), psycopg.errors.ObjectInUse) or time.monotonic() >= deadline:
                raise
        time.sleep(0.2)


# --- status ------------------------------------------------------------------------------------------------------


def _lsn(value: Any) -> str | None:
    return None if value in (None, 0) else (format_lsn(value) if isinstance(value, int) else str(value))


def _when(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _skip_command(subname: str, finish_lsn: int | None) -> str | None:
    """``applier alter NAME --skip-lsn X/Y`` for a failed remote transaction (None when the error had none)."""
    if not finish_lsn:
        return None
    from applier.apply.retries import skip_command

    return skip_command(subname, finish_lsn)


def _error_lines(e: dict[str, Any]) -> list[str]:
    """The last error for people: what the target said, in which remote transaction, and what can be done."""
    message = e["message"].strip().replace("\n", "\n      ")
    resolved = e.get("resolved")
    lines = [
        f"  last error ({e['at']}{', resolved since: the worker got past it' if resolved else ''}): {message}"
    ]
    if e["sqlstate"]:
        lines.append(f"    SQLSTATE {e['sqlstate']}")
    if e["finish_lsn"]:
        where = f"    in remote transaction {e['remote_xid']}, finished at {e['finish_lsn']}"
        if e["gid"]:
            where += f" (prepared, GID {e['gid']})"
        if e["message_type"]:
            where += f", during {e['message_type']}"
        if e["relation"]:
            where += f" on {e['relation']}"
        lines.append(where)
    elif e["message_type"] or e["relation"]:  # a table sync's error (the copy, or a live sync's catch-up)
        where = f"during {e['message_type']}" if e["message_type"] else ""
        if e["relation"]:
            where = f"{where} on {e['relation']}".strip()
        lines.append(f"    {where}")
    if resolved:
        return lines
    if e["next_retry_at"]:
        lines.append(
            f"    failed {e['retry_count'] or 1} time(s) in a row; next attempt at {e['next_retry_at']}"
        )
    if e["sqlstate"] == "42710" and e["gid"]:  # duplicate_object: PREPARE TRANSACTION of a GID in use
        lines.append(
            f"    HINT: gid_format=original prepares it under the publisher's GID {e['gid']}, which another prepared "
            "transaction on the target already has (pg_prepared_xacts): finish that one (COMMIT or ROLLBACK "
            "PREPARED); the worker retries by itself"
        )
    if e["skip_command"]:
        lines.append(
            f"    to skip that transaction (its changes are lost on this target): {e['skip_command']}"
        )
    return lines


def status(target: str, name: str | None = None, *, publisher_timeout: int = 5) -> list[dict[str, Any]]:
    """Everything ``applier status`` shows, one JSON-ready dict per subscription."""
    catalog = open_catalog(target)
    with target_errors(target):
        subs = [require_subscription(catalog, name)] if name else catalog.list()
        return [_status_of(catalog, sub, publisher_timeout) for sub in subs]


def _status_of(catalog: Catalog, sub: Subscription, publisher_timeout: int) -> dict[str, Any]:
    holder = _holder(catalog, sub.subid)
    origin = origin_progress(catalog, sub)
    error = catalog.last_error(sub.subid)
    tables = catalog.table_states(sub.subid)
    result: dict[str, Any] = {
        "name": sub.subname,
        "subid": sub.subid,
        "enabled": sub.subenabled,
        "two_phase": sub.subtwophasestate.value,  # the document shows the catalog's letters
        "streaming": sub.substream,
        "binary": sub.subbinary,
        "disable_on_error": sub.subdisableonerr,
        "run_as_owner": sub.subrunasowner,
        "origin": sub.suborigin,
        "gid_format": sub.subgidformat,
        "slot_name": sub.subslotname,
        "publications": list(sub.subpublications),
        "publisher": sub.subconninfo,
        "skip_lsn": _lsn(sub.subskiplsn),
        "worker": str(holder) if holder else None,
        "tables": [
            {"name": t.name, "state": t.state.value, "lsn": _lsn(t.lsn), "rows": t.rows, "bytes": t.bytes}
            for t in tables
        ],
        "prepared": [
            {"gid": gid, "prepared_at": _when(at)} for gid, at in catalog.pending_prepared(sub.subid)
        ],
        "last_error": None
        if error is None
        else {
            "at": _when(error["occurred_at"]),
            "message": error["message"],
            "remote_xid": error["remote_xid"],
            "finish_lsn": _lsn(error["finish_lsn"]),
            "message_type": error["message_type"],
            "relation": error["relation"],
            "sqlstate": error["sqlstate"],
            "gid": error["gid"],
            "retry_count": error["retry_count"],
            "next_retry_at": _when(error["next_retry_at"]),
            "skip_command": _skip_command(sub.subname, error["finish_lsn"]),
            "resolved": _resolved(error, origin, tables),
        },
    }
    lag = catalog.lag(sub.subid)
    if lag is not None:
        lag.pop("subid", None)
        lag["updated_at"] = _when(lag["updated_at"])
    result["apply_lag"] = lag
    result["replication"] = _publisher_view(sub, origin, publisher_timeout)
    return result


def _resolved(error: dict[str, Any], origin: int, tables: list[RelState]) -> bool | None:
    """Whether the worker has got past the recorded error since: the failing remote transaction is applied (or
    skipped: the origin is at or past its finish LSN), or the failing table of a table sync is synchronized (``s``
    or ``r``). None when the record says too little to tell (e.g. the publisher refused the replication start).
    Without it, a status read after the worker recovered would still show the old error's next attempt, in the
    past, as if it were still failing."""
    if error["finish_lsn"]:
        return origin >= error["finish_lsn"]
    if error["relation"] and error["message_type"]:
        synced = {t.name for t in tables if t.state in (SyncState.SYNCDONE, SyncState.READY)}
        return error["relation"] in synced
    return None


def _publisher_view(sub: Subscription, origin: int, timeout: int) -> dict[str, Any]:
    """Positions and lag as the publisher sees them: the slot, and the walsender serving our application_name.

    ``received`` is what the worker reported as written (it reports the last received LSN there, behaviour 7),
    ``flushed`` and ``applied`` are its flush and apply positions; ``origin`` is the target's own durable record of
    what it applied. Lag is the publisher's current WAL position minus the applied position.
    """
    view: dict[str, Any] = {"origin_lsn": _lsn(origin), "publisher_reachable": False}
    try:
        conn = psycopg.connect(sub.subconninfo, autocommit=True, connect_timeout=timeout)
    except psycopg.Error as exc:
        view["publisher_error"] = str(exc).strip()
        return view
    with conn:
        slot = conn.execute(
            "SELECT active, active_pid, restart_lsn::text, confirmed_flush_lsn::text, two_phase"
            " FROM pg_replication_slots WHERE slot_name = %s",
            (sub.subslotname,),
        ).fetchone()
        current = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
        stream = None
        if slot is not None and slot[1] is not None:
            stream = conn.execute(
                "SELECT state, write_lsn::text, flush_lsn::text, replay_lsn::text,"
                " (pg_current_wal_lsn() - replay_lsn)::bigint, extract(epoch FROM replay_lag)::float8, reply_time"
                " FROM pg_stat_replication WHERE pid = %s",
                (slot[1],),
            ).fetchone()
    view.update(publisher_reachable=True, publisher_lsn=current, slot_exists=slot is not None)
    if slot is not None:
        view.update(
            slot_active=slot[0], slot_two_phase=slot[4], restart_lsn=slot[2], confirmed_flush_lsn=slot[3]
        )
    if stream is not None and stream[0] is not None:  # NULLs unless the role has pg_read_all_stats
        state, write, flush, replay, lag_bytes, lag_seconds, reply_time = stream
        view.update(stream_state=state, received_lsn=write, flushed_lsn=flush, applied_lsn=replay,
                    last_reply=_when(reply_time), lag_bytes=max(lag_bytes or 0, 0),
                    lag_seconds=lag_seconds if lag_seconds is not None else (0.0 if not lag_bytes else None))  # fmt: skip
    elif origin:
        lag = parse_lsn(current) - origin
        view.update(lag_bytes=max(lag, 0), lag_seconds=None)
    return view


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


_TWO_PHASE_WORDS = {s.value: s.name.lower() for s in TwoPhaseState}
_STATE_WORDS = {s.value: s.name.lower() for s in SyncState}


def _secs(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def format_status(entries: list[dict[str, Any]]) -> str:
    """The human-readable form of :func:`status`."""
    if not entries:
        return "no subscriptions (applier create makes one)"
    blocks = []
    for s in entries:
        r = s["replication"]
        lines = [
            f'subscription "{s["name"]}" (subid {s["subid"]}): {"enabled" if s["enabled"] else "disabled"}, '
            f"two-phase {s['two_phase']} ({_TWO_PHASE_WORDS.get(s['two_phase'], '?')}), streaming {s['streaming']}, "
            f"binary {str(s['binary']).lower()}, origin {s['origin']}, disable_on_error "
            f"{str(s['disable_on_error']).lower()}, run_as_owner {str(s['run_as_owner']).lower()}"
            + (f", skip-LSN {s['skip_lsn']}" if s["skip_lsn"] else ""),
            f"  publisher: {s['publisher']}; publications {', '.join(s['publications'])}; slot {s['slot_name']}",
            f"  worker: {s['worker'] or 'not running'}",
        ]
        if r["publisher_reachable"]:
            positions = ", ".join(
                f"{label} {r.get(key) or '-'}"
                for label, key in (("received", "received_lsn"), ("flushed", "flushed_lsn"),
                                   ("applied", "applied_lsn"), ("origin", "origin_lsn"),
                                   ("publisher", "publisher_lsn"))
            )  # fmt: skip
            lag = "-" if r.get("lag_bytes") is None else f"{r['lag_bytes']} bytes"
            if r.get("lag_seconds") is not None:
                lag += f", {r['lag_seconds']:.1f} s"
            lines.append(f"  LSN: {positions}; lag {lag}")
            if not r["slot_exists"]:
                lines.append(f"  slot {s['slot_name']} does not exist on the publisher")
        else:
            lines.append(
                f"  LSN: origin {r['origin_lsn'] or '-'}; publisher unreachable: {r.get('publisher_error')}"
            )
        if s.get("apply_lag"):
            a = s["apply_lag"]
            lines.append(
                f"  apply lag (publisher commit to local commit): last {_secs(a['last_s'])} ({a['last_kind']}); "
                f"p50 {_secs(a['p50_s'])}, p99 {_secs(a['p99_s'])}, max {_secs(a['max_s'])} over {a['samples']} "
                f"local commits in the {a['window_s']:.0f} s before {a['updated_at']}"
            )
        lines.append(f"  tables ({len(s['tables'])}):")
        for t in s["tables"]:
            lsn = f" at {t['lsn']}" if t["lsn"] else ""
            copied = f", copied {t['rows']} rows / {_size(t['bytes'])}" if t["rows"] or t["bytes"] else ""
            lines.append(f"    {t['state']} ({_STATE_WORDS.get(t['state'], '?')}{lsn}{copied})  {t['name']}")
        if s["prepared"]:
            lines.append("  prepared on the target: " + ", ".join(p["gid"] for p in s["prepared"]))
        if s["last_error"]:
            lines.extend(_error_lines(s["last_error"]))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
