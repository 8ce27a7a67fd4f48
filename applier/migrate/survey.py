"""What ``applier migrate plan`` and ``start`` read from the servers: the I/O edge of the pure planning modules
(:mod:`applier.migrate.plan` judges the facts read here, :mod:`applier.migrate.selection` decides which tables a
selection covers). Kept apart so that those import no driver (``.importlinter``'s ``migrate-planning-pure``).

Every read of the source's tables goes through :func:`source_tables`, so that ``plan`` describes and checks exactly
the tables ``start`` migrates (a partition following its tree's root).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

import psycopg

from applier.conninfo import parse
from applier.migrate.plan import (
    PUBLIC_DEFAULT_OWNER,
    SourceFacts,
    SourcePrivileges,
    TableFacts,
    TargetFacts,
    TargetPrivileges,
)
from applier.migrate.selection import Selection, SourceTables, select_tables
from applier.privileges import ORIGIN_FUNCTIONS

__all__ = ["IDENTITY_USABLE", "gather_source", "gather_target", "source_tables"]

# each table with the schema and name of its partition tree's root (itself when it is not a partition)
_TABLE_TREES = """
SELECT n.nspname, c.relname, c.relkind, c.relpersistence, coalesce(rn.nspname, n.nspname), coalesce(r.relname, c.relname)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_class r ON r.oid = pg_partition_root(c.oid) LEFT JOIN pg_namespace rn ON rn.oid = r.relnamespace
WHERE c.relkind IN ('r', 'p') AND c.relpersistence <> 't'
ORDER BY 1, 2
"""


def source_tables(conn: psycopg.Connection[Any], selection: Selection) -> SourceTables:
    """What the selection covers on the source (:func:`applier.migrate.selection.select_tables`)."""
    schemas = [r[0] for r in conn.execute("SELECT nspname FROM pg_namespace ORDER BY 1")]
    return select_tables(selection, schemas, conn.execute(_TABLE_TREES).fetchall())


# --- plan's facts ------------------------------------------------------------------------------

#: Whether table ``c`` (a ``pg_class`` row) can publish UPDATE and DELETE, as PostgreSQL's own check on the table
#: itself decides (a partition by its own key or identity, not its parent's): a primary key under the default
#: identity, FULL, or an existing identity index. ``plan`` and ``start`` both ask this expression, so that what plan
#: warns about is what start publishes for INSERT and TRUNCATE only (:mod:`applier.migrate.publications`).
IDENTITY_USABLE = """CASE c.relreplident
         WHEN 'f' THEN true
         WHEN 'd' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary)
         WHEN 'i' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)
         ELSE false END"""

_TABLES = f"""
SELECT n.nspname, c.relname, c.relkind, c.relpersistence,
       pg_relation_size(c.oid), pg_total_relation_size(c.oid), pg_indexes_size(c.oid),
       CASE WHEN c.reltuples < 0 THEN NULL ELSE c.reltuples::bigint END,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
       c.relreplident,
       {IDENTITY_USABLE},
       coalesce(s.n_tup_upd + s.n_tup_del, 0),
       (SELECT count(*) FROM pg_index i WHERE i.indrelid = c.oid),
       pg_get_userbyid(c.relowner)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relkind IN ('r', 'p')
ORDER BY 1, 2
"""  # noqa: S608 - a constant expression of ours (IDENTITY_USABLE), no name

_INDEXES = """
SELECT n.nspname, t.relname, i.relname, am.amname, x.indisprimary, x.indisunique, pg_relation_size(i.oid),
       EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.oid AND k.conrelid = t.oid)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace JOIN pg_am am ON am.oid = i.relam
WHERE t.relkind IN ('r', 'p')
ORDER BY 1, 2, 3
"""

_CONSTRAINTS = """
SELECT n.nspname, t.relname, k.contype
FROM pg_constraint k JOIN pg_class t ON t.oid = k.conrelid JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE k.contype IN ('p', 'u', 'f', 'c', 'x') AND t.relkind IN ('r', 'p')
"""

# owners and grantees of selected schemas' relations, the schemas' own owners, the roles of the relations' policies
# and the owners of their statistics objects (post-data names them: applier.migrate.objects)
_ROLES = """
SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(c.relowner), 'owner' FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'S', 'v', 'm', 'f')
UNION ALL
SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(a.grantee), 'grant' FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(c.relacl) a
WHERE c.relkind IN ('r', 'p', 'S', 'v', 'm', 'f') AND a.grantee <> 0
UNION ALL
SELECT n.nspname, NULL, NULL, pg_get_userbyid(n.nspowner),
  CASE WHEN n.nspname = 'public' AND n.nspowner = 10 AND current_setting('server_version_num')::int < 150000
       THEN %s::text ELSE 'owner' END FROM pg_namespace n
