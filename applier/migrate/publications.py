"""The migration's publications on the source, and what becomes of the tables that cannot publish UPDATE/DELETE.

Do no harm to the source (issue 43): a table in a publication that carries UPDATE and DELETE must have a replica
identity (a primary key, FULL, or an identity index), or PostgreSQL refuses the *application's* UPDATE and DELETE on
it ("cannot update table ... because it does not have a replica identity and publishes updates"). So the selected
tables go in two publications, created together in one transaction:

- ``<name>``: the tables with a usable identity (:data:`applier.migrate.survey.IDENTITY_USABLE`), every operation;
- ``<name>_ins`` (:func:`insert_only_name`): the plain tables without one, ``publish = 'insert, truncate'``. The
  source keeps taking every write; their INSERTs and TRUNCATEs are migrated, their UPDATEs and DELETEs are not.
  A partition is published by its own name, so its own key or identity decides (PostgreSQL checks the partition,
  not its parent). ``<name>_ins`` exists even when empty: the subscription names both from the start, and a start
  run again before the copy ends may move a table between them (one that got a key, or lost it).

An insert-only table is watched rather than trusted: when the publications are made, each one's
``n_tup_upd + n_tup_del`` (``pg_stat_user_tables``) and the database's ``stats_reset`` go into the migration's
notes (``insert_only``). :func:`diverging` names the tables whose counter moved since (or went down, or whose
statistics were reset: then it cannot be told, and they count as diverging). The cutover refuses before the fence
when one of them is larger than :data:`RECOPY_MAX_BYTES` (:func:`refuse_before_fence`), and copies the others again
under the fence (:func:`recopy`); ``status`` shows them (:func:`report`).

Limits: the counters come from the statistics system, which a session reports up to about a second after its
transaction ends (PostgreSQL 15 and later; the statistics collector before), or at its exit, so the cutover asks
again under the fence; a counter also counts the rows of an UPDATE/DELETE that rolled back (a needless copy, never a
missed one). A crash of the source discards its statistics without setting ``stats_reset``: seen only where a
counter went down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from applier.humanize import human_bytes
from applier.migrate import store
from applier.migrate.plan import RECOPY_MAX_BYTES, insert_only_ways_out
from applier.migrate.state import MigrationError, Phase
from applier.migrate.survey import IDENTITY_USABLE

__all__ = [
    "INSERT_ONLY_PUBLISH",
    "NOTE",
    "RECOPY_MAX_BYTES",
    "Diverging",
    "Split",
    "create",
    "diverging",
    "drop",
    "existing",
    "insert_only_name",
    "insert_only_tables",
    "names",
    "recopy",
    "refuse_before_fence",
    "report",
]

#: What ``<name>_ins`` publishes: every write but those that need a replica identity.
INSERT_ONLY_PUBLISH = "insert, truncate"
#: The key of the migration's notes that holds the insert-only tables' baseline.
NOTE = "insert_only"
_SUFFIX = "_ins"
_NAME_BYTES = 63  # NAMEDATALEN - 1: a longer name would be truncated by the server, silently

# each selected (schema, table): its quoted name, whether it can publish UPDATE/DELETE, its UPDATE+DELETE counter
# (a table gone since the selection goes with the others: CREATE PUBLICATION then says it does not exist)
_TABLES = f"""
SELECT x.s, x.t, format('%%I.%%I', x.s, x.t), coalesce(c.relkind <> 'r' OR {IDENTITY_USABLE}, true),
       coalesce(st.n_tup_upd + st.n_tup_del, 0)
FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS x(s, t, i)
LEFT JOIN pg_namespace n ON n.nspname = x.s LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = x.t
LEFT JOIN pg_stat_user_tables st ON st.relid = c.oid
ORDER BY x.i
"""  # noqa: S608 - a constant expression of ours (IDENTITY_USABLE), no name

# the watched tables (quoted names) that still exist: schema, name, counter, size
_WATCHED = """
SELECT x.q, n.nspname, c.relname, coalesce(st.n_tup_upd + st.n_tup_del, 0), pg_total_relation_size(c.oid)
FROM unnest(%s::text[]) AS x(q) JOIN pg_class c ON c.oid = to_regclass(x.q)
JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_stat_user_tables st ON st.relid = c.oid
ORDER BY 1
"""

_STATS_RESET = "SELECT stats_reset::text FROM pg_stat_database WHERE datname = current_database()"


# --- names -------------------------------------------------------------------------------------------------------


def insert_only_name(name: str) -> str:
    """``<name>_ins``, the migration's name cut so that the whole fits PostgreSQL's 63 bytes (a migration's name is
    1-63 of ``[a-z0-9_]``, one byte each)."""
    return name[: _NAME_BYTES - len(_SUFFIX)] + _SUFFIX


def names(name: str) -> list[str]:
    """Both publications of migration ``name``: every operation first, then insert-only."""
    return [name, insert_only_name(name)]


def existing(src: psycopg.Connection[Any], name: str) -> list[str]:
    """Those of :func:`names` that exist on the source, in that order: what a subscription or a decoding of the
    migration's changes may name (a migration started before ``<name>_ins`` existed has only ``<name>``)."""
    found = {
        r[0]
        for r in src.execute("SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)", (names(name),))
    }
    return [p for p in names(name) if p in found]


