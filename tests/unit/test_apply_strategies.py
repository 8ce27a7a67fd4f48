"""The speed strategies of the apply core, each in its own module (issue 18), driven through the core with message
values against the recording fake target, and on their own where they hold logic of their own: the insert sink
(runs, COPY, the COPY lane), folding, prepared-record batching, the group commit written once, the state
dataclasses. No server."""

from __future__ import annotations

import dataclasses

import pytest

from applier.apply.apply_state import ApplyStats, RemoteTransaction
from applier.apply.context import ApplyError
from applier.apply.fold import Decision, Folding
from applier.apply.insert_sink import VECTOR_MIN
from applier.apply.ports import COPY_THRESHOLD
from applier.apply.relmap import LocalColumn, LocalTable
from applier.encoder import encode_message
from applier.messages import (
    BeginPrepare,
    CommitPrepared,
    Insert,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamCommit,
    StreamPrepare,
    TupleData,
    Update,
)
from state.twophase import gid_for
from tests.support.applier_kit import REL_T, REL_U, XID, ins, plain, prepared, row, stream_chunk

NAMES_SKIP = ("drain", "load_local_table")


# --- the insert sink: runs, COPY, the COPY lane ----------------------------------------------------------------


def _open_copy(core, n: int = COPY_THRESHOLD) -> None:
    core.feed(REL_T, *plain(1, 100)[:1], *(ins(1, i, "x") for i in range(n)))


def test_an_insert_for_the_open_copy_takes_the_lane_from_its_bytes(core_factory):
    core = core_factory()
    _open_copy(core)
    assert core.applier.copy_lane() == ((1 << 8) | ord("N"), 2)
    calls = len(core.target.calls)
    core.applier.handle_insert_bytes(encode_message(ins(1, 999, "lane")))
    assert len(core.target.calls) == calls  # no call at all: straight into the COPY
    assert core.target.copy_run.rows[-1] == row(999, "lane")
    core.feed(*plain(1, 100)[-1:])
    assert core.applier.rows["insert"] == COPY_THRESHOLD + 1


def test_an_insert_into_another_relation_leaves_the_lane_for_the_handler(core_factory):
    core = core_factory()
    core.feed(REL_U)
    _open_copy(core)
    core.applier.handle_insert_bytes(encode_message(ins(2, 7)))
    names = core.target.names(skip=NAMES_SKIP)
    assert names[-1] == "end_copy"  # the run into t ends; u's starts (buffered)
    assert core.applier.copy_lane() is None


def test_a_binary_row_closes_the_copy_and_keeps_the_order(core_factory):
    core = core_factory()
    _open_copy(core)
    binary = TupleData(b"tb", (b"5", b"\x00\x01"))
    core.applier.handle_insert_bytes(encode_message(Insert(None, 1, binary)))
    assert core.target.copy_run is None  # not into the COPY: it ends, the row waits in the run
    core.feed(*plain(1, 100)[-1:])
    names = core.target.names(skip=NAMES_SKIP)
    assert names[-3:] == ["end_copy", "insert", "commit"]


def test_no_lane_while_discarding_or_inside_a_stream_chunk(core_factory):
    core = core_factory()
    _open_copy(core)
    core.applier.tx.discarding = True
    assert core.applier.copy_lane() is None
    core.applier.tx.discarding = False
    core.applier.stream.xid = 9
    assert core.applier.copy_lane() is None


def test_a_relation_message_for_the_open_run_flushes_it(core_factory):
    core = core_factory()
    core.feed(REL_T, *plain(1, 100)[:1], ins(1, 1, "a"), ins(1, 2, "b"))
    assert "insert" not in core.target.names()  # buffered
    core.feed(REL_T)
    assert core.target.names(skip=NAMES_SKIP).count("insert") == 2
    assert core.applier.inserts.entry is None


def test_a_streamed_run_long_enough_is_converted_into_the_copy_a_stretch_at_a_time(core_factory):
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    n = COPY_THRESHOLD + VECTOR_MIN + 10
    core.feed(*stream_chunk(XID, rel, *(ins(1, i, "s", xid=XID) for i in range(n))))
    core.feed(StreamCommit(XID, 0, 400, 408, 5000))
    (copy,) = core.target.copies
    assert len(copy.rows) + sum(k for _, k in copy.texts) == n
    assert core.applier.converted_rows == n - COPY_THRESHOLD  # the rows after the COPY opened: one stretch
    assert core.applier.rows["insert"] == n
    assert core.target.origin_positions == [408]


# --- row changes the core checks itself ------------------------------------------------------------------------

NOKEY = LocalTable(1003, "public", "k", "r", (LocalColumn("a", 23),), None)
REL_K = Relation(None, 3, "public", "k", "d", (RelationColumn(0, "a", 23, -1),))


def test_an_update_of_a_table_without_replica_identity_is_an_error_with_its_context(core_factory):
    core = core_factory(tables=(NOKEY,))
    core.feed(REL_K, *plain(1, 100)[:1])
    with pytest.raises(ApplyError, match="neither REPLICA IDENTITY index nor PRIMARY KEY") as err:
        core.feed(Update(None, 3, None, None, row(1)))
    assert err.value.context.relation == "public.k" and err.value.context.xid == 1
    assert err.value.context.message_type == "UPDATE"


