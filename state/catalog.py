"""The subscription catalog: SQLAlchemy Core tables in schema ``applier`` of the target database.

Column names follow PostgreSQL's ``pg_subscription`` / ``pg_subscription_rel`` (fixed by DESIGN.md: other tools read
them). Everything else here is ours: the record of each prepared transaction (``LookupGXact``'s data, which
``pg_prepared_xacts`` does not show), error records, per-partition copy markers and the catalog version.

Why the catalog lives in the target: the apply worker must change it atomically with the data it applies (a table
turning ready, a skip-LSN cleared in the skipped transaction's commit), which only a table in the same database allows.

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
from sqlalchemy.types import TypeDecorator, UserDefinedType

from applier.errors import ApplierError
from applier.lsn import format_lsn, parse_lsn
from state.twophase import gid_for as gid_for  # pure; re-exported for the catalog's callers

SCHEMA = "applier"
#: Bump with a migration in :data:`_MIGRATIONS` whenever a table or column changes.
CATALOG_VERSION = 4


class CatalogError(ApplierError):
    """The catalog is missing, newer than this release, or inconsistent."""


# --- PostgreSQL types SQLAlchemy does not know -----------------------------------------------------------------


class _PgType(UserDefinedType[Any]):
    cache_ok = True
    render_bind_cast = True
    _spec = ""

    def get_col_spec(self, **kw: Any) -> str:
        return self._spec


class _PgLsnType(_PgType):
    cache_ok = True  # SQLAlchemy reads it from each class's own namespace
    _spec = "pg_lsn"


class PgLsn(TypeDecorator[int]):
    """``pg_lsn`` in the database, ``int`` in Python (as on the wire)."""

    impl = _PgLsnType
    cache_ok = True

    def process_bind_param(self, value: int | None, dialect: Any) -> str | None:
        return None if value is None else format_lsn(value)

    def process_result_value(self, value: Any, dialect: Any) -> int | None:
        return None if value is None else parse_lsn(str(value))


class PgChar(_PgType):
    """PostgreSQL's one-byte ``"char"``, the type of pg_subscription's state columns."""

    cache_ok = True
    _spec = '"char"'


class RegClass(_PgType):
    cache_ok = True
    _spec = "regclass"


metadata = sa.MetaData(schema=SCHEMA)

catalog_version = sa.Table(
    "catalog_version",
    metadata,
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("upgraded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

subscription = sa.Table(
    "subscription",
    metadata,
    sa.Column("subid", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("subname", sa.Text, nullable=False, unique=True),
    sa.Column("subenabled", sa.Boolean, nullable=False),
    sa.Column("subtwophasestate", PgChar, nullable=False),
    sa.Column("substream", sa.Text, nullable=False),
    sa.Column("subbinary", sa.Boolean, nullable=False),
    sa.Column("subdisableonerr", sa.Boolean, nullable=False),
    sa.Column("subskiplsn", PgLsn, nullable=True),
    sa.Column("suborigin", sa.Text, nullable=False),
    sa.Column("subslotname", sa.Text, nullable=True),
    sa.Column("subpublications", pg.ARRAY(sa.Text), nullable=False),
    sa.Column("subconninfo", sa.Text, nullable=False),
    # ours
    sa.Column("subcopydata", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("subslotconsistentlsn", PgLsn, nullable=True),  # X: where the slot's stream starts
    sa.Column("subcreated", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    # since catalog version 4: how local prepared transactions are named (state.twophase.GID_FORMATS)
    sa.Column("subgidformat", sa.Text, nullable=False, server_default="subscription"),
)

subscription_rel = sa.Table(
    "subscription_rel",
    metadata,
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("srrelid", RegClass, primary_key=True),
    sa.Column("srsubstate", PgChar, nullable=False),
    sa.Column("srsublsn", PgLsn, nullable=True),
    # ours: the publisher's schema-qualified name (the target table has the same name) and copy progress
    sa.Column("srremotename", sa.Text, nullable=False),
    sa.Column("srrows", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("srbytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("srupdated", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

#: One row per transaction prepared on the target by a subscription: what ``LookupGXact`` compares (behaviour 65).
#: Written and committed from a second session just before ``PREPARE TRANSACTION`` (rows written inside the
#: prepared transaction would stay invisible until it commits), removed after COMMIT/ROLLBACK PREPARED, and
#: reconciled against ``pg_prepared_xacts`` at start-up.
prepared_xact = sa.Table(
    "prepared_xact",
    metadata,
    sa.Column("gid", sa.Text, primary_key=True),
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), nullable=False
    ),
    sa.Column("remote_xid", sa.BigInteger, nullable=False),
    sa.Column("prepare_lsn", PgLsn, nullable=False),
    sa.Column("prepare_end_lsn", PgLsn, nullable=False),
    sa.Column("prepare_time", sa.BigInteger, nullable=False),  # wire µs since 2000-01-01: compared exactly
    sa.Column("recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

#: Errors the worker met, newest last; ``status`` shows the latest one per subscription.
apply_error = sa.Table(
    "apply_error",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), nullable=False
    ),
    sa.Column("occurred_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column("remote_xid", sa.BigInteger, nullable=True),
    sa.Column("finish_lsn", PgLsn, nullable=True),
    sa.Column("message_type", sa.Text, nullable=True),
    sa.Column("relation", sa.Text, nullable=True),
    sa.Column("message", sa.Text, nullable=False),
    # since catalog version 2: what a user needs to act on a failing remote transaction without reading our code
    sa.Column("sqlstate", sa.Text, nullable=True),  # the target's SQLSTATE, when the target raised it
    sa.Column("gid", sa.Text, nullable=True),  # the publisher's GID of a prepared transaction
    sa.Column("retry_count", sa.Integer, nullable=True),  # failures in a row of this same remote transaction
    sa.Column(
        "next_retry_at", sa.DateTime(timezone=True), nullable=True
    ),  # None: no retry (disabled, stopped)
)

#: Exactly-once markers of the Spark initial copy: a partition's rows and its row here commit in one transaction.
tablesync_partition = sa.Table(
    "tablesync_partition",
    metadata,
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("relname", sa.Text, primary_key=True),
    sa.Column("snapshot", sa.Text, primary_key=True),  # the exported snapshot (copy generation) it belongs to
    sa.Column("part", sa.Integer, primary_key=True),
    sa.Column("rows", sa.BigInteger, nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("done_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

#: apply_error's columns added by catalog version 2
_ERROR_COLUMNS_V2 = ("sqlstate", "gid", "retry_count", "next_retry_at")

#: The apply lag the worker measured recently (applier.apply.lag), one row per subscription, rewritten about every
#: two seconds while transactions are applied; read by ``status``. UNLOGGED: a live figure, not worth WAL or fsyncs
#: (after a crash the table is empty until the worker applies again).
apply_lag = sa.Table(
    "apply_lag",
    metadata,
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column("last_s", sa.Float, nullable=False),
    sa.Column("last_kind", sa.Text, nullable=False),
    sa.Column("p50_s", sa.Float, nullable=False),
    sa.Column("p99_s", sa.Float, nullable=False),
    sa.Column("max_s", sa.Float, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("window_s", sa.Float, nullable=False),
    prefixes=["UNLOGGED"],
)

# Migrations: version -> list of SQL statements that take the catalog from version-1 to version.
_MIGRATIONS: dict[int, list[str]] = {
    2: [
        f"ALTER TABLE {SCHEMA}.apply_error ADD COLUMN IF NOT EXISTS sqlstate text,"
        " ADD COLUMN IF NOT EXISTS gid text, ADD COLUMN IF NOT EXISTS retry_count integer,"
        " ADD COLUMN IF NOT EXISTS next_retry_at timestamptz",
    ],
    3: [
        "CREATE UNLOGGED TABLE IF NOT EXISTS applier.apply_lag (subid bigint PRIMARY KEY REFERENCES applier.subscription (subid)"
        " ON DELETE CASCADE, updated_at timestamptz NOT NULL DEFAULT now(), last_s float8 NOT NULL, last_kind text"
        " NOT NULL, p50_s float8 NOT NULL, p99_s float8 NOT NULL, max_s float8 NOT NULL, samples integer NOT NULL,"
        " window_s float8 NOT NULL)"
    ],
    4: [
        f"ALTER TABLE {SCHEMA}.subscription ADD COLUMN IF NOT EXISTS subgidformat text NOT NULL DEFAULT 'subscription'"
    ],
}


# --- values ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subscription:
    subid: int
    subname: str
    subenabled: bool
    subtwophasestate: str
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

    @property
    def origin_name(self) -> str:
        return origin_name(self.subid)

    @property
    def original_gids(self) -> bool:
        """Prepared transactions keep the publisher's GID on the target (``gid_format=original``)."""
        return self.subgidformat == "original"


