"""Stretches of Inserts converted at once (:mod:`applier.apply.copytext`) give byte for byte the COPY text the
row-by-row path gives, and anything that is not the simple shape is left to the row-by-row path."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from applier.apply import copytext
from applier.apply.copytext import InsertRun
from applier.apply.target import _copy_escape
from applier.decoder import decode_plain_insert
from applier.encoder import encode_message
from applier.errors import DecodeError
from applier.messages import Begin, Insert, TupleData, Update
from applier.testing import message_strategies as ms

RELID = 16385
HEAD = (RELID << 8) | ord("N")

# values rich in what COPY text must escape, and in what looks like our own framing
_VALUES = st.one_of(
    st.none(),
    st.binary(max_size=12),
    st.lists(
        st.sampled_from([b"\\", b"\t", b"\n", b"\r", b"N", b"t", b"\x00", b"a", b"\xc3\xa9"]), max_size=8
    ).map(b"".join),
)


def _rows(ncols: int) -> st.SearchStrategy[list[tuple[bytes | None, ...]]]:
    return st.lists(st.tuples(*[_VALUES] * ncols), min_size=1, max_size=40)


def _tuple(values: tuple[bytes | None, ...]) -> TupleData:
    return TupleData(bytes(110 if v is None else 116 for v in values), values)


def _xlog(payload: bytes, lsn: int = 1) -> bytes:
    return b"w" + struct.pack(">QQq", lsn, lsn, 0) + payload


def _copy_lines(rows: list[tuple[bytes | None, ...]]) -> bytes:
    """What ``_CopyRun.add`` writes, one row at a time."""
    return b"".join(b"\t".join(_copy_escape(v) for v in r) + b"\n" for r in rows)


@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), _rows(n))), st.booleans())
def test_copy_text_equals_row_by_row(shape: tuple[int, list], memoryviews: bool) -> None:
    ncols, rows = shape
    messages = [_xlog(encode_message(Insert(None, RELID, _tuple(r)))) for r in rows]
    run = InsertRun.of([memoryview(m) for m in messages] if memoryviews else messages, 25, 26)
    assert run.relid_heads().tolist() == [HEAD] * len(rows)
    assert run.copy_text(0, len(rows), ncols) == _copy_lines(rows)
    # any stretch of it
    if len(rows) > 2:
        assert run.copy_text(1, len(rows) - 1, ncols) == _copy_lines(rows[1:-1])
    # another column count is not this relation's shape
    assert run.copy_text(0, len(rows), ncols + 1) is None


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), _rows(n))))
def test_copy_text_with_int64_positions(shape: tuple[int, list]) -> None:
    """The gather's byte positions are int32 while they fit; past 2**31 bytes they are int64 (forced here), with
    the same text."""
    ncols, rows = shape
    run = InsertRun.of([_xlog(encode_message(Insert(None, RELID, _tuple(r)))) for r in rows], 25, 26)
    limit = copytext._INT32_LIMIT
    try:
        copytext._INT32_LIMIT = 0
        assert run.copy_text(0, len(rows), ncols) == _copy_lines(rows)
    finally:
        copytext._INT32_LIMIT = limit


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), _rows(n))), st.data())
def test_spooled_in_stream_inserts(shape: tuple[int, list], data: st.DataObject) -> None:
    """The spool's records: no envelope, a subtransaction xid before the relid."""
    ncols, rows = shape
    xids = data.draw(st.lists(ms.xids(), min_size=len(rows), max_size=len(rows)))
    messages = [encode_message(Insert(x, RELID, _tuple(r))) for x, r in zip(xids, rows, strict=True)]
    run = InsertRun.of(messages, 0, 5)
    assert run.relid_heads().tolist() == [HEAD] * len(rows)
    assert run.copy_text(0, len(rows), ncols) == _copy_lines(rows)