def test_a_missing_row_is_a_counted_conflict(core_factory):
    core = core_factory()
    core.feed(REL_T, *plain(1, 100)[:1], Update(None, 1, None, None, row(1, "a")))
    update = next(c for c in core.target.calls if c.name == "update")
    core.target.pipeline.on_missing_row(update.ctx)  # the target found no row
    assert core.applier.conflicts == {"update_missing": 1}


# --- group commit, written once ---------------------------------------------------------------------------------


def test_a_full_group_commits_by_itself(core_factory, monkeypatch):
    from applier.apply import commit_policy

    monkeypatch.setattr(commit_policy, "GROUP_MAX_TRANSACTIONS", 3)
    core = core_factory(group_commit=True)
    core.feed(REL_T)
    for x in range(1, 4):
        core.feed(*plain(x, 100 * x, ins(1, x)))
    assert core.target.origin_positions == [308]  # one commit for three, sent when the third joined
    assert not core.applier.group_pending and core.applier.groups == 1


def test_a_prepared_transaction_after_a_group_rides_its_record_in_the_group(core_factory):
    core = core_factory(group_commit=True)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)))
    assert core.applier.group_pending
    core.feed(*prepared(XID, 200, ins(1, 2)))
    names = core.target.names(skip=NAMES_SKIP)
    assert names == ["begin", "insert", "record_prepared", "commit", "begin", "insert", "prepare"]
    assert core.target.origin_positions == [108, 208]
    assert core.applier.records_in_group == 1


# --- folding and prepared records -------------------------------------------------------------------------------


def test_folding_takes_only_a_decision_that_matches_the_begin_prepare():
    folding = Folding()
    folding.decided = {1: Decision(108, 3001, True), 2: Decision(208, 3002, False)}
    assert folding.begin(BeginPrepare(100, 108, 9999, 1, "g1"), True) is None  # another prepare time
    assert 1 not in folding.decided  # (the decision is used up either way)
    assert folding.begin(BeginPrepare(200, 208, 3002, 2, "g2"), False) is None  # grouping not possible now
    folding.decided = {3: Decision(308, 3003, False)}
    decision = folding.begin(BeginPrepare(300, 308, 3003, 3, "g3"), True)
    assert decision is not None and folding.current is decision
    assert folding.ends(3, False, 3) and not folding.ends(3, True, 3) and not folding.ends(4, False, 3)


def test_a_folded_rollback_inside_a_group_stays_in_the_group(core_factory):
    core = core_factory(group_commit=True)
    core.applier.decided = {XID: Decision(208, 3000 + XID, False)}
    core.feed(REL_T, *plain(1, 100, ins(1, 1)))
    core.feed(*prepared(XID, 200, ins(1, 2)), RollbackPrepared(208, 300, 308, 3000 + XID, 4000, XID, "pub"))
    assert core.applier.group_pending and core.target.origin_positions == []
    core.applier.end_group()
    assert core.target.origin_positions == [308]
    assert [c.args[1] for c in core.target.calls if c.name == "insert"] == [row(1)]
    assert core.applier.folded_prepares == 1 and core.applier.kinds["rollback_prepared"] == 1


def test_a_record_written_ahead_is_not_written_again_by_a_stream_prepare(core_factory):
    core = core_factory()
    core.applier.expect_prepares([BeginPrepare(300, 308, 3003, XID + 1, "b")])
    core.feed(*prepared(XID, 200))
    core.feed(CommitPrepared(0, 250, 258, 4000, XID, "pub"))
    rel = dataclasses.replace(REL_T, xid=XID + 1)
    core.feed(*stream_chunk(XID + 1, rel, ins(1, 1, "a", xid=XID + 1)))
    core.feed(StreamPrepare(0, 300, 308, 3003, XID + 1, "b"))
    names = core.target.names(skip=NAMES_SKIP)
    assert names.count("record_prepared_many") == 1 and "record_prepared" not in names
    assert set(core.applier.prepared) == {gid_for(7, XID + 1)}
    assert core.applier.records_batched == 1 and core.applier.finished_prepared == 1


# --- the state dataclasses --------------------------------------------------------------------------------------


def test_row_counts_join_the_totals_when_their_transaction_ends():
    stats = ApplyStats()
    stats.pending_rows[0] += 3
    stats.pending_rows[3] += 1
    assert stats.rows == {} and stats.transactions == 0
    stats.count("commit")
    assert stats.rows == {"insert": 3, "truncate": 1} and stats.kinds == {"commit": 1}
    assert stats.pending_rows == [0, 0, 0, 0]
    stats.count_many(5, "commit", {"insert": 5, "update": 0})
    assert stats.transactions == 6 and stats.rows == {"insert": 8, "truncate": 1}


def test_a_remote_transaction_ends_clean_but_keeps_its_final_lsn():
    tx = RemoteTransaction()
    tx.start(5, 100)
    tx.gid, tx.skipping, tx.discarding = "g", True, True
    tx.end()
    assert (tx.active, tx.xid, tx.gid, tx.skipping, tx.discarding, tx.final_lsn) == (
        False,
        None,
        None,
        False,
        False,
        100,
    )


def test_the_public_names_read_and_write_the_parts(core_factory):
    core = core_factory()
    applier = core.applier
    core.feed(REL_T, *plain(1, 100)[:1])
    assert applier.in_remote_transaction and applier.remote_xid == 1 and applier.remote_final_lsn == 100
    applier.finished_prepared = 4
    assert applier.records.finished == 4
    assert applier.entries is applier.relmap.entries and applier.relations == {1: REL_T}
