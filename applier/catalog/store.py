"""Access to the subscription catalog (schema ``applier`` in the target, :mod:`applier.catalog.schema`): the rows as
values, and every read and write the command line, the runner, the worker and the table sync make.

**subid** must be unique across the whole target *cluster*, because it is part of every prepared-transaction GID
(``pg_gid_<subid>_<xid>``) and GIDs are cluster-wide. Each subscription owns the replication origin
``applier_<subid>``, and origins are cluster-wide too, so :meth:`Catalog.create_subscription` allocates an id by
creating that origin: a candidate that another database of the cluster already uses fails to create and the next one
is tried. An id with leftover prepared transactions (``pg_gid_<id>_*``, e.g. from a subscription dropped elsewhere)
is never reused.

The worker drives the catalog through a SQLAlchemy connection opened with ``isolation_level="AUTOCOMMIT"`` and
issues ``BEGIN``/``COMMIT``/``PREPARE TRANSACTION`` itself, so catalog statements run inside whatever local
transaction is open — that is what makes them atomic with the applied changes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from applier.catalog.figures import LiveFigures
from applier.catalog.schema import (
    CATALOG_VERSION,
    CONFLICT_LOG_TABLE,
    ERROR_COLUMNS_V2,
    MIGRATION_TABLES,
    MIGRATIONS,
    SCHEMA,
    TRUST_FUNCTIONS,
    apply_error,
    catalog_version,
    metadata,
    prepared_xact,
    subscription,
    subscription_rel,
    tablesync_partition,
)
from applier.catalog.substats import SubscriptionStats
from applier.catalog.trust import UNTRUSTED_TABLES
from applier.errors import ApplierError
from applier.lsn import parse_lsn
from state.tables import SyncState
from state.twophase import TwoPhaseState

__all__ = [
    "CATALOG_VERSION",
    "Catalog",
    "CatalogError",
    "PreparedRecord",
    "RelState",
    "Subscription",
    "origin_name",
]


class CatalogError(ApplierError):
    """The catalog is missing, newer than this release, or inconsistent."""


# --- values ----------------------------------------------------------------------------------------------------
# The catalog stores PostgreSQL's one-letter states ("char"); everything above the catalog sees the enums of
# ``state``. The conversion happens here, once each way: rows become values with enums (``__post_init__``), and
# :func:`_letter` turns an enum back into its letter for a write.


@dataclass(frozen=True)
class Subscription:
    """A row of ``applier.subscription``; ``subtwophasestate`` as a :class:`~state.twophase.TwoPhaseState`."""

    subid: int
    subname: str
    subenabled: bool
    subtwophasestate: TwoPhaseState
    substream: str
    subbinary: bool
    subdisableonerr: bool
    subskiplsn: int | None
    suborigin: str
    subslotname: str | None
    subpublications: list[str]
    subconninfo: str
    subcopydata: bool
    subslotconsistentlsn: int | None
    subgidformat: str = "subscription"  # a catalog of version < 4 has no such column: the default
    subrunasowner: bool = False  # version < 5 has none: table owners not trusted (PostgreSQL 16's default)
    subfailover: bool = False  # version < 9 has none: the slot is not a failover slot
    subddl: bool = False  # version < 13 has none: schema changes are not replayed
    subconflictlog: str = "log"  # version < 14 has none: conflicts go to the log only

    def __post_init__(self) -> None:
        object.__setattr__(self, "subtwophasestate", TwoPhaseState(self.subtwophasestate))

    @property
    def origin_name(self) -> str:
        return origin_name(self.subid)

    @property
    def original_gids(self) -> bool:
        """Prepared transactions keep the publisher's GID on the target (``gid_format=original``)."""
        return self.subgidformat == "original"