def test_heads_tell_relations_and_other_messages_apart() -> None:
    t = _tuple((b"1",))
    messages = [
        _xlog(encode_message(Insert(None, RELID, t))),
        _xlog(encode_message(Insert(None, RELID + 1, t))),
        _xlog(encode_message(Begin(5, 6, 7))),
        _xlog(encode_message(Update(None, RELID, None, None, t))),
        _xlog(b"I"),  # too short to be an Insert
    ]
    assert InsertRun.of(messages, 25, 26).relid_heads().tolist() == [
        HEAD,
        ((RELID + 1) << 8) | 78,
        -1,
        -1,
        -1,
    ]


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), _rows(n))), st.data())
def test_damaged_messages_are_left_to_the_row_by_row_path(
    shape: tuple[int, list], data: st.DataObject
) -> None:
    """Whatever damage is done to one message, the stretch is either refused (``None``: the row-by-row path
    then raises the precise error or copes) or converted exactly as the row-by-row path would convert it."""
    ncols, rows = shape
    messages = [bytearray(_xlog(encode_message(Insert(None, RELID, _tuple(r))))) for r in rows]
    victim = data.draw(st.integers(0, len(messages) - 1))
    wire = messages[victim]
    how = data.draw(st.sampled_from(["cut", "extra", "flip", "kind"]))
    if how == "cut":
        del wire[data.draw(st.integers(26, len(wire) - 1)) :]
    elif how == "extra":
        wire += data.draw(st.binary(min_size=1, max_size=4))
    elif how == "flip":
        wire[data.draw(st.integers(25, len(wire) - 1))] = data.draw(st.integers(0, 255))
    else:  # a binary or unchanged-TOAST kind: valid pgoutput, but not for COPY text
        kinds = [i for i in range(33, len(wire)) if wire[i] == ord("t")]
        if kinds:
            wire[data.draw(st.sampled_from(kinds))] = data.draw(st.sampled_from([ord("b"), ord("u")]))
    run = InsertRun.of([bytes(m) for m in messages], 25, 26)
    heads = run.relid_heads().tolist()
    if heads[victim] != HEAD:
        return  # the caller would not even offer it as an Insert into this relation
    text = run.copy_text(0, len(messages), ncols)
    if text is None:
        return
    decoded = []
    for m in messages:
        try:
            relid, tup = decode_plain_insert(bytes(m[25:]))
        except DecodeError:
            raise AssertionError("converted a message that does not decode") from None
        assert relid == RELID and len(tup.values) == ncols and set(tup.kinds) <= {ord("t"), ord("n")}
        decoded.append(tup.values)
    assert text == _copy_lines(decoded)


def test_large_messages_go_row_by_row(monkeypatch) -> None:
    """A row carrying a large value is left to the row-by-row path: converting it would take index arrays many
    times its size."""
    from applier.apply import copytext

    small, large = _tuple((b"x",)), _tuple((b"y" * 200,))
    messages = [_xlog(encode_message(Insert(None, RELID, t))) for t in (small, large, small)]
    monkeypatch.setattr(copytext, "MAX_MESSAGE", 100)
    assert InsertRun.of(messages, 25, 26).relid_heads().tolist() == [HEAD, -1, HEAD]


@given(
    st.lists(st.tuples(st.integers(-50, 200), st.integers(0, 6)), min_size=1, max_size=30),
    st.integers(0, 3),
    st.integers(1, 120),
    st.booleans(),
)
def test_source_positions_equal_repeated_offsets_plus_positions(
    runs: list[tuple[int, int]], first: int, size: int, int64: bool
) -> None:
    """The running-sum construction against its definition: ``offset[k]`` plus the output position for every byte
    of run ``k`` (empty runs included), clipped into the source, in int32 or, forced, int64."""
    offset = np.array([o for o, _ in runs], dtype=np.int64)
    width = np.array([w for _, w in runs], dtype=np.int64)
    total = first + int(width.sum())
    expected = np.clip(np.repeat(offset, width) + np.arange(first, total), 0, size - 1)
    limit = copytext._INT32_LIMIT
    try:
        if int64:
            copytext._INT32_LIMIT = 0
        got = copytext.source_positions(offset, width, first, total, size)
    finally:
        copytext._INT32_LIMIT = limit
    assert got.dtype == (np.int64 if int64 else np.int32)
    assert got.tolist() == expected.tolist()
