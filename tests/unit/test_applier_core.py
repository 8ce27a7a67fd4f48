"""The apply core (:class:`applier.apply.handlers.Applier`) driven with message values against a recording fake
target: which calls each message turns into, and where the replication origin ends up (behaviours 94, 113)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from applier.apply import bulk
from applier.apply.fold import Decision
from applier.apply.ports import COPY_THRESHOLD
from applier.encoder import encode_message
from applier.errors import ProtocolError
from applier.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Update,
)
from state.twophase import gid_for
from tests.support.applier_kit import (
    REL_B,
    REL_T,
    REL_U,
    XID,
    B,
    T,
    U,
    ins,
    plain,
    prepared,
    row,
    stream_chunk,
)

# --- plain transactions ----------------------------------------------------------------------------------------


def test_insert_commits_with_origin_progress_at_the_end_lsn(core_factory):
    core = core_factory()
    core.feed(REL_T, *plain(XID, 100, ins(1, 1, "a")))
    assert core.target.names() == ["load_local_table", "begin", "insert", "commit"]
    assert core.target.calls[-1].args == (108, 2000 + XID)
    assert core.target.calls[-1].ctx.xid == XID
    assert core.target.origin_positions == [108]
    assert core.tables.after == [108]
    assert core.applier.idle and not core.target.in_transaction
    # feedback reports the transaction only once the commit is confirmed
    assert core.tracker.pending == 1
    core.target.confirm_all()
    core.tracker.received(108)
    assert core.tracker.positions(None).flush == 0  # received, not flushed yet
    core.tracker.resolve(150)  # the target's WAL insert position after the commit
    assert core.tracker.positions(149).flush == 0 and core.tracker.positions(150).flush == 108
    assert core.applier.kinds["commit"] == 1 and core.applier.rows["insert"] == 1


def test_update_delete_truncate_in_one_local_transaction(core_factory):
    core = core_factory()
    core.feed(
        REL_T, REL_U,
        *plain(XID, 100, Update(None, 1, None, None, row(1, "b")), Delete(None, 1, "K", row(1, None)),
               Truncate(None, 2, (1, 2, 1))),
    )  # fmt: skip
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["begin", "update", "delete", "truncate", "commit"]
    truncate = next(c for c in core.target.calls if c.name == "truncate")
    assert truncate.args == (("public.t", "public.u"), True)  # each relation once, RESTART IDENTITY (flag 2)
    assert dict(core.applier.rows) == {"update": 1, "delete": 1, "truncate": 2}


def test_an_empty_transaction_commits_nothing_and_leaves_the_origin(core_factory):
    core = core_factory()
    core.feed(*plain(XID, 100))
    assert core.target.names() == []
    assert core.target.origin_positions == []
    assert core.tables.after == [108]  # the sync-state pass runs after every commit message all the same


def test_a_long_insert_run_continues_as_copy(core_factory):
    core = core_factory()
    n = COPY_THRESHOLD + 5
    core.feed(REL_T, *plain(XID, 100, *(ins(1, i, "x") for i in range(n))))
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["begin", "start_copy", "end_copy", "commit"]
    assert core.target.calls[2].args == ("public.t", COPY_THRESHOLD)
    assert len(core.target.copies[0].rows) == n
    assert core.applier.rows["insert"] == n


def test_a_short_insert_run_goes_row_by_row_at_the_next_other_change(core_factory):
    core = core_factory()
    core.feed(REL_T, REL_U, *plain(XID, 100, ins(1, 1, "a"), ins(1, 2, "b"), ins(2, 3)))
    assert core.target.names(skip=("drain", "load_local_table")) == [
        "begin",
        "insert",
        "insert",
        "insert",
        "commit",
    ]
    assert [c.args[0] for c in core.target.calls if c.name == "insert"] == [
        "public.t",
        "public.t",
        "public.u",
    ]


def test_commit_lsn_must_match_the_begin(core_factory):
    core = core_factory()
    core.feed(Begin(100, 1, XID))
    with pytest.raises(ProtocolError, match=r"incorrect commit LSN 0/65 in commit message \(expected 0/64\)"):
        core.feed(Commit(0, 0x64 + 1, 200, 2))


def test_begin_inside_a_remote_transaction_is_a_protocol_error(core_factory):
    core = core_factory()
    core.feed(Begin(100, 1, XID))
    with pytest.raises(ProtocolError, match="BEGIN received inside remote transaction 500"):
        core.feed(Begin(200, 1, XID + 1))


def test_a_change_of_an_unknown_relation_is_a_protocol_error(core_factory):
    core = core_factory()
    with pytest.raises(ProtocolError, match="no relation map entry for remote relation ID 9"):
        core.feed(Begin(100, 1, XID), ins(9, 1))


# --- tables not ready, skip-LSN --------------------------------------------------------------------------------


def test_changes_of_a_table_not_ready_are_not_applied(core_factory):
    core = core_factory(not_ready={T.oid: 0})
    core.feed(REL_T, REL_U, *plain(XID, 100, ins(1, 1, "a"), ins(2, 2)))
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "commit"]
    assert next(c for c in core.target.calls if c.name == "insert").args[0] == "public.u"


def test_a_syncdone_table_takes_changes_after_its_lsn_only(core_factory):
    core = core_factory(not_ready={T.oid: 150})
    core.feed(REL_T, *plain(XID, 100, ins(1, 1, "a")), *plain(XID + 1, 200, ins(1, 2, "b")))
    assert [c.args[1] for c in core.target.calls if c.name == "insert"] == [row(2, "b")]
    assert core.target.origin_positions == [208]


def test_the_skip_lsn_transaction_commits_empty_and_clears_the_skip_lsn(core_factory):
    core = core_factory(skip_lsn=100)
    core.feed(REL_T, *plain(XID, 100, ins(1, 1, "a")), *plain(XID + 1, 200, ins(1, 2, "b")))
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["begin", "send_query", "commit", "begin", "insert", "commit"]
    clear = next(c for c in core.target.calls if c.name == "send_query")
    assert clear.args[0].startswith(b"UPDATE applier.subscription SET subskiplsn = NULL")
    assert clear.args[1] == (b"7", b"0/64")
    assert core.skip.skip_lsn == 0
    assert core.target.origin_positions == [108, 208]
    assert core.applier.kinds == {"skipped": 1, "commit": 1}


# --- group commit ----------------------------------------------------------------------------------------------


def test_group_commit_off_commits_each_transaction(core_factory):
    core = core_factory(group_commit=False)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)), *plain(2, 200, ins(1, 2)))
    assert core.target.names().count("commit") == 2
    assert core.target.origin_positions == [108, 208]
    assert not core.applier.group_pending


def test_group_commit_shares_one_local_transaction_until_end_group(core_factory):
    core = core_factory(group_commit=True)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)), *plain(2, 200, Update(None, 1, None, None, row(1, "b"))))
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "update"]
    assert core.applier.group_pending and core.tracker.holding
    assert core.target.origin_positions == []
    core.applier.end_group()
    assert core.target.names(skip=("drain", "load_local_table"))[-1] == "commit"
    # one commit, at the last transaction's end, with that transaction's context
    assert core.target.origin_positions == [208]
    assert core.target.calls[-1].ctx.xid == 2
    assert not core.tracker.holding and core.applier.groups == 1
    assert core.applier.transactions == 2


def test_group_commit_waits_for_ready_tables_and_respects_ungrouped_until(core_factory):
    core = core_factory(group_commit=True, not_ready={U.oid: 0})
    core.feed(REL_T, *plain(1, 100, ins(1, 1)), *plain(2, 200, ins(1, 2)))
    assert core.target.origin_positions == [108, 208]  # a table is syncing: every commit goes out
    core = core_factory(group_commit=True, ungrouped_until=108)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)), *plain(2, 200, ins(1, 2)))
    assert core.target.origin_positions == [108]  # the retried one alone, then grouping resumes
    assert core.applier.group_pending


def test_a_non_groupable_message_ends_the_group_first(core_factory):
    core = core_factory(group_commit=True)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)))
    core.feed(StreamStart(XID, True))
    assert core.target.origin_positions == [108]
    assert not core.applier.group_pending


# --- two-phase -------------------------------------------------------------------------------------------------


def test_prepare_then_commit_prepared(core_factory):
    core = core_factory()
    gid = gid_for(7, XID)
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["record_prepared", "begin", "insert", "prepare"]
    assert core.target.calls[-1].args == (gid, 108, 3000 + XID)
    assert core.target.records[gid] == (108, 3000 + XID)
    assert core.applier.prepared == {gid: (108, 3000 + XID)}
    core.feed(CommitPrepared(0, 300, 308, 4000, XID, f"pub_{XID}"))
    assert core.target.calls[-1].name == "commit_prepared" and core.target.calls[-1].args == (gid, 308, 4000)
    assert core.target.origin_positions == [108, 308]
    assert core.applier.prepared == {} and core.applier.finished_prepared == 1
    assert core.applier.kinds == {"prepare": 1, "commit_prepared": 1}


def test_an_empty_transaction_is_prepared_too(core_factory):
    core = core_factory()
    core.feed(*prepared(XID, 100))
    assert core.target.names() == ["record_prepared", "begin", "prepare"]


def test_rollback_prepared_of_our_prepared_transaction(core_factory):
    core = core_factory()
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    core.feed(RollbackPrepared(0, 108, 308, 3000 + XID, 4000, XID, f"pub_{XID}"))
    assert core.target.calls[-1].name == "rollback_prepared"
    assert core.target.origin_positions == [108, 308]


def test_rollback_prepared_of_another_prepare_is_skipped_silently(core_factory):
    core = core_factory()
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    before = list(core.target.calls)
    core.feed(RollbackPrepared(0, 999, 308, 3000 + XID, 4000, XID, f"pub_{XID}"))  # other prepare end LSN
    assert core.target.calls == before
    assert core.target.origin_positions == [108]
    assert core.applier.kinds["skipped"] == 1
    assert core.tables.after == [108, 308]


def test_commit_prepared_inside_a_remote_transaction_is_a_protocol_error(core_factory):
    core = core_factory()
    core.feed(Begin(100, 1, XID))
    with pytest.raises(ProtocolError, match="COMMIT PREPARED received inside a remote transaction"):
        core.feed(CommitPrepared(0, 300, 308, 4000, XID, "g"))


def test_folded_prepare_commits_as_a_plain_transaction(core_factory):
    """A prepared transaction whose COMMIT PREPARED is in the same batch: no record, no PREPARE, one commit at the
    COMMIT PREPARED's end (applier.apply.fold)."""
    core = core_factory()
    core.applier.decided = {XID: Decision(108, 3000 + XID, True)}
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)), CommitPrepared(0, 300, 308, 4000, XID, f"pub_{XID}"))
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "commit"]
    assert core.target.origin_positions == [308]
    assert core.applier.folded_prepares == 1 and core.target.records == {}


