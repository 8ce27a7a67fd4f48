"""The cutover's row counts (``--verify counts``), counted before the fence where that stays exact (issue 28).

Counting every table under the fence was most of the write downtime (2.7 s for 6 M rows). Now the counts are taken
before the fence, at one point C of the source's WAL, and after the fence only the tables that changed since C are
counted again:

- **the source at C**: a second logical slot of ours (``<slot>_count``, pgoutput) is created with an exported
  snapshot; the source is counted in that snapshot, which holds exactly the transactions committed before the
  slot's consistent point C (the guarantee the initial copy relies on);
- **the target at C or later**: counted once the migration's slot has ``confirmed_flush_lsn`` ≥ C. The worker
  reports a position as flushed only once its commit came back from the target (:mod:`applier.apply.feedback`), so
  every transaction up to C is then visible to the count. (The replication origin's progress is not used here: it
  moves inside the commit, before the transaction is visible to others.)
- **what changed after C**: right after the fence (while the target still applies the end position), the
  ``_count`` slot is read (``pg_logical_slot_peek_binary_changes`` with the migration's publication; its Relation,
  Insert, Delete, Truncate and Commit messages): pgoutput sends a Relation message before the first change of each
  table in that decoding, so these name every table a transaction committed after C changed, up to the moment of
  the read (past the end position). The last Commit's position is where the target's replication origin will be
  once it has applied them all: the cutover waits for that, not for the slot to confirm the end position, which
  comes only after the target flushed its WAL and the worker reported it (about 0.4 s more).

A table no transaction changed after C has, on the source, its count at C as its final count; on the target,
nothing the stream applied after the pre-fence count touched it, so its count then is final too: the two counts
are compared as they are. So does a table that the transactions after C only updated: an UPDATE adds or removes no
row on the source, nor on the target as the worker applies it (by key; a row it does not find is a conflict, not a
new row; unless a trigger or rule enabled ALWAYS or REPLICA on the target table fires for the apply, and then the
table is counted again), so neither count can have moved (pgbench's accounts, tellers and branches: 3 M rows
not scanned under the fence). Every other table is counted again on the target after the fence; its final count on
the source is derived, exactly, from its count at C and the Insert and Delete messages the ``_count`` slot decodes
for it (an UPDATE changes no count; a row moved to another partition is a Delete and an Insert), so the source
scans nothing under the fence; after a TRUNCATE the source is counted again too. Anything that goes
wrong before the fence (no free slot or WAL sender, a prepared transaction on the source, which would hold the
slot's creation, a target that does not reach C in time) only means that every table is counted after the fence,
as before; the report and the migration's notes say which.

What this does not see that counting under the fence did: a write to the target by something else than the
migration (applications must not write to the new server before the cutover is done) into a table the source did
not change after C, or only updated.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from applier.lsn import format_lsn
from applier.replication import ReplicationConnection, ReplicationConnectionError

__all__ = [
    "Baseline",
    "Changes",
    "Verified",
    "after_fence",
    "before_fence",
    "drop_slot",
    "read_changes",
    "slot_name",
]

#: how long the ``_count`` slot's creation may wait for the source's running transactions
CREATE_SLOT_SECONDS = 10.0
#: how long the target may take to confirm the slot's point before the fence
REACH_SECONDS = 30.0
#: a table whose counts differ under the fence is counted again on the target after this many seconds
RECOUNT_AFTER = 0.1
_SUFFIX = "_count"
# pgoutput's message types: Relation, Insert, Delete, Truncate, Commit
_RELATION, _INSERT, _DELETE, _TRUNCATE, _COMMIT = 0x52, 0x49, 0x44, 0x54, 0x43
_KINDS = (_RELATION, _INSERT, _DELETE, _TRUNCATE, _COMMIT)
# the messages that end a transaction in the stream: Commit, Prepare, Commit Prepared, Rollback Prepared
_ENDS = (_COMMIT, 0x50, 0x4B, 0x72)


def slot_name(slot: str) -> str:
    """The ``_count`` slot beside the migration's ``slot`` (slot names have at most 63 bytes)."""
    return slot[: 63 - len(_SUFFIX)] + _SUFFIX


