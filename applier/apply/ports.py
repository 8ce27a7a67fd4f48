"""The narrow interfaces the apply core (:class:`~applier.apply.handlers.Applier`) talks to.

The core turns messages into calls; it does no I/O of its own. These protocols name exactly the calls it makes on
the target session, so that the real :class:`~applier.apply.target.Target` (psycopg, libpq pipeline mode) and the
recording fake of the unit tests (:mod:`applier.testing.fake_target`) are interchangeable, and so that the core
needs no psycopg to be imported or tested. Nothing here may import psycopg, SQLAlchemy or the worker (an
``import-linter`` contract checks it).

A commit-like call (``commit``, ``prepare``, ``finish_prepared``) queues ``pg_replication_origin_xact_setup(end_lsn,
time)`` just before the commit itself, in the same local transaction (behaviours 94, 113): that pairing is what
makes progress exactly-once, and the fake records the origin position at each of them so tests can check it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from applier.apply.context import ErrorContext
from applier.apply.relmap import LocalTable, RelMapEntry
from applier.messages import KIND_BINARY, KIND_UNCHANGED_TOAST, TupleData

#: An insert run of this many rows into one table continues as a COPY (see :mod:`applier.apply.target`).
COPY_THRESHOLD = 200

#: What the target calls when a commit-like statement (or a statement with a result the core waits for) is done.
OnResult = Callable[[Any], None]


def copy_eligible(t: TupleData) -> bool:
    """COPY text format can carry text values and NULLs; binary values and unchanged TOAST go through INSERT."""
    return KIND_BINARY not in t.kinds and KIND_UNCHANGED_TOAST not in t.kinds


class CopySink(Protocol):
    """An open COPY into one table: rows go straight in, in order."""

    entry: RelMapEntry

    def add(self, t: TupleData) -> None: ...

    def add_text(self, text: bytes, rows: int) -> None: ...


class PipelinePort(Protocol):
    """The few pipeline calls the core makes directly (the skip-LSN clearing and the missing-row hook)."""

    on_missing_row: Callable[[ErrorContext | None, Any], None] | None
    on_conflict: Callable[[str, ErrorContext | None, Sequence[str], Any], None] | None

    def send_query(
        self,
        query: bytes,
        params: Sequence[bytes | None] | None,
        ctx: ErrorContext | None,
        on_result: OnResult | None = None,
    ) -> None: ...

    def drain(self) -> None: ...


class DdlPort(Protocol):
    """The schema-change calls of the core (applier.apply.target_ddl.DdlWrites implements them)."""

    def run(self, statement: str, tag: str, search_path: str, ctx: ErrorContext | None) -> None: ...

    def join(self, subid: int, name: str, state: Any, ctx: ErrorContext | None) -> int | None: ...

    def recopy(self, subid: int, name: str, lsn: int, ctx: ErrorContext | None) -> int | None: ...

    def leave_dropped(self, subid: int, ctx: ErrorContext | None) -> None: ...

    def forget_tables(self) -> None: ...


class ApplyTarget(Protocol):
    """The target session as the apply core uses it (:class:`applier.apply.target.Target` implements it)."""

    #: a :class:`PipelinePort` (typed Any: the real Pipeline's wider signatures are no structural subtype of it)
    pipeline: Any
    binary: bool
    in_transaction: bool
    #: each UPDATE/DELETE checks its row's origin first (applier.apply.origin_probe): no bulk UPDATE/DELETE then
    origin_checks: bool
    #: a :class:`DdlPort` (typed Any, as ``pipeline``)
    ddl: Any

    @property
    def copy_run(self) -> CopySink | None: ...

    def load_local_table(self, schema: str, name: str) -> LocalTable | None: ...

    def bulk_tables(self, oids: Sequence[int]) -> set[int]: ...

    # transactions
    def begin(self, ctx: ErrorContext | None = None) -> None: ...

    def commit(self, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: OnResult) -> None: ...

    def prepare(self, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: OnResult) -> None: ...

    def finish_prepared(
        self, commit: bool, gid: str, end_lsn: int, ts: int, ctx: ErrorContext | None, on_ok: OnResult
    ) -> None: ...

    def record_prepared(
        self,
        gid: str,
        subid: int,
        xid: int,
        prepare_lsn: int,
        end_lsn: int,
        prepare_time: int,
        ctx: ErrorContext | None,
    ) -> None: ...

    def record_prepared_many(
        self, records: Sequence[tuple[str, int, int, int, int]], subid: int, ctx: ErrorContext | None
    ) -> None: ...

    # row changes
    def insert(self, entry: RelMapEntry, new: TupleData, ctx: ErrorContext | None) -> None: ...

    def update(
        self, entry: RelMapEntry, old: TupleData | None, new: TupleData, ctx: ErrorContext | None
    ) -> None: ...

    def delete(self, entry: RelMapEntry, old: TupleData, ctx: ErrorContext | None) -> None: ...

    def truncate(
        self, entries: Sequence[RelMapEntry], restart_identity: bool, ctx: ErrorContext | None
    ) -> None: ...

    def bulk_insert(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None) -> None: ...

    def bulk_update(
        self,
        entry: RelMapEntry,
        columns: Sequence[bytes],
        ctx: ErrorContext | None,
        on_missing: Callable[[list[int]], None],
    ) -> None: ...

    def bulk_delete(
        self,
        entry: RelMapEntry,
        keys: Sequence[bytes],
        ctx: ErrorContext | None,
        on_missing: Callable[[list[int]], None],
    ) -> None: ...

    def bulk_origins(
        self,
        entry: RelMapEntry,
        keys: Sequence[bytes],
        ctx: ErrorContext | None,
        on_found: Callable[[int, Any], None],
    ) -> None: ...

    # COPY
    def start_copy(self, entry: RelMapEntry, rows: Sequence[TupleData], ctx: ErrorContext | None) -> None: ...

    def end_copy(self) -> None: ...