def test_folded_rollback_discards_the_changes(core_factory):
    core = core_factory()
    core.applier.decided = {XID: Decision(108, 3000 + XID, False)}
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    core.feed(RollbackPrepared(0, 108, 308, 3000 + XID, 4000, XID, f"pub_{XID}"))
    assert core.target.names() == []
    assert core.applier.kinds["rollback_prepared"] == 1


def test_a_decision_for_another_prepare_is_not_folded(core_factory):
    core = core_factory()
    core.applier.decided = {XID: Decision(999, 3000 + XID, True)}
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    assert core.target.calls[-1].name == "prepare"


def test_the_next_prepared_records_are_written_ahead_in_one_statement(core_factory):
    core = core_factory()
    begins = [BeginPrepare(100, 108, 1, XID, "a"), BeginPrepare(200, 208, 2, XID + 1, "b")]
    core.applier.expect_prepares(begins)
    core.feed(*prepared(XID, 100))
    many = core.target.calls[0]
    assert many.name == "record_prepared_many"
    assert {r[0] for r in many.args[0]} == {gid_for(7, XID), gid_for(7, XID + 1)}
    core.feed(BeginPrepare(200, 208, 2, XID + 1, "b"), Prepare(0, 200, 208, 2, XID + 1, "b"))
    assert core.target.names().count("record_prepared") == 0 and core.applier.records_batched == 1