@dataclass
class Baseline:
    """The counts taken before the fence: the source at ``point`` (C), the target once it had applied C."""

    slot: str
    point: str
    source: dict[str, int]
    target: dict[str, int]
    seconds: float


@dataclass
class Verified:
    """What the verification counted, and when: ``to_json`` goes into the migration's notes."""

    tables: int
    before_fence: list[str] = field(default_factory=list)  # final before the fence (no row in or out after C)
    #: of those, the tables that transactions after C only updated: an UPDATE adds or removes no row, on the source
    #: or as the worker applies it on the target, so their counts from before the fence are final too
    updated_only: list[str] = field(default_factory=list)
    after_fence: list[str] = field(default_factory=list)  # counted again under the fence
    point: str | None = None  # C, when there was a pre-fence count
    end: str | None = None  # the end position the target had applied when counted after the fence
    fallback: str | None = None  # why every table was counted after the fence
    derived: dict[str, tuple[int, int]] = field(default_factory=dict)  # source side: C's count + (ins, del)
    seconds_before: float = 0.0
    seconds_after: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "tables": self.tables,
            "counted_before_fence": len(self.before_fence),
            "updated_only_since": self.updated_only,
            "before_fence_at": self.point,
            "counted_after_fence": self.after_fence,
            # the source's count of these changed tables: the count at C plus the rows inserted, less the rows
            # deleted by the transactions committed since (decoded by the _count slot), not counted again
            "source_derived": {t: {"inserted": i, "deleted": d} for t, (i, d) in self.derived.items()},
            "after_fence_at": self.end,
            "fallback": self.fallback,
            "seconds_before_fence": round(self.seconds_before, 3),
            "seconds_after_fence": round(self.seconds_after, 3),
        }

    def line(self) -> str:
        head = f"verify: row counts of {self.tables} table(s) equal"
        if self.point is None:
            return f"{head}, all counted after the fence ({self.fallback})"
        return (
            f"{head}: {len(self.before_fence)} counted before the fence at {self.point} and unchanged since"
            + (f" (or only updated: {len(self.updated_only)})" if self.updated_only else "")
            + ", "
            f"{len(self.after_fence)} changed since and counted again after the fence (at {self.end}"
            + (
                f"; on the source, {len(self.derived)} of them as their count at {self.point} plus the rows "
                "inserted less those deleted since)"
                if self.derived
                else ")"
            )
        )


def _count(conn: psycopg.Connection[Any], table: str) -> int:
    return int(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(table))).fetchone()[0])  # type: ignore[index]


def _count_all(conninfo: str, tables: Sequence[str]) -> dict[str, int]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return {t: _count(conn, t) for t in tables}


def drop_slot(src: psycopg.Connection[Any], slot: str) -> None:
    """Drop the ``_count`` slot if it exists and nobody holds it."""
    with contextlib.suppress(psycopg.Error):
        src.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE slot_name = %s AND NOT active",
            (slot,),
        )


def _create_slot(source: str, slot: str) -> tuple[ReplicationConnection, str, str]:
    """The ``_count`` slot with an exported snapshot: the connection that keeps the snapshot, its name, and C.
    Its creation waits for the source's running transactions: cancelled after :data:`CREATE_SLOT_SECONDS`."""
    repl = ReplicationConnection.open(source, application_name="applier migrate count")
    timer = threading.Timer(CREATE_SLOT_SECONDS, repl.connection.cancel)
    timer.start()
    try:
        info = repl.create_slot(slot, snapshot="export")
    except BaseException:
        repl.close()
        raise
    finally:
        timer.cancel()
    return repl, str(info.snapshot_name), format_lsn(info.consistent_point)


def _reached(src: psycopg.Connection[Any], slot: str, point: str, deadline: float) -> bool:
    """Until the migration's ``slot`` has confirmed ``point`` (the target applied and committed up to it)."""
    while time.monotonic() < deadline:
        row = src.execute(
            "SELECT coalesce(confirmed_flush_lsn >= %s::pg_lsn, false) FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (point, slot),
        ).fetchone()
        if row and row[0]:
            return True
        time.sleep(0.02)
    return False


