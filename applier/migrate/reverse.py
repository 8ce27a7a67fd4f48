"""``applier migrate cutover --reverse``: after the cutover the old server follows the new one, so that a user can
switch back without losing a write made on the new server.

What it creates: on the new server (the migration's target) a publication ``<name>_reverse`` of the migrated tables
and a logical slot ``<name>_reverse``; on the old server (the source) a native subscription ``<name>_reverse`` on
that slot, ``copy_data = false``, plus ``origin = none`` where the old server is PostgreSQL 16 or later.

Where it starts, so that nothing is lost or doubled: the slot is created on the new server once the target has
applied the cutover's end position and before the migration is ``done`` (before any application can write there).
At that moment the new server holds exactly what the old one holds (the source is fenced: nothing changed after the
end position), so every change after the slot's point is one the old server lacks, and nothing before it is sent.

Why a native subscription, for PostgreSQL 15 too: it lives inside the old server (no process of ours to keep
running) and nothing but the applications writes to the new server after the cutover. ``origin = none`` (16+) only
adds a guard against sending back what our apply wrote on the new server; on 15, which lacks the option, the slot's
starting point already excludes all of that (our apply has nothing left to write once the end position is applied,
and the migration's subscription is disabled at ``done``).

The fence: ``ALTER DATABASE … SET default_transaction_read_only = on`` stays on the old server (applications stay
fenced). The native apply worker is not stopped by it: it writes through the executor's low-level routines, which do
not check the transaction's read-only flag (tests/integration/test_migrate_carry.py shows a write arriving).

Everything is created before ``done``; if the cutover fails afterwards, :func:`undo` removes it again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from applier.migrate.state import MigrationError

__all__ = ["check_new_server", "create", "names", "new_server_conninfo", "undo"]


def names(migration: str) -> str:
    """The publication, slot and subscription name of the reverse direction."""
    return f"{migration}_reverse"


def check_new_server(target: psycopg.Connection[Any], migration: str) -> None:
    """Before fencing anything: the new server must be able to publish (``wal_level = logical``, a free slot)."""
    wal_level, free = target.execute(
        "SELECT current_setting('wal_level'), current_setting('max_replication_slots')::int"
        " - (SELECT count(*) FROM pg_replication_slots)"
    ).fetchone()  # type: ignore[misc]
    if wal_level != "logical":
        raise MigrationError(
            f"--reverse needs wal_level = logical on the new server (the target), not {wal_level}: "
            "set it and restart the target, or cut over without --reverse"
        )
    if free < 1:
        raise MigrationError(
            "--reverse needs a free replication slot on the new server (max_replication_slots)"
        )
    name = names(migration)
    row = target.execute(
        "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = %s)"
        " OR EXISTS (SELECT FROM pg_publication WHERE pubname = %s)",
        (name, name),
    ).fetchone()
    if row and row[0]:
        raise MigrationError(f'the new server already has a slot or publication "{name}": drop it first')


_PORTABLE = (
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
)


def new_server_conninfo(target: psycopg.Connection[Any]) -> str:
    """How the old server reaches the new one: the cutover's own target connection, as it was made (host, port,
    database, user, SSL settings: the ``PG*`` environment resolved), and its password if it used one, which a
    native subscription needs to log in (PostgreSQL keeps it in ``pg_subscription``, readable by superusers only)."""
    # only what every libpq from 15 on knows: the old server's own libpq reads it (a newer client reports options
    # such as sslcertmode that PostgreSQL 15 rejects)
    params = {k: v for k, v in target.info.get_parameters().items() if k in _PORTABLE}
    if target.info.password:
        params["password"] = target.info.password
    return make_conninfo("", **params)


def create(
    target: psycopg.Connection[Any],
    src: psycopg.Connection[Any],
    migration: str,
    tables: list[str],
    say: Callable[[str], None],
) -> None:
    """Publication and slot on the new server, then the old server's subscription on that slot (see the module's
    docstring for why here and why so). ``tables`` are schema-qualified and quoted (``format('%I.%I')``)."""
    name = names(migration)
    ident = sql.Identifier(name)
    target.execute(
        sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            ident, sql.SQL(", ").join(sql.SQL(t) for t in tables)
        )
    )
    (lsn,) = target.execute(
        "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)
    ).fetchone()  # type: ignore[misc]
    options = [
        sql.SQL("create_slot = false"),
        sql.SQL("copy_data = false"),
        sql.SQL("slot_name = {}").format(sql.Literal(name)),
    ]
    if src.info.server_version >= 160000:
        options.append(sql.SQL("origin = none"))
    src.execute(
        sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH ({})").format(
            ident, sql.Literal(new_server_conninfo(target)), ident, sql.SQL(", ").join(options)
        )
    )
    say(
        f"reverse: the old server follows the new one from {lsn} (subscription {name} on the old server; "
        f"publication and slot {name} on the new one)"
    )


def undo(target: psycopg.Connection[Any], src: psycopg.Connection[Any], migration: str) -> None:
    """Remove what :func:`create` made (each step tolerates its object being absent)."""
    name = names(migration)
    ident = sql.Identifier(name)
    if src.execute("SELECT FROM pg_subscription WHERE subname = %s", (name,)).fetchone() is not None:
        src.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(ident))
        src.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(ident))
        src.execute(sql.SQL("DROP SUBSCRIPTION {}").format(ident))
    deadline = time.monotonic() + 30
    while (
        target.execute("SELECT FROM pg_replication_slots WHERE slot_name = %s", (name,)).fetchone()
        is not None
    ):
        with contextlib.suppress(psycopg.errors.ObjectInUse):
            target.execute("SELECT pg_drop_replication_slot(%s)", (name,))
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    target.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(ident))
