"""Connection strings as the command line meets them: where the target's comes from, and keeping passwords out of
the catalog and of every message.

The target is ``--target CONNINFO`` or, without it, libpq's own defaults (``PGHOST``, ``PGDATABASE``, ``PGUSER``,
``PGPASSWORD``, ``~/.pgpass``, ``PGSERVICE``...), exactly as ``psql`` behaves: an empty conninfo string hands every
choice to libpq, so we add no rules of our own.

A publisher's conninfo is stored in ``applier.subscription.subconninfo`` *without* its password (PostgreSQL stores
it with one; we do not want a secret in a table every reader of the target can see). ``applier run`` then finds the
password where libpq looks for it: ``~/.pgpass`` / ``PGPASSFILE``, ``PGPASSWORD``, or a ``passfile`` or ``service``
named in the conninfo.
"""

from __future__ import annotations

import re

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from applier.errors import ApplierError

__all__ = [
    "ConninfoError",
    "connection_failure",
    "describe",
    "failure_reason",
    "has_password",
    "parse",
    "scrub",
    "target_conninfo",
    "without_password",
]


class ConninfoError(ApplierError):
    """A connection string libpq cannot parse; the message never contains its password."""


def target_conninfo(option: str | None) -> str:
    """The target's conninfo: ``--target`` if given, else ``""``, which makes libpq use the ``PG*`` environment,
    the service file and its compiled-in defaults, as psql does."""
    return option or ""


def parse(conninfo: str, what: str) -> dict[str, str]:
    """The conninfo's parameters (``what`` names it in the error: "publisher", "target")."""
    try:
        return {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}
    except psycopg.Error as exc:
        raise ConninfoError(
            f"invalid {what} connection string: {scrub(str(exc), conninfo)}"
            " (expected a libpq conninfo such as 'host=h dbname=d user=u' or a URI postgresql://u@h/d)"
        ) from None


def has_password(conninfo: str) -> bool:
    try:
        return bool(conninfo_to_dict(conninfo).get("password"))
    except psycopg.Error:
        return False


def without_password(conninfo: str, what: str = "publisher") -> str:
    """``conninfo`` in key=value form without its password: what ``subconninfo`` stores and messages show."""
    params = parse(conninfo, what)
    params.pop("password", None)
    return make_conninfo("", **params)


def describe(conninfo: str) -> str:
    """A password-free rendering for messages; ``""`` (the environment) and unparsable strings say so."""
    if not conninfo.strip():
        return "from the PG* environment"
    try:
        return without_password(conninfo)
    except ConninfoError:
        return "unparsable connection string"


_PASSWORD_KV = re.compile(r"""password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)""", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]+)@")


def _secrets(conninfo: str) -> list[str]:
    """Every text that may be (part of) the password in ``conninfo``, longest first.

    The parsed value and its raw spellings both count: a URI's password is percent-decoded by parsing but appears
    encoded in the string (and in libpq's messages), a key=value one may be quoted. An unparsable string is what
    libpq's error messages quote fragments of (``missing "=" after "y"``), so everything after ``password=`` counts
    too, piece by piece.
    """
    found: list[str] = []
    try:
        value = conninfo_to_dict(conninfo).get("password")
        if value:
            found.append(str(value))
        parsable = True
    except psycopg.Error:
        parsable = False
    for m in _PASSWORD_KV.finditer(conninfo):
        raw = m.group(1)
        found += [raw, raw.strip("'")]
        if raw.startswith("'"):
            found.append(raw[1:-1].replace("\\'", "'").replace("\\\\", "\\"))
        if not parsable:
            found += conninfo[m.start(1) :].split()
    found += [m.group(1) for m in _URI_PASSWORD.finditer(conninfo)]
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, *conninfos: str) -> str:
    """``text`` with every possible password of ``conninfos`` replaced by ``********``."""
    for conninfo in conninfos:
        for secret in _secrets(conninfo):
            text = text.replace(secret, "********")
    return text


#: What psycopg puts before libpq's own reason when a connection cannot be made: it says nothing to a user.
_PSYCOPG_PREFIX = re.compile(r"^\s*connection (?:is bad|failed):\s*")
#: How libpq begins the reasons that are about the connection string itself, not the server (fe-connect.c:
#: ``invalid integer value "abc" for connection option "port"``, ``invalid sslmode value: "x"``, ``could not match
#: 2 port numbers to 1 hosts``...), found only once it tries to connect.
_INVALID_REASONS = ("invalid ", "could not match ")


def failure_reason(error: BaseException | str, *conninfos: str) -> str:
    """libpq's reason why a connection failed, on one line, without psycopg's prefix or any password."""
    text = " ".join(scrub(str(error), *conninfos).split())
    return _PSYCOPG_PREFIX.sub("", text)


def connection_failure(side: str, conninfo: str, error: BaseException | str) -> tuple[str, bool]:
    """The message for a connection to ``side`` ("target", "publisher") that could not be made, and whether the
    connection string is at fault (else the server could not be reached or refused us). A user has to tell those
    two apart: one is fixed in the command line, the other on the server or the network."""
    reason = failure_reason(error, conninfo)
    if reason.startswith(_INVALID_REASONS):
        return f"invalid {side} connection string ({describe(conninfo)}): {reason}", True
    return f"could not connect to the {side} ({describe(conninfo)}): {reason}", False
