"""The DDL capture on the source (an I/O edge): per consumer (its slot), two functions in our schema
:data:`~applier.ddl.capture_sql.SCHEMA` and two event triggers (``ddl_command_end``, ``sql_drop``) that emit one
:mod:`applier.ddl.payload` message per DDL command inside the consumer's selection, in the command's transaction.

- :func:`can_capture`: whether the connected role may install it (creating an event trigger takes a superuser, or
  a managed service's admin role: docs/migrate.md, "Schema changes while following"); reads the catalogs only, so
  ``plan`` may ask inside its read-only transaction.
- :func:`install`: created or replaced in one transaction; installing twice is harmless (a resumed start).
- :func:`remove`: the consumer's triggers and functions, and the schema once no consumer is left; removing what is
  not there is harmless, and needs no right.

The SQL is built by :mod:`applier.ddl.capture_sql` (pure); every name goes through :mod:`psycopg.sql`.
"""

from __future__ import annotations

import secrets
from typing import Any

import psycopg
from psycopg import sql

from applier.ddl.capture_sql import BUSY, SCHEMA, Scope, names, trigger_function, worker_function

__all__ = [
    "ADMIN_ROLES",
    "SCHEMA",
    "can_capture",
    "install",
    "installed",
    "key_query",
    "manual_removal",
    "names",
    "remove",
]

#: The managed services' admin roles whose members may create event triggers (docs/migrate.md, "Schema changes
#: while following", with the sources): Amazon RDS and Aurora, Google Cloud SQL, Neon.
ADMIN_ROLES = ("rds_superuser", "cloudsqlsuperuser", "neon_superuser")

# the role, whether it is a superuser, the admin roles it is a member of, Supabase's privileged role when it is a
# member (supautils lets it create event triggers), and whether it may create our schema (or owns it already)
_PROBE = """
SELECT r.rolname, r.rolsuper,
       ARRAY(SELECT a.rolname FROM pg_roles a WHERE a.rolname = ANY(%s::text[])
              AND pg_has_role(r.oid, a.oid, 'MEMBER') ORDER BY 1),
       (SELECT p FROM nullif(current_setting('supautils.privileged_role', true), '') AS p
         WHERE EXISTS (SELECT FROM pg_roles s WHERE s.rolname = p AND pg_has_role(r.oid, s.oid, 'MEMBER'))),
       coalesce((SELECT pg_has_role(r.oid, n.nspowner, 'USAGE') FROM pg_namespace n WHERE n.nspname = %s),
                has_database_privilege(current_database(), 'CREATE'))
FROM pg_roles r WHERE r.rolname = current_user
"""


def can_capture(conn: psycopg.Connection[Any]) -> tuple[bool, str]:
    """Whether the role of ``conn`` may install the capture, and why (or why not, with what to do). A member of a
    managed service's admin role is taken at its word here; :func:`install` finds out for sure."""
    row = conn.execute(_PROBE, (list(ADMIN_ROLES), SCHEMA)).fetchone()
    assert row is not None
    role, superuser, admin, privileged, create = row
    if not create:
        return False, f"role {role} may not create schema {SCHEMA} in this database (no CREATE on it)"
    if superuser:
        return True, f"role {role} is a superuser"
    if admin or privileged:
        return True, f"role {role} is a member of {(admin or [privileged])[0]}"
    return False, (
        f"role {role} may not create event triggers on the source: only a superuser may (on managed services "
        f"a member of the provider's admin role: {', '.join(ADMIN_ROLES)}; Supabase: postgres)"
    )


def _busy(conn: psycopg.Connection[Any]) -> None:
    """Our own DDL is no DDL to any capture (another consumer's too): it neither emits nor counts."""
    conn.execute("SELECT set_config(%s, 'on', true)", (BUSY,))


def install(
    conn: psycopg.Connection[Any],
    slot: str,
    selection: Scope,
    publications: tuple[str, str] | None = None,
) -> None:
    """Install (or replace) the capture of ``slot`` for ``selection`` (a migration's patterns, or a subscription's
    :class:`~applier.ddl.capture_sql.Published`), with ``publications`` (every operation,
    insert-only) for the tables created while following to join; in one transaction. Raises the server's error
    (e.g. ``InsufficientPrivilege``) when the role may not: nothing is then left."""
    n = names(slot)
    schema = sql.Identifier(SCHEMA)
    with conn.transaction():
        _busy(conn)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(schema))
        _make_key(conn, n.key)
        conn.execute(sql.SQL(worker_function(slot, selection, publications)))  # type: ignore[arg-type]
        conn.execute(sql.SQL(trigger_function(slot)))  # type: ignore[arg-type]
        conn.execute(
            sql.SQL("COMMENT ON FUNCTION {}() IS {}").format(
                sql.Identifier(SCHEMA, n.trigger_function),
                sql.Literal(f"applier: DDL capture of slot {slot}"),
            )
        )
        existing = {r[0] for r in conn.execute("SELECT evtname FROM pg_event_trigger")}
        for trigger, event in ((n.end_trigger, "ddl_command_end"), (n.drop_trigger, "sql_drop")):
            if trigger not in existing:
                conn.execute(
                    sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION {}()").format(
                        sql.Identifier(trigger),
                        sql.Identifier(event),
                        sql.Identifier(SCHEMA, n.trigger_function),
                    )
                )
            # DDL run with session_replication_role = replica (a bulk load, a replica applying) is DDL too
            conn.execute(sql.SQL("ALTER EVENT TRIGGER {} ENABLE ALWAYS").format(sql.Identifier(trigger)))


