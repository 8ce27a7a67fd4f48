"""The apply side's pure parts, without servers: flush-map feedback, the spool, relation mapping, error context."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.apply.context import ErrorContext
from applier.apply.feedback import FeedbackTracker
from applier.apply.missing_columns import type_name
from applier.apply.relmap import LocalColumn, LocalTable, RelationMappingError, map_relation
from applier.apply.spool import Spool
from applier.messages import Relation, RelationColumn

# --- feedback (behaviours 7-9) ---------------------------------------------------------------------------------


def test_nothing_pending_reports_last_received_everywhere():
    t = FeedbackTracker(100)
    t.received(150)
    p = t.positions()
    assert (p.write, p.flush, p.apply) == (150, 150, 150)


def test_async_commit_counts_only_once_confirmed_and_flushed():
    t = FeedbackTracker(0)
    t.received(200)
    tok = t.queued(200)
    p = t.positions(10**9)
    # queued: neither confirmed nor flushed, and not visible yet, so not reported as applied either (replay_lsn
    # running ahead of visibility made wait_for_catchup return before the rows were there)
    assert (p.write, p.flush, p.apply) == (200, 0, 0)
    t.confirmed(tok)
    p = t.positions(10**9)
    assert p.flush == 0 and p.apply == 200  # confirmed (visible), but its local LSN is not known yet
    t.resolve(5000)
    assert t.positions(4999).flush == 0
    p = t.positions(5000)
    assert (p.write, p.flush, p.apply) == (200, 200, 200)
    assert t.pending == 0


def test_two_phase_records_are_flushed_when_confirmed_but_never_release_older_unflushed_entries():
    t = FeedbackTracker(0)
    a = t.queued(100)
    b = t.queued(300, two_phase=True)
    t.received(300)
    t.confirmed(b)  # e.g. a skipped ROLLBACK PREPARED: no local record, confirmed at once
    assert t.positions(None).flush == 0  # the commit before it is not even confirmed
    t.confirmed(a)
    t.resolve(5000)
    assert t.positions(4000).flush == 0
    p = t.positions(5000)
    assert p.flush == 300 and t.pending == 0


def test_forget_unconfirmed_after_error():
    t = FeedbackTracker(0)
    t.queued(100)
    t.received(120)
    t.forget_unconfirmed()
    assert t.pending == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 10**6)), max_size=40))
def test_positions_never_go_backwards_and_flush_never_passes_unflushed_work(events):
    t = FeedbackTracker(0)
    tokens = []
    lsn = 0
    flushed_upto = 0
    last = t.positions()
    unflushed_ends: list[int] = []
    for kind, step in events:
        lsn += step
        if kind == 0:
            t.received(lsn)
        elif kind == 1:
            tokens.append(t.queued(lsn))
            unflushed_ends.append(lsn)
            t.received(lsn)
        elif kind == 2 and tokens:
            t.confirmed(tokens.pop(0))
            t.resolve(lsn)
        else:
            flushed_upto = lsn if not tokens else flushed_upto
        p = t.positions(flushed_upto)
        assert p.write >= last.write and p.flush >= last.flush and p.apply >= last.apply
        if tokens:  # a queued, unconfirmed commit: flush stays before it
            assert p.flush < tokens[0].remote_end
        last = p


# --- spool (behaviours 84-88) -----------------------------------------------------------------------------------


def test_spool_subtransaction_abort_truncates_and_replay_is_ordered(tmp_path):
    s = Spool(tmp_path, 7)
    s.start_chunk(100, True)
    s.write(100, b"top-1")
    s.write(101, b"sub1-1")
    s.close_chunk()
    s.start_chunk(100, False)
    s.write(102, b"sub2-1")
    s.write(100, b"top-2")
    s.close_chunk()
    s.abort(100, 102)  # truncates sub2 and everything after it
    s.abort(100, 999)  # unknown subxact: nothing
    assert list(s.replay(100)) == [b"top-1", b"sub1-1"]
    s.start_chunk(100, False)
    s.write(103, b"sub3")
    s.close_chunk()
    s.abort(100, 101)
    assert list(s.replay(100)) == [b"top-1"]
    s.abort(100, 100)
    assert not s.has(100) and list(tmp_path.iterdir()) == []


@given(
    st.lists(
        st.tuples(st.sampled_from([100, 101, 102, 103]), st.binary(max_size=300), st.booleans()), max_size=40
    ),
    st.sampled_from([None, 101, 102]),
    st.integers(8, 64),
    st.sampled_from([1 << 16, 40]),
)
def test_spool_batches_write_and_read_what_single_writes_do(ops, abort, read_size, batch_max) -> None:
    """``write_batch`` (the worker's path for a stream chunk) leaves the same file and the same subtransaction
    offsets as one ``write`` per message, and ``replay_batches`` gives every record back in order whatever the read
    size (records larger than a read included)."""
    import tempfile
    from pathlib import Path

    from applier.apply import spool as spool_module

    payloads = [b"I" + x.to_bytes(4, "big") + body for x, body, _ in ops]
    with tempfile.TemporaryDirectory() as d, _patched(spool_module, "_BATCH_MESSAGE_MAX", batch_max):
        one, many = Spool(Path(d) / "one", 1), Spool(Path(d) / "many", 1)
        for s in (one, many):
            s.start_chunk(100, True)
        for p in payloads:
            one.write(int.from_bytes(p[1:5], "big"), p)
        batch: list[bytes] = []
        for p, (_, _, batched) in zip(payloads, ops, strict=True):
            if batched:
                batch.append(b"envelope" + p)
                continue
            many.write_batch(batch, 8)
            batch = []
            many.write(int.from_bytes(p[1:5], "big"), p)
        many.write_batch(batch, 8)
        for s in (one, many):
            s.close_chunk()
            if abort is not None:
                s.abort(100, abort)
        assert many._xacts[100] == dataclasses.replace(one._xacts[100], path=many._xacts[100].path)
        assert many._xacts[100].path.read_bytes() == one._xacts[100].path.read_bytes()
        with _patched(spool_module, "_READ_BUFFER", read_size):
            assert list(many.replay(100)) == list(one.replay(100))
            if abort is None:
                assert list(many.replay(100)) == payloads


@contextlib.contextmanager
def _patched(module: object, name: str, value: object) -> Iterator[None]:
    """A module constant set for the duration (hypothesis tests cannot take pytest's function-scoped fixtures)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def test_spool_cleanup_and_unknown_xids(tmp_path):
    s = Spool(tmp_path, 3)
    s.abort(5, 5)  # PG18 may abort a transaction it never streamed
    assert list(s.replay(5)) == []
    s.start_chunk(1, True)
    s.write(1, b"x")
    s.close_chunk()
    (tmp_path / "4-1.changes").write_bytes(b"another subscription")
    assert Spool(tmp_path, 3).cleanup() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["4-1.changes"]


# --- relation mapping (behaviours 41-44) --------------------------------------------------------------------------


def rel(replident: str, *cols: tuple[str, bool]) -> Relation:
    return Relation(None, 16384, "public", "t", replident,
                    tuple(RelationColumn(1 if key else 0, n, 23, -1) for n, key in cols))  # fmt: skip


def local(key: tuple[str, ...] | None, *names: str, generated: str = "") -> LocalTable:
    return LocalTable(1, "public", "t", "r",
                      tuple(LocalColumn(n, 25 if n == "v" else 23, generated if n == "g" else "") for n in names), key)  # fmt: skip


def test_mapping_by_name_with_extra_local_column():
    e = map_relation(rel("d", ("id", True), ("v", False)), local(("id",), "extra", "v", "id"))
    assert (
        e.names == ("id", "v") and e.types == (23, 25) and e.key_positions == (0,) and e.not_updatable is None
    )


def test_missing_columns_are_named():
    with pytest.raises(
        RelationMappingError, match=r'relation "public.t" is missing replicated columns: "a", "b"'
    ):
        map_relation(rel("d", ("id", True), ("a", False), ("b", False)), local(("id",), "id"))
    with pytest.raises(RelationMappingError, match=r'is missing replicated column: "a"; ') as err:
        map_relation(rel("d", ("id", True), ("a", False)), local(("id",), "id"))
    assert str(err.value).endswith(
        'the rows already there take it): ALTER TABLE "public"."t" ADD COLUMN "a" integer'
    )


@pytest.mark.parametrize(
    ("oid", "typmod", "spelled"),
    [
        (1043, 24, "character varying(20)"), (1700, (12 << 16 | 2) + 4, "numeric(12,2)"), (1700, -1, "numeric"),
        (1184, 3, "timestamp(3) with time zone"), (1115, 0, "timestamp(0) without time zone[]"), (1007, -1, "integer[]"), (23, -1, "integer"), (16385, -1, None),
    ],
)  # fmt: skip
def test_the_missing_columns_type_is_spelled_as_the_source_declared_it(oid, typmod, spelled):
    assert type_name(oid, typmod) == spelled


def test_generated_target_column_is_an_error():
    with pytest.raises(RelationMappingError, match='incompatible generated column: "g"'):
        map_relation(rel("d", ("id", True), ("g", False)), local(("id",), "id", "g", generated="s"))


def test_updatable_rules():
    full = map_relation(rel("f", ("a", True), ("b", True)), local(None, "a", "b"))
    assert full.key_positions is None and full.not_updatable is None
    nokey = map_relation(rel("d", ("a", False), ("b", False)), local(None, "a", "b"))
    assert "neither REPLICA IDENTITY index nor PRIMARY KEY" in (nokey.not_updatable or "")
    wrongkey = map_relation(rel("d", ("a", True), ("b", False)), local(("b",), "a", "b"))
    assert "did not send replica identity column" in (wrongkey.not_updatable or "")
    fullkey = map_relation(rel("f", ("a", True), ("b", True)), local(("b",), "a", "b"))
    assert fullkey.key_positions == (1,)


def test_error_context_wording():
    ctx = ErrorContext("applier_3", "INSERT", "public.tbl", 740, (1 << 32) + 0x14C0378)
    assert ctx.describe() == (
        'processing remote data for replication origin "applier_3" during message type "INSERT" for replication '
        'target relation "public.tbl" in transaction 740, finished at 1/14C0378'
    )