# --- streamed transactions -------------------------------------------------------------------------------------


def test_stream_commit_replays_the_spool_in_one_transaction(core_factory):
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    core.feed(*stream_chunk(XID, rel, ins(1, 1, "a", xid=XID)))
    core.feed(*stream_chunk(XID, ins(1, 2, "b", xid=XID + 1), first=False))
    assert core.target.names() == []  # spooled, nothing applied yet
    assert core.applier.idle
    core.feed(StreamCommit(XID, 0, 400, 408, 5000))
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "insert", "commit"]
    assert core.target.origin_positions == [408]
    assert core.applier.kinds["stream_commit"] == 1


def test_a_replayed_update_or_delete_follows_the_inserts_before_it(core_factory):
    """In a streamed transaction's replay, an Update or Delete of a row inserted just before must reach the target
    after that Insert: the replay calls the handlers directly, not through ``Applier.handle``, which ends the open
    insert run first. (Found by test_apply_crash.py: INSERT then DELETE of one row in a streamed transaction left
    the row on the target, the DELETE sent while the INSERT still waited in the run, a delete_missing conflict.)"""
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    changes = [ins(1, 1, "a", xid=XID), Update(XID, 1, None, None, row(1, "b")), ins(1, 2, "c", xid=XID),
               Delete(XID, 1, "K", row(2, None))]  # fmt: skip
    core.feed(*stream_chunk(XID, rel, *changes))
    core.feed(StreamCommit(XID, 0, 400, 408, 5000))
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["begin", "insert", "update", "insert", "delete", "commit"]