UNION ALL
SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(r), 'policy' FROM pg_policy p
JOIN pg_class c ON c.oid = p.polrelid JOIN pg_namespace n ON n.oid = c.relnamespace, unnest(p.polroles) r WHERE r <> 0
UNION ALL
SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(x.stxowner), 'statistics' FROM pg_statistic_ext x
JOIN pg_class c ON c.oid = x.stxrelid JOIN pg_namespace n ON n.oid = c.relnamespace
"""

# what the connected role may do on the source (rds_replication: RDS's replication role, where it exists)
_SOURCE_PRIVILEGES = """
SELECT quote_ident(current_user), quote_ident(current_database()), r.rolsuper,
       r.rolreplication OR CASE WHEN to_regrole('rds_replication') IS NULL THEN false
                                ELSE pg_has_role(current_user, 'rds_replication', 'USAGE') END,
       to_regrole('rds_replication') IS NOT NULL,
       has_database_privilege(current_database(), 'CREATE'),
       r.rolsuper OR pg_has_role(current_user, 'pg_signal_backend', 'USAGE'),
       r.rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
FROM pg_roles r WHERE r.rolname = current_user
"""

# per table and sequence: owned (as PostgreSQL's ownership check: the privileges of the owner) and readable
_SOURCE_RELATIONS = """
SELECT n.nspname, c.relname, c.relkind, format('%I.%I', n.nspname, c.relname),
       pg_has_role(current_user, c.relowner, 'USAGE'), has_table_privilege(c.oid, 'SELECT')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p', 'S')
ORDER BY 1, 2
"""

_TARGET_PRIVILEGES = """
SELECT quote_ident(current_user), quote_ident(current_database()), current_setting('is_superuser')::bool,
       has_database_privilege(current_database(), 'CREATE'),
       current_setting('is_superuser')::bool OR has_parameter_privilege('session_replication_role', 'SET')
"""

# the roles the connected role may make an object's owner (16+: those it may SET ROLE to)
_OWNABLE = """
SELECT rolname FROM pg_roles WHERE pg_has_role(current_user, oid,
  CASE WHEN current_setting('server_version_num')::int >= 160000 THEN 'SET' ELSE 'MEMBER' END) ORDER BY 1
