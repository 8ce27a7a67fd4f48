"""A recording stand-in for the target session, so that unit tests can drive the apply core without a server.

:class:`FakeTarget` implements exactly the calls of :class:`applier.apply.ports.ApplyTarget` (those the
:class:`~applier.apply.handlers.Applier` makes) and records each one in :attr:`FakeTarget.calls`, in order, as a
:class:`Call`. It keeps the little state the core reads back (``in_transaction``, the open COPY) and models the one
thing that makes progress exactly-once: a commit-like call (COMMIT, PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED)
moves the replication origin to its ``end_lsn``, as ``pg_replication_origin_xact_setup`` just before it does
(:attr:`FakeTarget.origin_positions`). It checks what a real session would refuse: a COMMIT outside a transaction,
a row change or a record written while a PREPARE TRANSACTION's transaction is not open, and so on (raising
:class:`FakeTargetError`), so a test cannot pass by accident.

Completion callbacks (``on_ok``) run when the pipeline is drained (:meth:`FakePipeline.drain`, or
:meth:`FakeTarget.confirm_all`), as results come back from a real pipeline later than the call.

This is a test double of *our* adapter, never of PostgreSQL: the behaviour of the statements themselves is tested
against real servers (tests/integration/test_apply_*.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from applier.apply.context import ErrorContext
from applier.apply.relmap import LocalTable, RelMapEntry
from applier.messages import TupleData


class FakeTargetError(AssertionError):
    """The core made a call a real target session would refuse (or that breaks exactly-once progress)."""


@dataclass(frozen=True)
class Call:
    """One recorded call: its name, its arguments (the context separately), in call order."""

    name: str
    args: tuple[Any, ...] = ()
    ctx: ErrorContext | None = None


@dataclass
class FakeCopy:
    """An open COPY: the rows it received (``add_text`` records the text and its row count)."""

    entry: RelMapEntry
    ctx: ErrorContext | None
    rows: list[TupleData] = field(default_factory=list)
    texts: list[tuple[bytes, int]] = field(default_factory=list)

    def add(self, t: TupleData) -> None:
        self.rows.append(t)

    def add_text(self, text: bytes, rows: int) -> None:
        self.texts.append((text, rows))


class FakePipeline:
    """The pipeline calls the core makes directly; queued callbacks run at :meth:`drain`."""

    def __init__(self, target: FakeTarget) -> None:
        self._target = target
        self.on_missing_row: Callable[[ErrorContext | None, Any], None] | None = None
        self.on_conflict: Callable[[str, ErrorContext | None, Sequence[str], Any], None] | None = None
        self.pending: list[tuple[Callable[[Any], None], Any]] = []

    def send_query(
        self,
        query: bytes,
        params: Sequence[bytes | None] | None = None,
        ctx: ErrorContext | None = None,
        on_result: Callable[[Any], None] | None = None,
    ) -> None:
        self._target.record("send_query", (query, tuple(params or ())), ctx)
        if on_result is not None:
            self.pending.append((on_result, None))

    def drain(self) -> None:
        """Every queued statement has its result: run their callbacks, in order."""
        self._target.record("drain")
        pending, self.pending = self.pending, []
        for callback, result in pending:
            callback(result)


class FakeDdl:
    """The fake's schema changes: recorded; a created table joins with the next free OID from 90000."""

    def __init__(self, target: FakeTarget) -> None:
        self._target = target
        self._next_oid = 90000

    def run(self, statement: str, tag: str, search_path: str, ctx: ErrorContext | None) -> None:
        self._target._require_transaction("DDL")
        self._target.record("ddl", (statement, search_path), ctx)

    def join(self, subid: int, name: str, state: Any, ctx: ErrorContext | None) -> int | None:
        self._target.record("ddl_join", (subid, name, state), ctx)
        self._next_oid += 1
        return self._next_oid

    def recopy(self, subid: int, name: str, lsn: int, ctx: ErrorContext | None) -> int | None:
        self._target.record("ddl_recopy", (subid, name, lsn), ctx)
        return 1001

    def leave_dropped(self, subid: int, ctx: ErrorContext | None) -> None:
        self._target.record("ddl_leave", (subid,), ctx)

    def forget_tables(self) -> None:
        self._target.record("ddl_forget")


