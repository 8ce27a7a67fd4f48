"""Bulk execution: whole plain transactions of a batch applied together, one statement per table stretch.

**Speed.** :mod:`applier.apply.bulk` plans (pure arrays over the batch's bytes); this module executes a plan on the
target: per stretch of changes to one table, one ``INSERT … SELECT unnest(…)``, ``UPDATE … FROM unnest(…)`` or
``DELETE … USING unnest(…)`` (``Target.bulk_insert`` / ``bulk_update`` / ``bulk_delete``), for hundreds of remote
transactions at a time. Those transactions join the open group commit through the core's one group-commit call
(:meth:`applier.apply.commit_policy.GroupCommit.join`), exactly as transactions applied message by message do.

**Safety.** Only when the transactions would join a group commit anyway (:meth:`BulkExecution.ready`), with text
values, into mapped tables fit for it (no triggers or rules that would see the difference, see ``BULK_OK_SQL``),
that take changes at that LSN. A change that finds no row is the conflict its message would have been, reported in
its own transaction's context. Anything else goes message by message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from applier.apply import bulk as bulkapply
from applier.apply import conflicts
from applier.apply.apply_state import ApplyStats, RemoteTransaction, StreamChunk
from applier.apply.commit_policy import CommitPolicy, DeferredCommit, GroupCommit
from applier.apply.context import ErrorContext
from applier.apply.insert_sink import InsertRuns
from applier.apply.ports import ApplyTarget
from applier.apply.relmap import RelationMap, RelMapEntry
from applier.decoder import decode_message
from applier.errors import ProtocolError
from applier.messages import Delete, Update

#: the operation (as counted in ApplyStats.rows) of each kind of bulk statement
_BULK_OPERATIONS = {bulkapply.INSERT: "insert", bulkapply.UPDATE: "update", bulkapply.DELETE: "delete"}
#: bytes before a pgoutput message in a batch's XLogData ('w', start, end, send time)
_XLOGDATA_HEADER = 25


class BulkCore(Protocol):
    """What :class:`BulkExecution` reads of the core (:class:`~applier.apply.handlers.Applier`)."""

    origin: str
    encoding: str
    target: ApplyTarget
    tables: Any  # TableStates: .should_apply
    tx: RemoteTransaction
    stream: StreamChunk
    stats: ApplyStats
    relmap: RelationMap
    inserts: InsertRuns
    commit_policy: CommitPolicy
    group: GroupCommit

    def protocol_error(self, message_type: str, text: str) -> ProtocolError: ...


class BulkExecution:
    """The bulk strategy of one :class:`~applier.apply.handlers.Applier` (see the module docstring)."""

    def __init__(self, core: BulkCore, enabled: bool) -> None:
        self.core = core
        self.enabled = enabled

    def ready(self) -> bool:
        """Whether the transactions coming next may be applied a batch at a time: nothing is open, and they would
        join a group commit (the conditions of ``GroupCommit.defer``) with text values."""
        core = self.core
        return (
            self.enabled
            and core.commit_policy.enabled
            and not core.tx.active
            and core.stream.xid is None
            and not core.target.binary
            and core.group.may_group()
        )

    def apply(self, batch: bulkapply.Batch, message: int) -> int:
        """Apply, together, the qualifying transactions of ``batch`` from the one whose Begin is message
        ``message`` on, as members of the open group commit; returns the index of the first message not applied,
        ``message`` itself when they go message by message (too few, a relation not mapped yet or not taking its
        changes this way, a change not of the simple shape)."""
        if message < batch.refused_until:
            return message
        first = batch.transaction_at(message)
        if first is None:
            return message
        core, policy = self.core, self.core.commit_policy
        stop = batch.cut_refused(first, min(batch.run_end(first), first + policy.room()))
        if stop - first < bulkapply.MIN_TRANSACTIONS or int(batch.final_lsn[first]) <= policy.ungrouped_until:
            return message
        planned = self._plan(batch, first, stop)
        if planned is None:
            return message
        stop, entries, stretches = planned
        last = stop - 1
        xid, final_lsn = int(batch.xid[last]), int(batch.final_lsn[last])
        core.inserts.flush()
        n_rows = self._send(batch, stretches, entries, xid, final_lsn)
        core.stats.count_many(stop - first, "commit", n_rows)
        core.stats.bulk_transactions += stop - first
        commit = DeferredCommit(int(batch.end_lsn[last]), int(batch.commit_time[last]), xid, final_lsn)
        core.group.join(commit, stop - first, sum(n_rows.values()))
        return int(batch.commits[last]) + 1

    def _plan(
        self, batch: bulkapply.Batch, first: int, stop: int
    ) -> tuple[int, dict[int, RelMapEntry], list[bulkapply.Stretch]] | None:
        """The transactions ``first`` to ``stop - 1`` (or fewer) cut into per-table stretches: ``(stop, entries by
        remote relid, stretches)``, or None when they go message by message (the batch then remembers why)."""
        idx = bulkapply.changes_in(batch, first, stop)
        relids, kinds = batch.relid[idx], batch.kind[idx]
        updated = set(relids[kinds != bulkapply.INSERT].tolist())  # (updated or deleted from: by key)
        entries, refused = self._entries(np.unique(relids).tolist(), updated, int(batch.final_lsn[stop - 1]))
        if refused:  # from the transaction of the first change of such a relation on, message by message
            batch.refuse(refused)
            stop = batch.cut_refused(first, stop)
            if stop - first < bulkapply.MIN_TRANSACTIONS:
                return None
        stretches = bulkapply.plan(
            batch,
            first,
            stop,
            {r: len(e.names) for r, e in entries.items()},
            {r: e.key_positions or () for r, e in entries.items() if r in updated},
        )
        if stretches is None:  # not the simple shape: message by message up to the end of this run
            batch.refused_until = int(batch.commits[stop - 1]) + 1
            return None
        return stop, entries, stretches

    def _entries(
        self, relids: list[int], updated: set[int], final_lsn: int
    ) -> tuple[dict[int, RelMapEntry], set[int]]:
        """The mapped relations that may take their changes as bulk statements, and the remote relids that may not
        (not mapped yet, not fit for it, or not taking changes at ``final_lsn``)."""
        entries: dict[int, RelMapEntry] = {}
        refused: set[int] = set()
        mapped, tables = self.core.relmap.entries, self.core.tables
        for relid in relids:
            entry = mapped.get(relid)
            if (
                entry is None
                or not (entry.bulk_update if relid in updated else entry.bulk_insert)
                or not tables.should_apply(entry.local.oid, final_lsn)
            ):
                refused.add(relid)
            else:
                entries[relid] = entry
        return entries, refused

    def _send(
        self,
        batch: bulkapply.Batch,
        stretches: Sequence[bulkapply.Stretch],
        entries: dict[int, RelMapEntry],
        xid: int,
        final_lsn: int,
    ) -> dict[str, int]:
        """Send one statement per stretch, in the group's local transaction; returns the rows by operation."""
        target = self.core.target
        n_rows = dict.fromkeys(_BULK_OPERATIONS.values(), 0)
        for st in stretches:
            entry = entries[st.relid]
            op = _BULK_OPERATIONS[st.kind]
            ctx = ErrorContext(self.core.origin, op.upper(), entry.display, xid, final_lsn)
            if not target.in_transaction:
                target.begin(ctx)
            if st.single:
                self._apply_single(batch, st, entry)
            elif st.kind == bulkapply.INSERT:
                target.bulk_insert(entry, st.columns, ctx)
            elif st.kind == bulkapply.UPDATE:
                if target.origin_checks:
                    keys = [st.columns[i] for i in entry.key_positions or ()]
                    target.bulk_origins(entry, keys, ctx, self._origin_differs(batch, st, entry))
                target.bulk_update(entry, st.columns, ctx, self._missing(batch, st, entry))
            else:
                if target.origin_checks:
                    target.bulk_origins(entry, st.columns, ctx, self._origin_differs(batch, st, entry))
                target.bulk_delete(entry, st.columns, ctx, self._missing(batch, st, entry))
            n_rows[op] += len(st.messages)
        return n_rows

    def _apply_single(self, batch: bulkapply.Batch, stretch: bulkapply.Stretch, entry: RelMapEntry) -> None:
        """One Update or Delete of a bulk run that its own statement applies (see ``Stretch.single``), in its own
        transaction's context, exactly as ``handle_update`` / ``handle_delete`` would."""
        core = self.core
        m, t = int(stretch.messages[0]), int(stretch.transactions[0])
        payload = batch.data[int(batch.starts[m]) + _XLOGDATA_HEADER : int(batch.ends[m])].tobytes()
        msg = decode_message(payload, encoding=core.encoding)
        ctx = ErrorContext(
            core.origin,
            _BULK_OPERATIONS[stretch.kind].upper(),
            entry.display,
            int(batch.xid[t]),
            int(batch.final_lsn[t]),
        )
        if isinstance(msg, Update):
            core.target.update(entry, msg.old, msg.new, ctx)
        elif isinstance(msg, Delete):
            core.target.delete(entry, msg.old, ctx)
        else:  # pragma: no cover - the batch said Update or Delete
            raise core.protocol_error(ctx.message_type, f"unexpected {type(msg).__name__} in a bulk run")

    def _origin_differs(
        self, batch: bulkapply.Batch, stretch: bulkapply.Stretch, entry: RelMapEntry
    ) -> Callable[[int, Any], None]:
        """What the origin check of a bulk UPDATE/DELETE calls for a change whose row another origin wrote last:
        the conflict its message would have been (applier.apply.origin_probe), in its own transaction's context,
        the message decoded for the DETAIL (rare: only for such rows)."""
        core = self.core
        kind = "update_origin_differs" if stretch.kind == bulkapply.UPDATE else "delete_origin_differs"

        def found(position: int, row: Any) -> None:
            m, t = int(stretch.messages[position - 1]), int(stretch.transactions[position - 1])
            payload = batch.data[int(batch.starts[m]) + _XLOGDATA_HEADER : int(batch.ends[m])].tobytes()
            msg = decode_message(payload, encoding=core.encoding)
            new = msg.new if isinstance(msg, Update) else None
            search = msg.old if msg.old is not None else new
            message_type = _BULK_OPERATIONS[stretch.kind].upper()
            ctx = ErrorContext(
                core.origin, message_type, entry.display, int(batch.xid[t]), int(batch.final_lsn[t])
            )
            detail = conflicts.change_detail(kind, entry, row, search, new)
            core.target.pipeline.on_conflict(kind, ctx, [detail], (entry, search, new, row))

        return found

    def _missing(
        self, batch: bulkapply.Batch, stretch: bulkapply.Stretch, entry: RelMapEntry
    ) -> Callable[[list[int]], None]:
        """What a bulk UPDATE/DELETE calls with the positions of its changes that found no row: each is the
        conflict its message would have been, in its own transaction's context."""
        xids, final_lsns = batch.xid[stretch.transactions], batch.final_lsn[stretch.transactions]
        message_type = _BULK_OPERATIONS[stretch.kind].upper()
        core = self.core

        def missing(positions: list[int]) -> None:
            for p in positions:
                core.stats.missing_row(
                    ErrorContext(
                        core.origin, message_type, entry.display, int(xids[p - 1]), int(final_lsns[p - 1])
                    ),
                    (entry, None, None),
                )

        return missing

    def recheck(self, lookup: Callable[[list[int]], set[int]] | None = None) -> None:
        """Forget the mapped tables whose fitness for bulk apply changed since they were loaded (a trigger enabled
        ALWAYS, say), so that their next change loads them again; the worker calls this about once a second while
        idle, standing in for the relcache invalidation that tells the native worker."""
        core = self.core
        entries = core.relmap.entries
        known = {e.local.oid for e in entries.values()}
        if not known:
            return
        ok = (lookup or core.target.bulk_tables)(sorted(known))
        for relid, entry in list(entries.items()):
            if entry.local.bulk != (entry.local.oid in ok):
                core.inserts.flush_if(relid)
                del entries[relid]
