"""One handler per logical-replication message, as worker.c has one ``apply_handle_*`` per message byte.

:class:`Applier` is the transaction/dispatch core of one streaming session: which remote transaction is open
(:class:`~applier.apply.apply_state.RemoteTransaction`), whether it is being skipped, which stream chunk is being
spooled (:class:`~applier.apply.apply_state.StreamChunk`), the relation map. It turns messages into calls on the
target (the narrow :class:`~applier.apply.ports.ApplyTarget` protocol; the real one pipelines them to the target
database) and on the :class:`~applier.apply.feedback.FeedbackTracker`; it performs no I/O of its own, so tests drive
it with message objects (``tests/unit/test_applier_core.py``). Anything that goes wrong raises
:class:`~applier.apply.context.ApplyError` carrying the error context of behaviour 54; the worker then abandons the
session and starts over from the replication origin's position.

The speed strategies live in their own modules and are called from here at one place each:

* group commit — :mod:`applier.apply.commit_policy`, joined through :meth:`Applier.join_group` (by the commit path
  and the bulk path alike);
* insert runs and COPY lanes — :mod:`applier.apply.insert_sink` (:class:`~applier.apply.insert_sink.InsertRuns`);
* bulk execution of whole transactions — :mod:`applier.apply.bulk_exec` (plans from :mod:`applier.apply.bulk`);
* folding decided prepared transactions — :class:`applier.apply.fold.Folding`;
* prepared-record batching — :mod:`applier.apply.prepared_records`;
* skip-LSN clearing — :mod:`applier.apply.skip_clear`.

Progress is exactly-once because every local COMMIT / PREPARE TRANSACTION / COMMIT PREPARED / ROLLBACK PREPARED is
preceded, in the same local transaction (or, for the standalone 2PC commands, in an empty local transaction just
before, whose COMMIT writes no record and so leaves the values set), by ``pg_replication_origin_xact_setup(end_lsn,
time)`` (behaviours 94, 113).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from applier.apply.apply_state import Alias, ApplyStats, RemoteTransaction, StreamChunk
from applier.apply.bulk_exec import BulkExecution
from applier.apply.commit_policy import CommitPolicy, GroupCommit
from applier.apply.context import ApplyError, ErrorContext
from applier.apply.copytext import InsertRun
from applier.apply.ddl_replay import DdlConsumer, DdlReplay
from applier.apply.feedback import FeedbackTracker
from applier.apply.fold import Folding
from applier.apply.insert_sink import VECTOR_MIN, InsertRuns
from applier.apply.ports import ApplyTarget
from applier.apply.prepared_records import PreparedRecords
from applier.apply.relmap import (
    RelationMap,
    RelationMappingError,
    RelMapEntry,
)
from applier.apply.skip_clear import SkipClearing, SkipState
from applier.apply.spool import Spool
from applier.decoder import decode_message, decode_plain_insert, decode_plain_update
from applier.errors import ProtocolError
from applier.lsn import format_lsn
from applier.messages import (
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
from state.tables import SyncState

__all__ = [
    "HANDLERS",
    "MESSAGE_NAMES",
    "RAW_SPOOL_TYPES",
    "VECTOR_MIN",
    "Applier",
    "SkipState",
    "TableStates",
]

log = logging.getLogger("applier.apply")

#: PostgreSQL's names of the message types, as the error context prints them (``logicalrep_message_type``).
MESSAGE_NAMES: dict[type, str] = {
    Begin: "BEGIN",
    Commit: "COMMIT",
    Origin: "ORIGIN",
    Relation: "RELATION",
    Type: "TYPE",
    Insert: "INSERT",
    Update: "UPDATE",
    Delete: "DELETE",
    Truncate: "TRUNCATE",
    Message: "MESSAGE",
    StreamStart: "STREAM START",
    StreamStop: "STREAM STOP",
    StreamCommit: "STREAM COMMIT",
    StreamAbort: "STREAM ABORT",
    BeginPrepare: "BEGIN PREPARE",
    Prepare: "PREPARE",
    CommitPrepared: "COMMIT PREPARED",
    RollbackPrepared: "ROLLBACK PREPARED",
    StreamPrepare: "STREAM PREPARE",
}

_SPOOLED = (Relation, Type, Insert, Update, Delete, Truncate, Message)
#: Type bytes of the messages above (all carry the subtransaction xid right after the type byte inside a stream).
RAW_SPOOL_TYPES = frozenset(b"RYIUDTM")
#: Messages that may follow a deferred group commit without ending the group first: a plain transaction's, and
#: BEGIN PREPARE (which ends the group itself: its prepared_xact record rides in it, PreparedRecords.record)
_KEEP_GROUP = frozenset(
    (Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message, BeginPrepare)
)
#: Messages whose handler ends the open insert run: :meth:`Applier.handle` flushes it before dispatching them (the
#: spool's replay goes through it too); a COMMIT only without group commit: one that joins a group keeps the run
#: open for the next transaction's inserts (whether it may join is not asked twice: the commit path flushes then)
_ENDS_RUN = frozenset((Update, Delete, Truncate, StreamStart, Commit))


class TableStates:
    """What the handlers need to know about the subscription's tables; the worker implements it over the catalog.

    ``should_apply(local_oid, remote_final_lsn)`` is ``should_apply_changes_for_rel`` (behaviour 75) and
    ``after_transaction(current_lsn)`` the sync-state pass (behaviour 76) run after every commit/prepare.
    """

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def after_transaction(self, current_lsn: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def joined(
        self, local_oid: int, name: str, state: SyncState, lsn: int | None = None
    ) -> None:  # pragma: no cover - interface
        """A table created by a replayed DDL joined the subscription in ``state`` (its catalog row is written in
        the open local transaction, which other sessions cannot see yet)."""
        raise NotImplementedError


class PublicNames:
    """The names the worker, tablesync and the tests use on :class:`Applier`, mapped onto its parts (the state in
    :mod:`applier.apply.apply_state`, the strategies in their modules): kept so callers need not know the layout."""

    in_remote_transaction, remote_xid = Alias("tx", "active"), Alias("tx", "xid")
    remote_final_lsn, stream_xid = Alias("tx", "final_lsn"), Alias("stream", "xid")
    relations, entries = Alias("relmap", "relations"), Alias("relmap", "entries")
    prepared, finished_prepared = Alias("records", "prepared"), Alias("records", "finished")
    expect_prepares, decided = Alias("records", "expect"), Alias("folding", "decided")
    groups, group_commit = Alias("commit_policy", "groups"), Alias("commit_policy", "enabled")
    group_pending, end_group = Alias("group", "pending"), Alias("group", "end")
    bulk, bulk_ready = Alias("bulk_exec", "enabled"), Alias("bulk_exec", "ready")
    apply_bulk, recheck_bulk = Alias("bulk_exec", "apply"), Alias("bulk_exec", "recheck")
    spool_batch = Alias("spool", "write_batch")
    transactions, kinds, rows, conflicts = (
        Alias("stats", n) for n in ("transactions", "kinds", "rows", "conflicts")
    )
    bulk_transactions, records_in_group, records_batched, folded_prepares, converted_rows = (
        Alias("stats", n)
        for n in (
            "bulk_transactions",
            "records_in_group",
            "records_batched",
            "folded_prepares",
            "converted_rows",
        )
    )

    copy_lane, handle_insert_run = Alias("inserts", "lane"), Alias("inserts", "copy_stretches")


class Applier(PublicNames):
    """The transaction/dispatch core of one streaming session (see the module docstring)."""

    def __init__(
        self, *, subid: int, subname: str, target: ApplyTarget, tracker: FeedbackTracker, spool: Spool,
        tables: TableStates, skip: SkipState, clear_skip_lsn: Callable[[int, int], bool], encoding: str = "utf-8",
        logger: logging.Logger | None = None, prepared: dict[str, tuple[int, int]] | None = None,
        group_commit: bool = False, ungrouped_until: int = 0, bulk: bool = False,
        ddl: DdlConsumer | None = None) -> None:  # fmt: skip
        self.subid, self.subname, self.origin = subid, subname, f"applier_{subid}"
        self.target, self.tracker, self.spool, self.tables = target, tracker, spool, tables
        self.skip, self.encoding, self.log = skip, encoding, logger or log
        self.tx, self.stream, self.stats, self.relmap = RemoteTransaction(), StreamChunk(), ApplyStats(), RelationMap()  # fmt: skip
        self._ctx_cache: dict[tuple[str, int], ErrorContext] = {}  # then the strategies:
        self.commit_policy = CommitPolicy(tracker, enabled=group_commit, ungrouped_until=ungrouped_until)
        self.group = GroupCommit(self, self.commit_policy)
        self.inserts = InsertRuns(target, self.stats, self.tx, self.stream, self.relmap)
        self.bulk_exec = BulkExecution(self, bulk)
        self.folding = Folding()
        self.records = PreparedRecords(subid, target, self.stats, prepared)
        self.skip_clearing = SkipClearing(subid, subname, skip, target, clear_skip_lsn, self.log)
        self.ddl = DdlReplay(self, ddl)
        self.stats.log = self.log  # conflicts are logged and counted there, whoever finds them:
        target.pipeline.on_missing_row = self.stats.missing_row  # an UPDATE/DELETE that found no row
        target.pipeline.on_conflict = self.stats.conflict  # the target's checks (origin_probe)

    # --- dispatch (``apply_dispatch``) -----------------------------------------------------------------------
    def handle(self, msg: Any, payload: bytes = b"") -> None:
        """Apply one decoded message (``payload``: its raw bytes); one that ends the insert run flushes it first."""
        cls = msg.__class__
        if self.inserts.entry is not None and cls in _ENDS_RUN:
            if cls is not Commit or not self.commit_policy.enabled:
                self.inserts.flush()
        if self.commit_policy.pending is not None and cls not in _KEEP_GROUP and not self.tx.active:
            self.inserts.flush()
            self.group.end()
        HANDLERS[cls](self, msg, payload)

    @property
    def idle(self) -> bool:
        """Not inside a remote transaction nor a stream chunk: housekeeping may run (behaviour 11)."""
        return not self.tx.active and self.stream.xid is None

    def context(self, message_type: str, relation: str | None = None) -> ErrorContext:
        """The error context of what is being applied now (behaviour 54)."""
        tx = self.tx
        if not tx.active:
            return ErrorContext(self.origin, message_type, relation)
        return ErrorContext(self.origin, message_type, relation, tx.xid, tx.final_lsn, tx.gid)

    def _change_context(self, message_type: str, entry: RelMapEntry) -> ErrorContext:
        key = (message_type, id(entry))
        ctx = self._ctx_cache.get(key)
        if ctx is None:
            ctx = self._ctx_cache[key] = self.context(message_type, entry.display)
        return ctx

    def protocol_error(self, message_type: str, text: str) -> ProtocolError:
        return ProtocolError(f"{text}\nCONTEXT:  {self.context(message_type).describe()}")

    # --- transactions ----------------------------------------------------------------------------------------
    def _start_remote(self, xid: int, final_lsn: int, message_type: str) -> None:
        if self.tx.active:
            text = f"{message_type} received inside remote transaction {self.tx.xid}"
            raise self.protocol_error(message_type, text)
        self.tx.start(xid, final_lsn)
        self._ctx_cache.clear()
        if skiprules.starts_skipping(self.skip.skip_lsn, final_lsn):
            self.tx.skipping = self.tx.discarding = True
            self.log.info(skiprules.starts_skipping_message(final_lsn))

    def _end_remote(self, kind: str) -> None:
        self.stats.count(kind)
        self.tx.end()

    def handle_begin(self, m: Begin, payload: bytes = b"") -> None:
        """``apply_handle_begin``: remember the transaction; the local one starts with the first change."""
        self._start_remote(m.xid, m.final_lsn, "BEGIN")

    def handle_commit(self, m: Commit, payload: bytes = b"") -> None:
        """``apply_handle_commit``: commit with origin progress, queue the flush-map entry, run the sync pass."""
        self._check_final_lsn("COMMIT", m.commit_lsn, True)
        kind = "skipped" if self.tx.skipping else "commit"
        self._commit_or_defer(m.commit_lsn, m.end_lsn, m.commit_time, "COMMIT", kind)

    def _check_final_lsn(self, message_type: str, lsn: int, ok: bool) -> None:
        """The COMMIT/PREPARE must end the transaction its BEGIN announced (``ok``: and of the right kind)."""
        if not ok or lsn != self.tx.final_lsn:
            word, expected = message_type.lower(), format_lsn(self.tx.final_lsn)
            text = f"incorrect {word} LSN {format_lsn(lsn)} in {word} message (expected {expected})"
            raise self.protocol_error(message_type, text)

    def _commit_or_defer(self, lsn: int, end_lsn: int, time: int, message_type: str, kind: str) -> None:
        """End the remote transaction: join the open group commit, or commit now and run the sync-state pass."""
        if self.group.defer(lsn, end_lsn, time):
            self._end_remote(kind)
            return
        self._commit_internal(end_lsn, time, message_type)
        self._end_remote(kind)
        self.tables.after_transaction(end_lsn)

    def _commit_internal(self, end_lsn: int, commit_time: int, message_type: str) -> None:
        """``apply_handle_commit_internal``: commit if a local transaction exists (something applied, or a
        skipped transaction, which commits empty to clear the skip-LSN and advance the origin)."""
        self.inserts.flush()
        finish_lsn = self.tx.final_lsn
        ctx = self.context(message_type)
        if self.tx.skipping:
            self.log.info(skiprules.completed_skipping_message(finish_lsn))
            self.target.begin(ctx)
        if self.target.in_transaction:
            self.skip_clearing.in_transaction(finish_lsn, ctx)
            token = self.tracker.queued(end_lsn)
            self.target.commit(end_lsn, commit_time, ctx, lambda _res: self.tracker.confirmed(token))

    def handle_origin(self, m: Origin, payload: bytes = b"") -> None:
        """``apply_handle_origin``: content unused; only its position is checked."""
        if not self.tx.active and self.stream.xid is None:
            raise self.protocol_error("ORIGIN", "ORIGIN message sent out of order")

    def _spooled(self, subxid: int | None, payload: bytes) -> bool:
        """Inside a stream chunk a change is spooled (``handle_streamed_transaction``), not applied."""
        if spooled := self.stream.xid is not None:
            self.spool.write(subxid, payload)
        return spooled

    def handle_message(self, m: Message, payload: bytes = b"") -> None:
        """The DDL capture's messages are replayed at their place (applier.apply.ddl_replay); any other logical
        decoding message is ignored, as by the native worker."""
        if not self._spooled(m.xid, payload) and not self.tx.discarding:
            self.ddl.message(m)

    def handle_type(self, m: Type, payload: bytes = b"") -> None:
        """``apply_handle_type``: read and discarded; values go through the local type's input function."""
        self._spooled(m.xid, payload)

    # --- relations -------------------------------------------------------------------------------------------
    def handle_relation(self, m: Relation, payload: bytes = b"") -> None:
        """``apply_handle_relation``: replace the map entry; the local table is looked up at first use."""
        if not self._spooled(m.xid, payload):
            self.inserts.flush_if(m.relid)
            self.relmap.describe(m)

    def _entry(self, relid: int, message_type: str) -> RelMapEntry:
        """``logicalrep_rel_open``: the mapped local table of a publisher relation, resolved by name."""
        if (entry := self.relmap.entries.get(relid)) is not None:
            return entry
        if relid not in self.relmap.relations:
            raise self.protocol_error(message_type, f"no relation map entry for remote relation ID {relid}")
        self.inserts.flush()
        try:
            return self.relmap.open(relid, self.target.load_local_table)
        except RelationMappingError as exc:
            raise ApplyError(str(exc), self.context(message_type, self.relmap.name(relid))) from None

    def _open_change(self, relid: int, message_type: str) -> tuple[RelMapEntry, ErrorContext] | None:
        """The relation and error context of an Update or Delete about to be sent, with a local transaction open,
        or None when its relation does not take changes now (behaviour 75). (The open insert run ended before.)"""
        entry = self._entry(relid, message_type)
        if not self.tables.should_apply(entry.local.oid, self.tx.final_lsn):
            return None
        if entry.not_updatable is not None:  # ``check_relation_updatable`` (behaviour 44)
            raise ApplyError(entry.not_updatable, self._change_context(message_type, entry))
        ctx = self._change_context(message_type, entry)
        if not self.target.in_transaction:
            self.target.begin(ctx)
        return entry, ctx

    # --- row changes -----------------------------------------------------------------------------------------
    def handle_insert(self, m: Insert, payload: bytes = b"") -> None:
        """``apply_handle_insert``, into a run of inserts per relation (:mod:`applier.apply.insert_sink`)."""
        if not (self._spooled(m.xid, payload) or self.inserts.add(m.relid, m.new) or self.tx.discarding):
            self.inserts.flush()
            self._new_run(m.relid, m.new)

    def handle_insert_bytes(self, payload: bytes) -> None:
        """An Insert outside a stream, from its bytes: as :meth:`handle_insert`, with no message object."""
        relid, new = decode_plain_insert(payload)
        if not self.inserts.add(relid, new) and not self.tx.discarding:
            self.inserts.flush()  # the open run, if any, ends here: another relation's (or its mapping was replaced)
            self._new_run(relid, new)

    def _new_run(self, relid: int, new: TupleData) -> None:
        """A new run starts with ``new``: applicability cannot change within a transaction (behaviour 75)."""
        entry = self._entry(relid, "INSERT")
        if self.tables.should_apply(entry.local.oid, self.tx.final_lsn):
            self.inserts.open(entry, self._change_context("INSERT", entry), new)

    def handle_update(self, m: Update, payload: bytes = b"") -> None:
        """``apply_handle_update``: by replica identity; no row found is a conflict, not an error."""
        if not self._spooled(m.xid, payload) and not self.tx.discarding:
            self._update(m.relid, m.old, m.new)

    def handle_update_bytes(self, payload: bytes) -> bool:
        """:meth:`handle_update` from the bytes of an Update outside a stream (no message object); False if not."""
        if applies := self.tx.active and not self.tx.discarding and self.stream.xid is None:
            self.inserts.flush()  # as handle() does first
            self._update(*decode_plain_update(payload))
        return applies

    def _update(self, relid: int, old: TupleData | None, new: TupleData) -> None:
        if (opened := self._open_change(relid, "UPDATE")) is not None:
            self.target.update(opened[0], old, new, opened[1])
            self.stats.pending_rows[1] += 1

    def handle_delete(self, m: Delete, payload: bytes = b"") -> None:
        """``apply_handle_delete``: by replica identity; no row found is a conflict, not an error."""
        if self._spooled(m.xid, payload) or self.tx.discarding:
            return
        if (opened := self._open_change(m.relid, "DELETE")) is not None:
            self.target.delete(opened[0], m.old, opened[1])
            self.stats.pending_rows[2] += 1

    def handle_truncate(self, m: Truncate, payload: bytes = b"") -> None:
        """``apply_handle_truncate``: the applicable relations in one TRUNCATE, RESTART IDENTITY honoured, never
        CASCADE (behaviour 49)."""
        if self._spooled(m.xid, payload) or self.tx.discarding:
            return
        self.inserts.flush()
        opened = {id(e): e for e in (self._entry(relid, "TRUNCATE") for relid in m.relids)}  # once each, in order  # fmt: skip
        entries = [e for e in opened.values() if self.tables.should_apply(e.local.oid, self.tx.final_lsn)]
        if not entries:
            return
        ctx = self.context("TRUNCATE", ", ".join(e.display for e in entries))
        if not self.target.in_transaction:
            self.target.begin(ctx)
        self.target.truncate(entries, m.restart_identity, ctx)
        self.stats.pending_rows[3] += len(entries)

    # --- two-phase -------------------------------------------------------------------------------------------
    def handle_begin_prepare(self, m: BeginPrepare, payload: bytes = b"") -> None:
        """``apply_handle_begin_prepare``: like Begin, with the prepare LSN as the finish LSN. A transaction whose
        decision is already here is folded (applier.apply.fold): no record, no PREPARE; a rolled back one's changes
        are discarded."""
        self._start_remote(m.xid, m.prepare_lsn, "BEGIN PREPARE")
        self.tx.prepare = m
        self.tx.gid = m.gid
        decision = self.folding.begin(m, not self.tx.skipping and self.group.may_group())
        if decision is not None:
            self.tx.discarding = not decision.commit
            return
        ctx = self.context("BEGIN PREPARE")
        self.records.record(m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time, ctx, self.group)

    def handle_prepare(self, m: Prepare, payload: bytes = b"") -> None:
        """``apply_handle_prepare``: always PREPARE, even an empty or skipped transaction (behaviour 61)."""
        self._check_final_lsn("PREPARE", m.prepare_lsn, self.tx.prepare is not None)
        if self.folding.current is not None:
            return  # the transaction ends with its COMMIT/ROLLBACK PREPARED, the next message
        self._prepare_internal(m.xid, m.end_lsn, m.prepare_time, "PREPARE")

    def _prepare_internal(self, xid: int, end_lsn: int, prepare_time: int, message_type: str) -> None:
        self.inserts.flush()
        ctx = self.context(message_type)
        finish_lsn = self.tx.final_lsn
        if self.tx.skipping:
            self.log.info(skiprules.completed_skipping_message(finish_lsn))
        token = self.tracker.queued(end_lsn, two_phase=True)
        self.target.prepare(self.records.gid(xid, self.tx.gid), end_lsn, prepare_time, ctx,
                            lambda _res: self.tracker.confirmed(token))  # fmt: skip
        self._end_remote("stream_prepare" if message_type == "STREAM PREPARE" else "prepare")
        self.tables.after_transaction(end_lsn)
        self.skip_clearing.separately(finish_lsn, True)

    def handle_commit_prepared(self, m: CommitPrepared, payload: bytes = b"") -> None:
        """``apply_handle_commit_prepared``: COMMIT PREPARED; an unknown GID is an error (no lookup)."""
        if self.folding.ends(m.xid, True, self.tx.xid):
            self._end_folded(m.commit_lsn, m.end_lsn, m.commit_time, "COMMIT PREPARED", "commit_prepared")
            return
        gid = self.records.gid(m.xid, m.gid)
        self._finish_prepared(True, gid, m.xid, m.commit_lsn, m.end_lsn, m.commit_time, "COMMIT PREPARED")
        self.stats.count("commit_prepared")
        self.tables.after_transaction(m.end_lsn)
        self.skip_clearing.separately(m.end_lsn, True)

    def handle_rollback_prepared(self, m: RollbackPrepared, payload: bytes = b"") -> None:
        """``apply_handle_rollback_prepared``: only if our prepared transaction is the one the publisher prepared
        (same GID, prepare end LSN and time, ``LookupGXact``), else skipped silently (behaviours 64-65)."""
        end_lsn = m.rollback_end_lsn
        if self.folding.ends(m.xid, False, self.tx.xid):
            self._end_folded(end_lsn, end_lsn, m.rollback_time, "ROLLBACK PREPARED", "rollback_prepared")
            return
        gid = self.records.gid(m.xid, m.gid)
        found = self.records.matches(gid, m.prepare_end_lsn, m.prepare_time)
        if found:
            self._finish_prepared(False, gid, m.xid, m.prepare_end_lsn, end_lsn, m.rollback_time, "ROLLBACK PREPARED")  # fmt: skip
        else:
            self._check_outside("ROLLBACK PREPARED")
            self.tracker.confirmed(self.tracker.queued(end_lsn, two_phase=True))
            self.log.debug("skipping ROLLBACK PREPARED of %s: no matching prepared transaction", gid)
        self.stats.count("rollback_prepared" if found else "skipped")
        self.tables.after_transaction(end_lsn)
        if found:
            self.skip_clearing.separately(end_lsn, True)

    def _check_outside(self, message_type: str) -> None:
        if self.tx.active:
            raise self.protocol_error(message_type, f"{message_type} received inside a remote transaction")

    def _finish_prepared(self, commit: bool, gid: str, xid: int, lsn: int, end_lsn: int, time: int, message_type: str) -> None:  # fmt: skip
        """COMMIT or ROLLBACK PREPARED of our prepared transaction (``lsn`` is what its error context names)."""
        self._check_outside(message_type)
        ctx = ErrorContext(self.origin, message_type, None, xid, lsn)
        token = self.tracker.queued(end_lsn, two_phase=True)
        self.target.finish_prepared(commit, gid, end_lsn, time, ctx, lambda _res: self.tracker.confirmed(token))  # fmt: skip
        self.records.forget(gid)

    def _end_folded(self, lsn: int, end_lsn: int, time: int, message_type: str, kind: str) -> None:
        """End a folded transaction as a plain commit at ``end_lsn`` (its COMMIT/ROLLBACK PREPARED's end), group
        commit included; a rolled back one applied nothing, so it commits nothing of its own."""
        self.folding.current = None
        self.stats.folded_prepares += 1
        self._commit_or_defer(lsn, end_lsn, time, message_type, kind)

    # --- streamed transactions -------------------------------------------------------------------------------
    def spool_raw(self, payload: bytes) -> None:
        """A change inside a stream chunk (type byte in :data:`RAW_SPOOL_TYPES`), spooled as received, undecoded:
        only the subtransaction xid after the type byte is read (``stream_write_change``); checked at replay."""
        if self.stream.xid is not None and len(payload) >= 5:
            self.spool.write(int.from_bytes(payload[1:5], "big"), payload)
        else:  # pragma: no cover - the worker's decoder says in-stream
            self.handle(decode_message(payload, in_stream=True, encoding=self.encoding), payload)

    def _check_chunk(self, message_type: str, chunk_open: bool, text: str) -> None:
        """A stream message must come inside (``chunk_open``) or outside a stream chunk."""
        if (self.stream.xid is not None) is not chunk_open:
            raise self.protocol_error(message_type, text)

    def handle_stream_start(self, m: StreamStart, payload: bytes = b"") -> None:
        """``apply_handle_stream_start``: open (or reopen) the transaction's spool file."""
        self._check_chunk("STREAM START", False, "duplicate STREAM START message")
        if self.tx.active:
            raise self.protocol_error("STREAM START", "STREAM START received inside a remote transaction")
        if m.xid == 0:
            raise self.protocol_error("STREAM START", "invalid transaction ID in streamed replication transaction")  # fmt: skip
        self.inserts.flush()
        self.spool.start_chunk(m.xid, m.first_segment)
        self.stream.xid = m.xid

    def handle_stream_stop(self, m: StreamStop, payload: bytes = b"") -> None:
        """``apply_handle_stream_stop``: close the chunk's spool file."""
        self._check_chunk("STREAM STOP", True, "STREAM STOP message without STREAM START")
        self.spool.close_chunk()
        self.stream.xid = None

    def handle_stream_abort(self, m: StreamAbort, payload: bytes = b"") -> None:
        """``apply_handle_stream_abort``: drop the spool, or truncate it back to the aborted subtransaction."""
        self._check_chunk("STREAM ABORT", False, "STREAM ABORT message without STREAM STOP")
        self.spool.abort(m.xid, m.subxid)
        if m.xid == m.subxid:
            self.stats.kinds["stream_abort"] += 1

    def _replay(self, xid: int, final_lsn: int, message_type: str) -> None:
        """``apply_spooled_messages``: the spooled changes through the handlers (Insert stretches into a COPY)."""
        self._start_remote(xid, final_lsn, message_type)
        for buffer, starts, ends in self.spool.replay_batches(xid):
            at, to = starts.tolist(), ends.tolist()

            def one(i: int, buffer: bytes = buffer, at: list[int] = at, to: list[int] = to) -> None:
                _replay_one(self, buffer[at[i] : to[i]], xid, message_type)

            self.handle_insert_run(InsertRun(buffer, starts, ends, 0, 5), 0, len(at), one)

    def handle_stream_commit(self, m: StreamCommit, payload: bytes = b"") -> None:
        """``apply_handle_stream_commit``: replay the spool in one local transaction, then the Commit path."""
        self._check_chunk("STREAM COMMIT", False, "STREAM COMMIT message without STREAM STOP")
        self._replay(m.xid, m.commit_lsn, "STREAM COMMIT")
        self._commit_internal(m.end_lsn, m.commit_time, "STREAM COMMIT")
        self._end_remote("stream_commit")
        self.spool.discard(m.xid)
        self.tables.after_transaction(m.end_lsn)

    def handle_stream_prepare(self, m: StreamPrepare, payload: bytes = b"") -> None:
        """``apply_handle_stream_prepare``: replay the spool, then PREPARE it."""
        self._check_chunk("STREAM PREPARE", False, "STREAM PREPARE message without STREAM STOP")
        ctx = ErrorContext(self.origin, "STREAM PREPARE", None, m.xid, m.prepare_lsn, m.gid)
        self.records.record(m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time, ctx, self.group)
        self.tx.gid = m.gid  # _replay's _start_remote keeps it; _end_remote clears it
        self._replay(m.xid, m.prepare_lsn, "STREAM PREPARE")
        self._prepare_internal(m.xid, m.end_lsn, m.prepare_time, "STREAM PREPARE")
        self.spool.discard(m.xid)

    # --- errors ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the session state after an error (the worker reconnects and replays from the origin)."""
        self.tx.end()
        self.stream.xid = None
        self.stats.pending_rows = [0, 0, 0, 0]
        for part in (self.relmap, self.folding, self.inserts, self.commit_policy, self.records):
            part.reset()
        self._ctx_cache.clear()


