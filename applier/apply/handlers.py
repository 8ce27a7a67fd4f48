"""One handler per logical-replication message, as worker.c has one ``apply_handle_*`` per message byte.

:class:`Applier` is the apply state of one streaming session: which remote transaction is open, whether it is
being skipped, which stream chunk is being spooled, the relation map. It turns messages into calls on the
:class:`~applier.apply.target.Target` (which pipelines them to the target database; the core sees it through
the narrow :class:`~applier.apply.ports.ApplyTarget` protocol) and on the
:class:`~applier.apply.feedback.FeedbackTracker`; it performs no I/O of its own, so tests can drive it with message
objects. Anything that goes wrong raises :class:`~applier.apply.context.ApplyError` carrying the error context of
behaviour 54; the worker then abandons the session and starts over from the replication origin's position.

Progress is exactly-once because every local COMMIT / PREPARE TRANSACTION / COMMIT PREPARED / ROLLBACK PREPARED is
preceded, in the same local transaction (or, for the standalone 2PC commands, as the statement just before), by
``pg_replication_origin_xact_setup(end_lsn, time)`` (behaviours 94, 113).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from applier.apply import bulk as bulkapply
from applier.apply.commit_policy import CommitPolicy, DeferredCommit
from applier.apply.context import ApplyError, ErrorContext
from applier.apply.copytext import InsertRun
from applier.apply.feedback import FeedbackTracker
from applier.apply.fold import Decision
from applier.apply.ports import COPY_THRESHOLD, ApplyTarget, copy_eligible
from applier.apply.relmap import (
    RelationMappingError,
    RelMapEntry,
    map_relation,
    missing_table_error,
    remote_schema,
)
from applier.apply.spool import Spool
from applier.catalog import sql as catalog_sql
from applier.decoder import decode_message, decode_plain_insert
from applier.errors import ProtocolError
from applier.lsn import format_lsn
from applier.messages import (
    KIND_BINARY,
    KIND_UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from state import skip as skiprules
from state.twophase import TwoPhaseState, gid_for

log = logging.getLogger("applier.apply")

#: PostgreSQL's names of the message types, as the error context prints them (``logicalrep_message_type``).
MESSAGE_NAMES: dict[type, str] = {
    Begin: "BEGIN", Commit: "COMMIT", Origin: "ORIGIN", Relation: "RELATION", Type: "TYPE", Insert: "INSERT",
    Update: "UPDATE", Delete: "DELETE", Truncate: "TRUNCATE", Message: "MESSAGE", StreamStart: "STREAM START",
    StreamStop: "STREAM STOP", StreamCommit: "STREAM COMMIT", StreamAbort: "STREAM ABORT",
    BeginPrepare: "BEGIN PREPARE", Prepare: "PREPARE", CommitPrepared: "COMMIT PREPARED",
    RollbackPrepared: "ROLLBACK PREPARED", StreamPrepare: "STREAM PREPARE",
}  # fmt: skip

_SPOOLED = (Relation, Type, Insert, Update, Delete, Truncate, Message)
#: Type bytes of the messages above (all carry the subtransaction xid right after the type byte inside a stream).
RAW_SPOOL_TYPES = frozenset(b"RYIUDTM")

#: Messages that may follow a deferred group commit without ending the group: a plain transaction's.
_GROUPABLE = frozenset((Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message))
#: the row operations counted in Applier.rows, in the order of Applier._pending_rows
_OPERATIONS = ("insert", "update", "delete", "truncate")
#: the operation (as counted in Applier.rows) of each kind of bulk statement
_BULK_OPERATIONS = {bulkapply.INSERT: "insert", bulkapply.UPDATE: "update", bulkapply.DELETE: "delete"}
#: Inserts in a stretch below this go row by row: converting a stretch costs a fixed ~50 µs of array calls
VECTOR_MIN = 32


class TableStates:
    """What the handlers need to know about the subscription's tables; the worker implements it over the catalog.

    ``should_apply(local_oid, remote_final_lsn)`` is ``should_apply_changes_for_rel`` (behaviour 75) and
    ``after_transaction(current_lsn)`` the sync-state pass (behaviour 76) run after every commit/prepare.
    """

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def after_transaction(self, current_lsn: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class SkipState:
    """The subscription's skip-LSN as this worker read it (0 = none), behaviours 97-100."""

    skip_lsn: int = 0
    subname: str = ""


