"""The apply core replays the capture's messages (applier.apply.ddl_replay) at their place, against the recording
fake target: inside the remote transaction's local one, after the rows before it, in streamed and prepared
transactions alike, never for a rolled-back one, another consumer's or a subscription without the capture."""

from __future__ import annotations

import dataclasses

import pytest

from applier.apply.ddl_replay import DdlConsumer
from applier.apply.fold import Decision
from applier.apply.housekeeping import Restart
from applier.ddl.payload import PREFIX, DdlEvent, DdlObject, encode_payload, sign
from applier.messages import (
    BeginPrepare,
    Message,
    Prepare,
    RollbackPrepared,
    StreamCommit,
)
from state.tables import SyncState
from tests.support.applier_kit import REL_T, XID, ins, plain, prepared, stream_chunk

SKIP = ("drain", "load_local_table")
KEY = b"4611686018427387"


def consumer(*, key: bytes | None = KEY, enabled: bool = True, recheck=lambda: None) -> DdlConsumer:
    return DdlConsumer("slot_a", enabled, key, recheck)


def ddl(query: str, *, tag: str = "ALTER TABLE", slot: str = "slot_a", xid: int | None = None,
        objects: tuple[DdlObject, ...] = ()) -> Message:  # fmt: skip
    ev = DdlEvent(
        slot=slot, tag=tag, n=1, ts="t", query=query, search_path='"$user", public', objects=objects
    )
    return Message(xid, 1, 0, PREFIX, sign(KEY, encode_payload(ev)))


def test_a_ddl_runs_between_the_rows_before_and_after_it_and_the_tables_are_read_again(core_factory):
    core = core_factory(ddl=consumer())
    core.feed(REL_T, *plain(XID, 100, ins(1, 1, "a"), ddl("ALTER TABLE t ADD c int"), ins(1, 2, "b")))
    names = core.target.names(skip=("drain",))
    assert names == [
        "load_local_table", "begin", "insert", "ddl", "ddl_forget", "load_local_table", "insert", "commit",
    ]  # fmt: skip
    statement, path = next(c.args for c in core.target.calls if c.name == "ddl")
    assert statement == "ALTER TABLE t ADD c int" and path == '"$user", public'
    assert core.target.origin_positions == [108]


def test_a_created_table_joins_ready_and_one_created_with_rows_joins_to_be_copied(core_factory):
    core = core_factory(ddl=consumer())
    new = (DdlObject("table", "public", "public.n", "public.n"),)
    core.feed(*plain(XID, 100, ddl("CREATE TABLE n (id int PRIMARY KEY)", tag="CREATE TABLE", objects=new)))
    core.feed(*plain(XID + 1, 200, ddl("CREATE TABLE m AS SELECT 1 AS a", tag="CREATE TABLE AS", objects=(
        DdlObject("table", "public", "public.m", "public.m"),))))  # fmt: skip
    assert [(name, state) for _oid, name, state in core.tables.joins] == [
        ("public.n", SyncState.READY), ("public.m", SyncState.INIT),
    ]  # fmt: skip
    ran = [c.args[0] for c in core.target.calls if c.name == "ddl"]
    assert ran[1].endswith("WITH NO DATA")


def test_a_dropped_table_leaves(core_factory):
    core = core_factory(ddl=consumer())
    gone = (DdlObject("table", "public", "public.t", "public.t", dropped=True),)
    core.feed(*plain(XID, 100, ddl("DROP TABLE t", tag="DROP TABLE", objects=gone)))
    assert "ddl_leave" in core.target.names()


def test_in_a_stream_the_ddl_waits_for_the_commit_and_keeps_its_place(core_factory):
    core = core_factory(ddl=consumer())
    rel = dataclasses.replace(REL_T, xid=XID)
    core.feed(*stream_chunk(XID, rel, ins(1, 1, "a", xid=XID), ddl("ALTER TABLE t ADD c int", xid=XID)))
    assert core.target.names() == []
    core.feed(StreamCommit(XID, 0, 400, 408, 5000))
    assert core.target.names(skip=SKIP) == ["begin", "insert", "ddl", "ddl_forget", "commit"]


