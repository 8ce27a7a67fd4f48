"""Which grants the apply role on the target lacks, decided from facts read off the target (docs/security.md).

Pure on purpose: :mod:`applier.subscriptions` reads the facts (``has_*_privilege`` answers, all of them before
anything is written) and this module turns them into the exact statements a superuser pastes, so the rule per
PostgreSQL version is unit-tested without a server. Names arrive already quoted by the server (``quote_ident``,
``regclass::text``), so nothing here quotes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ORIGIN_FUNCTIONS",
    "SET_PARAMETER_VERSION",
    "TABLE_PRIVILEGES",
    "TableFacts",
    "TargetFacts",
    "least_privilege_grants",
    "missing_grants",
]

#: ``GRANT SET ON PARAMETER`` arrived in PostgreSQL 15; before it only a superuser sets session_replication_role.
SET_PARAMETER_VERSION = 150000

#: The replication-origin functions applier calls (PostgreSQL revokes them from PUBLIC): create and drop with the
#: subscription; session setup/reset, per-transaction setup/reset, advance and progress while applying and copying.
ORIGIN_FUNCTIONS: tuple[str, ...] = (
    "pg_catalog.pg_replication_origin_create(text)",
    "pg_catalog.pg_replication_origin_drop(text)",
    "pg_catalog.pg_replication_origin_session_setup(text)",
    "pg_catalog.pg_replication_origin_session_reset()",
    "pg_catalog.pg_replication_origin_xact_setup(pg_lsn, timestamp with time zone)",
    "pg_catalog.pg_replication_origin_xact_reset()",
    "pg_catalog.pg_replication_origin_advance(text, pg_lsn)",
    "pg_catalog.pg_replication_origin_progress(text, boolean)",
)

#: What applying needs on a subscribed table: the changes themselves, and SELECT for their WHERE clauses, the
#: initial copy's restart and verify.
TABLE_PRIVILEGES: tuple[str, ...] = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")

_CATALOG_SCHEMA = "applier"


@dataclass(frozen=True)
class TableFacts:
    """One subscribed table on the target: its name as ``regclass::text`` and the privileges the role lacks."""

    name: str
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class TargetFacts:
    """What the target says about the connected role; every name already quoted as an identifier."""

    server_version: int
    role: str
    database: str
    superuser: bool
    may_create_in_database: bool
    schema_exists: bool
    may_create_in_schema: bool  # owner, or CREATE on schema applier (False when it does not exist)
    may_use_schema: bool
    catalog_exists: bool
    catalog_writable: bool  # SELECT/INSERT/UPDATE/DELETE on every catalog table (True when there is none)
    may_set_replication_role: bool
    missing_functions: tuple[str, ...] = ()
    tables: Sequence[TableFacts] = field(default_factory=tuple)
    unusable_schemas: tuple[str, ...] = ()  # schemas of subscribed tables without USAGE for the role


def missing_grants(facts: TargetFacts) -> list[str]:
    """The statements, one per line and ready to paste into psql as a superuser, that would give ``facts.role``
    everything a subscription's whole life needs; empty when nothing is missing. A line starting with ``--``
    says what no grant can give (session_replication_role before PostgreSQL 15) or offers an alternative."""
    if facts.superuser:
        return []
    lines = _catalog_grants(facts)
    role = facts.role
    if not facts.may_set_replication_role:
        if facts.server_version >= SET_PARAMETER_VERSION:
            lines.append(f"GRANT SET ON PARAMETER session_replication_role TO {role};")
        else:
            lines.append(
                f"-- PostgreSQL {facts.server_version // 10000} lets only a superuser set session_replication_role:"
                " upgrade the target to 15 or later, or connect as a superuser"
            )
    lines += [f"GRANT EXECUTE ON FUNCTION {f} TO {role};" for f in facts.missing_functions]
    lines += [f"GRANT USAGE ON SCHEMA {s} TO {role};" for s in facts.unusable_schemas]
    lines += [f"GRANT {', '.join(t.missing)} ON TABLE {t.name} TO {role};" for t in facts.tables if t.missing]
    return lines


def _catalog_grants(facts: TargetFacts) -> list[str]:
    """Schema ``applier``: the least is a schema the role owns (created for it), else CREATE on the database."""
    role, schema = facts.role, _CATALOG_SCHEMA
    if not facts.schema_exists:
        if facts.may_create_in_database:
            return []
        return [
            f"CREATE SCHEMA {schema} AUTHORIZATION {role};",
            f"-- or instead: GRANT CREATE ON DATABASE {facts.database} TO {role};",
        ]
    lines = []
    if facts.catalog_exists:
        if not facts.may_use_schema:
            lines.append(f"GRANT USAGE ON SCHEMA {schema} TO {role};")
        if not facts.catalog_writable:
            lines.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};")
            lines.append(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role};")
    elif not (facts.may_create_in_schema and facts.may_use_schema):
        lines.append(f"ALTER SCHEMA {schema} OWNER TO {role};")
    return lines


def least_privilege_grants(server_version: int, role: str, database: str, tables: Sequence[str]) -> list[str]:
    """Everything a role that has nothing yet needs for a subscription of ``tables``, least first (schema
    ``applier`` created for it rather than CREATE on the database): what docs/security.md shows, and what the
    test harness grants (:mod:`applier.testing.roles`)."""
    nothing = TargetFacts(
        server_version=server_version,
        role=role,
        database=database,
        superuser=False,
        may_create_in_database=False,
        schema_exists=False,
        may_create_in_schema=False,
        may_use_schema=False,
        catalog_exists=False,
        catalog_writable=True,
        may_set_replication_role=False,
        missing_functions=ORIGIN_FUNCTIONS,
        tables=tuple(TableFacts(t, TABLE_PRIVILEGES) for t in tables),
    )
    return [line for line in missing_grants(nothing) if not line.startswith("-- or instead")]