def _make_key(conn: psycopg.Connection[Any], name: str) -> None:
    """The capture's signing key, made once (a reinstall keeps it: a running consumer has read it): a sequence
    whose value is 62 random bits, readable by its owner alone (the capture's function, SECURITY DEFINER, and the
    consumer's own streaming role, which :func:`key` reads it as)."""
    seq = sql.Identifier(SCHEMA, name)
    made = conn.execute("SELECT to_regclass(%s) IS NULL", (f"{SCHEMA}.{name}",)).fetchone()
    conn.execute(
        sql.SQL("CREATE SEQUENCE IF NOT EXISTS {} MINVALUE 1 MAXVALUE {}").format(seq, sql.Literal(2**62))
    )
    conn.execute(sql.SQL("REVOKE ALL ON SEQUENCE {} FROM PUBLIC").format(seq))
    if made and made[0]:
        conn.execute(sql.SQL("SELECT setval({}, {}, true)").format(
            sql.Literal(f"{SCHEMA}.{name}"), sql.Literal(secrets.randbelow(2**62) + 1)))  # fmt: skip


def key_query(slot: str) -> sql.Composed:
    """The query of the key that signs ``slot``'s capture messages (applier.ddl.payload): the consumer runs it on
    its streaming connection before it streams (a missing capture, or a role that may not read the key: no message
    can be trusted, and none is replayed)."""
    return sql.SQL("SELECT last_value::text FROM {}").format(sql.Identifier(SCHEMA, names(slot).key))


def manual_removal(slot: str) -> str:
    """The statements that remove ``slot``'s capture by hand, as a superuser on the source (when the verb could
    not: the source unreachable, or the role not the one that installed it)."""
    n = names(slot)
    drops = [
        f"DROP EVENT TRIGGER IF EXISTS {sql.Identifier(t).as_string()};"
        for t in (n.end_trigger, n.drop_trigger)
    ]
    fn = sql.Identifier(SCHEMA, n.trigger_function).as_string()
    emit = sql.Identifier(SCHEMA, n.worker_function).as_string()
    drops.append(f"DROP FUNCTION IF EXISTS {fn}(), {emit}(text, text, text);")
    drops.append(f"DROP SEQUENCE IF EXISTS {sql.Identifier(SCHEMA, n.key).as_string()};")
    return " ".join(drops) + f" then DROP SCHEMA {SCHEMA} once nothing else is in it"


def installed(conn: psycopg.Connection[Any], slot: str) -> list[str]:
    """What of ``slot``'s capture exists on the source: its event triggers and functions, by name."""
    n = names(slot)
    triggers = [
        r[0]
        for r in conn.execute(
            "SELECT evtname FROM pg_event_trigger WHERE evtname = ANY(%s) ORDER BY 1",
            ([n.end_trigger, n.drop_trigger],),
        )
    ]
    functions = [
        r[0]
        for r in conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace"
            " WHERE s.nspname = %s AND p.proname = ANY(%s) ORDER BY 1",
            (SCHEMA, [n.trigger_function, n.worker_function]),
        )
    ]
    return triggers + functions


def remove(conn: psycopg.Connection[Any], slot: str) -> bool:
    """Remove ``slot``'s capture, then our schema when nothing else is in it; whether anything was removed.
    Nothing there: nothing done (no right needed)."""
    n = names(slot)
    schema_left = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (SCHEMA,)).fetchone()
    found = installed(conn, slot)
    if not found and not (schema_left and schema_left[0] and _empty(conn)):
        return False
    with conn.transaction():
        _busy(conn)
        for trigger in (n.end_trigger, n.drop_trigger):
            conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(trigger)))
        conn.execute(
            sql.SQL("DROP FUNCTION IF EXISTS {}(), {}(text, text, text)").format(
                sql.Identifier(SCHEMA, n.trigger_function), sql.Identifier(SCHEMA, n.worker_function)
            )
        )
        conn.execute(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(sql.Identifier(SCHEMA, n.key)))
        if _empty(conn):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {}").format(sql.Identifier(SCHEMA)))
    return True


def _empty(conn: psycopg.Connection[Any]) -> bool:
    """Whether our schema holds nothing (no other consumer's capture, nothing anyone put there)."""
    row = conn.execute(
        "SELECT NOT EXISTS (SELECT FROM pg_depend d WHERE d.refclassid = 'pg_namespace'::regclass"
        " AND d.refobjid = to_regnamespace(%s) AND d.deptype = 'n')",
        (SCHEMA,),
    ).fetchone()
    return bool(row and row[0])
