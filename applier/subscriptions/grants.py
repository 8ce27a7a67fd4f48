"""The apply role's privileges on the target, read before ``create`` writes anything and judged by the pure
:mod:`applier.privileges`: a missing grant is refused up front with the statement to run, rather than found
halfway through the first copy. Also the once-per-process warning that the role need not be a superuser."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sqlalchemy as sa

from applier.catalog.store import Catalog
from applier.privileges import (
    ORIGIN_FUNCTIONS,
    SET_PARAMETER_VERSION,
    TABLE_PRIVILEGES,
    TableFacts,
    TargetFacts,
    missing_grants,
)
from applier.subscriptions.common import SubscriptionError

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
        server_version=r.version,
        role=r.role,
        database=r.database,
        superuser=r.superuser,
        may_create_in_database=r.create_db,
        schema_exists=r.schema_exists,
        may_create_in_schema=r.create_schema,
        may_use_schema=r.use_schema,
        catalog_exists=r.catalog,
        catalog_writable=r.catalog_writable,
        may_set_replication_role=may_set,
        missing_functions=tuple(r.missing_functions),
    )


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