def test_stream_abort_of_a_subtransaction_drops_its_changes(core_factory):
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    core.feed(*stream_chunk(XID, rel, ins(1, 1, "a", xid=XID), ins(1, 2, "b", xid=XID + 1)))
    core.feed(StreamAbort(XID, XID + 1))
    core.feed(StreamCommit(XID, 0, 400, 408, 5000))
    assert [c.args[1] for c in core.target.calls if c.name == "insert"] == [row(1, "a")]


def test_stream_abort_of_the_whole_transaction_applies_nothing(core_factory):
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    core.feed(*stream_chunk(XID, rel, ins(1, 1, "a", xid=XID)), StreamAbort(XID, XID))
    assert core.target.names() == [] and core.target.origin_positions == []
    assert core.applier.kinds["stream_abort"] == 1


def test_stream_prepare_records_replays_and_prepares(core_factory):
    core = core_factory()
    rel = dataclasses.replace(REL_T, xid=XID)
    core.feed(*stream_chunk(XID, rel, ins(1, 1, "a", xid=XID)))
    core.feed(StreamPrepare(0, 400, 408, 5000, XID, "pub"))
    names = core.target.names(skip=("drain", "load_local_table"))
    assert names == ["record_prepared", "begin", "insert", "prepare"]
    assert core.target.origin_positions == [408]
    core.feed(CommitPrepared(0, 500, 508, 6000, XID, "pub"))
    assert core.target.origin_positions == [408, 508]


def test_stream_messages_out_of_order_are_protocol_errors(core_factory):
    core = core_factory()
    with pytest.raises(ProtocolError, match="STREAM STOP message without STREAM START"):
        core.feed(StreamStop())
    core.feed(StreamStart(XID, True))
    with pytest.raises(ProtocolError, match="duplicate STREAM START message"):
        core.feed(StreamStart(XID, False))
    with pytest.raises(ProtocolError, match="STREAM COMMIT message without STREAM STOP"):
        core.feed(StreamCommit(XID, 0, 400, 408, 5000))


def test_reset_forgets_the_session(core_factory):
    core = core_factory(group_commit=True)
    core.feed(REL_T, *plain(1, 100, ins(1, 1)), Begin(200, 1, 2))
    core.applier.reset()
    assert core.applier.idle and not core.applier.group_pending and core.applier.relations == {}


