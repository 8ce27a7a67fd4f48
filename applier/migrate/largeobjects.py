"""Large objects: copied at the migration's snapshot during ``start``, brought up to date at the cutover.

``pg_largeobject`` is not replicated by logical decoding, so the stream never carries a large object's change. Two
passes make the target's large objects equal the source's:

- ``start`` copies every large object *inside the pre-data's target transaction*, read at the slot's exported
  snapshot: with its OID (``lo_create(oid)``), contents, owner and privileges, as pg_dump restores them. A kill
  before that transaction commits leaves none of it, one after leaves all of it, so a resume never copies one twice.
- the cutover, once the source is fenced and the apply has caught up, compares both sides by OID, size, ``md5`` of
  the contents, owner and ACL (:func:`differences`, pure) and re-copies what changed, creates what is new and unlinks
  what the source unlinked. Its cost is in the write downtime: both servers read every large object once (``md5``
  is computed on each server, only the changed ones cross the network).

Large objects belong to the database, not to a schema: like pg_dump, a migration carries them when it selects the
whole database (no ``--schema`` and no ``--table``; ``--exclude-table`` does not matter), see :func:`selected`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["CHUNK", "LargeObject", "copy", "differences", "read", "selected", "sync"]

#: Bytes read and written per round trip.
CHUNK = 4 << 20


@dataclass(frozen=True)
class LargeObject:
    oid: int
    owner: str
    acl: (
        tuple[tuple[str, str, bool], ...] | None
    )  # (grantee, "" for PUBLIC; privilege; grantable) in order; None: default
    size: int
    md5: str


def selected(selection: Mapping[str, Any]) -> bool:
    """Whether the migration carries large objects: pg_dump's rule, only when the whole database is selected."""
    return not selection.get("schemas") and not selection.get("tables")


_READ = """
SELECT m.oid::int8, pg_get_userbyid(m.lomowner), m.lomacl IS NULL,
       coalesce((SELECT array_agg(ARRAY[CASE WHEN a.grantee = 0 THEN '' ELSE pg_get_userbyid(a.grantee) END,
                                        a.privilege_type, a.is_grantable::text] ORDER BY a.n)
                 FROM aclexplode(m.lomacl) WITH ORDINALITY a(grantor, grantee, privilege_type, is_grantable, n)),
                '{}'),
       {contents}
FROM pg_largeobject_metadata m ORDER BY 1
"""


def read(conn: psycopg.Connection[Any], *, checksums: bool = True) -> dict[int, LargeObject]:
    """Every large object of ``conn``'s database with its owner, privileges, size and (``checksums``) md5.
    ``lo_get`` needs the SELECT privilege on each: run as their owner or a superuser."""
    contents = "length(lo_get(m.oid))::int8, " + ("md5(lo_get(m.oid))" if checksums else "''")
    out = {}
    for oid, owner, default, grants, size, digest in conn.execute(_READ.replace("{contents}", contents)):
        acl = None if default else tuple((g, p, b == "true") for g, p, b in grants)  # in the ACL's order
        out[oid] = LargeObject(oid, owner, acl, size, digest)
    return out


def differences(
    source: Mapping[int, LargeObject], target: Mapping[int, LargeObject]
) -> tuple[list[int], list[int]]:
    """Pure: (OIDs to copy: new on the source, or other contents, owner or privileges; OIDs to unlink)."""
    changed = [oid for oid, lo in source.items() if target.get(oid) != lo]
    return changed, [oid for oid in target if oid not in source]


def _privileges(target: psycopg.Connection[Any], lo: LargeObject) -> None:
    """Owner and privileges as on the source, on a large object just created (default privileges)."""
    obj = sql.SQL("LARGE OBJECT {}").format(sql.Literal(lo.oid))
    target.execute(sql.SQL("ALTER {} OWNER TO {}").format(obj, sql.Identifier(lo.owner)))
    if lo.acl is None:
        return
    target.execute(sql.SQL("REVOKE ALL ON {} FROM PUBLIC, {}").format(obj, sql.Identifier(lo.owner)))
    for grantee, privilege, grantable in lo.acl:
        who = sql.SQL("PUBLIC") if grantee == "" else sql.Identifier(grantee)
        option = sql.SQL(" WITH GRANT OPTION") if grantable else sql.SQL("")
        target.execute(sql.SQL("GRANT {} ON {} TO {}{}").format(sql.SQL(privilege), obj, who, option))


def _contents(source: psycopg.Connection[Any], target: psycopg.Connection[Any], oid: int, size: int) -> None:
    """Create ``oid`` on the target (unlinking an older one) with the source's contents, :data:`CHUNK` at a time."""
    target.execute("SELECT lo_unlink(oid) FROM pg_largeobject_metadata WHERE oid = %s::oid", (oid,))
    target.execute("SELECT lo_create(%s::oid)", (oid,))
    for offset in range(0, size, CHUNK):
        data = source.execute("SELECT lo_get(%s::oid, %s, %s)", (oid, offset, CHUNK)).fetchone()[0]  # type: ignore[index]
        target.execute("SELECT lo_put(%s::oid, %s, %s)", (oid, offset, data))


def copy(source: psycopg.Connection[Any], target: psycopg.Connection[Any]) -> int:
    """Every large object of the source onto the target, in the callers' transactions (``source`` inside the
    migration's snapshot); returns how many."""
    los = read(source, checksums=False)
    for lo in los.values():
        _contents(source, target, lo.oid, lo.size)
        _privileges(target, lo)
    return len(los)


def sync(
    source: psycopg.Connection[Any], target: psycopg.Connection[Any], say: Callable[[str], None]
) -> None:
    """The cutover's pass (source fenced, apply caught up): make the target's large objects equal the source's, in
    one target transaction."""
    have = read(source)
    changed, unlink = differences(have, read(target))
    with target.transaction():
        for oid in changed:
            _contents(source, target, oid, have[oid].size)
            _privileges(target, have[oid])
        for oid in unlink:
            target.execute("SELECT lo_unlink(%s::oid)", (oid,))
    say(
        f"large objects: {len(have)} on the source; {len(changed)} copied and {len(unlink)} unlinked at the cutover"
    )
