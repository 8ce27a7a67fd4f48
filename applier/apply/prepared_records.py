"""The ``applier.prepared_xact`` records of our prepared transactions, and their batching.

A record (gid, prepare end LSN, prepare time) is what ``LookupGXact`` compares (behaviour 65); it must be committed
before its transaction is prepared, so it is visible while the transaction stays prepared. The core also keeps the
records in memory (:attr:`PreparedRecords.prepared`), so ROLLBACK PREPARED needs no lookup round trip; rows of
finished ones are removed in batches by the worker when :attr:`finished` > 0 (queued down the apply pipeline,
``CatalogWrites.reconcile_prepared``, so the removal never waits for the pipeline to drain).

**Speed (prepared-record batching).** The worker announces the BEGIN PREPAREs of a batch it has read but not applied
yet (:meth:`PreparedRecords.expect`); the next record written writes theirs along with it, in one statement
(``Target.record_prepared_many``), so the later ones need no statement, nor a local transaction, of their own.
Committing a record earlier changes nothing; one whose transaction never gets prepared here (an error, a crash
first) is replaced when the transaction comes again, or dropped by the worker's reconciliation.

Pure: it calls the target (:class:`~applier.apply.ports.ApplyTarget`) and does no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from applier.apply.apply_state import ApplyStats
from applier.apply.commit_policy import GroupCommit
from applier.apply.context import ErrorContext
from applier.apply.ports import ApplyTarget
from applier.messages import BeginPrepare
from state.twophase import gid_for


class PreparedRecords:
    """Our prepared transactions' records: those committed, those announced, those written ahead."""

    def __init__(
        self, subid: int, target: ApplyTarget, stats: ApplyStats, prepared: dict[str, tuple[int, int]] | None
    ) -> None:
        self.subid = subid
        self.target = target
        self.stats = stats
        #: our prepared transactions: gid -> (prepare_end_lsn, prepare_time) (``LookupGXact``'s data)
        self.prepared: dict[str, tuple[int, int]] = dict(prepared or {})
        self.finished = 0  # COMMIT/ROLLBACK PREPARED done since the worker last reconciled the records
        #: announced BEGIN PREPAREs whose records are still to be written: gid -> (xid, prepare LSN, end LSN, time)
        self._upcoming: dict[str, tuple[int, int, int, int]] = {}
        #: records written ahead, for transactions not applied yet: gid -> (prepare end LSN, prepare time)
        self._ahead: dict[str, tuple[int, int]] = {}
        #: ``gid_format=original``: local prepared transactions keep the publisher's GID (state.twophase.gid_for)
        self.original_gids = False

    def gid(self, xid: int, remote_gid: str | None) -> str:
        """The local GID of remote transaction ``xid`` (prepared by the publisher as ``remote_gid``)."""
        return gid_for(self.subid, xid, remote_gid if self.original_gids else None)

    def record(
        self,
        xid: int,
        prepare_lsn: int,
        end_lsn: int,
        prepare_time: int,
        ctx: ErrorContext,
        group: GroupCommit,
    ) -> None:
        """Store the record of a transaction about to be applied, committed before its local transaction begins: in
        the open group commit's local transaction when there is one (one local transaction end fewer), else
        queued in a transaction of its own (with asynchronous commit it still becomes durable no later than the
        PREPARE, whose WAL flush covers it)."""
        gid = self.gid(xid, ctx.gid)
        recorded = self.written_ahead(gid, end_lsn, prepare_time)
        if group.pending:
            group.core.inserts.flush()
            if not recorded:
                self.write(gid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
                self.stats.records_in_group += 1
            group.end()
        elif not recorded:
            self.write(gid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
        self.prepared[gid] = (end_lsn, prepare_time)

    def written_ahead(self, gid: str, end_lsn: int, prepare_time: int) -> bool:
        """Whether this transaction's record was already written along with an earlier one."""
        return self._ahead.pop(gid, None) == (end_lsn, prepare_time) if self._ahead else False

    def write(
        self, gid: str, xid: int, prepare_lsn: int, end_lsn: int, prepare_time: int, ctx: ErrorContext
    ) -> None:
        """Queue this transaction's record, and those of the announced transactions, in one statement."""
        upcoming = self._upcoming
        if not upcoming:
            self.target.record_prepared(gid, self.subid, xid, prepare_lsn, end_lsn, prepare_time, ctx)
            return
        upcoming[gid] = (xid, prepare_lsn, end_lsn, prepare_time)
        self.target.record_prepared_many([(g, *r) for g, r in upcoming.items()], self.subid, ctx)
        for g, (_xid, _lsn, e, t) in upcoming.items():
            if g != gid:
                self._ahead[g] = (e, t)
        self.stats.records_batched += len(upcoming) - 1
        upcoming.clear()

    def expect(self, begins: Sequence[BeginPrepare]) -> None:
        """The BEGIN PREPAREs of a batch read but not applied yet: the next record written writes theirs too
        (not with publisher GIDs: the batched statement takes only GIDs that need no quoting)."""
        if self.original_gids:
            return
        for m in begins:
            self._upcoming[gid_for(self.subid, m.xid)] = (m.xid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def matches(self, gid: str, prepare_end_lsn: int, prepare_time: int) -> bool:
        """``LookupGXact``: is our prepared transaction ``gid`` the one the publisher prepared (behaviour 65)?"""
        return self.prepared.get(gid) == (prepare_end_lsn, prepare_time)

    def forget(self, gid: str) -> None:
        """Its COMMIT/ROLLBACK PREPARED was sent: the record is removed with the next reconciliation."""
        self.prepared.pop(gid, None)
        self.finished += 1

    def reset(self) -> None:
        """After an error: the records announced or written ahead may not have been committed."""
        self._upcoming.clear()
        self._ahead.clear()
