"""The pure part of bulk apply (:mod:`applier.apply.bulk`): which transactions of a batch qualify, how their changes
are cut into per-table stretches, and the array literals that carry the values. Without a server; the tests that
apply through it against real servers are in ``test_apply_bulk.py``."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from applier.apply import bulk
from applier.encoder import encode_message
from applier.messages import (
    Begin,
    Commit,
    Delete,
    Insert,
    Origin,
    Relation,
    RelationColumn,
    TupleData,
    Update,
)

_VALUES = st.one_of(
    st.none(),
    st.lists(
        st.sampled_from([b'"', b"\\", b",", b"{", b"}", b" ", b"NULL", b"a", b"\xc3\xa9", b"\n", b"\t"]),
        max_size=6,
    ).map(b"".join),
)


def _parse_array(text: bytes) -> list[bytes | None]:
    """array_in for a one-dimensional literal whose elements are all quoted or NULL (what array_literal writes)."""
    assert text[:1] == b"{" and text[-1:] == b"}"
    out: list[bytes | None] = []
    i, n = 1, len(text) - 1
    while i < n:
        if text[i : i + 4] == b"NULL":
            out.append(None)
            i += 4
        else:
            assert text[i : i + 1] == b'"', text[i:]
            i += 1
            value = bytearray()
            while text[i : i + 1] != b'"':
                if text[i : i + 1] == b"\\":
                    i += 1
                value += text[i : i + 1]
                i += 1
            out.append(bytes(value))
            i += 1
        if i < n:
            assert text[i : i + 1] == b",", text[i:]
            i += 1
    return out


def _xlog(payload: bytes, lsn: int = 1) -> bytes:
    return b"w" + struct.pack(">QQq", lsn, lsn, 0) + payload


def _tuple(values: tuple[bytes | None, ...]) -> TupleData:
    return TupleData(bytes(110 if v is None else 116 for v in values), values)


@given(st.lists(_VALUES, max_size=30))
def test_array_literal_round_trips(values: list[bytes | None]) -> None:
    msgs = [_xlog(encode_message(Insert(None, 7, _tuple((v,))))) for v in values]
    if not msgs:
        return
    batch = bulk.Batch(msgs)
    seg = bulk.tuple_segments(batch.data, batch.null_at, batch.starts + 31, batch.ends, 1)
    assert seg is not None
    start, length, null = seg
    text = bulk.array_literal(batch.data, start[:, 0], length[:, 0], null[:, 0], batch.null_at)
    assert _parse_array(text) == values


# a transaction's body: Insert/Update-with-new-tuple/Delete-by-key/Origin qualify, an Update with a key change not
_QUALIFYING = ("I", "U", "D", "O")
_BODY = st.lists(st.sampled_from(["I", "U", "O", "I", "U", "K", "D"]), max_size=5)


def _change(kind: str, relid: int, i: int) -> bytes:
    t = _tuple((str(i).encode(), b"x"))
    msg = {
        "I": lambda: Insert(None, relid, t),
        "U": lambda: Update(None, relid, None, None, t),
        "K": lambda: Update(None, relid, "K", _tuple((b"1", None)), t),
        "D": lambda: Delete(None, relid, "K", _tuple((b"1", None))),
        "O": lambda: Origin(5, "elsewhere"),
    }[kind]()
    return _xlog(encode_message(msg))


@given(
    st.lists(st.tuples(_BODY, st.booleans(), st.booleans()), min_size=1, max_size=12),
    st.integers(0, 3),
    st.integers(0, 3),
)
def test_batch_finds_the_transactions_that_qualify(txns, head: int, tail: int) -> None:
    """Whole transactions whose every change is an Insert or an Update without old tuple qualify; a batch that
    starts or ends inside a transaction, a Commit whose LSN differs from its Begin's: none of them counts as (or
    makes) a qualifying transaction. A run of them ends where a message comes between two (a Relation message)."""
    msgs: list[bytes] = [_change("I", 1, 0) for _ in range(head)]  # the end of a transaction begun earlier
    if head:
        msgs.append(_xlog(encode_message(Commit(0, 50, 60, 0))))
    expected: dict[int, bool] = {}
    gap_before: dict[int, bool] = {}
    lsn = 100
    for n, (body, relation_before, bad_lsn) in enumerate(txns):
        if relation_before:
            msgs.append(
                _xlog(encode_message(Relation(None, 9, "public", "t", "d", [RelationColumn(1, "a", 23, -1)])))
            )
        gap_before[len(msgs)] = relation_before
        expected[len(msgs)] = all(k in _QUALIFYING for k in body) and not bad_lsn
        msgs.append(_xlog(encode_message(Begin(lsn, 0, 1000 + n))))
        msgs += [_change(k, 1 + i % 2, i) for i, k in enumerate(body)]
        msgs.append(_xlog(encode_message(Commit(0, lsn + (1 if bad_lsn else 0), lsn + 8, 0))))
        lsn += 100
    msgs.append(_xlog(encode_message(Begin(lsn, 0, 1))))  # a transaction the next batch ends
    msgs += [_change("I", 1, 0) for _ in range(tail)]
    batch = bulk.Batch(msgs)
    found = {m: batch.transaction_at(m) is not None for m in expected}
    assert found == expected
    assert batch.transaction_at(len(msgs) - 1 - tail) is None  # no Commit in this batch
    # runs: from each qualifying transaction, up to the first that does not, or that does not begin right after
    # the one before (a run takes everything between its first Begin and its last Commit)
    order = list(expected)
    for t, m in enumerate(order):
        if expected[m]:
            end = t + 1
            while end < len(order) and expected[order[end]] and not gap_before[order[end]]:
                end += 1
            assert batch.run_end(batch.transaction_at(m)) == end


def test_plan_cuts_each_table_into_stretches_of_one_kind_in_its_order() -> None:
    """Per table in order of first appearance; a table's stretches follow its own order (I I U I D D -> 4);
    the transaction of every change is kept; values that are not text (binary) refuse the whole plan."""
    msgs = [_xlog(encode_message(Begin(100, 0, 7)))]
    changes = [("I", 1), ("U", 2), ("I", 1), ("U", 1), ("I", 2), ("I", 1), ("D", 1), ("D", 1)]
    for i, (k, r) in enumerate(changes):
        msgs.append(_change(k, r, i))
        if i == 2:
            msgs.append(_xlog(encode_message(Commit(0, 100, 108, 0))))
            msgs.append(_xlog(encode_message(Begin(200, 0, 8))))
    msgs.append(_xlog(encode_message(Commit(0, 200, 208, 0))))
    batch = bulk.Batch(msgs)
    assert batch.run_end(0) == 2
    plan = bulk.plan(batch, 0, 2, {1: 2, 2: 2}, {1: (0,), 2: (0,)})
    assert plan is not None
    got = [(s.relid, chr(s.kind), len(s.messages), s.transactions.tolist()) for s in plan]
    assert got == [
        (1, "I", 2, [0, 0]), (1, "U", 1, [1]), (1, "I", 1, [1]), (1, "D", 2, [1, 1]), (2, "U", 1, [0]),
        (2, "I", 1, [1]),
    ]  # fmt: skip
    first = plan[0]
    assert [_parse_array(c) for c in first.columns] == [[b"0", b"2"], [b"x", b"x"]]
    assert [_parse_array(c) for c in plan[3].columns] == [[b"1", b"1"]]  # a Delete's key column only

    binary = _xlog(encode_message(Insert(None, 1, TupleData(b"bt", (b"\x00\x01", b"x")))))
    batch = bulk.Batch([msgs[0], binary, msgs[-1]])
    batch2 = bulk.Batch([
        _xlog(encode_message(Begin(100, 0, 7))), binary, _xlog(encode_message(Commit(0, 100, 108, 0)))
    ])  # fmt: skip
    assert bulk.plan(batch2, 0, 1, {1: 2}, {}) is None
    assert np.array_equal(batch.kind[[0, 2]], [bulk.BEGIN, bulk.COMMIT])


@given(
    st.lists(
        st.tuples(st.sampled_from(b"BCIUOD"), st.binary(max_size=40)).map(
            lambda t: _xlog(bytes([t[0]]) + t[1])
        ),
        min_size=1,
        max_size=40,
    )
)
def test_malformed_batches_never_raise(msgs: list[bytes]) -> None:
    """Arbitrary bytes behind the type bytes: the batch is read without an error (whatever is malformed does not
    qualify, or its plan is refused, and goes message by message, where the decoder names what is wrong)."""
    batch = bulk.Batch(msgs)
    for m in range(len(msgs)):
        t = batch.transaction_at(m)
        if t is not None:
            stop = batch.run_end(t)
            relids = set(batch.relid[bulk.changes_in(batch, t, stop)].tolist())
            bulk.plan(batch, t, stop, dict.fromkeys(relids, 2), dict.fromkeys(relids, (0,)))


def test_unchanged_toast_and_null_keys_are_applied_singly_in_their_place() -> None:
    """An Update carrying an unchanged-TOAST value, and an Update or Delete whose key is NULL, become single
    changes between the stretches of their table, in that table's order; the rest stays bulk."""
    full = _tuple((b"1", b"x"))
    toast = TupleData(b"tu", (b"2", None))
    null_key = _tuple((None, b"y"))
    changes = [
        Update(None, 1, None, None, full),
        Update(None, 1, None, None, toast),
        Update(None, 1, None, None, full),
        Update(None, 1, None, None, full),
        Delete(None, 1, "K", null_key),
        Delete(None, 1, "K", full),
    ]
    msgs = [_xlog(encode_message(Begin(100, 0, 7)))]
    msgs += [_xlog(encode_message(c)) for c in changes]
    msgs.append(_xlog(encode_message(Commit(0, 100, 108, 0))))
    batch = bulk.Batch(msgs)
    plan = bulk.plan(batch, 0, 1, {1: 2}, {1: (0,)})
    assert plan is not None
    got = [(chr(s.kind), s.messages.tolist(), s.single) for s in plan]
    assert got == [
        ("U", [1], False),
        ("U", [2], True),
        ("U", [3, 4], False),
        ("D", [5], True),
        ("D", [6], False),
    ]
    assert [_parse_array(c) for c in plan[2].columns] == [[b"1", b"1"], [b"x", b"x"]]