# --- which tables go where --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """The selected tables (schema, name) by publication, and each insert-only table's ``n_tup_upd + n_tup_del``
    now, by its quoted name (``format('%I.%I')``, the notes' key)."""

    full: list[tuple[str, str]]
    insert_only: list[tuple[str, str]]
    counters: dict[str, int]


def _split(src: psycopg.Connection[Any], tables: Sequence[tuple[str, str]]) -> Split:
    full: list[tuple[str, str]] = []
    insert_only: list[tuple[str, str]] = []
    counters: dict[str, int] = {}
    rows = src.execute(_TABLES, ([s for s, _ in tables], [t for _, t in tables])).fetchall()
    for schema, table, quoted, usable, counter in rows:
        if usable:
            full.append((schema, table))
        else:
            insert_only.append((schema, table))
            counters[quoted] = int(counter)
    return Split(full, insert_only, counters)


def insert_only_tables(
    src: psycopg.Connection[Any], tables: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Those of ``tables`` (schema, name) that go in ``<name>_ins``: plain tables whose own key or identity cannot
    publish UPDATE/DELETE. Partitioned tables are never published (their leaves are)."""
    return _split(src, tables).insert_only


# --- creating and dropping them --------------------------------------------------------------------------------


def _check_ours(m: store.Migration, found: list[str]) -> None:
    """Never touch a publication this migration did not make: one that exists before it marked its own."""
    if found and not m.pub_created:
        raise MigrationError(
            f'a publication "{found[0]}" already exists on the source and was not made by this migration: '
            "choose another migration name"
        )


def _put(
    src: psycopg.Connection[Any],
    pub: str,
    tables: list[tuple[str, str]],
    exists: bool,
    publish: str | None,
) -> None:
    """Make publication ``pub`` hold exactly ``tables``: created (with ``publish`` when given), set, or emptied (an
    existing one stays, empty: the subscription may name it)."""
    ident = sql.Identifier(pub)
    listed = sql.SQL(", ").join(sql.Identifier(s, t) for s, t in tables)
    with_ = sql.SQL(" WITH (publish = {})").format(sql.Literal(publish)) if publish else sql.SQL("")
    if not exists:
        tail = sql.SQL(" FOR TABLE {}").format(listed) if tables else sql.SQL("")
        src.execute(sql.SQL("CREATE PUBLICATION {}{}{}").format(ident, tail, with_))
        return
    if tables:
        src.execute(sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(ident, listed))
        return
    held = src.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (pub,)
    ).fetchall()
    if held:
        src.execute(
            sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                ident, sql.SQL(", ").join(sql.Identifier(s, t) for s, t in held)
            )
        )


def create(
    src: psycopg.Connection[Any],
    target: psycopg.Connection[Any],
    m: store.Migration,
    tables: Sequence[tuple[str, str]],
) -> Split | None:
    """Both publications of migration ``m`` over ``tables`` (schema, name; ``src`` autocommits), and the
    insert-only tables' baseline in its notes. Idempotent as a start is: created once; set to today's tables when
    started again before the copy is over; left as they are after it (a cutover may have fenced the source
    already), which returns None. Refused when a publication of either name exists that this migration did not
    make."""
    main, ins = names(m.name)
    found = existing(src, m.name)
    _check_ours(m, found)
    if found and m.phase not in (Phase.SCHEMA, Phase.COPY):
        return None
    split = _split(src, tables)
    store.mark_publication_created(target, m.name)
    before = m.notes.get(NOTE) or {}
    store.add_notes(target, m.name, {NOTE: _note(src, split, before, ins)})
    with src.transaction():
        _put(src, main, split.full, main in found, None)
        _put(src, ins, split.insert_only, ins in found, INSERT_ONLY_PUBLISH)
    return split


def _note(src: psycopg.Connection[Any], split: Split, before: Mapping[str, Any], ins: str) -> dict[str, Any]:
    """The ``insert_only`` note: a table watched already keeps its older counter (the earlier, the more a later
    comparison sees), a new one gets today's, read before the publication exists; with the statistics' reset time
    they count from (a reset since the first baseline is seen as one)."""
    old = before.get("tables", {})
    reset = before["stats_reset"] if "stats_reset" in before else src.execute(_STATS_RESET).fetchone()[0]  # type: ignore[index]
    return {
        "publication": ins,
        "tables": {q: int(old.get(q, n)) for q, n in split.counters.items()},
        "stats_reset": reset,
    }


def drop(src: psycopg.Connection[Any], name: str, say: Callable[[str], None]) -> None:
    """Drop both publications of migration ``name`` from the source, those that exist (``src`` must be allowed to
    write: :func:`applier.migrate.fence.open_source` under a fence)."""
    found = existing(src, name)
    if not found:
        return
    src.execute(
        sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.SQL(", ").join(sql.Identifier(p) for p in found))
    )
    say(f"publication {', '.join(found)} dropped from the source")


# --- watching the insert-only tables -------------------------------------------------------------------------


@dataclass(frozen=True)
class Diverging:
    """An insert-only table that received UPDATE/DELETE since its baseline: the target may lack those."""

    table: str  # quoted, format('%I.%I')
    schema: str
    name: str
    changes: int | None  # UPDATE/DELETE rows since the baseline; None: cannot be told (statistics reset)
    bytes: int  # pg_total_relation_size on the source (what a copy moves, and the target's indexes to fill)

    def describe(self) -> str:
        what = (
            "its statistics were reset, so whether it received UPDATE/DELETE cannot be told"
            if self.changes is None
            else f"{self.changes} row(s) updated or deleted"
        )
        return f"{self.table} ({human_bytes(self.bytes)}: {what})"

    def to_json(self, limit_bytes: int = RECOPY_MAX_BYTES) -> dict[str, Any]:
        return {
            "table": self.table,
            "updates_deletes": self.changes,
            "statistics_reset": self.changes is None,
            "bytes": self.bytes,
            "recopy": self.bytes <= limit_bytes,
        }


def diverging(src: psycopg.Connection[Any], m: store.Migration) -> list[Diverging]:
    """The insert-only tables of ``m`` whose ``n_tup_upd + n_tup_del`` moved from the baseline in its notes, went
    down, or whose database's statistics were reset since (both: cannot be told, so diverging), with their size on
    the source. A table dropped since is left out (DDL is not migrated)."""
    note = m.notes.get(NOTE) or {}
    base: dict[str, int] = note.get("tables") or {}
    if not base:
        return []
    reset = src.execute(_STATS_RESET).fetchone()[0] != note.get("stats_reset")  # type: ignore[index]
    out = []
    for quoted, schema, name, counter, size in src.execute(_WATCHED, (sorted(base),)):
        before, now = base[quoted], int(counter)
        if reset or now < before:
            out.append(Diverging(quoted, schema, name, None, int(size)))
        elif now > before:
            out.append(Diverging(quoted, schema, name, now - before, int(size)))
    return out


def report(
    src: psycopg.Connection[Any], m: store.Migration, limit_bytes: int = RECOPY_MAX_BYTES
) -> list[dict[str, Any]]:
    """``status``'s view of :func:`diverging`, as JSON: each table, what moved, its size and whether the cutover
    would copy it again (``recopy``) or refuse."""
    return [d.to_json(limit_bytes) for d in diverging(src, m)]


def refuse_before_fence(tables: Sequence[Diverging], limit_bytes: int = RECOPY_MAX_BYTES) -> str | None:
    """Why the cutover refuses, or None: a diverging table larger than ``limit_bytes`` would be copied again under
    the fence (write downtime), so it is refused before the fence, naming each such table and the ways out."""
    large = [d for d in tables if d.bytes > limit_bytes]
    if not large:
        return None
    ways = "; ".join(f"for {d.table}: {insert_only_ways_out(d.table, started=True)}" for d in large)
    return (
        f"{len(large)} table(s) without a primary key or usable replica identity received UPDATE/DELETE on the "
        "source during the migration, which are not migrated (they are published for INSERT and TRUNCATE only), and "
        f"are larger than the {human_bytes(limit_bytes)} the cutover copies again while the source is fenced: "
        + ", ".join(d.describe() for d in large)
        + f". Ways out: {ways}"
    )


# --- copying them again ----------------------------------------------------------------------------------------


def _columns(target: psycopg.Connection[Any], table: str) -> list[str]:
    """The target table's columns a COPY writes: not dropped, not generated (the target computes those)."""
    return [
        r[0]
        for r in target.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
            " AND attgenerated = '' ORDER BY attnum",
            (table,),
        )
    ]


def _copy_table(src: psycopg.Connection[Any], target: psycopg.Connection[Any], d: Diverging) -> int:
    """Replace the target's rows of ``d`` with the source's (inside the caller's transaction); rows copied."""
    ident = sql.Identifier(d.schema, d.name)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in _columns(target, d.table))
    target.execute(sql.SQL("DELETE FROM {}").format(ident))
    with target.cursor() as into, src.cursor() as out:
        with (
            out.copy(sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(cols, ident)) as reading,
            into.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(ident, cols)) as writing,
        ):
            for chunk in reading:
                writing.write(chunk)
        return into.rowcount  # the COPY's own count, once it has ended


def recopy(
    src: psycopg.Connection[Any],
    target: psycopg.Connection[Any],
    tables: Sequence[Diverging],
    say: Callable[[str], None],
) -> dict[str, int]:
    """Copy ``tables`` again from the fenced source (nothing changes there any more) once the target has applied
    its end position: in one target transaction (all or none), as the apply writes (``session_replication_role =
    replica``: no trigger, no foreign-key action fires, the source is the authority), each table emptied then
    filled with the source's rows. Returns each table's rows: the source's count too, for a verification."""
    copied: dict[str, int] = {}
    if not tables:
        return copied
    with target.transaction():
        target.execute("SET LOCAL session_replication_role = replica")
        for d in tables:
            copied[d.table] = _copy_table(src, target, d)
    for d in tables:
        say(
            f"copied again: {d.table}, {copied[d.table]} row(s) (it received UPDATE/DELETE, which are not migrated)"
        )
    return copied