"""

# extensions that only a superuser may create, and not created yet
_UNTRUSTED = """
SELECT name FROM pg_available_extension_versions v
WHERE NOT EXISTS (SELECT FROM pg_extension e WHERE e.extname = v.name)
GROUP BY name HAVING bool_and(superuser AND NOT trusted) ORDER BY 1
"""

# one row when the role we connect as does not see row-level security policies
_BYPASS_RLS = "SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolsuper OR rolbypassrls)"

_KINDS = {"p": "primary_key", "u": "unique", "f": "foreign_key", "c": "check", "x": "exclusion"}


def _read_only(conninfo: str, what: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(
        conninfo, autocommit=False, connect_timeout=int(parse(conninfo, what).get("connect_timeout", "10"))
    )
    conn.execute("SET TRANSACTION READ ONLY")
    return conn


def _setting(conn: psycopg.Connection[Any], name: str) -> str:
    return str(conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0])  # type: ignore[index]


def database_read_only(conn: psycopg.Connection[Any]) -> bool:
    """Whether the connected database makes new sessions read-only (``ALTER DATABASE ... SET
    default_transaction_read_only = on``: a migration's fence, ours or anyone's, or its owner's choice)."""
    row = conn.execute(
        "SELECT coalesce(bool_or(c = 'default_transaction_read_only=on'), false) FROM pg_db_role_setting s,"
        " unnest(s.setconfig) c WHERE s.setrole = 0"
        " AND s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    return bool(row and row[0])


def gather_source(conninfo: str, selection: Selection) -> SourceFacts:
    """Everything the plan needs from the source, read in one read-only transaction."""
    with _read_only(conninfo, "source") as conn:
        q = conn.execute
        chosen = source_tables(conn, selection)
        covered = chosen.covered
        tables = _source_tables(conn, covered)
        indexes = _source_indexes(conn, covered)
        constraints = dict.fromkeys(_KINDS.values(), 0)
        for nsp, rel, kind in q(_CONSTRAINTS):
            if (nsp, rel) in covered:
                constraints[_KINDS[kind]] += 1
        sequences = [
            f"{r[0]}.{r[1]}"
            for r in q("SELECT schemaname, sequencename FROM pg_sequences ORDER BY 1, 2")
            if selection.covers_schema(r[0])
        ]
        matviews = [
            f"{r[0]}.{r[1]}"
            for r in q("SELECT schemaname, matviewname FROM pg_matviews ORDER BY 1, 2")
            if selection.covers_schema(r[0])
        ]
        uses = _source_roles(conn, selection, covered)
        roles = sorted(uses)
        facts = SourceFacts(
            version_num=int(_setting(conn, "server_version_num")),
            wal_level=_setting(conn, "wal_level"),
            max_replication_slots=int(_setting(conn, "max_replication_slots")),
            slots_used=int(q("SELECT count(*) FROM pg_replication_slots").fetchone()[0]),  # type: ignore[index]
            max_wal_senders=int(_setting(conn, "max_wal_senders")),
            wal_senders_used=int(
                q("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'").fetchone()[0]
            ),  # type: ignore[index]
            schemas=chosen.schemas,
            tables=tables,
            indexes=indexes,
            constraints=constraints,
            sequences=sequences,
            large_objects=int(q("SELECT count(*) FROM pg_largeobject_metadata").fetchone()[0]),  # type: ignore[index]
            extensions={r[0]: r[1] for r in q("SELECT extname, extversion FROM pg_extension ORDER BY 1")},
            publications=[r[0] for r in q("SELECT pubname FROM pg_publication ORDER BY 1")],
            materialized_views=matviews,
            roles=roles,
            row_security=_row_security(conn, covered),
            event_triggers=_event_triggers(conn),
            role_uses={r: sorted(u) for r, u in uses.items()},
            privileges=_source_privileges(conn, selection, covered),
            read_only=database_read_only(conn),
            ddl_capture_refused=_capture_refused(conn),
        )
        conn.rollback()
    return facts


def _source_tables(conn: psycopg.Connection[Any], covered: set[tuple[str, str]]) -> list[TableFacts]:
    return [
        TableFacts(
            r[0],
            r[1],
            r[2],
            r[3],
            int(r[4]),
            int(r[5]),
            int(r[6]),
            r[7],
            r[8],
            r[9],
            r[10],
            int(r[11]),
            int(r[12]),
            r[13],
        )
        for r in conn.execute(_TABLES)
        if (r[0], r[1]) in covered
    ]


def _source_indexes(conn: psycopg.Connection[Any], covered: set[tuple[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "schema": r[0],
            "table": r[1],
            "name": r[2],
            "method": r[3],
            "primary": r[4],
            "unique": r[5],
            "bytes": int(r[6]),
            "constraint": r[7],
        }
        for r in conn.execute(_INDEXES)
        if (r[0], r[1]) in covered
    ]


def _source_roles(
    conn: psycopg.Connection[Any], selection: Selection, covered: set[tuple[str, str]]
) -> dict[str, set[str]]:
    """The roles that own or are granted something selected (the target needs them before the schema), each with
    how it is named (owner, grant, policy, statistics, large object); with the whole database selected, the large
    objects' owners too (large objects migrate then, :mod:`applier.migrate.largeobjects`)."""
    roles: dict[str, set[str]] = {}
    for nsp, rel, kind, role, use in conn.execute(_ROLES, (PUBLIC_DEFAULT_OWNER,)):
        if not selection.covers_schema(nsp):
            continue
        if rel is not None and kind in ("r", "p") and (nsp, rel) not in covered:
            continue
        roles.setdefault(role, set()).add(use)
    if not selection.schemas and not selection.tables:
        for (role,) in conn.execute("SELECT DISTINCT pg_get_userbyid(lomowner) FROM pg_largeobject_metadata"):
            roles.setdefault(role, set()).add("large object")
    return roles


def _source_privileges(
    conn: psycopg.Connection[Any], selection: Selection, covered: set[tuple[str, str]]
) -> SourcePrivileges:
    row = conn.execute(_SOURCE_PRIVILEGES).fetchone()
    assert row is not None
    not_owned, unreadable = [], []
    for nsp, rel, kind, name, owned, readable in conn.execute(_SOURCE_RELATIONS):
        if kind == "S" and not selection.covers_schema(nsp):
            continue
        if kind != "S" and (nsp, rel) not in covered:
            continue
        if kind != "S" and not owned:
            not_owned.append(name)
        if not readable:
            unreadable.append(name)
    role, database, superuser, replication, rds, create, signal, stats = row
    return SourcePrivileges(
        role=role,
        database=database,
        superuser=superuser,
        replication=replication,
        rds_replication=rds,
        create_on_database=create,
        not_owned=tuple(not_owned),
        unreadable=tuple(unreadable),
        signal_backend=signal,
        read_all_stats=stats,
    )


def _row_security(conn: psycopg.Connection[Any], covered: set[tuple[str, str]]) -> list[str]:
    return [
        f"{r[0]}.{r[1]}"
        for r in conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relrowsecurity ORDER BY 1, 2"
        )
        if (r[0], r[1]) in covered
    ]


def _event_triggers(conn: psycopg.Connection[Any]) -> list[str]:
    """The event triggers not created by an extension (those come with it) nor by a DDL capture of ours (its
    functions are in schema ``applier_capture``: :mod:`applier.ddl.capture`)."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT evtname FROM pg_event_trigger e WHERE NOT EXISTS (SELECT FROM pg_depend d WHERE"
            " d.classid = 'pg_event_trigger'::regclass AND d.objid = e.oid AND d.deptype = 'e')"
            " AND NOT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE p.oid = e.evtfoid AND n.nspname = 'applier_capture') ORDER BY 1"
        )
    ]


def _capture_refused(conn: psycopg.Connection[Any]) -> str | None:
    """Why ``start`` could not install the DDL capture on the source (None: it can): catalogs only, so it may be
    asked inside plan's read-only transaction."""
    from applier.ddl import capture  # its SQL builds on this module's IDENTITY_USABLE

    ok, why = capture.can_capture(conn)
    return None if ok else why


def _local_free_bytes(conninfo: str, conn: psycopg.Connection[Any]) -> int | None:
    """Free bytes on the target's data directory's file system, when that directory is visible from here: the
    target is on this machine (a Unix socket or a loopback address) and we may read ``data_directory``."""
    host = conn.info.host or ""
    if not (host.startswith("/") or host in ("localhost", "127.0.0.1", "::1")):
        return None
    try:
        datadir = conn.execute("SELECT current_setting('data_directory')").fetchone()[0]  # type: ignore[index]
    except psycopg.Error:
        conn.rollback()
        conn.execute("SET TRANSACTION READ ONLY")
        return None
    try:
        return shutil.disk_usage(datadir).free
    except OSError:
        return None


def _target_privileges(conn: psycopg.Connection[Any], schemas: Sequence[str]) -> TargetPrivileges:
    role, database, superuser, create, set_role = conn.execute(_TARGET_PRIVILEGES).fetchone()  # type: ignore[misc]
    return TargetPrivileges(
        role=role,
        database=database,
        superuser=superuser,
        create_on_database=create,
        schemas_without_create=tuple(
            r[1]
            for r in conn.execute(
                "SELECT nspname, quote_ident(nspname) FROM pg_namespace WHERE nspname = ANY(%s)"
                " AND NOT has_schema_privilege(oid, 'CREATE') ORDER BY 1",
                (list(schemas),),
            )
        ),
        set_replication_role=set_role,
        missing_functions=tuple(
            r[0]
            for r in conn.execute(
                "SELECT f FROM unnest(%s::text[]) f WHERE NOT has_function_privilege(f, 'EXECUTE')",
                (list(ORIGIN_FUNCTIONS),),
            )
        ),
        untrusted_extensions=tuple(r[0] for r in conn.execute(_UNTRUSTED)),
        ownable=tuple(r[0] for r in conn.execute(_OWNABLE)),
    )


def gather_target(conninfo: str, tables: Sequence[TableFacts], schemas: Sequence[str] = ()) -> TargetFacts:
    """Everything the plan needs from the target, read in one read-only transaction."""
    with _read_only(conninfo, "target") as conn:
        q = conn.execute
        avail: dict[str, list[str]] = {}
        for name, version in q("SELECT name, version FROM pg_available_extension_versions"):
            avail.setdefault(name, []).append(version)
        existing = {
            f"{r[0]}.{r[1]}"
            for r in q(
                "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE c.relkind IN ('r', 'p')"
            )
        }
        facts = TargetFacts(
            version_num=int(_setting(conn, "server_version_num")),
            max_prepared_transactions=int(_setting(conn, "max_prepared_transactions")),
            available_extensions=avail,
            roles=[r[0] for r in q("SELECT rolname FROM pg_roles ORDER BY 1")],
            existing_tables=[tf.qualified for tf in tables if tf.qualified in existing],
            free_bytes=_local_free_bytes(conninfo, conn),
            bypass_rls=bool(q(_BYPASS_RLS).fetchone()),
            privileges=_target_privileges(conn, schemas),
        )
        conn.rollback()
    return facts
