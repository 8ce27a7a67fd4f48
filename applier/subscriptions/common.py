"""What every verb shares: the errors and the console, the target's catalog and the connection to the
publisher, and the checks that both ``create`` and ``alter`` make (a slot name, the target's copy of a table).

Underscore names here are private to the package: its modules share them, callers outside do not."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from applier import slots
from applier.catalog.store import Catalog, CatalogError, Subscription
from applier.conninfo import ConninfoError, connection_failure, has_password, parse, scrub
from applier.errors import ApplierError
from applier.lsn import parse_lsn
from applier.replication import (
    FAILOVER_VERSION,
    ORIGIN_VERSION,
    STREAMING_VERSION,
    TWO_PHASE_VERSION,
    ReplicationConnection,
    ReplicationConnectionError,
)

#: First key of the two-key advisory lock ``(LOCK_NAMESPACE, subid)`` that marks a subscription as in use ("appl").
LOCK_NAMESPACE = 0x6170706C
#: First key of the shared advisory lock ``(STANDBY_NAMESPACE, subid)`` that a waiting ``run --standby`` holds, so
#: that ``status`` can show it ("stby"). Shared: any number of standbys may wait; nothing else ever takes it.
STANDBY_NAMESPACE = 0x73746279

#: Slots of the initial copy are named ``applier_<subid>_sync...``; ``drop`` removes leftovers.
SYNC_SLOT_PATTERN = "applier\\_{subid}\\_sync%"

#: The oldest publisher applier subscribes to (and is tested against: issue 31); older ones are refused.
MIN_PUBLISHER_VERSION = STREAMING_VERSION
#: failover slots with two-phase from PostgreSQL 18 on (17 does not synchronize a slot's ``two_phase_at``, and
#: refuses the pair, as we do).
FAILOVER_TWO_PHASE_PUBLISHER_VERSION = 180000
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


def _db_error(exc: BaseException) -> BaseException:
    """The psycopg error inside a SQLAlchemy one."""
    return getattr(exc, "orig", None) or exc


def _is_connection_failure(exc: BaseException) -> bool:
    """libpq's own failures carry no SQLSTATE; the server's connection errors are class 08 (57P0x: shutting down)."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))


_TARGET_HINT = (
    "pass --target CONNINFO, or set PGHOST, PGPORT, PGDATABASE, PGUSER (and PGPASSWORD or ~/.pgpass) "
    "as for psql"
)
_TARGET_CONNINFO_HINT = (
    "fix --target: a libpq conninfo such as 'host=h port=5432 dbname=d user=u' or a URI postgresql://u@h:5432/d; "
    "without --target, the PG* environment is used, as by psql"
)
_PUBLISHER_HINT = (
    "check the publisher connection string (host, port, dbname, user); the role needs the REPLICATION "
    "attribute (or superuser) and pg_hba.conf must let it connect; a password comes from ~/.pgpass, "
    "PGPASSFILE or PGPASSWORD, because applier does not store it"
)
_PUBLISHER_CONNINFO_HINT = (
    "fix the publisher connection string: a libpq conninfo such as 'host=h port=5432 dbname=d user=u' or a URI "
    "postgresql://u@h:5432/d"
)


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
        message, invalid = connection_failure("target", target, _db_error(exc))
        raise SubscriptionError(message, _TARGET_CONNINFO_HINT if invalid else _TARGET_HINT) from None
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
    try:  # a string libpq cannot even parse fails here, not as "the target failed" at the first query
        parse(target, "target")
    except ConninfoError as exc:
        raise SubscriptionError(str(exc), _TARGET_CONNINFO_HINT) from None
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
            "check --target (applier status lists a target's subscriptions); applier create makes the first one",
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


def connect_publisher(conninfo: str, command: str, subname: str, *, doing: str) -> ReplicationConnection:
    """A replication connection to the publisher (it also answers SQL); ``doing`` says in the error what could not
    be done without it. Its application_name is ``applier <command> <subname>``, not the subscription's own name,
    which belongs to the worker's stream (pg_stat_replication and synchronous_standby_names match on it)."""
    try:
        parse(conninfo, "publisher")
    except ConninfoError as exc:
        raise SubscriptionError(str(exc), _PUBLISHER_CONNINFO_HINT) from None
    try:
        return ReplicationConnection.open(conninfo, application_name=f"applier {command} {subname}"[:63])
    except ReplicationConnectionError as exc:
        raise _publisher_failure(conninfo, exc, doing) from None


def _publisher_failure(conninfo: str, exc: ReplicationConnectionError, doing: str) -> SubscriptionError:
    """Whether the publisher's connection string is wrong or the publisher could not be reached, from libpq's
    own reason (the psycopg error the replication connection raised from, when there is one)."""
    cause = exc.__context__
    if not isinstance(cause, psycopg.Error):
        return SubscriptionError(f"{exc} (needed to {doing})", _PUBLISHER_HINT)
    message, invalid = connection_failure("publisher", conninfo, cause)
    return SubscriptionError(
        f"{message} (needed to {doing})", _PUBLISHER_CONNINFO_HINT if invalid else _PUBLISHER_HINT
    )


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


