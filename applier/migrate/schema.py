"""Pre-data at the migration's snapshot: ``pg_dump --section=pre-data --snapshot=S`` of the selected schemas (and
the extensions), applied to the target in one transaction.

The dump runs with the source's password in ``PGPASSWORD`` (never on the command line, where ``ps`` shows it). Its
plain SQL is executed by us, not by psql, so that it commits in the same target transaction as the migration's
record of it (a kill leaves either everything or nothing). Two edits make it apply to a fresh database: psql's
``\\restrict``/``\\unrestrict`` lines (meta-commands, which only psql understands and which guard psql itself) are
dropped, so is a ``SET`` of a parameter the target does not have (a newer pg_dump's, into an older target), and
``CREATE SCHEMA x;`` becomes ``CREATE SCHEMA IF NOT EXISTS x;`` (``public`` exists already).

On a target where we are not a superuser (managed services: docs/security.md), :func:`without_unrestorable` drops
what only a superuser could run, each a line of pg_dump's plain output: ``ALTER ... OWNER TO r`` when ``r`` does not
exist on the target or we may not hand objects to it (the object stays owned by the migrating role: pg_restore's
``--no-owner``), ``GRANT``/``REVOKE`` naming a role the target lacks (the other grants are kept), ``SET SESSION
AUTHORIZATION`` (pg_dump's way of granting as another grantor; the grant then runs as the owner) and ``COMMENT ON
EXTENSION`` (only the extension's owner may). What was dropped is said, and kept in the migration's record; except
``ALTER SCHEMA public OWNER TO`` the bootstrap superuser of a source older than 15 (:func:`default_public_owner`),
dropped without a word: that was the public schema's default owner then (15 made it ``pg_database_owner``), which the
target's public schema keeps.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from applier.conninfo import parse
from applier.migrate.state import MigrationError
from applier.migrate.tools import DumpTools

__all__ = [
    "TargetRoles",
    "default_public_owner",
    "dump_pre_data",
    "edit_script",
    "pattern",
    "without_unrestorable",
]

_RESTRICT = re.compile(r"^\\(?:un)?restrict [A-Za-z0-9]+$", re.M)
_CREATE_SCHEMA = re.compile(r"^CREATE SCHEMA (.+);$", re.M)
_SET = re.compile(r"^SET ([a-z_]+) = [^;\n]*;$", re.M)


#: a role name as pg_dump prints it (fmtId: double-quoted unless a plain lower-case identifier)
_ROLE = r'("(?:[^"]|"")+"|[a-z_][a-z0-9_$]*)'
_OWNER = re.compile(rf"^ALTER .+ OWNER TO {_ROLE};$", re.M)
_GRANT = re.compile(rf"^GRANT .+ TO {_ROLE}(?: WITH GRANT OPTION)?;$", re.M)
_REVOKE = re.compile(rf"^REVOKE .+ FROM {_ROLE}(?: CASCADE)?;$", re.M)
_DEFAULT_PRIVILEGES = re.compile(
    rf"^ALTER DEFAULT PRIVILEGES FOR ROLE {_ROLE} .+ (?:TO|FROM) {_ROLE};$", re.M
)
_SESSION_AUTHORIZATION = re.compile(r"^(?:SET SESSION AUTHORIZATION .+|RESET SESSION AUTHORIZATION);$", re.M)
_EXTENSION_COMMENT = re.compile(r"^COMMENT ON EXTENSION .+;$", re.M)


@dataclass(frozen=True)
class TargetRoles:
    """What the target lets the migrating role do with roles: ``roles`` exist there; ``ownable`` are those it may
    make an object's owner (itself and the roles it may SET ROLE to; all of them for a superuser)."""

    superuser: bool
    roles: frozenset[str]
    ownable: frozenset[str]


def read_target_roles(conn: psycopg.Connection[Any]) -> TargetRoles:
    """What the target lets the migrating role do with roles (:func:`without_unrestorable`)."""
    rows = conn.execute(
        "SELECT rolname, current_setting('is_superuser')::bool, pg_has_role(current_user, oid,"
        " CASE WHEN current_setting('server_version_num')::int >= 160000 THEN 'SET' ELSE 'MEMBER' END)"
        " FROM pg_roles"
    ).fetchall()
    return TargetRoles(
        superuser=bool(rows and rows[0][1]),
        roles=frozenset(r[0] for r in rows),
        ownable=frozenset(r[0] for r in rows if r[2]),
    )


#: the public schema's owner on a source older than 15 when it is the default one, the bootstrap superuser (oid 10:
#: ``postgres``, RDS's ``rdsadmin``); pg_dump 15 and later say ``ALTER SCHEMA public OWNER TO`` it
DEFAULT_PUBLIC_OWNER = """
SELECT pg_catalog.pg_get_userbyid(nspowner) FROM pg_catalog.pg_namespace
WHERE nspname = 'public' AND nspowner = 10 AND pg_catalog.current_setting('server_version_num')::int < 150000
"""


