"""The attack of the trust tests (issue 26): an unprivileged role owns a table on the target and attaches code to it
that makes the role a superuser when a replicated change runs it. ``tests/integration/test_trust.py`` plays it
against the apply, ``tests/integration/test_tablesync_copy.py`` against the copy's Spark tasks; the role is the
:func:`mallory` fixture, offered to every module by ``tests/integration/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from psycopg import sql

#: the body of every attack: make the table's owner a superuser, with the rights of whoever runs it
_ESCALATE = "BEGIN EXECUTE format('ALTER ROLE %I SUPERUSER', {owner}); RETURN {ret}; END"


@pytest.fixture
def mallory(pair: Any) -> Iterator[str]:
    """An unprivileged role on the target (the owner of a replicated table), dropped at the end."""
    role = f"m_{pair.name}"[:63]
    pair.target.cluster.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield role
    for stmt in ("DROP OWNED BY {} CASCADE", "DROP ROLE {}"):
        pair.target.execute(sql.SQL(stmt).format(sql.Identifier(role)))


def superuser(pair: Any, role: str) -> bool:
    """Whether ``role`` is a superuser on the target: the attack's success, what every test asserts is false."""
    return bool(pair.target.scalar("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,)))


def owned_table(pair: Any, role: str, target_extra: str = "") -> None:
    """Table t on both sides; on the target owned by ``role`` (with ``target_extra`` columns)."""
    pair.publisher.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute(f"CREATE TABLE t (id int PRIMARY KEY, v text{target_extra})")
    pair.target.execute(sql.SQL("ALTER TABLE t OWNER TO {}").format(sql.Identifier(role)))


def escalating_function(pair: Any, role: str, signature: str, returns: str, ret: str) -> None:
    """A plpgsql function owned by ``role`` that makes ``role`` a superuser when it runs."""
    body = _ESCALATE.format(owner=sql.Literal(role).as_string(None), ret=ret)
    pair.target.execute(
        f"CREATE FUNCTION public.{signature} RETURNS {returns} LANGUAGE plpgsql AS $$ {body} $$"
    )
    pair.target.execute(
        sql.SQL("ALTER FUNCTION public.{} OWNER TO {}").format(sql.SQL(signature), sql.Identifier(role))
    )


def evil_trigger(pair: Any, role: str, when: str = "BEFORE INSERT OR UPDATE") -> None:
    """An ``ENABLE ALWAYS`` trigger ``evil`` on t running :func:`escalating_function`: it fires in the apply's
    ``session_replication_role = replica`` too, as an owner's trigger would."""
    escalating_function(pair, role, "evil()", "trigger", "NEW")
    pair.target.execute(f"CREATE TRIGGER evil {when} ON t FOR EACH ROW EXECUTE FUNCTION public.evil()")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER evil")
