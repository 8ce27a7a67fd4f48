"""The apply loop: read → plan → apply → housekeeping, for the apply worker and a table sync's catch-up alike.

One round (:meth:`ApplyLoop.round`) reads what the publisher sent, a batch at a time, undecoded
(``ReplicationConnection.read_undecoded``), asks the planner (:mod:`applier.apply.route`) which route each stretch of
the batch takes into the apply core (:class:`~applier.apply.handlers.Applier`) and takes it; between reads it lets
:class:`~applier.apply.pacing.ReadPacer` decide whether to wait a moment for the walsender's output to queue up. After
the round, the *worker context* does its housekeeping: feedback, the catalog watch and the sync-state pass for the
apply worker; the position reached and status updates for a table sync's catch-up. That context is what PostgreSQL's
``am_tablesync_worker()`` and supabase/etl's ``WorkerContext`` tell apart; the loop itself is the same
(``LogicalRepApplyLoop``).

A plain INSERT goes :meth:`ApplyLoop.round` → :meth:`ApplyLoop.apply_batch` → :meth:`ApplyLoop.apply_one` →
``Applier.handle_insert_bytes`` → ``InsertRuns.add`` → the target's send call (five calls, as on its other routes:
docs/architecture.md); tests/unit/test_loop.py records the depths.

The loop does no SQL and holds no connection of its own: the stream source and the core are handed in (the real
``ReplicationConnection`` or a list of messages in the unit tests).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

from applier.apply.bulk import Batch
from applier.apply.copytext import InsertRun
from applier.apply.feedback import FeedbackTracker
from applier.apply.fold import decided_prepares
from applier.apply.handlers import Applier
from applier.apply.pacing import ReadPacer, StatusPacer
from applier.apply.route import Route, bulk_worthwhile, has_prepares, kinds_of, plan
from applier.decoder import MessageDecoder, decode_message
from applier.messages import (
    BEGIN_PREPARE_TYPE,
    INSERT_TYPE,
    SPOOLED_TYPES,
    UPDATE_TYPE,
    XLOG_ENVELOPE,
    PrimaryKeepalive,
    XLogData,
)

#: Messages applied in one round, before the context's housekeeping (feedback, stop, catalog) runs again.
BURST = 5000
#: every XLogData is read undecoded and handled in batches
ALL_TYPES = bytes([1] * 256)
#: dataStart and walEnd of an XLogData envelope
_XLOG_POSITIONS = struct.Struct(">QQ").unpack_from
_ENV = XLOG_ENVELOPE


def _refused() -> bool:
    """``bulk_ready`` after the core refused a Begin for bulk apply: go on one by one, up to the next Begin."""
    return False


class StreamSource(Protocol):
    """The replication stream as the loop reads it (:class:`applier.replication.ReplicationConnection`)."""

    ran_dry: bool

    def read(self, timeout: float) -> XLogData | PrimaryKeepalive | None: ...

    def read_undecoded(
        self, into: list[bytes], limit: int, wanted: bytes, *, refill: bool = False
    ) -> XLogData | PrimaryKeepalive | None: ...


class WorkerContext(Protocol):
    """What differs between the apply worker and a table sync's catch-up (``am_tablesync_worker()``)."""

    def should_stop(self) -> bool:
        """Checked before each round: True ends :meth:`ApplyLoop.run` (stop requested, caught up)."""
        ...

    def caught_up(self) -> bool:
        """Checked after each read: a sync worker stops reading at its end point, mid-round."""
        ...

    def housekeeping(self, received: int, reply_requested: bool) -> None:
        """After a round of ``received`` messages: feedback, catalog, sync state (may raise to end the session)."""
        ...