def test_a_skipped_prepared_transaction_is_prepared_empty_and_clears_the_skip_lsn_on_its_own(core_factory):
    core = core_factory(skip_lsn=100)
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    assert core.target.names(skip=("drain", "load_local_table")) == ["record_prepared", "begin", "prepare"]
    assert core.cleared == [(7, 100)]  # PREPARE cannot carry it: a transaction of its own, after a drain
    assert core.target.calls[-1].name == "drain" and core.skip.skip_lsn == 0


# --- whole transactions a batch at a time (applier.apply.bulk) -------------------------------------------------


def _xlog(payload: bytes, lsn: int) -> bytes:
    return b"w" + struct.pack(">QQq", lsn, lsn, 0) + payload


def test_bulk_applies_a_run_of_transactions_as_members_of_the_group(core_factory):
    core = core_factory(tables=(B,), group_commit=True, bulk=True)
    core.feed(REL_B, *plain(1, 50, ins(3, 0, "z")))  # maps the relation (and opens the group)
    assert core.applier.bulk_ready()
    messages = [m for i in range(10) for m in plain(10 + i, 100 * (i + 1), ins(3, i + 1, "x"))]
    batch = bulk.Batch([_xlog(encode_message(m), 1) for m in messages])
    assert core.applier.apply_bulk(batch, 0) == len(messages)
    assert core.target.names(skip=("drain", "load_local_table")) == ["begin", "insert", "bulk_insert"]
    assert core.applier.group_pending and core.tracker.holding
    core.applier.end_group()
    assert core.target.origin_positions == [1008]  # the last transaction's end, one commit for all eleven
    assert core.applier.bulk_transactions == 10 and core.applier.transactions == 11
    assert core.applier.rows["insert"] == 11


def test_bulk_declines_too_few_transactions(core_factory):
    core = core_factory(tables=(B,), group_commit=True, bulk=True)
    core.feed(REL_B, *plain(1, 50, ins(3, 0, "z")))
    messages = [
        m for i in range(bulk.MIN_TRANSACTIONS - 1) for m in plain(10 + i, 100 * (i + 1), ins(3, i, "x"))
    ]
    batch = bulk.Batch([_xlog(encode_message(m), 1) for m in messages])
    assert core.applier.apply_bulk(batch, 0) == 0
    assert "bulk_insert" not in core.target.names()


def test_original_gids_keep_the_publishers_gid_through_prepare_and_decisions(core_factory):
    """``gid_format=original`` (migrations' ``--prepared carry``): the publisher's GID names the local prepared
    transaction, its record, COMMIT PREPARED and ROLLBACK PREPARED; BEGIN PREPAREs are not recorded ahead (their GIDs
    may need quoting)."""
    core = core_factory()
    core.applier.records.original_gids = True
    core.applier.expect_prepares([BeginPrepare(100, 108, 3000 + XID, XID, f"pub_{XID}")])
    core.feed(REL_T, *prepared(XID, 100, ins(1, 1)))
    assert core.target.names(skip=("drain", "load_local_table")) == [
        "record_prepared",
        "begin",
        "insert",
        "prepare",
    ]
    assert core.target.calls[-1].args == (f"pub_{XID}", 108, 3000 + XID)
    assert core.applier.prepared == {f"pub_{XID}": (108, 3000 + XID)}
    core.feed(CommitPrepared(0, 300, 308, 4000, XID, f"pub_{XID}"))
    assert core.target.calls[-1].args == (f"pub_{XID}", 308, 4000)
    odd = "it's 1"
    core.feed(StreamStart(XID + 1, True), StreamStop(), StreamPrepare(0, 400, 408, 5000, XID + 1, odd))
    assert core.target.calls[-1].name == "prepare" and core.target.calls[-1].args[0] == odd
    core.feed(RollbackPrepared(0, 408, 508, 5000, 6000, XID + 1, odd))
    assert core.target.calls[-1].name == "rollback_prepared" and core.target.calls[-1].args[0] == odd
    assert core.applier.prepared == {}