class Applier:
    """Apply state and handlers for one streaming session (see module docstring)."""

    def __init__(
        self,
        *,
        subid: int,
        subname: str,
        target: ApplyTarget,
        tracker: FeedbackTracker,
        spool: Spool,
        tables: TableStates,
        skip: SkipState,
        clear_skip_lsn: Callable[[int, int], bool],
        encoding: str = "utf-8",
        logger: logging.Logger | None = None,
        prepared: dict[str, tuple[int, int]] | None = None,
        group_commit: bool = False,
        ungrouped_until: int = 0,
        bulk: bool = False,
    ) -> None:
        self.subid = subid
        self.subname = subname
        self.origin = f"applier_{subid}"
        self.target = target
        self.tracker = tracker
        self.spool = spool
        self.tables = tables
        self.skip = skip
        self._clear_skip_lsn_now = clear_skip_lsn  # own transaction (after PREPARE / COMMIT PREPARED)
        self.encoding = encoding
        self.log = logger or log

        #: our prepared transactions: gid -> (prepare_end_lsn, prepare_time) (``LookupGXact``'s data)
        self.prepared: dict[str, tuple[int, int]] = dict(prepared or {})
        self.finished_prepared = (
            0  # COMMIT/ROLLBACK PREPARED done since the worker last reconciled the records
        )
        self.relations: dict[int, Relation] = {}
        self.entries: dict[int, RelMapEntry] = {}
        # the open remote transaction
        self.in_remote_transaction = False
        self.remote_xid: int | None = None
        self.remote_final_lsn = 0
        self.prepare: BeginPrepare | None = None
        #: the publisher's GID of the prepared transaction being applied (error contexts name it)
        self.remote_gid: str | None = None
        self.skipping = False  # the skip-LSN names this transaction (behaviours 99-100)
        self.discarding = False  # its changes are not applied: skipped, or a folded ROLLBACK PREPARED
        self.last_message_type = ""
        # the open stream chunk
        self.stream_xid: int | None = None
        # a run of inserts into one relation, turned into COPY when it gets long
        self._run_entry: RelMapEntry | None = None
        self._run_rows: list[TupleData] = []
        self._run_ctx: ErrorContext | None = None
        self._ctx_cache: dict[tuple[str, int], ErrorContext] = {}
        #: immediate or group commit (applier.apply.commit_policy), for the commit path and the bulk path alike
        self.commit_policy = CommitPolicy(tracker, enabled=group_commit, ungrouped_until=ungrouped_until)
        #: whole plain transactions that join a group may be applied a batch at a time (applier.apply.bulk)
        self.bulk = bulk
        self.bulk_transactions = 0  # remote transactions applied that way (stats)
        self.records_in_group = 0  # prepared_xact records that rode in a group commit (stats)
        self.records_batched = 0  # prepared_xact records written ahead, with an earlier one (stats)
        #: announced BEGIN PREPAREs whose records are still to be written: gid -> (xid, prepare LSN, end LSN, time)
        self._upcoming: dict[str, tuple[int, int, int, int]] = {}
        #: records written ahead, for transactions not applied yet: gid -> (prepare end LSN, prepare time)
        self._prerecorded: dict[str, tuple[int, int]] = {}
        #: prepared transactions of the batch being applied whose COMMIT/ROLLBACK PREPARED is in it too, by remote
        #: xid (applier.apply.fold; the worker fills it); :attr:`_folding` is the one being applied now
        self.decided: dict[int, Decision] = {}
        self._folding: Decision | None = None
        self.folded_prepares = 0  # prepared transactions applied folded (stats)
        self.converted_rows = 0  # Inserts that went into a COPY through copytext, a stretch at a time (stats)
        self.transactions = 0  # remote transactions finished (for tests and stats)
        # for metrics: finished transactions by kind, and row changes of finished transactions by operation (a
        # transaction's rows count once it ends; an error drops them with the transaction)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[str] = collections.Counter()
        #: conflicts by PostgreSQL 18's name (``update_missing``, ``delete_missing``), counted when detected
        self.conflicts: collections.Counter[str] = collections.Counter()
        target.pipeline.on_missing_row = self._missing_row
        self._pending_rows = [0, 0, 0, 0]  # insert, update, delete, truncate

        self._dispatch: dict[type, Callable[[Any, bytes], None]] = {
            Begin: self.handle_begin, Commit: self.handle_commit, Origin: self.handle_origin,
            Relation: self.handle_relation, Type: self.handle_type, Insert: self.handle_insert,
            Update: self.handle_update, Delete: self.handle_delete, Truncate: self.handle_truncate,
            Message: self.handle_message, StreamStart: self.handle_stream_start,
            StreamStop: self.handle_stream_stop, StreamCommit: self.handle_stream_commit,
            StreamAbort: self.handle_stream_abort, BeginPrepare: self.handle_begin_prepare,
            Prepare: self.handle_prepare, CommitPrepared: self.handle_commit_prepared,
            RollbackPrepared: self.handle_rollback_prepared, StreamPrepare: self.handle_stream_prepare,
        }  # fmt: skip

    # --- dispatch --------------------------------------------------------------------------------------------
    def handle(self, msg: Any, payload: bytes = b"") -> None:
        """Apply one decoded message; ``payload`` is its raw bytes (needed to spool streamed changes)."""
        # (BEGIN PREPARE ends the group itself: its prepared_xact record rides in it, see _record_prepared)
        if (
            self.commit_policy.pending is not None
            and msg.__class__ not in _GROUPABLE
            and not self.in_remote_transaction
            and msg.__class__ is not BeginPrepare
        ):
            self.end_group()
        self._dispatch[msg.__class__](msg, payload)

    @property
    def idle(self) -> bool:
        """Not inside a remote transaction nor a stream chunk: housekeeping may run (behaviour 11)."""
        return not self.in_remote_transaction and self.stream_xid is None

    @property
    def group_pending(self) -> bool:
        """A group commit is deferred: the worker calls :meth:`end_group` when nothing more is waiting."""
        return self.commit_policy.pending is not None

    @property
    def group_commit(self) -> bool:
        return self.commit_policy.enabled

    @property
    def groups(self) -> int:
        """Group commits of more than one remote transaction sent (stats)."""
        return self.commit_policy.groups

    def end_group(self) -> None:
        """Send the deferred commit of the open group: origin progress to the last remote transaction's end and
        COMMIT, in the group's one local transaction (so exactly-once holds as for a single transaction)."""
        group = self.commit_policy.take()
        if group is None:
            return
        self._flush_run()
        ctx = ErrorContext(self.origin, "COMMIT", None, group.xid, group.finish_lsn)
        token = self.tracker.queued(group.end_lsn)
        self.target.commit(group.end_lsn, group.commit_time, ctx, lambda _res: self.tracker.confirmed(token))

    def context(self, message_type: str, relation: str | None = None) -> ErrorContext:
        """The error context of what is being applied now (behaviour 54)."""
        return ErrorContext(
            self.origin, message_type, relation,
            self.remote_xid if self.in_remote_transaction else None,
            self.remote_final_lsn if self.in_remote_transaction else None,
            self.remote_gid if self.in_remote_transaction else None,
        )  # fmt: skip

    def _change_context(self, message_type: str, entry: RelMapEntry) -> ErrorContext:
        key = (message_type, id(entry))
        ctx = self._ctx_cache.get(key)
        if ctx is None:
            ctx = self._ctx_cache[key] = self.context(message_type, entry.display)
        return ctx

    def _protocol_error(self, message_type: str, text: str) -> ProtocolError:
        return ProtocolError(f"{text}\nCONTEXT:  {self.context(message_type).describe()}")

    # --- transactions ----------------------------------------------------------------------------------------
    def _start_remote(self, xid: int, final_lsn: int, message_type: str) -> None:
        if self.in_remote_transaction:
            raise self._protocol_error(
                message_type, f"{message_type} received inside remote transaction {self.remote_xid}"
            )
        self.in_remote_transaction = True
        self.remote_xid = xid
        self.remote_final_lsn = final_lsn
        self._ctx_cache.clear()
        if skiprules.starts_skipping(self.skip.skip_lsn, final_lsn):
            self.skipping = self.discarding = True
            self.log.info(skiprules.starts_skipping_message(final_lsn))

    def _end_remote(self, kind: str) -> None:
        self._count(kind)
        self.in_remote_transaction = False
        self.remote_xid = None
        self.remote_gid = None
        self.prepare = None
        self.skipping = self.discarding = False

    def _count(self, kind: str) -> None:
        self.transactions += 1
        self.kinds[kind] += 1
        pending = self._pending_rows
        if pending[0] or pending[1] or pending[2] or pending[3]:
            rows = self.rows
            for op, n in zip(_OPERATIONS, pending, strict=True):
                if n:
                    rows[op] += n
            self._pending_rows = [0, 0, 0, 0]

    def handle_begin(self, m: Begin, payload: bytes = b"") -> None:
        """``apply_handle_begin``: remember the transaction; the local one starts with the first change."""
        self._start_remote(m.xid, m.final_lsn, "BEGIN")

    def handle_commit(self, m: Commit, payload: bytes = b"") -> None:
        """``apply_handle_commit``: commit with origin progress, queue the flush-map entry, run the sync pass."""
        if m.commit_lsn != self.remote_final_lsn:
            raise self._protocol_error(
                "COMMIT", f"incorrect commit LSN {format_lsn(m.commit_lsn)} in commit message (expected "
                f"{format_lsn(self.remote_final_lsn)})",
            )  # fmt: skip
        kind = "skipped" if self.skipping else "commit"
        if self._defer_commit(m.commit_lsn, m.end_lsn, m.commit_time):
            self._end_remote(kind)
            return
        self._commit_internal(m.end_lsn, m.commit_time, "COMMIT")
        self._end_remote(kind)
        self.tables.after_transaction(m.end_lsn)

    def _defer_commit(self, commit_lsn: int, end_lsn: int, commit_time: int) -> bool:
        """Group commit (:mod:`applier.apply.commit_policy`): leave the local transaction open so that the next
        remote transactions, if they have already arrived, join it; the worker ends the group (:meth:`end_group`)
        as soon as the publisher has nothing more waiting, so no commit is delayed. Only plain transactions group,
        and only while nothing else needs the commit itself: no skip-LSN to clear, no table being synchronised
        (the sync-state pass runs after every commit then), no retry of a failed group."""
        policy = self.commit_policy
        if not policy.enabled:
            return False
        if not self.target.in_transaction and policy.pending is None:
            return False  # nothing applied and no group open: nothing to commit (as the native worker)
        if self.skipping or commit_lsn <= policy.ungrouped_until or not self._may_group():
            # (the conditions only change between groups) this commit, in _commit_internal, also commits the
            # open group's local transaction
            policy.abandon()
            return False
        # an insert run (a COPY, say) stays open: the next transaction's inserts into the same table continue it
        pending = self._pending_rows
        rows = pending[0] + pending[1] + pending[2] + pending[3]
        if policy.defer(
            DeferredCommit(end_lsn, commit_time, self.remote_xid, self.remote_final_lsn), 1, rows
        ):
            self.end_group()
        return True

    def _may_group(self) -> bool:
        """Nothing outside the transactions needs their commits: no skip-LSN to clear, no table being synchronised
        (the sync-state pass runs after every commit then), two-phase not about to be enabled."""
        tables = self.tables
        return (
            not self.skip.skip_lsn
            and getattr(tables, "all_ready", False)
            and getattr(tables, "two_phase_state", None) != TwoPhaseState.PENDING
        )

    def _commit_internal(self, end_lsn: int, commit_time: int, message_type: str) -> None:
        """``apply_handle_commit_internal``: commit if a local transaction exists (something applied, or a
        skipped transaction, which commits empty to clear the skip-LSN and advance the origin)."""
        self._flush_run()
        finish_lsn = self.remote_final_lsn
        ctx = self.context(message_type)
        if self.skipping:
            self.log.info(skiprules.completed_skipping_message(finish_lsn))
            self.target.begin(ctx)
        if self.target.in_transaction:
            self._clear_skip_lsn_in_transaction(finish_lsn, ctx)
            token = self.tracker.queued(end_lsn)
            self.target.commit(end_lsn, commit_time, ctx, lambda _res: self.tracker.confirmed(token))

    def _clear_skip_lsn_in_transaction(self, finish_lsn: int, ctx: ErrorContext) -> None:
        """``clear_subscription_skip_lsn`` inside the local transaction being committed (behaviours 99-100)."""
        skip_lsn = self.skip.skip_lsn
        if not skip_lsn:
            return
        outcome = skiprules.on_transaction_end(skip_lsn, finish_lsn, True)
        if not outcome.clears:
            return
        self.skip.skip_lsn = 0

        def cleared(res: Any) -> None:
            if res is not None and res.command_tuples and outcome is skiprules.SkipOutcome.CLEAR_WITH_WARNING:
                warning, detail = skiprules.mistaken_skip_warning(self.subname, skip_lsn, finish_lsn)
                self.log.warning("%s\nDETAIL:  %s", warning, detail)

        self.target.pipeline.send_query(
            catalog_sql.CLEAR_SKIP_LSN,
            [str(self.subid).encode(), format_lsn(skip_lsn).encode()], ctx, cleared,
        )  # fmt: skip

    def _clear_skip_lsn_separately(self, finish_lsn: int, applied_something: bool) -> None:
        """For PREPARE (which cannot include it) and COMMIT/ROLLBACK PREPARED: clear in a transaction of its own,
        once the target has confirmed what came before."""
        skip_lsn = self.skip.skip_lsn
        outcome = skiprules.on_transaction_end(skip_lsn, finish_lsn, applied_something)
        if not outcome.clears:
            return
        self.target.pipeline.drain()
        self.skip.skip_lsn = 0
        if (
            self._clear_skip_lsn_now(self.subid, skip_lsn)
            and outcome is skiprules.SkipOutcome.CLEAR_WITH_WARNING
        ):
            warning, detail = skiprules.mistaken_skip_warning(self.subname, skip_lsn, finish_lsn)
            self.log.warning("%s\nDETAIL:  %s", warning, detail)

    def handle_origin(self, m: Origin, payload: bytes = b"") -> None:
        """``apply_handle_origin``: content unused; only its position is checked."""
        if not self.in_remote_transaction and self.stream_xid is None:
            raise self._protocol_error("ORIGIN", "ORIGIN message sent out of order")

    def handle_message(self, m: Message, payload: bytes = b"") -> None:
        """Logical decoding messages are ignored, as by the native worker (we never ask for them)."""
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)

    def handle_type(self, m: Type, payload: bytes = b"") -> None:
        """``apply_handle_type``: read and discarded; values go through the local type's input function."""
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)

    # --- relations -------------------------------------------------------------------------------------------
    def handle_relation(self, m: Relation, payload: bytes = b"") -> None:
        """``apply_handle_relation``: replace the map entry; the local table is looked up at first use."""
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)
            return
        self._flush_run_if(m.relid)
        self.relations[m.relid] = m
        self.entries.pop(m.relid, None)

    def _entry(self, relid: int, message_type: str) -> RelMapEntry:
        """``logicalrep_rel_open``: the mapped local table of a publisher relation, resolved by name."""
        entry = self.entries.get(relid)
        if entry is not None:
            return entry
        rel = self.relations.get(relid)
        if rel is None:
            raise self._protocol_error(message_type, f"no relation map entry for remote relation ID {relid}")
        self._flush_run()
        try:
            local = self.target.load_local_table(remote_schema(rel), rel.relname)
            if local is None:
                raise missing_table_error(rel)
            entry = map_relation(rel, local)
        except RelationMappingError as exc:
            raise ApplyError(
                str(exc), self.context(message_type, f"{remote_schema(rel)}.{rel.relname}")
            ) from None
        self.entries[relid] = entry
        return entry

    def _applies(self, entry: RelMapEntry) -> bool:
        return self.tables.should_apply(entry.local.oid, self.remote_final_lsn)

    def _begin_local(self, ctx: ErrorContext) -> None:
        if not self.target.in_transaction:
            self.target.begin(ctx)

    # --- row changes -----------------------------------------------------------------------------------------
    def handle_insert(self, m: Insert, payload: bytes = b"") -> None:
        """``apply_handle_insert``. Inserts are gathered into runs per relation: a short run is sent as prepared
        INSERTs, a long one continues as a COPY (see :mod:`applier.apply.target`)."""
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)
            return
        if self.discarding:
            return
        entry = self.entries.get(m.relid)
        if entry is None or entry is not self._run_entry:
            # a new run: the relation's applicability cannot change within a transaction, so it is checked
            # once per run, not per row
            entry = self._entry(m.relid, "INSERT")
            if not self._applies(entry):
                return
            self._flush_run()
            ctx = self._change_context("INSERT", entry)
            self._begin_local(ctx)
            self._run_entry = entry
            self._run_ctx = ctx
        target = self.target
        copy = target.copy_run
        if copy is not None and copy.entry is entry:
            kinds = m.new.kinds
            if KIND_BINARY not in kinds and KIND_UNCHANGED_TOAST not in kinds:
                copy.add(m.new)
                self._pending_rows[0] += 1
                return
            target.end_copy()  # keep the order: this row goes after everything already copied
        self._pending_rows[0] += 1
        rows = self._run_rows
        rows.append(m.new)
        if len(rows) >= COPY_THRESHOLD:
            if all(copy_eligible(r) for r in rows):
                target.start_copy(entry, rows, self._run_ctx)
            else:
                for r in rows:
                    target.insert(entry, r, self._run_ctx)
            rows.clear()

    def handle_insert_bytes(self, payload: bytes) -> None:
        """An Insert outside a stream, from its bytes: a row for the open COPY of its relation goes straight in
        (no message object, no dispatch); anything else takes :meth:`handle_insert`."""
        relid, new = decode_plain_insert(payload)
        lane = self.copy_lane()
        if lane is not None and lane[0] >> 8 == relid:
            kinds = new.kinds
            if KIND_BINARY not in kinds and KIND_UNCHANGED_TOAST not in kinds:
                self.target.copy_run.add(new)  # type: ignore[union-attr]
                self._pending_rows[0] += 1
                return
        self.handle_insert(Insert(None, relid, new), payload)

    def copy_lane(self) -> tuple[int, int] | None:
        """``(relid << 8 | 'N', column count)`` of the Inserts that would go straight into the open COPY, or
        ``None`` when none would (no COPY open, skipping, inside a stream chunk)."""
        entry = self._run_entry
        if entry is None or self.discarding or self.stream_xid is not None:
            return None
        copy = self.target.copy_run
        relid = entry.remote.relid
        if copy is None or copy.entry is not entry or self.entries.get(relid) is not entry:
            return None
        return (relid << 8) | 78, len(entry.names)

    def handle_insert_run(self, run: InsertRun, first: int, stop: int, one: Callable[[int], None]) -> None:
        """Messages ``first`` to ``stop - 1`` of ``run``, in arrival order, Inserts or not: every stretch of at
        least :data:`VECTOR_MIN` of them that goes into the open COPY is converted in one go
        (:mod:`applier.apply.copytext`); ``one(i)`` handles the rest message by message, exactly as if they had
        come alone (so a malformed one gets its precise error, and a new relation starts its own run and, once
        long enough, its own COPY)."""
        heads = run.relid_heads(first, stop).tolist()
        i = first
        while i < stop:
            head = heads[i - first]
            end = i + 1
            while end < stop and heads[end - first] == head:
                end += 1
            while i < end:
                lane = self.copy_lane() if head != -1 and end - i >= VECTOR_MIN else None
                if lane is not None and lane[0] == head:
                    text = run.copy_text(i, end, lane[1])
                    if text is not None:
                        self.target.copy_run.add_text(text, end - i)  # type: ignore[union-attr]
                        self._pending_rows[0] += end - i
                        self.converted_rows += end - i
                    else:  # not the simple shape: the whole stretch row by row
                        for j in range(i, end):
                            one(j)
                    i = end
                    break
                one(i)
                i += 1

    def _flush_run(self) -> None:
        """End the current insert run: send what is buffered as INSERTs, and close a COPY."""
        entry = self._run_entry
        if entry is None:
            return
        self._run_entry = None
        self.target.end_copy()
        rows = self._run_rows
        if rows:
            ctx = self._run_ctx
            for r in rows:
                self.target.insert(entry, r, ctx)
            rows.clear()

    def _flush_run_if(self, relid: int) -> None:
        if self._run_entry is not None and self._run_entry.remote.relid == relid:
            self._flush_run()

    def _updatable(self, entry: RelMapEntry, message_type: str) -> None:
        """``check_relation_updatable`` (behaviour 44)."""
        if entry.not_updatable is not None:
            raise ApplyError(entry.not_updatable, self._change_context(message_type, entry))

    def handle_update(self, m: Update, payload: bytes = b"") -> None:
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)
            return
        if self.discarding:
            return
        self._flush_run()
        entry = self._entry(m.relid, "UPDATE")
        if not self._applies(entry):
            return
        self._updatable(entry, "UPDATE")
        ctx = self._change_context("UPDATE", entry)
        self._begin_local(ctx)
        self.target.update(entry, m.old, m.new, ctx)
        self._pending_rows[1] += 1

    def handle_delete(self, m: Delete, payload: bytes = b"") -> None:
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)
            return
        if self.discarding:
            return
        self._flush_run()
        entry = self._entry(m.relid, "DELETE")
        if not self._applies(entry):
            return
        self._updatable(entry, "DELETE")
        ctx = self._change_context("DELETE", entry)
        self._begin_local(ctx)
        self.target.delete(entry, m.old, ctx)
        self._pending_rows[2] += 1

    def _missing_row(self, ctx: ErrorContext | None) -> None:
        """An UPDATE/DELETE found no row: not an error (behaviour 47); logged as PostgreSQL 18 does, as an
        ``update_missing``/``delete_missing`` conflict (behaviour 110), and counted."""
        op = "update" if ctx is not None and ctx.message_type == "UPDATE" else "delete"
        kind = f"{op}_missing"
        self.conflicts[kind] += 1
        self.log.info(
            'conflict detected on relation "%s": conflict=%s\nDETAIL:  Could not find the row to be %sd.'
            "\nCONTEXT:  %s", ctx.relation if ctx else "?", kind, op, ctx.describe() if ctx else "",
        )  # fmt: skip

    def handle_truncate(self, m: Truncate, payload: bytes = b"") -> None:
        """``apply_handle_truncate``: the applicable relations in one TRUNCATE, RESTART IDENTITY honoured, never
        CASCADE (behaviour 49)."""
        if self.stream_xid is not None:
            self.spool.write(m.xid, payload)
            return
        if self.discarding:
            return
        self._flush_run()
        entries: list[RelMapEntry] = []
        for relid in m.relids:
            entry = self._entry(relid, "TRUNCATE")
            if self._applies(entry) and all(e is not entry for e in entries):
                entries.append(entry)
        if not entries:
            return
        ctx = self.context("TRUNCATE", ", ".join(e.display for e in entries))
        self._begin_local(ctx)
        self.target.truncate(entries, m.restart_identity, ctx)
        self._pending_rows[3] += len(entries)

    # --- two-phase -------------------------------------------------------------------------------------------
    def _record_prepared(
        self, xid: int, prepare_lsn: int, end_lsn: int, prepare_time: int, ctx: ErrorContext
    ) -> None:
        """Store (gid, prepare_end_lsn, prepare_time), what ``LookupGXact`` compares (behaviour 65), committed
        before the local transaction begins, so it is visible while the transaction stays prepared: in the open
        group commit's local transaction when there is one, else in a transaction of its own.

        It is queued on the apply session in a transaction of its own (no extra round trip); with asynchronous
        commit it still becomes durable no later than the PREPARE, whose WAL flush covers it. The worker also keeps
        the records of its prepared transactions in memory (:attr:`prepared`), so ROLLBACK PREPARED needs no
        lookup round trip; rows of finished ones are removed in batches (``Catalog.reconcile_prepared``).
        """
        gid = gid_for(self.subid, xid)
        recorded = self._prerecorded.pop(gid, None) == (end_lsn, prepare_time) if self._prerecorded else False
        if self.commit_policy.pending is not None:
            # a group commit is deferred (plain transactions just before this one): the record rides in its local
            # transaction, committed here, before this transaction begins; one local transaction end fewer
            self._flush_run()
            if not recorded:
                self._write_records(gid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
                self.records_in_group += 1
            self.end_group()
        elif not recorded:
            self._write_records(gid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
        self.prepared[gid] = (end_lsn, prepare_time)

    def _write_records(
        self, gid: str, xid: int, prepare_lsn: int, end_lsn: int, prepare_time: int, ctx: ErrorContext
    ) -> None:
        """This transaction's record, and those of the transactions announced by :meth:`expect_prepares`, in one
        statement: the later ones then need no record, nor a local transaction around it, of their own."""
        upcoming = self._upcoming
        if not upcoming:
            self.target.record_prepared(gid, self.subid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
            return
        upcoming[gid] = (xid, prepare_lsn, end_lsn, prepare_time)
        self.target.record_prepared_many([(g, *r) for g, r in upcoming.items()], self.subid, ctx)
        for g, (_xid, _lsn, e, t) in upcoming.items():
            if g != gid:
                self._prerecorded[g] = (e, t)
        self.records_batched += len(upcoming) - 1
        upcoming.clear()

    def expect_prepares(self, begins: Sequence[BeginPrepare]) -> None:
        """The BEGIN PREPAREs of a batch the worker has read but not applied yet: the next record written (at the
        first of them, or at a STREAM PREPARE) writes theirs along with it (:meth:`_write_records`).

        A record only has to be committed before its transaction is prepared; committing it earlier changes
        nothing. One whose transaction never gets prepared here (an error, a crash first) is replaced when the
        transaction comes again, or dropped by the worker's reconciliation of finished records."""
        upcoming = self._upcoming
        for m in begins:
            upcoming[gid_for(self.subid, m.xid)] = (m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def _forget_prepared(self, gid: str) -> None:
        self.prepared.pop(gid, None)
        self.finished_prepared += 1

    def handle_begin_prepare(self, m: BeginPrepare, payload: bytes = b"") -> None:
        """``apply_handle_begin_prepare``: like Begin, with the prepare LSN as the finish LSN. A transaction whose
        decision is already here is folded (applier.apply.fold): no record, no PREPARE; a rolled back one's changes
        are discarded."""
        self._start_remote(m.xid, m.prepare_lsn, "BEGIN PREPARE")
        self.prepare = m
        self.remote_gid = m.gid
        decision = self.decided.pop(m.xid, None) if self.decided else None
        if (
            decision is not None
            and decision.prepare_end_lsn == m.end_lsn
            and decision.prepare_time == m.prepare_time
            and not self.skipping
            and self._may_group()
        ):
            self._folding = decision
            self.discarding = not decision.commit
            return
        self._record_prepared(m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time, self.context("BEGIN PREPARE"))

    def handle_prepare(self, m: Prepare, payload: bytes = b"") -> None:
        """``apply_handle_prepare``: always PREPARE, even an empty or skipped transaction (behaviour 61)."""
        if self.prepare is None or m.prepare_lsn != self.remote_final_lsn:
            raise self._protocol_error(
                "PREPARE", f"incorrect prepare LSN {format_lsn(m.prepare_lsn)} in prepare message (expected "
                f"{format_lsn(self.remote_final_lsn)})",
            )  # fmt: skip
        if self._folding is not None:
            return  # the transaction ends with its COMMIT/ROLLBACK PREPARED, the next message
        self._prepare_internal(m.xid, m.end_lsn, m.prepare_time, "PREPARE")

    def _prepare_internal(self, xid: int, end_lsn: int, prepare_time: int, message_type: str) -> None:
        self._flush_run()
        ctx = self.context(message_type)
        was_skipping = self.skipping
        if was_skipping:
            self.log.info(skiprules.completed_skipping_message(self.remote_final_lsn))
        finish_lsn = self.remote_final_lsn
        token = self.tracker.queued(end_lsn, two_phase=True)
        self.target.prepare(gid_for(self.subid, xid), end_lsn, prepare_time, ctx,
                            lambda _res: self.tracker.confirmed(token))  # fmt: skip
        self._end_remote("stream_prepare" if message_type == "STREAM PREPARE" else "prepare")
        self.tables.after_transaction(end_lsn)
        self._clear_skip_lsn_separately(finish_lsn, True)

    def handle_commit_prepared(self, m: CommitPrepared, payload: bytes = b"") -> None:
        """``apply_handle_commit_prepared``: COMMIT PREPARED; an unknown GID is an error (no lookup)."""
        if self._folding is not None and self._folding.commit and m.xid == self.remote_xid:
            self._end_folded(m.commit_lsn, m.end_lsn, m.commit_time, "COMMIT PREPARED", "commit_prepared")
            return
        if self.in_remote_transaction:
            raise self._protocol_error(
                "COMMIT PREPARED", "COMMIT PREPARED received inside a remote transaction"
            )
        gid = gid_for(self.subid, m.xid)
        ctx = ErrorContext(self.origin, "COMMIT PREPARED", None, m.xid, m.commit_lsn)
        token = self.tracker.queued(m.end_lsn, two_phase=True)
        self.target.finish_prepared(True, gid, m.end_lsn, m.commit_time, ctx,
                                    lambda _res: self.tracker.confirmed(token))  # fmt: skip
        self._forget_prepared(gid)
        self._count("commit_prepared")
        self.tables.after_transaction(m.end_lsn)
        self._clear_skip_lsn_separately(m.end_lsn, True)

    def handle_rollback_prepared(self, m: RollbackPrepared, payload: bytes = b"") -> None:
        """``apply_handle_rollback_prepared``: only if our prepared transaction is the one the publisher prepared
        (same GID, prepare end LSN and time, ``LookupGXact``), else skipped silently (behaviours 64-65)."""
        folding = self._folding
        if folding is not None and not folding.commit and m.xid == self.remote_xid:
            self._end_folded(m.rollback_end_lsn, m.rollback_end_lsn, m.rollback_time, "ROLLBACK PREPARED",
                             "rollback_prepared")  # fmt: skip
            return
        if self.in_remote_transaction:
            raise self._protocol_error(
                "ROLLBACK PREPARED", "ROLLBACK PREPARED received inside a remote transaction"
            )
        gid = gid_for(self.subid, m.xid)
        ctx = ErrorContext(self.origin, "ROLLBACK PREPARED", None, m.xid, m.prepare_end_lsn)
        found = self.prepared.get(gid) == (m.prepare_end_lsn, m.prepare_time)
        token = self.tracker.queued(m.rollback_end_lsn, two_phase=True)
        if found:
            self.target.finish_prepared(False, gid, m.rollback_end_lsn, m.rollback_time, ctx,
                                        lambda _res: self.tracker.confirmed(token))  # fmt: skip
            self._forget_prepared(gid)
        else:
            self.tracker.confirmed(token)
            self.log.debug("skipping ROLLBACK PREPARED of %s: no matching prepared transaction", gid)
        self._count("rollback_prepared" if found else "skipped")
        self.tables.after_transaction(m.rollback_end_lsn)
        if found:
            self._clear_skip_lsn_separately(m.rollback_end_lsn, True)

    def _end_folded(self, lsn: int, end_lsn: int, time: int, message_type: str, kind: str) -> None:
        """End a folded transaction as a plain commit at ``end_lsn`` (its COMMIT/ROLLBACK PREPARED's end), group
        commit included; a rolled back one applied nothing, so it commits nothing of its own."""
        self._folding = None
        self.folded_prepares += 1
        if self._defer_commit(lsn, end_lsn, time):
            self._end_remote(kind)
            return
        self._commit_internal(end_lsn, time, message_type)
        self._end_remote(kind)
        self.tables.after_transaction(end_lsn)

    # --- streamed transactions -------------------------------------------------------------------------------
    def spool_raw(self, payload: bytes) -> None:
        """A change inside a stream chunk (type byte in :data:`RAW_SPOOL_TYPES`), spooled as received, undecoded:
        only the subtransaction xid after the type byte is read (as ``stream_write_change`` does). It is decoded,
        and checked, once, at replay."""
        if (
            self.stream_xid is None or len(payload) < 5
        ):  # pragma: no cover - the worker's decoder says in-stream
            self.handle(decode_message(payload, in_stream=True, encoding=self.encoding), payload)
            return
        self.spool.write(int.from_bytes(payload[1:5], "big"), payload)

    def spool_batch(self, messages: Sequence[bytes | memoryview], offset: int) -> None:
        """Several changes of the open stream chunk at once, as :meth:`spool_raw` spools one
        (``messages[i][offset:]`` is each one's raw bytes)."""
        self.spool.write_batch(messages, offset)

    def handle_stream_start(self, m: StreamStart, payload: bytes = b"") -> None:
        """``apply_handle_stream_start``: open (or reopen) the transaction's spool file."""
        if self.stream_xid is not None:
            raise self._protocol_error("STREAM START", "duplicate STREAM START message")
        if self.in_remote_transaction:
            raise self._protocol_error("STREAM START", "STREAM START received inside a remote transaction")
        if m.xid == 0:
            raise self._protocol_error(
                "STREAM START", "invalid transaction ID in streamed replication transaction"
            )
        self._flush_run()
        self.spool.start_chunk(m.xid, m.first_segment)
        self.stream_xid = m.xid

    def handle_stream_stop(self, m: StreamStop, payload: bytes = b"") -> None:
        if self.stream_xid is None:
            raise self._protocol_error("STREAM STOP", "STREAM STOP message without STREAM START")
        self.spool.close_chunk()
        self.stream_xid = None

    def handle_stream_abort(self, m: StreamAbort, payload: bytes = b"") -> None:
        """``apply_handle_stream_abort``: drop the spool, or truncate it back to the aborted subtransaction."""
        if self.stream_xid is not None:
            raise self._protocol_error("STREAM ABORT", "STREAM ABORT message without STREAM STOP")
        self.spool.abort(m.xid, m.subxid)
        if m.xid == m.subxid:
            self.kinds["stream_abort"] += 1

    def _replay(self, xid: int, final_lsn: int, message_type: str) -> None:
        """``apply_spooled_messages``: run the spooled changes through the normal handlers."""
        self._start_remote(xid, final_lsn, message_type)
        handle = self._dispatch
        encoding = self.encoding
        for buffer, starts, ends in self.spool.replay_batches(xid):
            at, to = starts.tolist(), ends.tolist()

            def one(i: int, buffer: bytes = buffer, at: list[int] = at, to: list[int] = to) -> None:
                payload = buffer[at[i] : to[i]]
                msg = decode_message(payload, in_stream=True, encoding=encoding)
                if not isinstance(msg, _SPOOLED):
                    raise self._protocol_error(
                        message_type, f"unexpected {MESSAGE_NAMES[msg.__class__]} in spool of {xid}"
                    )
                handle[msg.__class__](msg, payload)

            # stretches of Inserts go into the COPY at once; every other change through one()
            self.handle_insert_run(InsertRun(buffer, starts, ends, 0, 5), 0, len(at), one)

    def handle_stream_commit(self, m: StreamCommit, payload: bytes = b"") -> None:
        """``apply_handle_stream_commit``: replay the spool in one local transaction, then the Commit path."""
        if self.stream_xid is not None:
            raise self._protocol_error("STREAM COMMIT", "STREAM COMMIT message without STREAM STOP")
        self._replay(m.xid, m.commit_lsn, "STREAM COMMIT")
        self._commit_internal(m.end_lsn, m.commit_time, "STREAM COMMIT")
        self._end_remote("stream_commit")
        self.spool.discard(m.xid)
        self.tables.after_transaction(m.end_lsn)

    def handle_stream_prepare(self, m: StreamPrepare, payload: bytes = b"") -> None:
        """``apply_handle_stream_prepare``: replay the spool, then PREPARE it."""
        if self.stream_xid is not None:
            raise self._protocol_error("STREAM PREPARE", "STREAM PREPARE message without STREAM STOP")
        ctx = ErrorContext(self.origin, "STREAM PREPARE", None, m.xid, m.prepare_lsn, m.gid)
        self._record_prepared(m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time, ctx)
        self.remote_gid = m.gid  # _replay's _start_remote keeps it; _end_remote clears it
        self._replay(m.xid, m.prepare_lsn, "STREAM PREPARE")
        self._prepare_internal(m.xid, m.end_lsn, m.prepare_time, "STREAM PREPARE")
        self.spool.discard(m.xid)

    # --- whole transactions a batch at a time (applier.apply.bulk) ------------------------------------------
    def bulk_ready(self) -> bool:
        """Whether the transactions coming next may be applied a batch at a time: nothing is open, and they would
        join a group commit (the conditions of :meth:`_defer_commit`) with text values."""
        return (
            self.bulk
            and self.group_commit
            and not self.in_remote_transaction
            and self.stream_xid is None
            and not self.target.binary
            and self._may_group()
        )

    def apply_bulk(self, batch: bulkapply.Batch, message: int) -> int:
        """Apply, together, the qualifying transactions of ``batch`` from the one whose Begin is message
        ``message`` on (see :mod:`applier.apply.bulk`), as members of the open group commit; returns the index of
        the first message not applied, ``message`` itself when they go message by message (too few, a relation
        not mapped yet or not taking its changes this way, a change not of the simple shape)."""
        if message < batch.refused_until:
            return message
        first = batch.transaction_at(message)
        if first is None:
            return message
        policy = self.commit_policy
        stop = batch.cut_refused(first, min(batch.run_end(first), first + policy.room()))
        if stop - first < bulkapply.MIN_TRANSACTIONS or int(batch.final_lsn[first]) <= policy.ungrouped_until:
            return message
        planned = self._plan_bulk(batch, first, stop)
        if planned is None:
            return message
        stop, entries, stretches = planned
        last = stop - 1
        xid, final_lsn = int(batch.xid[last]), int(batch.final_lsn[last])
        self._flush_run()
        n_rows = self._send_stretches(batch, stretches, entries, xid, final_lsn)
        n = stop - first
        self.transactions += n
        self.bulk_transactions += n
        self.kinds["commit"] += n
        for op, count in n_rows.items():
            if count:
                self.rows[op] += count
        commit = DeferredCommit(int(batch.end_lsn[last]), int(batch.commit_time[last]), xid, final_lsn)
        if policy.defer(commit, n, sum(n_rows.values())):
            self.end_group()
        return int(batch.commits[last]) + 1

    def _plan_bulk(
        self, batch: bulkapply.Batch, first: int, stop: int
    ) -> tuple[int, dict[int, RelMapEntry], list[bulkapply.Stretch]] | None:
        """The transactions ``first`` to ``stop - 1`` (or fewer) cut into per-table stretches: ``(stop, entries by
        remote relid, stretches)``, or None when they go message by message (the batch then remembers why)."""
        idx = bulkapply.changes_in(batch, first, stop)
        relids, kinds = batch.relid[idx], batch.kind[idx]
        updated = set(relids[kinds != bulkapply.INSERT].tolist())  # (updated or deleted from: by key)
        entries, refused = self._bulk_entries(
            np.unique(relids).tolist(), updated, int(batch.final_lsn[stop - 1])
        )
        if refused:  # from the transaction of the first change of such a relation on, message by message
            batch.refuse(refused)
            stop = batch.cut_refused(first, stop)
            if stop - first < bulkapply.MIN_TRANSACTIONS:
                return None
        stretches = bulkapply.plan(
            batch, first, stop, {r: len(e.names) for r, e in entries.items()},
            {r: e.key_positions or () for r, e in entries.items() if r in updated},
        )  # fmt: skip
        if stretches is None:  # not the simple shape: message by message up to the end of this run
            batch.refused_until = int(batch.commits[stop - 1]) + 1
            return None
        return stop, entries, stretches

    def _bulk_entries(
        self, relids: list[int], updated: set[int], final_lsn: int
    ) -> tuple[dict[int, RelMapEntry], set[int]]:
        """The mapped relations that may take their changes as bulk statements, and the remote relids that may not
        (not mapped yet, not fit for it, or not taking changes at ``final_lsn``)."""
        entries: dict[int, RelMapEntry] = {}
        refused: set[int] = set()
        for relid in relids:
            entry = self.entries.get(relid)
            if (
                entry is None
                or not (entry.bulk_update if relid in updated else entry.bulk_insert)
                or not self.tables.should_apply(entry.local.oid, final_lsn)
            ):
                refused.add(relid)
            else:
                entries[relid] = entry
        return entries, refused

    def _send_stretches(
        self, batch: bulkapply.Batch, stretches: Sequence[bulkapply.Stretch], entries: dict[int, RelMapEntry],
        xid: int, final_lsn: int,
    ) -> dict[str, int]:  # fmt: skip
        """Send one statement per stretch, in the group's local transaction; returns the rows by operation."""
        target = self.target
        n_rows = dict.fromkeys(_BULK_OPERATIONS.values(), 0)
        for st in stretches:
            entry = entries[st.relid]
            op = _BULK_OPERATIONS[st.kind]
            ctx = ErrorContext(self.origin, op.upper(), entry.display, xid, final_lsn)
            if not target.in_transaction:
                target.begin(ctx)
            if st.single:
                self._apply_single(batch, st, entry)
            elif st.kind == bulkapply.INSERT:
                target.bulk_insert(entry, st.columns, ctx)
            elif st.kind == bulkapply.UPDATE:
                target.bulk_update(entry, st.columns, ctx, self._bulk_missing(batch, st, entry))
            else:
                target.bulk_delete(entry, st.columns, ctx, self._bulk_missing(batch, st, entry))
            n_rows[op] += len(st.messages)
        return n_rows

    def _apply_single(self, batch: bulkapply.Batch, stretch: bulkapply.Stretch, entry: RelMapEntry) -> None:
        """One Update or Delete of a bulk run that its own statement applies (see ``Stretch.single``), in its own
        transaction's context, exactly as :meth:`handle_update` / :meth:`handle_delete` would."""
        m, t = int(stretch.messages[0]), int(stretch.transactions[0])
        msg = decode_message(
            batch.data[int(batch.starts[m]) + 25 : int(batch.ends[m])].tobytes(), encoding=self.encoding
        )
        ctx = ErrorContext(self.origin, _BULK_OPERATIONS[stretch.kind].upper(), entry.display, int(batch.xid[t]),
                           int(batch.final_lsn[t]))  # fmt: skip
        if isinstance(msg, Update):
            self.target.update(entry, msg.old, msg.new, ctx)
        elif isinstance(msg, Delete):
            self.target.delete(entry, msg.old, ctx)
        else:  # pragma: no cover - the batch said Update or Delete
            raise self._protocol_error(
                ctx.message_type, f"unexpected {MESSAGE_NAMES[msg.__class__]} in a bulk run"
            )

    def recheck_bulk(self, lookup: Callable[[list[int]], set[int]] | None = None) -> None:
        """Forget the mapped tables whose fitness for bulk apply changed since they were loaded (a trigger enabled
        ALWAYS, say), so that their next change loads them again; the worker calls this about once a second while
        idle, standing in for the relcache invalidation that tells the native worker."""
        known = {e.local.oid for e in self.entries.values()}
        if not known:
            return
        ok = (lookup or self.target.bulk_tables)(sorted(known))
        for relid, entry in list(self.entries.items()):
            if entry.local.bulk != (entry.local.oid in ok):
                self._flush_run_if(relid)
                del self.entries[relid]

    def _bulk_missing(
        self, batch: bulkapply.Batch, stretch: bulkapply.Stretch, entry: RelMapEntry
    ) -> Callable[[list[int]], None]:
        """What a bulk UPDATE/DELETE calls with the positions of its changes that found no row: each is the
        conflict its message would have been, in its own transaction's context."""
        xids, final_lsns = batch.xid[stretch.transactions], batch.final_lsn[stretch.transactions]
        message_type = _BULK_OPERATIONS[stretch.kind].upper()

        def missing(positions: list[int]) -> None:
            for p in positions:
                self._missing_row(ErrorContext(
                    self.origin, message_type, entry.display, int(xids[p - 1]), int(final_lsns[p - 1])
                ))  # fmt: skip

        return missing

    # --- errors ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the session state after an error (the worker reconnects and replays from the origin)."""
        self.relations.clear()
        self.entries.clear()
        self.in_remote_transaction = False
        self.remote_xid = None
        self.remote_gid = None
        self.prepare = None
        self.skipping = self.discarding = False
        self._folding = None
        self.decided.clear()
        self.stream_xid = None
        self._run_entry = None
        self._run_rows.clear()
        self._ctx_cache.clear()
        self._pending_rows = [0, 0, 0, 0]
        self.commit_policy.reset()
        self._upcoming.clear()
        self._prerecorded.clear()
