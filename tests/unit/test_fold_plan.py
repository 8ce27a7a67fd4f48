"""The pure part of folding decided prepared transactions (:mod:`applier.apply.fold`): which prepared transactions
of one read have their COMMIT/ROLLBACK PREPARED right behind their PREPARE. Without a server; the tests that apply
through it against real servers are in ``test_apply_fold.py``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from applier.apply.fold import Decision, decided_prepares
from applier.encoder import encode_message
from applier.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Insert,
    Prepare,
    RollbackPrepared,
    StreamCommit,
    StreamStart,
    StreamStop,
    TupleData,
)

_ROW = Insert(None, 16384, TupleData(b"t", (b"1",)))

# A transaction's shape: plain, prepared and decided at once (commit / rollback), prepared with its decision later
# or never, or a streamed one (whose chunks come between whole transactions).
_SHAPES = st.sampled_from(["plain", "commit", "rollback", "open", "streamed"])


def _plain(xid: int, lsn: int) -> list[bytes]:
    return [
        encode_message(Begin(lsn, 5, xid)),
        encode_message(_ROW),
        encode_message(Commit(0, lsn, lsn + 8, 5)),
    ]


def _stream(
    shapes: list[str], split: list[bool], mismatch: list[bool]
) -> tuple[list[bytes], dict[int, Decision]]:
    """The messages of ``shapes`` in stream order and the decisions a correct reader must find. ``split[k]``: a
    plain transaction comes between transaction k's PREPARE and its decision, so it does not count; ``mismatch[k]``:
    its decision names another transaction."""
    out: list[bytes] = []
    expected: dict[int, Decision] = {}
    lsn = 0x1000
    for k, shape in enumerate(shapes):
        xid, gid = 700 + k, f"pg_gid_1_{700 + k}"
        lsn += 0x100
        if shape == "plain":
            out += _plain(xid, lsn)
        elif shape == "streamed":
            out += [encode_message(StreamStart(xid, True)), encode_message(StreamStop()),
                    encode_message(StreamCommit(xid, 0, lsn, lsn + 8, 5))]  # fmt: skip
        else:
            end, t = lsn + 8, 1000 + k
            out += [encode_message(BeginPrepare(lsn, end, t, xid, gid)), encode_message(_ROW),
                    encode_message(Prepare(0, lsn, end, t, xid, gid))]  # fmt: skip
            if shape == "open":
                continue
            if split[k]:
                out += _plain(xid + 500, lsn + 0x40)
            other = xid + 1 if mismatch[k] else xid
            out.append(encode_message(
                CommitPrepared(0, lsn + 0x80, lsn + 0x88, 9, other, gid)
                if shape == "commit"
                else RollbackPrepared(0, end, lsn + 0x88, t, 9, other, gid)
            ))  # fmt: skip
            if not mismatch[k] and not split[k]:
                expected[xid] = Decision(end, t, shape == "commit")
    return out, expected


@given(st.data())
def test_decided_prepares_are_exactly_those_decided_right_after_their_prepare(data: st.DataObject) -> None:
    shapes = data.draw(st.lists(_SHAPES, max_size=12))
    split = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    mismatch = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    messages, expected = _stream(shapes, split, mismatch)
    # as the worker holds them: each message behind a 25-byte XLogData envelope, as memoryviews
    offset = data.draw(st.sampled_from([0, 25]))
    held = [memoryview(b"w" * offset + m) for m in messages]
    assert decided_prepares(held, offset) == expected
    # a read that ends somewhere: only what is wholly inside it counts
    cut = data.draw(st.integers(0, len(messages)))
    head = decided_prepares(messages[:cut])
    assert all(expected.get(xid) == d for xid, d in head.items())


def test_a_read_ending_between_prepare_and_decision_decides_nothing() -> None:
    messages, expected = _stream(["commit"], [False], [False])
    assert len(expected) == 1 and decided_prepares(messages) == expected
    assert decided_prepares(messages[:-1]) == {}


def test_a_rollback_must_name_the_prepare_it_undoes() -> None:
    """ROLLBACK PREPARED carries the prepare's end LSN and time (``LookupGXact``): a different one is not this
    transaction's decision."""
    messages, _ = _stream(["rollback"], [False], [False])
    bad = RollbackPrepared(0, 0x1999, 0x1118, 1000, 9, 700, "pg_gid_1_700")
    assert decided_prepares([*messages[:-1], encode_message(bad)]) == {}


@given(st.lists(st.binary(max_size=40), max_size=12), st.data())
def test_malformed_bytes_never_raise(blobs: list[bytes], data: st.DataObject) -> None:
    """Bytes that do not decode decide nothing (the handlers report them, in stream order)."""
    messages, _ = _stream(["commit", "rollback"], [False, False], [False, False])
    for blob in blobs:
        at = data.draw(st.integers(0, len(messages)))
        messages.insert(at, blob)
    for i in data.draw(st.lists(st.integers(0, len(messages) - 1), max_size=3)):
        cut = data.draw(st.integers(0, len(messages[i])))
        messages[i] = messages[i][:cut]
    decided_prepares(messages)