class FakeTarget:
    """Records the apply core's calls (see module docstring); ``tables`` are what ``load_local_table`` finds."""

    def __init__(self, tables: Sequence[LocalTable] = (), *, binary: bool = False) -> None:
        self.tables = {(t.schema, t.name): t for t in tables}
        self.binary = binary
        self.origin_checks = False
        self.in_transaction = False
        self.pipeline = FakePipeline(self)
        self.ddl = FakeDdl(self)
        self.calls: list[Call] = []
        #: the replication origin's position after each commit-like call, in order
        self.origin_positions: list[int] = []
        #: local GIDs prepared and not finished yet
        self.prepared: set[str] = set()
        #: prepared_xact records written: gid -> (prepare end LSN, prepare time)
        self.records: dict[str, tuple[int, int]] = {}
        self._copy: FakeCopy | None = None
        #: every COPY ever opened, in order (a closed one keeps its rows)
        self.copies: list[FakeCopy] = []

    # --- recording -------------------------------------------------------------------------------------------
    def record(self, name: str, args: tuple[Any, ...] = (), ctx: ErrorContext | None = None) -> None:
        self.calls.append(Call(name, args, ctx))

    def names(self, *, skip: Sequence[str] = ("drain",)) -> list[str]:
        """The names of the calls so far, without the ones in ``skip``."""
        return [c.name for c in self.calls if c.name not in skip]

    def confirm_all(self) -> None:
        """Every queued statement succeeded (as a sync point's results arriving)."""
        self.pipeline.drain()

    @property
    def origin_lsn(self) -> int:
        return self.origin_positions[-1] if self.origin_positions else 0

    def _require_transaction(self, what: str) -> None:
        if not self.in_transaction:
            raise FakeTargetError(f"{what} outside a local transaction")

    def _advance_origin(self, end_lsn: int, on_ok: Callable[[Any], None]) -> None:
        self.origin_positions.append(end_lsn)
        self.pipeline.pending.append((on_ok, None))

    # --- ApplyTarget -----------------------------------------------------------------------------------------
    @property
    def copy_run(self) -> FakeCopy | None:
        return self._copy

    def load_local_table(self, schema: str, name: str) -> LocalTable | None:
        self.record("load_local_table", (schema, name))
        return self.tables.get((schema, name))

    def bulk_tables(self, oids: Sequence[int]) -> set[int]:
        self.record("bulk_tables", (tuple(oids),))
        return {t.oid for t in self.tables.values() if t.bulk and t.oid in oids}

    def begin(self, ctx: ErrorContext | None = None) -> None:
        if not self.in_transaction:
            self.record("begin", (), ctx)
            self.in_transaction = True

    def commit(self, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]) -> None:
        self.end_copy()
        self._require_transaction("COMMIT")
        self.record("commit", (end_lsn, ts), ctx)
        self.in_transaction = False
        self._advance_origin(end_lsn, on_ok)

    def prepare(
        self, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: Callable[[Any], None]
    ) -> None:
        self.end_copy()
        self.begin(ctx)  # as the real one: an empty transaction is prepared too (behaviour 61)
        if gid in self.prepared:
            raise FakeTargetError(f'transaction identifier "{gid}" is already in use')
        self.record("prepare", (gid, end_lsn, ts), ctx)
        self.in_transaction = False
        self.prepared.add(gid)
        self._advance_origin(end_lsn, on_ok)

    def finish_prepared(
        self,
        commit: bool,
        gid: str,
        end_lsn: int,
        ts: int,
        ctx: ErrorContext | None,
        on_ok: Callable[[Any], None],
    ) -> None:
        self.end_copy()
        if self.in_transaction:
            raise FakeTargetError("COMMIT/ROLLBACK PREPARED inside a transaction block")
        if gid not in self.prepared:
            raise FakeTargetError(f'prepared transaction with identifier "{gid}" does not exist')
        self.record("commit_prepared" if commit else "rollback_prepared", (gid, end_lsn, ts), ctx)
        self.prepared.discard(gid)
        self._advance_origin(end_lsn, on_ok)

    def record_prepared(
        self,
        gid: str,
        subid: int,
        xid: int,
        prepare_lsn: int,
        end_lsn: int,
        prepare_time: int,
        ctx: ErrorContext | None,
    ) -> None:
        self.end_copy()
        self.record("record_prepared", (gid, subid, xid, prepare_lsn, end_lsn, prepare_time), ctx)
        self.records[gid] = (end_lsn, prepare_time)

    def record_prepared_many(
        self, records: Sequence[tuple[str, int, int, int, int]], subid: int, ctx: ErrorContext | None
    ) -> None:
        self.end_copy()
        self.record("record_prepared_many", (tuple(records), subid), ctx)
        for gid, _xid, _lsn, end_lsn, prepare_time in records:
            self.records[gid] = (end_lsn, prepare_time)

    def insert(self, entry: RelMapEntry, new: TupleData, ctx: ErrorContext | None) -> None:
        self.end_copy()
        self._require_transaction("INSERT")
        self.record("insert", (entry.local.display, new), ctx)

    def update(
        self, entry: RelMapEntry, old: TupleData | None, new: TupleData, ctx: ErrorContext | None
    ) -> None:
        self.end_copy()
        self._require_transaction("UPDATE")
        self.record("update", (entry.local.display, old, new), ctx)

    def delete(self, entry: RelMapEntry, old: TupleData, ctx: ErrorContext | None) -> None:
        self.end_copy()
        self._require_transaction("DELETE")
        self.record("delete", (entry.local.display, old), ctx)

    def truncate(
        self, entries: Sequence[RelMapEntry], restart_identity: bool, ctx: ErrorContext | None
    ) -> None:
        self.end_copy()
        self._require_transaction("TRUNCATE")
        self.record("truncate", (tuple(e.local.display for e in entries), restart_identity), ctx)

    def bulk_insert(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None) -> None:
        self.end_copy()
        self._require_transaction("bulk INSERT")
        self.record("bulk_insert", (entry.local.display, tuple(columns)), ctx)

    def bulk_update(
        self,
        entry: RelMapEntry,
        columns: Sequence[bytes],
        ctx: ErrorContext | None,
        on_missing: Callable[[list[int]], None],
    ) -> None:
        self.end_copy()
        self._require_transaction("bulk UPDATE")
        self.record("bulk_update", (entry.local.display, tuple(columns)), ctx)

    def bulk_delete(
        self,
        entry: RelMapEntry,
        keys: Sequence[bytes],
        ctx: ErrorContext | None,
        on_missing: Callable[[list[int]], None],
    ) -> None:
        self.end_copy()
        self._require_transaction("bulk DELETE")
        self.record("bulk_delete", (entry.local.display, tuple(keys)), ctx)

    def bulk_origins(
        self,
        entry: RelMapEntry,
        keys: Sequence[bytes],
        ctx: ErrorContext | None,
        on_found: Callable[[int, Any], None],
    ) -> None:
        self.record("bulk_origins", (entry.local.display, tuple(keys)), ctx)

    def start_copy(self, entry: RelMapEntry, rows: Sequence[TupleData], ctx: ErrorContext | None) -> None:
        self.end_copy()
        self._require_transaction("COPY")
        self.record("start_copy", (entry.local.display, len(rows)), ctx)
        self._copy = FakeCopy(entry, ctx, list(rows))
        self.copies.append(self._copy)

    def end_copy(self) -> None:
        copy = self._copy
        if copy is None:
            return
        self._copy = None
        self.record("end_copy", (copy.entry.local.display, len(copy.rows) + sum(n for _, n in copy.texts)))
