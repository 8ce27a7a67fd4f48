"""The catalog's schema: SQLAlchemy Core tables in schema ``applier`` of the target database, its version, and the
migrations that take an older catalog to this version.

Column names follow PostgreSQL's ``pg_subscription`` / ``pg_subscription_rel`` (fixed by docs/reference.md, "Catalog": other
tools read them). Everything else here is ours: the record of each prepared transaction (``LookupGXact``'s data,
which ``pg_prepared_xacts`` does not show), error records, per-partition copy markers, the recent apply lag and the
catalog version.

Why the catalog lives in the target: the apply worker must change it atomically with the data it applies (a table
turning ready, a skip-LSN cleared in the skipped transaction's commit), which only a table in the same database
allows. The statements that the apply pipeline and the Spark tasks send themselves are in :mod:`applier.catalog.sql`,
next to these tables; everything else goes through :class:`applier.catalog.store.Catalog`.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.types import TypeDecorator, UserDefinedType

from applier.catalog.trust import FUNCTIONS as TRUST_FUNCTIONS
from applier.lsn import format_lsn, parse_lsn

SCHEMA = "applier"
#: Bump with a migration in :data:`MIGRATIONS` whenever a table or column changes.
CATALOG_VERSION = 14


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
    # since catalog version 5: PostgreSQL 16's run_as_owner; false: run no code the apply role does not trust
    sa.Column("subrunasowner", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("subfailover", sa.Boolean, nullable=False, server_default=sa.false()),
    # schema changes on the publisher replayed at their place in the stream (applier.ddl; issue 39)
    sa.Column("subddl", sa.Boolean, nullable=False, server_default=sa.false()),
    # where conflicts go (create --conflict-log, since catalog version 14): log, table (applier.conflict_log), all
    sa.Column("subconflictlog", sa.Text, nullable=False, server_default="log"),
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
ERROR_COLUMNS_V2 = ("sqlstate", "gid", "retry_count", "next_retry_at")

#: A stall the worker's watchdog sees (applier.apply.stall): behind, and no progress for a while; one row per
#: subscription, written when it begins and refreshed while it lasts (every second), removed when it ends; read by
#: ``status``, which shows it only while fresh (a killed worker leaves its row). UNLOGGED, as apply_lag. Since
#: catalog version 7.
apply_stall = sa.Table(
    "apply_stall",
    metadata,
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("since", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column("waiting_on", sa.Text, nullable=False),
    sa.Column("received_lsn", PgLsn, nullable=False),
    sa.Column("applied_lsn", PgLsn, nullable=False),
    sa.Column("unanswered", sa.Integer, nullable=False),
    prefixes=["UNLOGGED"],
)

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

#: PostgreSQL 18's ``pg_stat_subscription_stats`` under its column names, one row per subscription (since catalog
#: version 12): apply errors, table-sync errors and conflicts by kind, each attempt counted as PostgreSQL counts it.
#: Written by the worker on the catalog's own connection when one happens (never inside the apply transaction, so
#: a count survives the rollback of the attempt that met it), read by ``status``, zeroed by ``alter --reset-stats``
#: (which sets ``stats_reset``). A logged table: the counts are kept across restarts of ``run``.
STATS_COLUMNS = (
    "apply_error_count",
    "sync_error_count",
    "confl_insert_exists",
    "confl_update_origin_differs",
    "confl_update_exists",
    "confl_update_missing",
    "confl_delete_origin_differs",
    "confl_delete_missing",
    "confl_multiple_unique_conflicts",
)
subscription_stats = sa.Table(
    "subscription_stats",
    metadata,
    sa.Column(
        "subid", sa.BigInteger, sa.ForeignKey(subscription.c.subid, ondelete="CASCADE"), primary_key=True
    ),
    *(sa.Column(name, sa.BigInteger, nullable=False, server_default="0") for name in STATS_COLUMNS),
    sa.Column("stats_reset", sa.DateTime(timezone=True), nullable=True),
)

#: ``applier migrate``'s tables (since catalog version 6; read and written only by :mod:`applier.migrate.store`):
#: one row per migration and one per post-data step. Plain DDL, not SQLAlchemy tables: no module but that store
#: touches them, and its statements are psycopg's. ``IF NOT EXISTS`` because releases before version 6 created
#: them outside the catalog's versioning, on the first ``migrate start``: an upgraded target may have them already.
MIGRATION_TABLES = [
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.migration (
    name text PRIMARY KEY,
    subname text NOT NULL,
    source text NOT NULL,
    selection jsonb NOT NULL,
    publication text NOT NULL,
    slot text NOT NULL,
    phase text NOT NULL,
    pub_created bool NOT NULL DEFAULT false,
    slot_created bool NOT NULL DEFAULT false,
    snapshot_lsn pg_lsn,
    times jsonb NOT NULL DEFAULT '{{}}',
    error text,
    notes jsonb NOT NULL DEFAULT '{{}}',
    fenced_at timestamptz,
    created timestamptz NOT NULL DEFAULT now(),
    updated timestamptz NOT NULL DEFAULT now()
)""",
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.migration_step (
    name text NOT NULL REFERENCES {SCHEMA}.migration ON DELETE CASCADE,
    step text NOT NULL,
    ord int NOT NULL,
    kind text NOT NULL,
    relnames text[] NOT NULL,
    after text[] NOT NULL,
    statements text[] NOT NULL,
    done bool NOT NULL DEFAULT false,
    seconds float8,
    finished timestamptz,
    PRIMARY KEY (name, step)
)""",
]

#: The conflict log table (since catalog version 14): one row per conflict of a subscription whose ``--conflict-log``
#: is ``table`` or ``all``, written in the local transaction of the change it is about (applier.apply.conflict_table),
#: so a rolled-back attempt leaves none. The columns of the conflict log table of PostgreSQL's development branch,
#: plus ``subid`` and ``logged_at``. Plain DDL, as the migration's tables: only that module writes it.
CONFLICT_LOG_TABLE = [
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.conflict_log (
    subid bigint NOT NULL REFERENCES {SCHEMA}.subscription (subid) ON DELETE CASCADE,
    relid oid,
    schemaname text,
    relname text,
    conflict_type text NOT NULL,
    remote_xid xid,
    remote_commit_lsn pg_lsn,
    remote_commit_ts timestamptz,
    remote_origin text,
    replica_identity json,
    remote_tuple json,
    local_conflicts json[],
    logged_at timestamptz NOT NULL DEFAULT now()
)""",
    f"CREATE INDEX IF NOT EXISTS conflict_log_subid_logged_at ON {SCHEMA}.conflict_log (subid, logged_at)",
]