def before_fence(
    source: str, target: str, slot: str, tables: Sequence[str], say: Callable[[str], None]
) -> Baseline | None:
    """Count every table on both servers at the ``_count`` slot's point C (see the module's docstring); None when
    that cannot be done (then every table is counted after the fence), with the reason said."""
    try:
        return _before_fence(source, target, slot, tables, say)
    except psycopg.Error as exc:
        say(f"verify: no count before the fence ({str(exc).strip()}): every table is counted after it")
        with contextlib.suppress(psycopg.Error), psycopg.connect(source, autocommit=True) as src:
            drop_slot(src, slot_name(slot))
        return None


def _before_fence(
    source: str, target: str, slot: str, tables: Sequence[str], say: Callable[[str], None]
) -> Baseline | None:
    started = time.monotonic()
    name = slot_name(slot)
    with psycopg.connect(source, autocommit=True) as src:
        prepared = src.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchone()[0]  # type: ignore[index]
        if prepared:
            say(
                f"verify: {prepared} prepared transaction(s) on the source: every table is counted after the fence"
            )
            return None
        drop_slot(src, name)
        try:
            repl, snapshot, point = _create_slot(source, name)
        except (ReplicationConnectionError, psycopg.Error) as exc:
            say(f"verify: no count before the fence ({str(exc).strip()}): every table is counted after it")
            drop_slot(src, name)
            return None
        counts = _count_both(src, repl, snapshot, point, (source, target), slot, tables)
        if counts is None:
            say(f"verify: the target did not reach {point} in time: every table is counted after the fence")
            drop_slot(src, name)
            return None
    seconds = time.monotonic() - started
    say(
        f"verify: {len(tables)} table(s) counted on both servers at {point} before the fence ({seconds:.2f}s)"
    )
    return Baseline(name, point, counts[0], counts[1], seconds)


def _count_in_snapshot(counter: psycopg.Connection[Any], tables: Sequence[str]) -> dict[str, int]:
    """The source's counts in the transaction that imported the snapshot, ended at once: its locks would hold
    off a TRUNCATE or DDL on the source until the target's count is over too."""
    try:
        return {t: _count(counter, t) for t in tables}
    finally:
        counter.execute("COMMIT")


def _count_both(
    src: psycopg.Connection[Any],
    repl: ReplicationConnection,
    snapshot: str,
    point: str,
    servers: tuple[str, str],
    slot: str,
    tables: Sequence[str],
) -> tuple[dict[str, int], dict[str, int]] | None:
    """The source's counts in the exported ``snapshot`` and, at the same time, the target's once the migration's
    ``slot`` has confirmed ``point`` (``servers``: the source's and the target's conninfo); None when it does not
    in time."""
    counter = psycopg.connect(servers[0], autocommit=True)
    try:
        counter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        counter.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
        repl.close()  # the snapshot is imported: its exporter may go
        with ThreadPoolExecutor(1) as pool:
            on_source = pool.submit(_count_in_snapshot, counter, tables)
            if not _reached(src, slot, point, time.monotonic() + REACH_SECONDS):
                on_source.result()
                return None
            on_target = _count_all(servers[1], tables)
            return on_source.result(), on_target
    finally:
        repl.close()
        counter.close()


@dataclass
class Changes:
    """What the transactions committed after C did, per table (``format('%I.%I')`` names): the tables changed,
    the rows inserted and deleted in each, and whether any table was truncated (then none is derived)."""

    tables: set[str] = field(default_factory=set)
    inserted: dict[str, int] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    #: the end of the last published transaction's commit record after C (None: none committed since C)
    last_commit: str | None = None
    #: the end of the stream's last event after C: its last commit, prepare, commit prepared or rollback prepared
    #: ("0/0": none since C; None: not known). The target's replication origin reaches exactly this position when
    #: the worker has applied it, so once it is there the target has applied everything before the fence.
    last_event: str | None = None
    #: why the changes could not be read (then every table is counted after the fence)
    error: str | None = None


