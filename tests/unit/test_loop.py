"""The apply loop (applier.apply.loop) over a scripted stream and the recording fake target: read → plan → apply →
housekeeping, the depth at which a plain INSERT reaches the target, and a sync worker's stop at its end point."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from applier.apply.loop import ApplyLoop
from applier.apply.pacing import READ_REST_WAIT
from applier.apply.ports import COPY_THRESHOLD
from applier.apply.route import BULK_WORTHWHILE
from applier.encoder import encode_envelope, encode_message
from applier.messages import (
    Begin,
    Commit,
    Insert,
    PrimaryKeepalive,
    StreamStart,
    StreamStop,
    Update,
    XLogData,
)
from tests.support.applier_kit import REL_B, REL_T, REL_U, B, Core, make_core, row


class ScriptedStream:
    """A stream source that hands out the XLogData of ``rounds`` (one list per burst of the publisher) as the
    replication connection does: undecoded into the caller's batch, up to its limit; a keepalive alone."""

    def __init__(self, *rounds: list[Any]) -> None:
        self.rounds: list[list[Any]] = [list(r) for r in rounds]
        self.ran_dry = False
        self.lsn = 0

    def read_undecoded(self, into: list[bytes], limit: int, wanted: bytes, *, refill: bool = False) -> Any:
        while len(into) < limit:
            current = self.rounds[0] if self.rounds else []
            if not current:
                self.ran_dry = True
                return None
            msg = current[0]
            if isinstance(msg, PrimaryKeepalive):
                if into:
                    return None
                current.pop(0)
                return msg
            current.pop(0)
            self.lsn += 10
            into.append(encode_envelope(XLogData(self.lsn, self.lsn, 0, encode_message(msg))))
        self.ran_dry = False
        return None

    def read(self, timeout: float) -> Any:
        """As the real read(): the next message decoded, once the next burst has arrived (None when none is left)."""
        if self.rounds and not self.rounds[0]:
            self.rounds.pop(0)  # the next round arrives
        if not self.rounds or not self.rounds[0]:
            return None
        msg = self.rounds[0].pop(0)
        if isinstance(msg, PrimaryKeepalive):
            return msg
        self.lsn += 10
        return XLogData(self.lsn, self.lsn, 0, encode_message(msg))


class Context:
    """Stops when the script is done (or, as a sync worker, at ``until`` transactions)."""

    def __init__(self, stream: ScriptedStream, core: Core, until: int | None = None) -> None:
        self.stream, self.core, self.until = stream, core, until
        self.rounds: list[tuple[int, bool]] = []

    def should_stop(self) -> bool:
        return not any(self.stream.rounds) or self.caught_up()

    def caught_up(self) -> bool:
        return self.until is not None and self.core.applier.transactions >= self.until

    def housekeeping(self, received: int, reply_requested: bool) -> None:
        self.rounds.append((received, reply_requested))


def txn(xid: int, *ids: int) -> list[Any]:
    return [
        Begin(1000 * xid, 0, xid),
        *(Insert(None, 1, row(i, "v")) for i in ids),
        Commit(0, 1000 * xid, 1000 * xid, 0),
    ]


def run(core: Core, *rounds: list[Any], **options: Any) -> Context:
    stream = ScriptedStream(*rounds)
    context = Context(stream, core, options.pop("until", None))
    ApplyLoop(stream, core.applier, core.tracker, context, sleep=lambda _s: None, **options).run()
    return context