class ApplyLoop:
    """read → plan → apply → housekeeping (see the module docstring)."""

    def __init__(
        self,
        source: StreamSource,
        applier: Applier,
        tracker: FeedbackTracker,
        context: WorkerContext,
        *,
        two_phase: bool = False,
        fold_prepares: bool = False,
        batch_limit: int = BURST,
        pacer: ReadPacer | None = None,
        status_pacer: StatusPacer | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.source, self.applier, self.tracker, self.context = source, applier, tracker, context
        self.decoder = MessageDecoder()
        self.two_phase = two_phase  # prepared transactions can come: their records are batched
        self.fold_prepares = fold_prepares
        self.batch_limit = batch_limit  # 1 for a catch-up, which must stop right after its end point
        self.pacer = pacer or ReadPacer()
        self.status_pacer = (
            status_pacer  # an owed status update shortens the read wait (the housekeeping sends it)
        )
        self.sleep = sleep
        self._batch: list[bytes] = []  # XLogData read undecoded, envelope included, handled together
        self._insert = applier.handle_insert_bytes
        # the core's remote transaction, read directly each round (not through its alias)
        self._tx = applier.tx
        #: one pgoutput message, as ``apply_dispatch`` (see :meth:`_dispatcher`)
        self.apply_one = self._dispatcher()

    def run(self) -> None:
        """Rounds until the context says stop (errors end the session by raising)."""
        context = self.context
        while not context.should_stop():
            received, reply_requested = self.round()
            context.housekeeping(received, reply_requested)

    # --- read ------------------------------------------------------------------------------------------------
    def round(self) -> tuple[int, bool]:
        """Read and apply up to :data:`BURST` messages, until nothing more is there (or the context caught up);
        return how many, and whether the publisher asked for a reply."""
        n, reply_requested, waited = 0, False, False
        batch, context, source = self._batch, self.context, self.source
        while n < BURST and not context.caught_up():
            # The first read of a round takes only what libpq has buffered: the socket is then waited on by
            # read() below, whose wait covers it (a check here would be one more system call per round).
            refill = n > 0
            item = source.read_undecoded(batch, min(BURST - n, self.batch_limit), ALL_TYPES, refill=refill)
            if batch:
                n += len(batch)
                self._received(batch)
                self.apply_batch(batch)
                if item is None and self._pace(batch, refill):
                    break
                batch.clear()
                if item is None:
                    continue
            if item is None:
                wait = self._wait(n, waited)
                if wait is None:
                    break  # the read before this one found the socket empty a moment ago
                waited = n > 0
                item = source.read(wait)
                if item is None:
                    break
            n += 1
            reply_requested |= self._take(item)
        return n, reply_requested

    def _wait(self, n: int, waited: bool) -> float | None:
        """How long this read waits for data, or None to end the round. The first read of a round (``n`` 0) waits
        as the read pacing says, less while a status update is owed. A later one follows a read that found the
        socket empty: mid-transaction it waits for the rest of the transaction, once per round (``waited``: done
        already), and otherwise the round ends."""
        if n:
            if waited or not self._tx.active:
                return None
            return self.pacer.rest_wait
        wait = self.pacer.wait_for_data(bool(self.tracker.pending), True)
        if wait and self.status_pacer is not None:
            return self.status_pacer.timeout(time.monotonic(), wait)
        return wait

    def _received(self, batch: list[bytes]) -> None:
        data_start, wal_end = _XLOG_POSITIONS(batch[-1], 1)
        self.tracker.received(max(data_start, wal_end))

    def _pace(self, batch: list[bytes], refilled: bool) -> bool:
        """After a batch that ended the read: when more is on its way, let the walsender's output queue up
        (applier.apply.pacing). Returns True when the round is over: the read emptied the socket (``refilled``:
        it looked at the socket, not only at libpq's buffer) between two remote transactions and no pause was
        due, so nothing is arriving. Under a steady load of small transactions, one per round, reading on would
        only find the socket empty twice more: two system calls and two passes through the read path each."""
        emptied = refilled and self.source.ran_dry
        in_transaction = self._tx.active
        pause = self.pacer.pause_after(len(batch), emptied, in_transaction)
        if pause:
            self.sleep(pause)
            return False
        if emptied and not in_transaction:
            batch.clear()
            return True
        return False

    def _take(self, item: XLogData | PrimaryKeepalive) -> bool:
        """One message read decoded (a keepalive, or an XLogData too short to be read undecoded)."""
        if item.__class__ is XLogData:
            self.tracker.received(max(item.data_start, item.wal_end))  # type: ignore[union-attr]
            self.apply_one(item.payload)  # type: ignore[union-attr]
            return False
        if item.__class__ is PrimaryKeepalive:
            self.tracker.received(item.wal_end)
            return item.reply_requested  # type: ignore[union-attr]
        return False

    # --- plan and apply ------------------------------------------------------------------------------------------
    def apply_batch(self, messages: list[bytes]) -> None:
        """XLogData in stream order (envelope included), each stretch along the route the planner chooses."""
        applier, decoder = self.applier, self.decoder
        kinds = kinds_of(messages)
        if self.two_phase and has_prepares(kinds):
            self._announce_prepares(messages)
        bulk = applier.bulk_exec
        bulk_ready = bulk.ready if bulk.enabled and bulk_worthwhile(kinds) else None
        lane, apply_one, ONE = applier.inserts.lane, self.apply_one, Route.ONE  # noqa: N806 - a local alias
        batch: Batch | None = None
        i, count = 0, len(messages)
        while i < count:
            route, j = plan(kinds, i, decoder.in_stream, applier.stream.xid is not None, bulk_ready, lane)
            if route is Route.BULK:
                batch = batch or Batch(messages)
                j = applier.apply_bulk(batch, i)
                if j > i:
                    i = j
                    continue
                route, j = plan(
                    kinds, i, False, False, _refused, lane
                )  # not this way: one by one from the Begin
            if route is ONE:
                apply_one(messages[i][_ENV:])
                for message in messages[i + 1 : j]:
                    apply_one(message[_ENV:])
            elif route is Route.SPOOL:
                applier.spool_batch(messages[i:j], _ENV)
            else:
                self._copy_lane(messages[i:j])
            i = j

    def _dispatcher(self) -> Callable[[bytes], None]:
        """:meth:`apply_one` as a closure over what it calls (it runs once per message: no attribute lookups)."""
        decoder, decode, handle = self.decoder, self.decoder.decode, self.applier.handle
        insert, spool_raw = self.applier.handle_insert_bytes, self.applier.spool_raw
        update = self.applier.handle_update_bytes

        def apply_one(payload: bytes) -> None:
            """One pgoutput message (``apply_dispatch``): a streamed change is spooled undecoded, an Insert outside
            a stream goes in from its bytes, an Update too (when the core takes it so), anything else is decoded
            and handled."""
            if decoder.in_stream:
                if payload[0] in SPOOLED_TYPES:
                    spool_raw(payload)
                else:
                    handle(decode(payload), payload)
            elif payload[0] == INSERT_TYPE:
                insert(payload)
            elif payload[0] != UPDATE_TYPE or not update(payload):
                handle(decode(payload), payload)

        return apply_one

    def _copy_lane(self, stretch: list[bytes]) -> None:
        """Inserts into the open COPY, converted into COPY text at once (applier.apply.copytext)."""
        insert = self._insert
        self.applier.handle_insert_run(
            InsertRun.of(stretch, _ENV, _ENV + 1), 0, len(stretch), lambda k: insert(stretch[k][_ENV:])
        )

    def _announce_prepares(self, messages: list[bytes]) -> None:
        """Prepared transactions whose COMMIT/ROLLBACK PREPARED is in the batch too are applied folded
        (applier.apply.fold); the prepared_xact records of the others are written together, at the first."""
        applier = self.applier
        decided = applier.decided
        if self.fold_prepares:
            decided.update(decided_prepares(messages, _ENV))
        begins: list[Any] = [
            b
            for b in (decode_message(m[_ENV:]) for m in messages if m[_ENV] == BEGIN_PREPARE_TYPE)
            if b.xid not in decided  # type: ignore[union-attr]
        ]
        if len(begins) > 1:
            applier.expect_prepares(begins)