def default_public_owner(conn: psycopg.Connection[Any]) -> str | None:
    """The source's public schema's owner when that is its default before PostgreSQL 15 (:data:`DEFAULT_PUBLIC_OWNER`),
    else None."""
    row = conn.execute(DEFAULT_PUBLIC_OWNER).fetchone()
    return None if row is None else str(row[0])


def _unquote(name: str) -> str:
    return name[1:-1].replace('""', '"') if name.startswith('"') else name


def without_unrestorable(
    script: str, target: TargetRoles, public_owner: str | None = None
) -> tuple[str, list[str]]:
    """The script without what the target's role could not run (see the module docstring), and what was dropped
    as sentences for the user. A superuser's script is returned as it is. ``public_owner``: the source's public
    schema's default owner before 15 (:func:`default_public_owner`), whose ``ALTER SCHEMA public OWNER TO`` is not
    said."""
    if target.superuser:
        return script, []
    owners: dict[str, int] = {}
    grantees: dict[str, int] = {}
    counted: dict[str, int] = {"session": 0, "comment": 0}

    def owner(m: re.Match[str]) -> str:
        role = _unquote(m.group(1))
        if role in target.ownable:
            return m.group(0)
        if role == public_owner and m.group(0).startswith("ALTER SCHEMA public OWNER TO "):
            return ""  # the target's public schema keeps its own default owner
        owners[role] = owners.get(role, 0) + 1
        return ""

    def grant(m: re.Match[str]) -> str:
        roles = [_unquote(g) for g in m.groups() if g is not None]
        missing = [r for r in roles if r != "PUBLIC" and r not in target.roles]
        if not missing:
            return m.group(0)
        for r in missing:
            grantees[r] = grantees.get(r, 0) + 1
        return ""

    def default_privileges(m: re.Match[str]) -> str:
        who = _unquote(m.group(1))
        if who not in target.ownable:
            grantees[who] = grantees.get(who, 0) + 1
            return ""
        return grant(m)

    def drop(kind: str) -> Any:
        def sub(_: re.Match[str]) -> str:
            counted[kind] += 1
            return ""

        return sub

    script = _OWNER.sub(owner, script)
    script = _DEFAULT_PRIVILEGES.sub(default_privileges, script)
    script = _GRANT.sub(grant, script)
    script = _REVOKE.sub(grant, script)
    script = _SESSION_AUTHORIZATION.sub(drop("session"), script)
    script = _EXTENSION_COMMENT.sub(drop("comment"), script)
    return script, _skipped_sentences(owners, grantees, counted)


def _skipped_sentences(
    owners: dict[str, int], grantees: dict[str, int], counted: dict[str, int]
) -> list[str]:
    said = [
        f"{n} object(s) of role {r} are owned by the migrating role instead (the role does not exist on the "
        "target, or the migrating role may not hand objects to it)"
        for r, n in sorted(owners.items())
    ]
    said += [
        f"{n} grant(s) naming role {r} skipped: the role does not exist on the target"
        for r, n in sorted(grantees.items())
    ]
    if counted["session"]:
        said.append(
            f"{counted['session']} SET/RESET SESSION AUTHORIZATION skipped (superuser only): the grants they "
            "surrounded are made by the objects' owner"
        )
    if counted["comment"]:
        said.append(f"{counted['comment']} COMMENT ON EXTENSION skipped (only the extension's owner may)")
    return said


def pattern(*parts: str) -> str:
    """A pg_dump name pattern that matches exactly these identifiers (no wildcards): each part double-quoted."""
    return ".".join('"' + p.replace('"', '""') + '"' for p in parts)


def edit_script(script: str, settings: Collection[str] | None = None) -> str:
    """The dump as our own session can run it (see the module docstring). ``settings``: the target's parameter
    names; a ``SET`` of one it lacks is dropped (a newer pg_dump sets ``transaction_timeout``, unknown before 17)."""
    script = _RESTRICT.sub("", script)
    if settings is not None:
        known = set(settings)
        script = _SET.sub(lambda m: m.group(0) if m.group(1) in known else "", script)
    return _CREATE_SCHEMA.sub(r"CREATE SCHEMA IF NOT EXISTS \1;", script)


def dump_pre_data(
    tools: DumpTools,
    source: str,
    snapshot: str | None,
    schemas: Sequence[str],
    exclude: Sequence[tuple[str, str]],
    settings: Collection[str] | None = None,
) -> str:
    """The pre-data SQL of ``schemas`` without the tables in ``exclude`` (``(schema, table)``), plus extensions."""
    params = parse(source, "source")
    password = params.pop("password", None)
    env = dict(os.environ)
    if password:
        env["PGPASSWORD"] = password
    argv = [
        tools.pg_dump,
        "--section=pre-data",
        "--no-publications",
        "--no-subscriptions",
        "--extension=*",
        "--dbname",
        make_conninfo("", **params),
    ]
    if snapshot:
        argv.append(f"--snapshot={snapshot}")
    for s in schemas:
        argv += ["--schema", pattern(s)]
    for s, t in exclude:
        argv += ["--exclude-table", pattern(s, t)]
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise MigrationError(f"pg_dump of the source's schema failed: {res.stderr.strip()}")
    return edit_script(res.stdout, settings)
