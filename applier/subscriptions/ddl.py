"""A subscription's schema changes (``create --ddl``, ``alter --set ddl``, issue 39): the DDL capture of
:mod:`applier.ddl.capture` on the publisher, for the subscription's slot, covering what its publications cover
(:func:`published_scope`); the apply worker replays its messages when ``subddl`` is on
(:mod:`applier.apply.ddl_replay`).

The capture is installed *before* the slot is created, so that every DDL committed after the slot's consistent
point is in the stream with its message; a ``create`` that fails later removes it again (:func:`installed_for`).
No publication is altered by a subscription's capture: ``FOR ALL TABLES`` and ``TABLES IN SCHEMA`` publications
publish a new table by themselves, and the table joins the subscription when its ``CREATE TABLE`` is replayed.

The capture needs a plain (non-replication) session: a walsender answers only the simple query protocol, and the
capture's statements bind parameters. It is opened with the same conninfo, so the same password source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from applier.conninfo import ConninfoError, connection_failure, parse
from applier.ddl import capture
from applier.ddl.capture_sql import SCHEMA, Published
from applier.subscriptions.common import (
    _PUBLISHER_CONNINFO_HINT,
    _PUBLISHER_HINT,
    Console,
    SubscriptionError,
)

__all__ = ["installed_for", "published_scope", "remove", "set_capture"]

#: pg_publication_namespace (``TABLES IN SCHEMA``) exists from PostgreSQL 15 on.
_IN_SCHEMA_VERSION = 150000

_HINT = (
    "--ddl needs a publisher conninfo that names a superuser (on a managed service, a member of its admin role); "
    "without --ddl, schema changes on the publisher must be run on the target by hand, before the rows that need "
    'them (docs/security.md, "Schema changes")'
)


@contextlib.contextmanager
def _session(conninfo: str, command: str, subname: str, doing: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain SQL session on the publisher, its failures worded as :func:`~applier.subscriptions.common.
    connect_publisher` words them (the password never in them)."""
    try:
        parse(conninfo, "publisher")
    except ConninfoError as exc:
        raise SubscriptionError(str(exc), _PUBLISHER_CONNINFO_HINT) from None
    try:
        conn = psycopg.connect(
            conninfo, autocommit=True, application_name=f"applier {command} {subname}"[:63]
        )
    except psycopg.Error as exc:
        message, invalid = connection_failure("publisher", conninfo, exc)
        raise SubscriptionError(
            f"{message} (needed to {doing})", _PUBLISHER_CONNINFO_HINT if invalid else _PUBLISHER_HINT
        ) from None
    with conn:
        yield conn


def published_scope(conn: psycopg.Connection[Any], publications: Sequence[str]) -> Published:
    """What ``publications`` cover, by exact names: every user schema if one is ``FOR ALL TABLES``, else the
    schemas of their ``TABLES IN SCHEMA`` (PostgreSQL 15+) and the tables they list."""
    pubs = list(publications)
    row = conn.execute(
        "SELECT coalesce(bool_or(puballtables), false) FROM pg_publication WHERE pubname = ANY(%s)", (pubs,)
    ).fetchone()
    if row and row[0]:
        return Published(tuple(pubs), all_tables=True)
    schemas: list[str] = []
    if conn.info.server_version >= _IN_SCHEMA_VERSION:
        schemas = [
            r[0]
            for r in conn.execute(
                "SELECT DISTINCT n.nspname FROM pg_publication_namespace pn JOIN pg_publication p"
                " ON p.oid = pn.pnpubid JOIN pg_namespace n ON n.oid = pn.pnnspid WHERE p.pubname = ANY(%s)"
                " ORDER BY 1",
                (pubs,),
            )
        ]
    tables = [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT DISTINCT n.nspname, c.relname FROM pg_publication_rel pr JOIN pg_publication p"
            " ON p.oid = pr.prpubid JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE p.pubname = ANY(%s) ORDER BY 1, 2",
            (pubs,),
        )
    ]
    return Published(tuple(pubs), schemas=tuple(schemas), tables=tuple(tables))


def _install(conn: psycopg.Connection[Any], slot: str, publications: Sequence[str]) -> None:
    """Install the capture of ``slot`` for ``publications``, or refuse with what right is missing."""
    ok, why = capture.can_capture(conn)
    if ok:
        try:
            capture.install(conn, slot, published_scope(conn, publications), None)
            return
        except psycopg.errors.InsufficientPrivilege as exc:
            why = str(exc).splitlines()[0]
        except psycopg.Error as exc:
            raise SubscriptionError(
                f"could not install the DDL capture on the publisher: {str(exc).splitlines()[0]}"
            ) from None
    raise SubscriptionError(
        "--ddl cannot install its DDL capture on the publisher: " + why.replace("on the source", "there"),
        _HINT,
    )


@contextlib.contextmanager
def installed_for(conninfo: str, subname: str, slot: str, publications: Sequence[str],
                  *, enabled: bool, console: Console) -> Iterator[None]:  # fmt: skip
    """``create --ddl``: the capture installed on entry (before the slot: see the module's docstring) and removed
    again if the body fails, Ctrl-C included, so that a failed create leaves nothing on the publisher."""
    if not enabled:
        yield
        return
    with _session(conninfo, "create", subname, "install the DDL capture") as conn:
        _install(conn, slot, publications)
    console.info(f'DDL capture of slot "{slot}" installed on the publisher (schema {SCHEMA}, event triggers)')
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception), _session(conninfo, "create", subname, "undo") as conn:
            capture.remove(conn, slot)
        raise


def set_capture(conninfo: str, subname: str, slot: str | None, publications: Sequence[str], on: bool,
                console: Console) -> None:  # fmt: skip
    """``alter --set ddl=true|false``: install or remove the capture of ``slot``, before the catalog changes (so a
    refusal changes nothing). Turning it on needs a slot; turning it off without one has nothing to remove."""
    if slot is None:
        if on:
            raise SubscriptionError(
                f'cannot set ddl for subscription "{subname}": it has no slot (slot_name = NONE)',
                "set a slot first: applier alter NAME --set slot_name=SLOT",
            )
        return
    if not on:
        remove(conninfo, subname, slot, console, command="alter")
        return
    with _session(conninfo, "alter", subname, "install the DDL capture") as conn:
        _install(conn, slot, publications)
    console.info(f'DDL capture of slot "{slot}" installed on the publisher')


def remove(conninfo: str, subname: str, slot: str, console: Console, *, command: str = "drop") -> None:
    """``drop`` (and ``alter --set ddl=false``): the capture of ``slot`` removed from the publisher (nothing there:
    nothing done)."""
    try:
        with _session(conninfo, command, subname, "remove the DDL capture") as conn:
            removed = capture.remove(conn, slot)
    except psycopg.Error as exc:
        raise SubscriptionError(
            f'could not remove the DDL capture of slot "{slot}" from the publisher: {str(exc).splitlines()[0]}',
            f"remove it as a superuser on the publisher: {capture.manual_removal(slot)}",
        ) from None
    if removed:
        console.info(f'DDL capture of slot "{slot}" removed from the publisher')