@dataclass(frozen=True)
class RelState:
    """A row of ``applier.subscription_rel``; ``state`` as a :class:`~state.tables.SyncState`."""

    subid: int
    relid: int  # the target table's OID
    name: str  # schema-qualified, quoted as needed: what ``regclass`` prints with an empty search_path
    remote_name: str
    state: SyncState
    lsn: int | None
    rows: int
    bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", SyncState(self.state))


@dataclass(frozen=True)
class PreparedRecord:
    gid: str
    subid: int
    remote_xid: int
    prepare_lsn: int
    prepare_end_lsn: int
    prepare_time: int


def origin_name(subid: int) -> str:
    return f"applier_{subid}"


def _letter(value: Any) -> Any:
    """A state enum as the catalog's letter (``"char"``); any other column value as it is."""
    return value.value if isinstance(value, SyncState | TwoPhaseState) else value


# --- access ----------------------------------------------------------------------------------------------------


def make_engine(conninfo: str) -> sa.Engine:
    """An engine over a libpq conninfo string (URI or key=value), as psql accepts it."""
    return sa.create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(conninfo),
        pool_pre_ping=True,
    )


class Catalog(LiveFigures, SubscriptionStats):
    """Reads and writes the catalog. Methods take an optional SQLAlchemy connection so the worker can run them
    inside its own local transaction; without one they run in a short transaction of their own."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    @classmethod
    def connect(cls, conninfo: str) -> Catalog:
        return cls(make_engine(conninfo))

    @contextmanager
    def _conn(self, conn: sa.Connection | None) -> Iterator[sa.Connection]:
        if conn is not None:
            yield conn
        else:
            with self.engine.begin() as c:
                yield c

    # schema ---------------------------------------------------------------------------------------------------
    def exists(self, conn: sa.Connection | None = None) -> bool:
        with self._conn(conn) as c:
            return bool(
                c.execute(sa.text("SELECT to_regclass('applier.catalog_version') IS NOT NULL")).scalar()
            )

    def ensure(self) -> int:
        """Create the catalog on first use, or upgrade an older one in place; return its version.

        Serialised with an advisory lock so two processes starting at once do not both create it.
        """
        with self.engine.begin() as c:
            c.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('applier.catalog'))"))
            # only when missing: CREATE SCHEMA IF NOT EXISTS wants CREATE on the database even when the schema
            # is there, and a least-privileged role is given a schema of its own instead (docs/security.md)
            if not c.execute(sa.text("SELECT to_regnamespace(:s) IS NOT NULL"), {"s": SCHEMA}).scalar():
                c.execute(sa.text(f"CREATE SCHEMA {SCHEMA}"))
            if not self.exists(c):
                metadata.create_all(c)
                # the trust check's functions (applier.catalog.trust) and the migration's tables, plain DDL
                for stmt in [*TRUST_FUNCTIONS, *MIGRATION_TABLES, *CONFLICT_LOG_TABLE]:
                    c.execute(sa.text(stmt))
                c.execute(catalog_version.insert().values(version=CATALOG_VERSION))
                return CATALOG_VERSION
            version = c.execute(sa.select(sa.func.max(catalog_version.c.version))).scalar() or 0
            if version > CATALOG_VERSION:
                raise CatalogError(
                    f"the catalog in schema {SCHEMA} has version {version}, newer than this release understands "
                    f"({CATALOG_VERSION}): upgrade applier"
                )
            for v in range(version + 1, CATALOG_VERSION + 1):
                for stmt in MIGRATIONS.get(v, []):
                    c.execute(sa.text(stmt))
                c.execute(catalog_version.insert().values(version=v))
            return CATALOG_VERSION

    def untrusted_code(self, relids: Sequence[int]) -> list[tuple[str, str, str, str, str]]:
        """(table, kind, object, owner, why) of the code the trust check would refuse on these tables
        (applier.catalog.trust.UNTRUSTED_TABLES), for ``create`` to warn of before a change is refused."""
        with self.engine.connect() as c:
            rows = c.execute(sa.text(UNTRUSTED_TABLES), {"relids": list(relids)}).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]

    # subscriptions -----------------------------------------------------------------------------------------
    def create_subscription(self, *, subname: str, conninfo: str, publications: Sequence[str], two_phase_state: TwoPhaseState,
                            streaming: str, binary: bool, disable_on_error: bool, origin: str, slot_name: str | None,
                            enabled: bool, copy_data: bool, gid_format: str = "subscription",
                            run_as_owner: bool = False, failover: bool = False, ddl: bool = False,
                            conflict_log: str = "log") -> Subscription:  # fmt: skip
        """Insert the subscription row with a cluster-wide unique subid and create its replication origin."""
        with self.engine.begin() as c:
            c.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('applier.subid'))"))
            if c.execute(sa.select(subscription.c.subid).where(subscription.c.subname == subname)).first():
                raise CatalogError(f'subscription "{subname}" already exists')
            candidate = (c.execute(sa.select(sa.func.max(subscription.c.subid))).scalar() or 0) + 1
            while True:
                used = c.execute(
                    sa.text(
                        "SELECT EXISTS (SELECT 1 FROM pg_replication_origin WHERE roname = :o)"
                        " OR EXISTS (SELECT 1 FROM pg_prepared_xacts WHERE gid LIKE :g)"
                    ),
                    {"o": origin_name(candidate), "g": f"pg\\_gid\\_{candidate}\\_%"},
                ).scalar()
                if not used:
                    break
                candidate += 1
            c.execute(
                subscription.insert().values(
                    subid=candidate, subname=subname, subenabled=enabled, subtwophasestate=TwoPhaseState(two_phase_state).value,
                    substream=streaming, subbinary=binary, subdisableonerr=disable_on_error, subskiplsn=None,
                    suborigin=origin, subslotname=slot_name, subpublications=list(publications),
                    subconninfo=conninfo, subcopydata=copy_data, subgidformat=gid_format, subrunasowner=run_as_owner,
                    subfailover=failover, subddl=ddl, subconflictlog=conflict_log,
                )
            )  # fmt: skip
            # Creating the origin claims the id cluster-wide; a concurrent creator in another database fails here
            # with a unique violation and its transaction (and row) roll back.
            c.execute(sa.text("SELECT pg_replication_origin_create(:o)"), {"o": origin_name(candidate)})
            return self._get(c, subscription.c.subid == candidate)  # type: ignore[return-value]

    def _subscription_columns(self, c: sa.Connection) -> list[sa.Column[Any]]:
        """The subscription table's columns this catalog has: one of version < 4 (not upgraded yet: ``run`` and
        ``create`` upgrade it) has no ``subgidformat``, which then reads as its default."""
        version = c.execute(sa.select(sa.func.max(catalog_version.c.version))).scalar() or 0
        since = {"subgidformat": 4, "subrunasowner": 5, "subfailover": 9, "subddl": 13, "subconflictlog": 14}
        return [col for col in subscription.c if version >= since.get(col.name, 0)]

    def _get(self, c: sa.Connection, where: Any) -> Subscription | None:
        row = c.execute(sa.select(*self._subscription_columns(c)).where(where)).mappings().first()
        if row is None:
            return None
        fields = Subscription.__dataclass_fields__
        return Subscription(**{k: v for k, v in row.items() if k in fields})

    def get(self, name: str, conn: sa.Connection | None = None) -> Subscription | None:
        with self._conn(conn) as c:
            return self._get(c, subscription.c.subname == name)

    def get_by_id(self, subid: int, conn: sa.Connection | None = None) -> Subscription | None:
        with self._conn(conn) as c:
            return self._get(c, subscription.c.subid == subid)

    def require(self, name: str, conn: sa.Connection | None = None) -> Subscription:
        sub = self.get(name, conn)
        if sub is None:
            raise CatalogError(f'subscription "{name}" does not exist (see: applier status)')
        return sub

    def list(self, conn: sa.Connection | None = None) -> list[Subscription]:
        with self._conn(conn) as c:
            if not self.exists(c):
                return []
            rows = (
                c.execute(sa.select(*self._subscription_columns(c)).order_by(subscription.c.subname))
                .mappings()
                .all()
            )
            fields = Subscription.__dataclass_fields__
            return [Subscription(**{k: v for k, v in r.items() if k in fields}) for r in rows]

    def update_subscription(self, subid: int, conn: sa.Connection | None = None, **values: Any) -> None:
        """Set catalog columns by name, e.g. ``update_subscription(7, subenabled=False)``."""
        unknown = set(values) - set(subscription.c.keys())
        if unknown:
            raise CatalogError(f"unknown subscription column(s): {', '.join(sorted(unknown))}")
        with self._conn(conn) as c:
            c.execute(
                subscription.update()
                .where(subscription.c.subid == subid)
                .values(**{k: _letter(v) for k, v in values.items()})
            )

    def clear_skip_lsn(self, subid: int, expected: int, conn: sa.Connection | None = None) -> bool:
        """Clear subskiplsn only if it still holds ``expected`` (behaviour 100: the user may have changed it)."""
        with self._conn(conn) as c:
            res = c.execute(
                subscription.update()
                .where(subscription.c.subid == subid, subscription.c.subskiplsn == expected)
                .values(subskiplsn=None)
            )
            return res.rowcount > 0

    def delete_subscription(self, subid: int, conn: sa.Connection | None = None) -> None:
        """Remove the rows and the origin (the caller drops the publisher's slot)."""
        with self._conn(conn) as c:
            c.execute(subscription.delete().where(subscription.c.subid == subid))
            c.execute(
                sa.text(
                    "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin"
                    " WHERE roname IN (:o, :sync)"
                ),
                # and the live table sync's catch-up origin, which a killed worker can leave (tablesync.live)
                {"o": origin_name(subid), "sync": f"{origin_name(subid)}_sync"},
            )

    # tables -------------------------------------------------------------------------------------------------
    def table_states(self, subid: int, conn: sa.Connection | None = None) -> list[RelState]:
        with self._conn(conn) as c:
            rows = c.execute(
                sa.text(
                    "SELECT r.subid, r.srrelid::oid AS relid,"
                    " quote_ident(n.nspname) || '.' || quote_ident(cl.relname) AS name,"
                    " r.srremotename, r.srsubstate, r.srsublsn::text AS lsn, r.srrows, r.srbytes"
                    " FROM applier.subscription_rel r JOIN pg_class cl ON cl.oid = r.srrelid"
                    " JOIN pg_namespace n ON n.oid = cl.relnamespace WHERE r.subid = :s ORDER BY 3"
                ),
                {"s": subid},
            ).all()
            return [
                RelState(r.subid, r.relid, r.name, r.srremotename, r.srsubstate,
                         None if r.lsn is None else parse_lsn(r.lsn), r.srrows, r.srbytes)
                for r in rows
            ]  # fmt: skip

    def add_table(self, subid: int, relid: int, remote_name: str, state: SyncState, lsn: int | None = None,
                  conn: sa.Connection | None = None) -> None:  # fmt: skip
        with self._conn(conn) as c:
            c.execute(
                pg.insert(subscription_rel)
                .values(
                    subid=subid,
                    srrelid=str(relid),
                    srremotename=remote_name,
                    srsubstate=SyncState(state).value,
                    srsublsn=lsn,
                )
                .on_conflict_do_nothing()
            )

    def set_table_state(self, subid: int, relid: int, state: SyncState, lsn: int | None,
                        conn: sa.Connection | None = None) -> None:  # fmt: skip
        with self._conn(conn) as c:
            c.execute(
                subscription_rel.update()
                .where(subscription_rel.c.subid == subid, subscription_rel.c.srrelid == str(relid))
                .values(srsubstate=SyncState(state).value, srsublsn=lsn, srupdated=sa.func.now())
            )

    def set_table_progress(self, subid: int, relid: int, rows: int, nbytes: int,
                           conn: sa.Connection | None = None) -> None:  # fmt: skip
        with self._conn(conn) as c:
            c.execute(
                subscription_rel.update()
                .where(subscription_rel.c.subid == subid, subscription_rel.c.srrelid == str(relid))
                .values(srrows=rows, srbytes=nbytes, srupdated=sa.func.now())
            )

    def remove_table(self, subid: int, relid: int, conn: sa.Connection | None = None) -> None:
        with self._conn(conn) as c:
            c.execute(
                subscription_rel.delete().where(
                    subscription_rel.c.subid == subid, subscription_rel.c.srrelid == str(relid)
                )
            )

    # prepared transactions -------------------------------------------------------------------------------------
    def record_prepared(self, rec: PreparedRecord, conn: sa.Connection | None = None) -> None:
        """Store (gid, prepare_end_lsn, prepare_time); replaces a stale record of the same GID."""
        with self._conn(conn) as c:
            stmt = pg.insert(prepared_xact).values(
                gid=rec.gid, subid=rec.subid, remote_xid=rec.remote_xid, prepare_lsn=rec.prepare_lsn,
                prepare_end_lsn=rec.prepare_end_lsn, prepare_time=rec.prepare_time,
            )  # fmt: skip
            c.execute(
                stmt.on_conflict_do_update(index_elements=[prepared_xact.c.gid], set_=dict(stmt.excluded))
            )

    def prepared_record(self, gid: str, conn: sa.Connection | None = None) -> PreparedRecord | None:
        with self._conn(conn) as c:
            row = c.execute(sa.select(prepared_xact).where(prepared_xact.c.gid == gid)).mappings().first()
            if row is None:
                return None
            return PreparedRecord(row["gid"], row["subid"], row["remote_xid"], row["prepare_lsn"],
                                  row["prepare_end_lsn"], row["prepare_time"])  # fmt: skip

    def forget_prepared(self, gid: str, conn: sa.Connection | None = None) -> None:
        with self._conn(conn) as c:
            c.execute(prepared_xact.delete().where(prepared_xact.c.gid == gid))

    def pending_prepared(
        self, subid: int, conn: sa.Connection | None = None
    ) -> list[tuple[str, dt.datetime]]:
        """GIDs of this subscription's transactions prepared on the target (from ``pg_prepared_xacts``): those
        named ``pg_gid_<subid>_*``, and those its ``prepared_xact`` records name (``gid_format=original`` keeps the
        publisher's GIDs, which only the record ties to the subscription)."""
        with self._conn(conn) as c:
            rows = c.execute(
                sa.text(
                    "SELECT gid, prepared FROM pg_prepared_xacts WHERE gid LIKE :g"
                    " OR gid IN (SELECT gid FROM applier.prepared_xact WHERE subid = :s) ORDER BY prepared"
                ),
                {"g": f"pg\\_gid\\_{subid}\\_%", "s": subid},
            ).all()
            return [(r.gid, r.prepared) for r in rows]

    def reconcile_prepared(self, subid: int, conn: sa.Connection | None = None) -> int:
        """Drop records whose prepared transaction no longer exists (finished while we were down); return count."""
        with self._conn(conn) as c:
            res = c.execute(
                sa.text(
                    "DELETE FROM applier.prepared_xact p WHERE p.subid = :s"
                    " AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts x WHERE x.gid = p.gid)"
                ),
                {"s": subid},
            )
            return res.rowcount

    # initial copy markers (tablesync.initial; the Spark tasks use applier.catalog.sql) --------------------------
    def delete_partition_markers(self, subid: int, relname: str, conn: sa.Connection) -> None:
        """Forget every copy generation's markers of ``relname`` (waits for a task that still holds its claim)."""
        m = tablesync_partition.c
        conn.execute(tablesync_partition.delete().where(m.subid == subid, m.relname == relname))

    def has_partition_markers(self, subid: int, relname: str, conn: sa.Connection) -> bool:
        """Whether an earlier attempt committed partitions of ``relname`` (each commits with its marker row)."""
        m = tablesync_partition.c
        found = sa.select(sa.literal(1)).where(m.subid == subid, m.relname == relname, m.part >= 0)
        return bool(conn.execute(sa.select(found.exists())).scalar())

    def claim_partitions(self, subid: int, relname: str, snapshot: str, claim_part: int,
                         conn: sa.Connection) -> None:  # fmt: skip
        """Insert the claim row (part ``claim_part``) of copy generation ``snapshot`` for ``relname``."""
        conn.execute(
            tablesync_partition.insert().values(
                subid=subid, relname=relname, snapshot=snapshot, part=claim_part, rows=0, bytes=0
            )
        )

    def partition_markers(self, subid: int, snapshot: str,
                          conn: sa.Connection | None = None) -> dict[str, dict[int, tuple[int, int]]]:  # fmt: skip
        """Copy generation ``snapshot``'s committed partitions: ``{relname: {part: (rows, bytes)}}``."""
        m = tablesync_partition.c
        out: dict[str, dict[int, tuple[int, int]]] = {}
        with self._conn(conn) as c:
            query = sa.select(m.relname, m.part, m.rows, m.bytes).where(
                m.subid == subid, m.snapshot == snapshot, m.part >= 0
            )
            for relname, part, rows, nbytes in c.execute(query):
                out.setdefault(relname, {})[part] = (rows, nbytes)
        return out

    # errors ----------------------------------------------------------------------------------------------------
    def record_error(self, subid: int, message: str, *, remote_xid: int | None = None, finish_lsn: int | None = None,
                     message_type: str | None = None, relation: str | None = None, sqlstate: str | None = None,
                     gid: str | None = None, retry_count: int | None = None,
                     retry_in: float | None = None) -> None:  # fmt: skip
        """Always in its own transaction: the failed local transaction is rolled back, the record must survive.
        ``retry_in``: seconds until the worker tries again (None: it will not, e.g. the subscription was disabled)."""
        next_retry = (
            None if retry_in is None else sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, retry_in)
        )
        with self.engine.begin() as c:
            c.execute(
                apply_error.insert().values(subid=subid, message=message, remote_xid=remote_xid,
                                            finish_lsn=finish_lsn, message_type=message_type, relation=relation,
                                            sqlstate=sqlstate, gid=gid, retry_count=retry_count,
                                            next_retry_at=next_retry)
            )  # fmt: skip
            c.execute(
                sa.text(
                    "DELETE FROM applier.apply_error WHERE subid = :s AND id NOT IN"
                    " (SELECT id FROM applier.apply_error WHERE subid = :s ORDER BY id DESC LIMIT 100)"
                ),
                {"s": subid},
            )

    # apply lag -------------------------------------------------------------------------------------------------
    def last_error(self, subid: int, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        """The newest error record of ``subid``. A catalog of version 1 (not upgraded yet: ``applier run`` and
        ``create`` upgrade it) has no sqlstate/gid/retry columns: they read as None."""
        with self._conn(conn) as c:
            version = c.execute(sa.select(sa.func.max(catalog_version.c.version))).scalar() or 0
            columns = [col for col in apply_error.c if version >= 2 or col.name not in ERROR_COLUMNS_V2]
            row = (
                c.execute(
                    sa.select(*columns).where(apply_error.c.subid == subid).order_by(apply_error.c.id.desc())
                )
                .mappings()
                .first()
            )
            if not row:
                return None
            return {name: None for name in ERROR_COLUMNS_V2} | dict(row)