def read_changes(src: psycopg.Connection[Any], base: Baseline | None, publication: str) -> Changes | None:
    """:func:`changed_since` under the fence, or None without a baseline; an error reading them is kept in
    ``error``, not raised: the cutover then waits and counts as without a baseline. Once per slot: the read for
    :attr:`Changes.last_event` turns two-phase decoding on in the slot for good, and a read for the counts after it
    would see a prepared transaction's changes at its PREPARE, even one rolled back later."""
    if base is None:
        return None
    try:
        changes = changed_since(src, base, publication)
    except psycopg.Error as exc:
        return Changes(error=f"the changes since the count could not be read: {str(exc).strip()}")
    changes.last_event = _last_event(src, base, publication, changes.last_commit)
    return changes


def _last_event(
    src: psycopg.Connection[Any], base: Baseline, publication: str, last_commit: str | None
) -> str | None:
    """Where the stream's last event since C ends (see :attr:`Changes.last_event`). Without two-phase on the source
    (``max_prepared_transactions`` = 0) that is the last commit. Otherwise a transaction prepared after C and rolled
    back sends the stream a PREPARE and a ROLLBACK PREPARED that the counts' decoding does not show (it decodes a
    prepared transaction only at its COMMIT PREPARED): the slot is read again with two-phase decoding, which
    from then on it keeps, from C (``two_phase_at``); its PREPARE, COMMIT PREPARED and ROLLBACK PREPARED messages
    end where the stream's do. None when that cannot be read (a publisher before 15 has no two-phase pgoutput)."""
    try:
        row = src.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
        if row is not None and row[0] == 0:
            return last_commit or "0/0"
        row = src.execute(
            "SELECT max(lsn)::text FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '3',"
            " 'two_phase', 'on', 'publication_names', %s) WHERE get_byte(data, 0) = ANY(%s)",
            (base.slot, publication, list(_ENDS)),
        ).fetchone()
    except psycopg.Error:
        return None
    return str(row[0]) if row and row[0] is not None else "0/0"


def changed_since(src: psycopg.Connection[Any], base: Baseline, publication: str) -> Changes:
    """The ``_count`` slot's changes since C up to now (read, not consumed), counted on the source by message type
    and relation: pgoutput's Relation, Insert and Delete messages carry the table's OID right after their type
    byte; a Truncate message (its relations listed differently) only marks that there was one. The greatest LSN
    of a Commit message is the end of the last commit record (``commit_cb_wrapper`` sets the write location to
    ``txn->end_lsn``)."""
    rows = src.execute(
        "SELECT get_byte(data, 0), CASE WHEN get_byte(data, 0) <> %s THEN substr(data, 2, 4) END, count(*),"
        " max(lsn)::text FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
        " 'publication_names', %s) WHERE get_byte(data, 0) = ANY(%s) GROUP BY 1, 2",
        (_COMMIT, base.slot, publication, list(_KINDS)),
    ).fetchall()
    last_commit = next((str(lsn) for kind, _, _, lsn in rows if kind == _COMMIT), None)
    by_oid = [
        (kind, int.from_bytes(bytes(oid), "big"), int(n)) for kind, oid, n, _ in rows if kind != _COMMIT
    ]
    names = dict(
        src.execute(
            "SELECT c.oid::int8, format('%%I.%%I', n.nspname, c.relname) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = ANY(%s::oid[])",
            ([oid for kind, oid, _ in by_oid if kind != _TRUNCATE],),
        ).fetchall()
    )
    changes = Changes(truncated=any(kind == _TRUNCATE for kind, _, _ in by_oid), last_commit=last_commit)
    for kind, oid, n in by_oid:
        name = names.get(oid)
        if kind == _RELATION and name is not None:
            changes.tables.add(name)
        elif kind in (_INSERT, _DELETE) and name is not None:
            into = changes.inserted if kind == _INSERT else changes.deleted
            into[name] = into.get(name, 0) + n
    return changes