def test_prepared_with_its_transaction_and_never_for_a_rolled_back_one(core_factory):
    core = core_factory(ddl=consumer())
    core.feed(
        BeginPrepare(200, 208, 2, XID, "g"), ddl("ALTER TABLE t ADD c int"), Prepare(0, 200, 208, 2, XID, "g")
    )
    names = core.target.names(skip=SKIP)
    assert names.index("ddl") < names.index("prepare")
    folded = core_factory(ddl=consumer())
    folded.applier.decided = {XID: Decision(108, 3000 + XID, False)}
    folded.feed(*prepared(XID, 100, ddl("ALTER TABLE t ADD c int")))
    folded.feed(RollbackPrepared(0, 108, 308, 3000 + XID, 4000, XID, f"pub_{XID}"))
    assert "ddl" not in folded.target.names()


def test_another_consumers_capture_and_a_subscription_without_one_run_nothing(core_factory):
    mine = core_factory(ddl=consumer())
    mine.feed(*plain(XID, 100, ddl("ALTER TABLE t ADD c int", slot="slot_b")))
    off = core_factory()
    off.feed(*plain(XID, 100, ddl("ALTER TABLE t ADD c int")))
    assert "ddl" not in mine.target.names() + off.target.names()


def test_ddl_from_code_is_skipped_with_a_warning_that_says_what(core_factory, caplog):
    core = core_factory(ddl=consumer())
    core.feed(*plain(XID, 100, ddl("DO $$ BEGIN EXECUTE 'ALTER TABLE t ADD c int'; END $$", objects=(
        DdlObject("table", "public", "public.t", "public.t"),))))  # fmt: skip
    assert "ddl" not in core.target.names()
    assert core.applier.ddl.skipped and "could not replay ALTER TABLE on public.t" in caplog.text


def test_a_message_not_signed_with_the_captures_key_is_never_run(core_factory, caplog):
    """Any role of the source may emit a message with our prefix: only the capture's own are run."""
    core = core_factory(ddl=consumer())
    forged = ddl("CREATE TABLE pwned (i int)", tag="CREATE TABLE")
    forged = Message(None, 1, 0, PREFIX, b"0" * 64 + forged.content[64:])
    unkeyed = core_factory(ddl=consumer(key=None))
    core.feed(*plain(XID, 100, forged))
    unkeyed.feed(*plain(XID, 100, ddl("CREATE TABLE pwned (i int)", tag="CREATE TABLE")))
    assert "ddl" not in core.target.names() + unkeyed.target.names()
    assert caplog.text.count("wrong signature") == 2


def test_a_capture_newer_than_the_session_restarts_it_before_the_transaction_commits(core_factory):
    """``alter --set ddl=true`` while the worker streams: its session (ddl off, or the old key) meets the capture's
    first message and asks whether the subscription changed; if so it restarts, and the next session replays it."""
    calls: list[str] = []

    def changed() -> None:
        calls.append("recheck")
        raise Restart()

    off = core_factory(ddl=consumer(enabled=False, key=None, recheck=changed))
    with pytest.raises(Restart):
        off.feed(*plain(XID, 100, ddl("ALTER TABLE t ADD c int")))
    assert "commit" not in off.target.names() and calls == ["recheck"]
    unchanged = core_factory(ddl=consumer(enabled=False, key=None, recheck=lambda: calls.append("same")))
    unchanged.feed(*plain(XID, 100, ddl("ALTER TABLE t ADD c int")))
    assert "ddl" not in unchanged.target.names() and calls[-1] == "same"


def test_a_table_filled_anew_by_its_alter_is_copied_again(core_factory):
    core = core_factory(ddl=consumer())
    t = (DdlObject("table", "public", "public.t", "public.t"),)
    core.feed(*plain(XID, 100, ddl("ALTER TABLE t ADD r float8 DEFAULT random()", objects=t)))
    core.feed(*plain(XID + 1, 200, ddl("ALTER TABLE t ADD s int DEFAULT 5", objects=t)))
    assert core.target.names().count("ddl_recopy") == 1
    assert core.tables.joins == [(1001, "public.t", SyncState.FINISHEDCOPY)]
