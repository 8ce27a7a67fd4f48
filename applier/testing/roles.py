"""Least-privileged roles on a test cluster (docs/security.md): the apply role on the target and the publisher's
replication role, so that tests run applier as users are told to, not only as the superuser ``postgres``.

Roles are cluster-wide and outlive a test's database: :func:`drop_role` removes one again (its grants on
configuration parameters are shared objects, so ``DROP OWNED`` runs first, in a database that still exists).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from psycopg import sql

from applier.privileges import least_privilege_grants
from applier.testing.cluster import Database

__all__ = ["apply_role_grants", "create_apply_role", "create_replication_role", "drop_role"]


def apply_role_grants(db: Database, role: str, tables: Sequence[str]) -> list[str]:
    """The statements that give ``role`` exactly what docs/security.md lists for ``tables`` of ``db``."""
    with db.connect() as conn:
        version, quoted_role, quoted_db = conn.execute(
            "SELECT current_setting('server_version_num')::int, quote_ident(%s), quote_ident(current_database())",
            (role,),
        ).fetchone()  # type: ignore[misc]
    return least_privilege_grants(version, quoted_role, quoted_db, tables)


def create_apply_role(
    db: Database, role: str, tables: Sequence[str], *, leave_out: Collection[str] = ()
) -> Database:
    """Create LOGIN ``role`` with the least privileges for a subscription of ``tables`` (names as SQL, e.g.
    ``public.t1``), except the statements that contain any of ``leave_out`` (to test a missing one); return ``db``
    as that role."""
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    for stmt in apply_role_grants(db, role, tables):
        if not stmt.startswith("--") and not any(part in stmt for part in leave_out):
            db.execute(stmt)
    return db.as_user(role)


def create_replication_role(db: Database, role: str, tables: Sequence[str]) -> Database:
    """Create ``role`` with LOGIN REPLICATION (no superuser) and SELECT on ``tables``: all a publisher needs to
    give; return ``db`` as that role."""
    db.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION").format(sql.Identifier(role)))
    for table in tables:
        db.execute(sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(sql.SQL(table), sql.Identifier(role)))
    return db.as_user(role)


def drop_role(db: Database, role: str) -> None:
    """End ``role``'s sessions, hand what it owns in ``db`` to the superuser, revoke its grants there and on shared
    objects, then drop the role."""
    admin = db.as_user("postgres")
    with admin.connect() as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        # ownership (schema applier and its catalog) goes to the superuser, so the pair fixture can still read the
        # catalog to drop the subscriptions' origins; DROP OWNED then only revokes, shared grants included
        conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