def _replay_one(core: Applier, payload: bytes, xid: int, message_type: str) -> None:
    """One spooled message of a replay (:meth:`Applier._replay`), through :meth:`Applier.handle` like a message
    that arrived alone: it ends the open insert run before an Update or Delete, so that those go after the Inserts
    before them (the handlers do not; a replayed change is always inside its remote transaction, so nothing ends a
    group here)."""
    msg = decode_message(payload, in_stream=True, encoding=core.encoding)
    if not isinstance(msg, _SPOOLED):
        raise core.protocol_error(
            message_type, f"unexpected {MESSAGE_NAMES[msg.__class__]} in spool of {xid}"
        )
    core.handle(msg, payload)


#: One handler per message, named as worker.c's ``apply_handle_*`` (``apply_dispatch``): BEGIN PREPARE ->
#: :meth:`Applier.handle_begin_prepare`. A literal table, so that a reader (and grep) finds every handler's caller.
HANDLERS: dict[type, Callable[[Applier, Any, bytes], None]] = {
    Begin: Applier.handle_begin,
    Commit: Applier.handle_commit,
    Origin: Applier.handle_origin,
    Relation: Applier.handle_relation,
    Type: Applier.handle_type,
    Insert: Applier.handle_insert,
    Update: Applier.handle_update,
    Delete: Applier.handle_delete,
    Truncate: Applier.handle_truncate,
    Message: Applier.handle_message,
    StreamStart: Applier.handle_stream_start,
    StreamStop: Applier.handle_stream_stop,
    StreamCommit: Applier.handle_stream_commit,
    StreamAbort: Applier.handle_stream_abort,
    BeginPrepare: Applier.handle_begin_prepare,
    Prepare: Applier.handle_prepare,
    CommitPrepared: Applier.handle_commit_prepared,
    RollbackPrepared: Applier.handle_rollback_prepared,
    StreamPrepare: Applier.handle_stream_prepare,
}