@dataclass(frozen=True)
class RelState:
    subid: int
    relid: int  # the target table's OID
    name: str  # schema-qualified, quoted as needed: what ``regclass`` prints with an empty search_path
    remote_name: str
    state: str
    lsn: int | None
    rows: int
    bytes: int


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


# --- access ----------------------------------------------------------------------------------------------------


def make_engine(conninfo: str) -> sa.Engine:
    """An engine over a libpq conninfo string (URI or key=value), as psql accepts it."""
    return sa.create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(conninfo),
        pool_pre_ping=True,
    )


class Catalog:
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
            c.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            if not self.exists(c):
                metadata.create_all(c)
                c.execute(catalog_version.insert().values(version=CATALOG_VERSION))
                return CATALOG_VERSION
            version = c.execute(sa.select(sa.func.max(catalog_version.c.version))).scalar() or 0
            if version > CATALOG_VERSION:
                raise CatalogError(
                    f"the catalog in schema {SCHEMA} has version {version}, newer than this release understands "
                    f"({CATALOG_VERSION}): upgrade applier"
                )
            for v in range(version + 1, CATALOG_VERSION + 1):
                for stmt in _MIGRATIONS.get(v, []):
                    c.execute(sa.text(stmt))
                c.execute(catalog_version.insert().values(version=v))
            return CATALOG_VERSION

    # subscriptions -----------------------------------------------------------------------------------------
    def create_subscription(self, *, subname: str, conninfo: str, publications: Sequence[str], two_phase_state: str,
                            streaming: str, binary: bool, disable_on_error: bool, origin: str, slot_name: str | None,
                            enabled: bool, copy_data: bool, gid_format: str = "subscription") -> Subscription:  # fmt: skip
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
                    subid=candidate, subname=subname, subenabled=enabled, subtwophasestate=two_phase_state,
                    substream=streaming, subbinary=binary, subdisableonerr=disable_on_error, subskiplsn=None,
                    suborigin=origin, subslotname=slot_name, subpublications=list(publications),
                    subconninfo=conninfo, subcopydata=copy_data, subgidformat=gid_format,
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
        return [col for col in subscription.c if version >= 4 or col.name != "subgidformat"]

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
            c.execute(subscription.update().where(subscription.c.subid == subid).values(**values))

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

    def add_table(self, subid: int, relid: int, remote_name: str, state: str, lsn: int | None = None,
                  conn: sa.Connection | None = None) -> None:  # fmt: skip
        with self._conn(conn) as c:
            c.execute(
                pg.insert(subscription_rel)
                .values(
                    subid=subid, srrelid=str(relid), srremotename=remote_name, srsubstate=state, srsublsn=lsn
                )
                .on_conflict_do_nothing()
            )

    def set_table_state(self, subid: int, relid: int, state: str, lsn: int | None,
                        conn: sa.Connection | None = None) -> None:  # fmt: skip
        with self._conn(conn) as c:
            c.execute(
                subscription_rel.update()
                .where(subscription_rel.c.subid == subid, subscription_rel.c.srrelid == str(relid))
                .values(srsubstate=state, srsublsn=lsn, srupdated=sa.func.now())
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
    def record_lag(self, subid: int, figures: dict[str, Any]) -> None:
        """Upsert the subscription's recent apply lag (``last_s``, ``last_kind``, ``p50_s``, ``p99_s``, ``max_s``,
        ``samples``, ``window_s``): its own short transaction, not waited for on disk (an unlogged table)."""
        stmt = pg.insert(apply_lag).values(subid=subid, updated_at=sa.func.now(), **figures)
        stmt = stmt.on_conflict_do_update(
            index_elements=[apply_lag.c.subid], set_={"updated_at": sa.func.now(), **figures}
        )
        with self.engine.begin() as c:
            c.execute(stmt)

    def lag(self, subid: int, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        """What :meth:`record_lag` stored last, with ``updated_at``; None when nothing was recorded."""
        with self._conn(conn) as c:
            if not self.has_lag_table(c):  # a catalog of version 1, not upgraded yet
                return None
            row = c.execute(sa.select(apply_lag).where(apply_lag.c.subid == subid)).mappings().first()
            return dict(row) if row is not None else None

    def has_lag_table(self, conn: sa.Connection | None = None) -> bool:
        with self._conn(conn) as c:
            return bool(c.execute(sa.text("SELECT to_regclass('applier.apply_lag') IS NOT NULL")).scalar())

    def last_error(self, subid: int, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        """The newest error record of ``subid``. A catalog of version 1 (not upgraded yet: ``applier run`` and
        ``create`` upgrade it) has no sqlstate/gid/retry columns: they read as None."""
        with self._conn(conn) as c:
            version = c.execute(sa.select(sa.func.max(catalog_version.c.version))).scalar() or 0
            columns = [col for col in apply_error.c if version >= 2 or col.name not in _ERROR_COLUMNS_V2]
            row = (
                c.execute(
                    sa.select(*columns).where(apply_error.c.subid == subid).order_by(apply_error.c.id.desc())
                )
                .mappings()
                .first()
            )
            if not row:
                return None
            return {name: None for name in _ERROR_COLUMNS_V2} | dict(row)
