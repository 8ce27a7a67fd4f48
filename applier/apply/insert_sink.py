"""Where the Inserts of a remote transaction go: row by row as prepared INSERTs, or, once a run is long, as a COPY.

**Speed.** A backlog is mostly runs of Inserts into one table. :class:`InsertRuns` gathers the Inserts into one
relation: a short run is sent as prepared INSERTs; once it reaches :data:`~applier.apply.ports.COPY_THRESHOLD` rows
it continues as a COPY (``Target.start_copy``), which costs a fraction of an INSERT per row. While a COPY is open,
the worker can hand over whole stretches of Inserts at once (:meth:`InsertRuns.copy_stretches`): each stretch of at
least :data:`VECTOR_MIN` of them is converted into COPY text in one go (:mod:`applier.apply.copytext`), with no
message objects at all — the "COPY lane".

**Safety.** Order is kept: a row that COPY text cannot carry (binary, unchanged TOAST) closes the COPY first, and
any other change, relation message or transaction end flushes the run (:meth:`InsertRuns.flush`) before it is sent.

Pure: it calls the target (:class:`~applier.apply.ports.ApplyTarget`) and does no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from applier.apply.apply_state import ApplyStats, RemoteTransaction, StreamChunk
from applier.apply.context import ErrorContext
from applier.apply.copytext import InsertRun
from applier.apply.ports import COPY_THRESHOLD, ApplyTarget, copy_eligible
from applier.apply.relmap import RelationMap, RelMapEntry
from applier.messages import KIND_BINARY, KIND_UNCHANGED_TOAST, TupleData

#: Inserts in a stretch below this go row by row: converting a stretch costs a fixed ~50 µs of array calls
VECTOR_MIN = 32
#: pgoutput's type byte of an Insert's new tuple ('N'), the low byte of a COPY lane's key
_NEW_TUPLE = ord("N")


class InsertRuns:
    """The insert sink of one apply session: the open run (its relation, buffered rows and error context)."""

    __slots__ = ("target", "stats", "tx", "stream", "relmap", "entry", "rows", "ctx")

    def __init__(
        self,
        target: ApplyTarget,
        stats: ApplyStats,
        tx: RemoteTransaction,
        stream: StreamChunk,
        relmap: RelationMap,
    ) -> None:
        self.target = target
        self.stats = stats
        self.tx, self.stream, self.relmap = tx, stream, relmap  # the core's, read by lane()
        self.entry: RelMapEntry | None = None  # the relation of the open run
        self.rows: list[TupleData] = []  # its rows not sent yet (fewer than COPY_THRESHOLD)
        self.ctx: ErrorContext | None = None

    def open(self, entry: RelMapEntry, ctx: ErrorContext, new: TupleData) -> None:
        """Start a run into ``entry`` with its first row ``new`` (after :meth:`flush` of the previous one); the
        local transaction starts with it."""
        self.entry = entry
        self.ctx = ctx
        if not self.target.in_transaction:
            self.target.begin(ctx)
        self.add(entry.remote.relid, new)

    def add(self, relid: int, new: TupleData) -> bool:
        """One Insert into remote relation ``relid``, if the open run is into it: into the open COPY, or buffered
        until the run is long enough, when the COPY starts with the buffered rows. Returns False when the Insert
        must start a new run instead (no run open, another relation, its mapping replaced since, the transaction
        discarded): the core checks the relation then, once per run. (No run is open inside a stream chunk: Stream
        Start ends it, and the chunk's Inserts are spooled before they get here.)

        The row's send call is made here, not in a helper: a plain INSERT reaches the target in five calls from
        the loop's round on every route (tests/unit/test_loop.py)."""
        entry = self.entry
        if entry is None or self.relmap.entries.get(relid) is not entry or self.tx.discarding:
            return False
        target = self.target
        copy = target.copy_run
        if copy is not None and copy.entry is entry:
            kinds = new.kinds
            if KIND_BINARY not in kinds and KIND_UNCHANGED_TOAST not in kinds:
                copy.add(new)
                self.stats.pending_rows[0] += 1
                return True
            target.end_copy()  # keep the order: this row goes after everything already copied
        self.stats.pending_rows[0] += 1
        rows = self.rows
        rows.append(new)
        if len(rows) < COPY_THRESHOLD:
            return True
        if all(copy_eligible(r) for r in rows):
            target.start_copy(entry, rows, self.ctx)  # the run continues as a COPY
        else:
            for r in rows:
                target.insert(entry, r, self.ctx)
        rows.clear()
        return True

    def flush(self) -> None:
        """End the open run: send what is buffered as INSERTs, and close a COPY."""
        entry = self.entry
        if entry is None:
            return
        target, ctx = self.target, self.ctx
        target.end_copy()
        for r in self.rows:
            target.insert(entry, r, ctx)
        self.rows.clear()
        self.entry = None

    def reset(self) -> None:
        """After an error: the run's local transaction is gone with the session."""
        self.entry = None
        self.rows.clear()

    def flush_if(self, relid: int) -> None:
        """End the open run if it is into remote relation ``relid`` (its mapping is about to change)."""
        if self.entry is not None and self.entry.remote.relid == relid:
            self.flush()

    def lane(self) -> tuple[int, int] | None:
        """``(relid << 8 | 'N', column count)`` of the Inserts that would go straight into the open COPY, or
        ``None`` when none would (no COPY open, its relation remapped since, discarding, inside a stream chunk)."""
        entry = self.entry
        if entry is None or self.tx.discarding or self.stream.xid is not None:
            return None
        copy = self.target.copy_run
        relid = entry.remote.relid
        if copy is None or copy.entry is not entry or self.relmap.entries.get(relid) is not entry:
            return None
        return (relid << 8) | _NEW_TUPLE, len(entry.names)

    def copy_stretches(self, run: InsertRun, first: int, stop: int, one: Callable[[int], None]) -> None:
        """Messages ``first`` to ``stop - 1`` of ``run``, in arrival order, Inserts or not: every stretch of at
        least :data:`VECTOR_MIN` Inserts that goes into the open COPY (see :meth:`lane`) is converted
        in one go; ``one(i)`` handles the rest message by message, exactly as if they had come alone (so a
        malformed one gets its precise error, and a new relation starts its own run and, once long enough, its
        own COPY)."""
        heads = run.relid_heads(first, stop).tolist()
        i = first
        while i < stop:
            head = heads[i - first]
            end = i + 1
            while end < stop and heads[end - first] == head:
                end += 1
            self._stretch(run, i, end, head, one)
            i = end

    def _stretch(self, run: InsertRun, i: int, end: int, head: int, one: Callable[[int], None]) -> None:
        """Messages ``i`` to ``end - 1``, all with the same relid head ``head`` (-1: not Inserts): one by one until
        the rest goes into the open COPY (the first ones may open it), then the rest converted at once (sent from
        here: a converted stretch reaches the target in five calls from the loop's round, as a single row)."""
        columns: int | None = None  # of the open lane, once the rest goes into it
        while i < end:
            open_lane = self.lane() if head != -1 and end - i >= VECTOR_MIN else None
            if open_lane is not None and open_lane[0] == head:
                columns = open_lane[1]
                break
            one(i)
            i += 1
        text = None if columns is None else run.copy_text(i, end, columns)
        if text is None:  # not the simple shape: the rest row by row (none left once the loop ran through)
            for j in range(i, end):
                one(j)
            return
        self.target.copy_run.add_text(text, end - i)  # type: ignore[union-attr]
        self.stats.pending_rows[0] += end - i
        self.stats.converted_rows += end - i