def test_a_round_applies_what_was_read_and_then_does_the_housekeeping(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    context = run(core, [REL_T, *txn(1, 1), *txn(2, 2)], [PrimaryKeepalive(0, 0, True)])
    core.target.confirm_all()
    assert core.target.names(skip=("drain", "load_local_table")) == [
        "begin",
        "insert",
        "commit",
        "begin",
        "insert",
        "commit",
    ]
    assert core.target.origin_lsn == 2000
    assert context.rounds == [(7, False), (1, True)]
    assert core.tracker.last_received == 70


def test_a_long_insert_run_goes_into_the_copy_lane(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    n = COPY_THRESHOLD + 100
    run(core, [REL_T, *txn(1, *range(n))])
    core.target.confirm_all()
    assert core.applier.converted_rows > 0  # converted into COPY text a stretch at a time
    assert "start_copy" in core.target.names()


def test_a_sync_worker_stops_right_after_its_end_point(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    stream = ScriptedStream([REL_T, *txn(1, 1), *txn(2, 2)])
    context = Context(stream, core, until=1)
    ApplyLoop(stream, core.applier, core.tracker, context, batch_limit=1).run()
    core.target.confirm_all()
    assert core.target.origin_lsn == 1000
    assert len(stream.rounds[0]) == 3  # the second transaction was never read


class GroupEndingContext(Context):
    """As the apply worker's housekeeping: a group commit still open after a round is committed."""

    def housekeeping(self, received: int, reply_requested: bool) -> None:
        super().housekeeping(received, reply_requested)
        applier = self.core.applier
        if applier.group_pending and not applier.in_remote_transaction:
            applier.end_group()


#: the fake target's calls that send rows: prepared INSERT, COPY start, a row into the COPY, converted COPY text, and
#: a bulk statement
SENDS = frozenset(("insert", "start_copy", "add", "add_text", "bulk_insert"))


def _sends_within_five(core: Core, *rounds: list[Any]) -> set[str]:
    """The row send calls the loop made over ``rounds``, each asserted to be at most five calls below the loop (the
    target of issue 18; PostgreSQL's worker takes three to ``apply_handle_insert``)."""
    depths = _send_depths(core, *rounds)
    assert max(depths.values()) <= 5, depths
    return set(depths)


def _send_depths(core: Core, *rounds: list[Any]) -> dict[str, int]:
    """For each of :data:`SENDS` the loop reached: how many calls below the loop it first was (below
    ``ApplyLoop.round``, or ``ApplyLoop.run`` for what the housekeeping between rounds sends)."""
    depths: dict[str, int] = {}

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        name = frame.f_code.co_name
        if event == "call" and name in SENDS and "fake_target" in frame.f_code.co_filename:
            depth, f = 0, frame
            while f is not None and f.f_code.co_name not in ("round", "run"):
                depth, f = depth + 1, f.f_back  # type: ignore[assignment]
            depths.setdefault(name, depth)

    stream = ScriptedStream(*rounds)
    context = GroupEndingContext(stream, core)
    loop = ApplyLoop(stream, core.applier, core.tracker, context, sleep=lambda _s: None)
    sys.setprofile(profile)
    try:
        loop.run()
    finally:
        sys.setprofile(None)
    return depths


def test_a_plain_insert_reaches_the_target_in_five_calls_on_every_route(tmp_path: Path) -> None:
    """Issue 18: round -> apply_batch -> apply_one -> Applier.handle_insert_bytes -> InsertRuns.add -> the send
    (the COPY's add; or start_copy, for the row that opens the COPY); a stretch converted in the COPY lane: round ->
    apply_batch -> _copy_lane -> InsertRuns.copy_stretches -> _stretch -> add_text; rows buffered in a short run
    are sent when something ends it: round -> apply_batch -> apply_one -> Applier.handle (or handle_insert_bytes,
    for an Insert into another table) -> InsertRuns.flush -> insert."""
    long_run = [REL_T, *txn(1, *range(COPY_THRESHOLD + 100))]
    assert _sends_within_five(make_core(tmp_path), long_run) == {"start_copy", "add", "add_text"}
    short_run, single_row = [REL_T, *txn(1, 1, 2, 3)], [REL_T, *txn(1, 1)]
    assert _sends_within_five(make_core(tmp_path), short_run) == {"insert"}  # flushed at COMMIT
    assert _sends_within_five(make_core(tmp_path), single_row) == {"insert"}
    other_table = [REL_T, REL_U, Begin(1000, 0, 1), Insert(None, 1, row(1, "v")), Insert(None, 2, row(1)),
                   Commit(0, 1000, 1000, 0)]  # fmt: skip
    assert _sends_within_five(make_core(tmp_path), other_table) == {"insert"}
    then_update = [*other_table[:4], Update(None, 1, None, None, row(1, "w")), other_table[-1]]
    assert _sends_within_five(make_core(tmp_path), then_update) == {"insert"}


def test_with_group_commit_a_short_run_reaches_the_target_in_five_calls_too(tmp_path: Path) -> None:
    """A COMMIT that joins a group leaves the run open (the next transaction's inserts continue it): its rows are
    sent when the group ends, from the housekeeping after the round (run -> housekeeping -> GroupCommit.end ->
    InsertRuns.flush -> insert), or by a message that cannot join it (round -> apply_batch -> apply_one -> handle
    -> flush -> insert). A bulk run of whole transactions: round -> apply_batch -> BulkExecution.apply -> _send -> bulk_insert."""
    core = make_core(tmp_path, group_commit=True)
    assert _sends_within_five(core, [REL_T, *txn(1, 1), *txn(2, 2)]) == {"insert"}
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "insert", "commit"]
    core = make_core(tmp_path, group_commit=True)
    stream = [StreamStart(77, True), StreamStop()]
    assert _sends_within_five(core, [REL_T, *txn(1, 1), *stream]) == {"insert"}
    core = make_core(tmp_path, tables=(B,), group_commit=True, bulk=True)
    first, *bulk_run = ([dataclasses.replace(m, relid=3) if isinstance(m, Insert) else m for m in txn(x, x)]
                        for x in range(1, BULK_WORTHWHILE + 3))  # fmt: skip
    bulk_rounds = [REL_B, *first], [m for t in bulk_run for m in t]  # the relation is mapped first
    assert _sends_within_five(core, *bulk_rounds) == {"insert", "bulk_insert"}
    # the second round's first read waits for one message (the round's first look is libpq's buffer only), so
    # its first transaction goes one by one and the rest as one bulk run, in the same group
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "commit", "begin", "insert",
                                                                      "bulk_insert", "commit"]  # fmt: skip


class CountingStream(ScriptedStream):
    """Records the reads the loop makes: ``("buffer" | "socket", got)`` for read_undecoded without and with
    ``refill``, ``("wait", timeout)`` for read."""

    def __init__(self, *rounds: list[Any]) -> None:
        super().__init__(*rounds)
        self.calls: list[tuple[str, float]] = []

    def read_undecoded(self, into: list[bytes], limit: int, wanted: bytes, *, refill: bool = False) -> Any:
        before = len(into)
        item = super().read_undecoded(into, limit, wanted, refill=refill)
        self.calls.append(("socket" if refill else "buffer", len(into) - before))
        return item

    def read(self, timeout: float) -> Any:
        self.calls.append(("wait", timeout))
        return super().read(timeout)


def test_a_round_ends_when_the_socket_runs_dry_between_transactions(tmp_path: Path) -> None:
    """A steady load of small transactions, one per round: the round waits once, reads the transaction and ends
    at the first read that finds the socket empty after its COMMIT (no second look at an empty socket)."""
    core = make_core(tmp_path)
    stream = CountingStream([REL_T, *txn(1, 1)], txn(2, 2), txn(3, 3))
    context = Context(stream, core)
    ApplyLoop(stream, core.applier, core.tracker, context, sleep=lambda _s: None).run()
    core.target.confirm_all()
    assert core.target.origin_lsn == 3000
    assert context.rounds == [(4, False), (3, False), (3, False)]
    # rounds 2 and 3: libpq's buffer (empty), the wait (Begin), the rest of the transaction from the socket
    assert [(kind, got if kind != "wait" else 0) for kind, got in stream.calls[-6:]] == [
        ("buffer", 0),
        ("wait", 0),
        ("socket", 2),
    ] * 2


def test_a_transaction_caught_half_sent_is_waited_for_within_the_round(tmp_path: Path) -> None:
    """The socket ran dry in the middle of a transaction: the loop waits for the rest (once per round) rather than
    end the round and pass through the housekeeping for half a transaction."""
    core = make_core(tmp_path)
    first = txn(1, 1, 2)
    stream = CountingStream([REL_T, *first[:2]], first[2:], txn(2, 3))
    context = Context(stream, core)
    ApplyLoop(stream, core.applier, core.tracker, context, sleep=lambda _s: None).run()
    core.target.confirm_all()
    assert core.target.origin_lsn == 2000
    assert context.rounds == [(5, False), (3, False)]
    assert ("wait", READ_REST_WAIT) in stream.calls
