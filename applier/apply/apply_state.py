"""The mutable state of the apply core, grouped by what it describes (worker.c keeps the same in a handful of
globals: ``in_remote_transaction``, ``remote_final_lsn``, ``stream_xid``, ``skip_xact_finish_lsn`` …).

* :class:`RemoteTransaction` — the remote transaction being applied (BEGIN … COMMIT, BEGIN PREPARE … PREPARE, or a
  spooled stream being replayed);
* :class:`StreamChunk` — the stream chunk being spooled (STREAM START … STREAM STOP);
* :class:`ApplyStats` — counters for tests, ``applier status`` and the metrics; a transaction's row changes count
  once it ends (:meth:`ApplyStats.count`), so an error drops them with the transaction.

Plain slotted dataclasses: the handlers read these fields for every message, so they stay cheap attributes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from applier.apply import conflicts
from applier.apply.context import ErrorContext
from applier.messages import BeginPrepare

#: the row operations counted in :attr:`ApplyStats.rows`, in the order of :attr:`ApplyStats.pending_rows`
OPERATIONS = ("insert", "update", "delete", "truncate")


@dataclass(slots=True)
class RemoteTransaction:
    """The open remote transaction (``active``), as its first message announced it."""

    active: bool = False
    xid: int | None = None
    #: commit LSN, or prepare LSN for two-phase: what the error context calls "finished at" and SKIP takes
    final_lsn: int = 0
    #: the BEGIN PREPARE of a prepared transaction being applied
    prepare: BeginPrepare | None = None
    #: the publisher's GID of the prepared transaction being applied (error contexts name it)
    gid: str | None = None
    skipping: bool = False  # the skip-LSN names this transaction (behaviours 99-100)
    discarding: bool = False  # its changes are not applied: skipped, or a folded ROLLBACK PREPARED

    def start(self, xid: int, final_lsn: int) -> None:
        self.active = True
        self.xid = xid
        self.final_lsn = final_lsn

    def end(self) -> None:
        """Forget the transaction (``final_lsn`` stays: the sync-state pass and the next BEGIN replace it)."""
        self.active = False
        self.xid = None
        self.gid = None
        self.prepare = None
        self.skipping = self.discarding = False


@dataclass(slots=True)
class StreamChunk:
    """The stream chunk being spooled: the streamed transaction's xid between STREAM START and STREAM STOP."""

    xid: int | None = None


@dataclass(slots=True)
class ApplyStats:
    """What the core has done, for tests and metrics (the worker adds them up per session)."""

    transactions: int = 0  # remote transactions finished
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)  # finished ones by kind
    rows: collections.Counter[str] = field(default_factory=collections.Counter)  # their row changes
    #: conflicts by PostgreSQL 18's name (``update_missing``, ``delete_missing``), counted when detected
    conflicts: collections.Counter[str] = field(default_factory=collections.Counter)
    #: row changes of the open transaction: insert, update, delete, truncate
    pending_rows: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    bulk_transactions: int = 0  # remote transactions applied a batch at a time (applier.apply.bulk_exec)
    records_in_group: int = 0  # prepared_xact records that rode in a group commit
    records_batched: int = 0  # prepared_xact records written ahead, with an earlier one
    folded_prepares: int = 0  # prepared transactions applied folded (applier.apply.fold)
    converted_rows: int = 0  # Inserts that went into a COPY through copytext, a stretch at a time
    #: told of each conflict as it is detected (the worker's WorkerMetrics.conflict: Prometheus and the catalog's
    #: subscription_stats, outside the apply transaction, so a rolled-back attempt's conflicts stay counted)
    on_conflict: Callable[[str], None] | None = None
    #: conflicts are logged (``--conflict-log log|all``); with ``table`` only :attr:`on_record` hears of them
    log_lines: bool = True
    #: told of each conflict with its (entry, search tuple, new tuple, local row) for the conflict log table
    #: (applier.apply.conflict_table), when ``--conflict-log`` is ``table`` or ``all``
    on_record: Callable[[str, ErrorContext | None, Any], None] | None = None
    #: where conflicts are logged (the worker's logger: the core sets it)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("applier.apply"))

    def count(self, kind: str) -> None:
        """A remote transaction of ``kind`` ended: its pending row changes count now."""
        self.transactions += 1
        self.kinds[kind] += 1
        pending = self.pending_rows
        if pending[0] or pending[1] or pending[2] or pending[3]:
            rows = self.rows
            for op, n in zip(OPERATIONS, pending, strict=True):
                if n:
                    rows[op] += n
            self.pending_rows = [0, 0, 0, 0]

    def count_many(self, transactions: int, kind: str, rows: dict[str, int]) -> None:
        """``transactions`` remote transactions of ``kind`` applied together, with ``rows`` by operation."""
        self.transactions += transactions
        self.kinds[kind] += transactions
        for op, n in rows.items():
            if n:
                self.rows[op] += n

    def missing_row(self, ctx: ErrorContext | None, row: Any = None) -> None:
        """An UPDATE/DELETE found no row: not an error (behaviour 47); logged as PostgreSQL 18 does, as an
        ``update_missing``/``delete_missing`` conflict (behaviour 110), and counted. ``row``: the statement's
        (entry, search tuple, new tuple), for the remote row and replica identity of the DETAIL (a bulk
        statement's missing rows have none: the DETAIL then has the first sentence only)."""
        op = "update" if ctx is not None and ctx.message_type == "UPDATE" else "delete"
        kind = f"{op}_missing"
        if row is None or row[1] is None:
            record = None if row is None else (row[0], None, None, None)
            self.conflict(kind, ctx, [conflicts.detail(kind, None)], record)
            return
        entry, search, new = row
        identity, full = conflicts.identity_description(entry, search)
        remote = conflicts.remote_texts(entry, new) if new is not None else None
        detail = conflicts.detail(kind, None, remote, identity, full)
        self.conflict(kind, ctx, [detail], (entry, search, new, None))

    def conflict(
        self, kind: str, ctx: ErrorContext | None, details: Sequence[str], record: Any = None
    ) -> None:
        """A conflict detected while applying (``details``: one part per conflicting row, see
        :mod:`applier.apply.conflicts`): counted at once (and told to :attr:`on_conflict`), logged at LOG in
        PostgreSQL 18's words with the error context, and ``record`` (entry, search tuple, new tuple, local row)
        given to :attr:`on_record` for the conflict log table."""
        self.conflicts[kind] += 1
        if self.on_conflict is not None:
            self.on_conflict(kind)
        if record is not None and self.on_record is not None:
            self.on_record(kind, ctx, record)
        if not self.log_lines:
            return
        self.log.info(
            "%s\nCONTEXT:  %s",
            conflicts.message(kind, ctx.relation or "?" if ctx else "?", details),
            ctx.describe() if ctx else "",
        )


class Alias:
    """A read/write attribute that is another object's: ``remote_xid = Alias("tx", "xid")`` makes
    ``applier.remote_xid`` read ``applier.tx.xid``. Keeps the names the worker and the tests use while the state
    lives in the dataclasses above (not for the hot path: the handlers use the dataclasses directly)."""

    __slots__ = ("part", "name")

    def __init__(self, part: str, name: str) -> None:
        self.part = part
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)