def missing_publications(pub: ReplicationConnection, publications: Sequence[str]) -> list[str]:
    """Those of ``publications`` that the publisher's database does not have, in their order."""
    query = "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)"
    found = {r[0] for r in _pub_query(pub, query, (list(publications),))}
    return [p for p in publications if p not in found]


def slot_mismatch(row: tuple[Any, ...], dbname: str) -> str | None:
    """Why a slot (a :func:`_slot_row`) cannot serve a subscription of database ``dbname``, or None."""
    if (row[2], row[3]) == (dbname, "pgoutput"):
        return None
    return f"a {row[3] or 'physical'} slot of database {row[2] or '(none)'}, not a pgoutput slot of {dbname}"


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


def _check_slot_name(slot: str, *, default: bool) -> None:
    if not _SLOT_NAME.match(slot):
        raise SubscriptionError(
            f'replication slot name "{slot}" is not valid: slot names are 1-63 characters of lower case letters, '
            "digits and the underscore",
            "choose one with --slot-name" if default else "choose another slot name",
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


def check_publisher_version(
    version: int, *, two_phase: bool = False, origin: str = "any", failover: bool = False
) -> None:
    """Refuse a publisher too old for applier, or for an option it cannot honour. PostgreSQL's subscriber accepts
    both options there and quietly does without (it asks a 14 publisher for no two-phase decoding, a 15 one for no
    origin filter); we refuse, because a user who asked for them relies on them (docs/reference.md)."""
    major = version // 10000
    if version < MIN_PUBLISHER_VERSION:
        raise SubscriptionError(
            f"the publisher runs PostgreSQL {major}, applier needs 14 or later",
            "upgrade the publisher (applier is tested against publishers 14 to 18)",
        )
    if two_phase and version < TWO_PHASE_VERSION:
        raise SubscriptionError(
            f"two-phase needs a publisher of PostgreSQL 15 or later, and this one runs {major}: its pgoutput "
            "cannot decode prepared transactions",
            "leave two-phase off: a transaction prepared on the publisher then arrives as an ordinary one when "
            "COMMIT PREPARED runs there (one that is rolled back never arrives)",
        )
    if origin == "none" and version < ORIGIN_VERSION:
        raise SubscriptionError(
            f"origin = none needs a publisher of PostgreSQL 16 or later, and this one runs {major}: its pgoutput "
            "cannot leave out changes that came from elsewhere",
            "use origin = any (the default), or upgrade the publisher",
        )
    if failover and version < FAILOVER_VERSION:
        raise SubscriptionError(
            f"failover needs a publisher of PostgreSQL 17 or later, and this one runs {major}: its slots cannot be "
            "synchronized to a standby",
            "leave failover off (after a failover of the publisher the subscription then starts again with a new "
            "slot and a full copy), or upgrade the publisher",
        )
    if failover and two_phase and version < FAILOVER_TWO_PHASE_PUBLISHER_VERSION:
        raise SubscriptionError(
            f"failover and two-phase together need a publisher of PostgreSQL 18 or later, and this one runs {major}: "
            "a standby of 17 does not synchronize when the slot began decoding prepared transactions",
            "choose one of the two, or upgrade the publisher",
        )


def set_slot_failover(pub: ReplicationConnection, slot: str, failover: bool, console: Console) -> None:
    """``ALTER_REPLICATION_SLOT slot (FAILOVER ...)`` (PostgreSQL 17+, checked by the caller): whether standbys with
    ``sync_replication_slots`` keep a copy of the slot. Fails while a walsender uses the slot."""
    try:
        pub.connection.execute(
            sql.SQL("ALTER_REPLICATION_SLOT {} ( FAILOVER {} )").format(  # type: ignore[arg-type]
                sql.Identifier(slot), sql.SQL("true" if failover else "false")
            )
        )
    except psycopg.Error as exc:
        raise SubscriptionError(
            f'could not turn failover {"on" if failover else "off"} on slot "{slot}" on the publisher: '
            f"{str(exc).strip()}",
            "stop the subscription's worker first (applier alter NAME --disable)",
        ) from None
    console.info(f'failover turned {"on" if failover else "off"} on slot "{slot}" on the publisher')


def warn_password_not_stored(conninfo: str, console: Console) -> None:
    """A password given in a publisher conninfo is used for the command, never stored: say where ``run`` finds it."""
    if has_password(conninfo):
        console.warn(
            "the publisher's password is not stored: applier run takes it from ~/.pgpass, PGPASSFILE or "
            "PGPASSWORD, as psql does"
        )