# Migrations: version -> list of SQL statements that take the catalog from version-1 to version.
MIGRATIONS: dict[int, list[str]] = {
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
    5: [
        f"ALTER TABLE {SCHEMA}.subscription ADD COLUMN IF NOT EXISTS subrunasowner boolean NOT NULL DEFAULT false",
        *TRUST_FUNCTIONS,
    ],
    6: MIGRATION_TABLES,
    7: [
        f"CREATE UNLOGGED TABLE IF NOT EXISTS {SCHEMA}.apply_stall (subid bigint PRIMARY KEY REFERENCES"
        f" {SCHEMA}.subscription (subid) ON DELETE CASCADE, since timestamptz NOT NULL, updated_at timestamptz NOT NULL"
        " DEFAULT now(), waiting_on text NOT NULL, received_lsn pg_lsn NOT NULL, applied_lsn pg_lsn NOT NULL,"
        " unanswered integer NOT NULL)"
    ],
    # the trust functions again, rewritten to look their catalogs up by index: 4 ms a call instead of 240 ms in a
    # database of 200 tables (the copy checks every partition, the apply every plan of its guard statements)
    8: [*TRUST_FUNCTIONS],
    # failover slots (PostgreSQL 17+): create --failover, alter --set failover (pg_subscription.subfailover)
    9: [
        f"ALTER TABLE {SCHEMA}.subscription ADD COLUMN IF NOT EXISTS subfailover boolean NOT NULL DEFAULT false"
    ],
    # what a migration did that its user should know afterwards (applier.migrate.store.add_notes): the cutover's
    # fence (sessions ended, left, held off) and the objects start skipped on a target without superuser
    10: [f"ALTER TABLE {SCHEMA}.migration ADD COLUMN IF NOT EXISTS notes jsonb NOT NULL DEFAULT '{{}}'"],
    # the migration's fence of its source, recorded before it is set and cleared once lifted
    # (applier.migrate.ownership): only the migration that fenced lifts it, and a killed cutover's fence is
    # lifted by the next verb of that migration
    11: [f"ALTER TABLE {SCHEMA}.migration ADD COLUMN IF NOT EXISTS fenced_at timestamptz"],
    # pg_stat_subscription_stats' counters, kept across restarts (applier.catalog.substats)
    12: [
        f"CREATE TABLE IF NOT EXISTS {SCHEMA}.subscription_stats (subid bigint PRIMARY KEY REFERENCES"
        f" {SCHEMA}.subscription (subid) ON DELETE CASCADE, "
        + ", ".join(f"{name} bigint NOT NULL DEFAULT 0" for name in STATS_COLUMNS)
        + ", stats_reset timestamptz)"
    ],
    # schema changes replayed (create --ddl, migrations by default): applier.ddl
    13: [f"ALTER TABLE {SCHEMA}.subscription ADD COLUMN IF NOT EXISTS subddl boolean NOT NULL DEFAULT false"],
    # where conflicts go (create --conflict-log, alter --set conflict_log), and the conflict log table
    14: [
        f"ALTER TABLE {SCHEMA}.subscription ADD COLUMN IF NOT EXISTS subconflictlog text NOT NULL DEFAULT 'log'",
        *CONFLICT_LOG_TABLE,
    ],
}