def _firing_for_the_apply(target: psycopg.Connection[Any], tables: set[str]) -> set[str]:
    """Of ``tables``, those with a trigger or rule that fires for the apply on the target (enabled ALWAYS or
    REPLICA): such code could add or remove rows when the worker applies an UPDATE, so they are counted again."""
    if not tables:
        return set()
    rows = target.execute(
        "SELECT t FROM unnest(%s::text[]) AS t WHERE EXISTS (SELECT FROM pg_catalog.pg_trigger g WHERE g.tgrelid ="
        " t::regclass AND NOT g.tgisinternal AND g.tgenabled IN ('A', 'R')) OR EXISTS (SELECT FROM"
        " pg_catalog.pg_rewrite r WHERE r.ev_class = t::regclass AND r.rulename <> '_RETURN'"
        " AND r.ev_enabled IN ('A', 'R'))",
        (sorted(tables),),
    ).fetchall()
    return {r[0] for r in rows}


def _count_again(
    src: psycopg.Connection[Any], target: psycopg.Connection[Any], again: list[str], derived: dict[str, int]
) -> list[str]:
    """Count ``again`` on both servers (the source's count taken from ``derived`` where it is there); each table
    whose counts differ. A difference is counted once more on the target after :data:`RECOUNT_AFTER`: the
    replication origin moves inside the worker's commit, a moment before its rows are visible to others."""
    with ThreadPoolExecutor(1) as pool:
        on_source = pool.submit(lambda: {t: derived[t] if t in derived else _count(src, t) for t in again})
        on_target = {t: _count(target, t) for t in again}
        counts = on_source.result()
    differ = [t for t in again if counts[t] != on_target[t]]
    if differ:
        time.sleep(RECOUNT_AFTER)
        on_target |= {t: _count(target, t) for t in differ}
    return [
        f"{t}: {counts[t]} rows on the source, {on_target[t]} on the target"
        for t in differ
        if counts[t] != on_target[t]
    ]


def after_fence(
    src: psycopg.Connection[Any],
    target: psycopg.Connection[Any],
    tables: Sequence[str],
    base: Baseline | None,
    changes: Changes | None,
    end: str,
    recount: Collection[str] = (),
) -> tuple[Verified, list[str]]:
    """Under the fence, the target having applied ``end``: count again on the target what changed after C
    (``changes``, read by :func:`read_changes` under the fence; everything without a baseline), and derive the
    source's counts of those tables from C's and the rows inserted and deleted since (counted again too after a
    truncate); what was verified, and each table whose counts differ. ``recount``: tables counted again on both
    servers whatever changed (the insert-only tables the cutover copied again: their deletes are not in the
    stream, so no count of theirs can be derived from it)."""
    started = time.monotonic()
    result = Verified(len(tables), end=end)
    again: list[str] = list(tables)
    derived: dict[str, int] = {}
    if base is not None and changes is not None:
        if changes.error is not None:
            result.fallback = changes.error
        else:
            counted = {
                t
                for t in changes.tables
                if changes.truncated or changes.inserted.get(t) or changes.deleted.get(t)
            }  # rows went in or out (a row moved to another partition is a Delete and an Insert)
            counted |= _firing_for_the_apply(target, changes.tables - counted)
            counted |= set(recount)
            again = [t for t in tables if t in counted or t not in base.source or t not in base.target]
            result.point, result.seconds_before = base.point, base.seconds
            result.before_fence = [t for t in tables if t not in again]
            result.updated_only = [t for t in result.before_fence if t in changes.tables]
            if not changes.truncated:
                derived = {
                    t: base.source[t] + changes.inserted.get(t, 0) - changes.deleted.get(t, 0)
                    for t in again
                    if t in base.source and t not in recount
                }
                result.derived = {t: (changes.inserted.get(t, 0), changes.deleted.get(t, 0)) for t in derived}
    else:
        result.fallback = "no count before the fence"
    result.after_fence = again
    wrong = _count_again(src, target, again, derived)
    if base is not None:
        wrong += [
            f"{t}: {base.source[t]} rows on the source, {base.target[t]} on the target (both at {base.point}, "
            "no row added or removed since)"
            for t in result.before_fence
            if base.source[t] != base.target[t]
        ]
    result.seconds_after = time.monotonic() - started
    return result, wrong
