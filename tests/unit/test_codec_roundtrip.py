"""Round trips through the codec, and byte layouts checked by hand against the documented format.

The round trips prove the decoder and encoder agree with each other; the hand-written layouts (field by field, from
PostgreSQL's "Logical Replication Message Formats" and ``proto.c``'s writers) prove they agree with the server, so
that the encoder is not merely the decoder's mirror image.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from applier.decoder import MessageDecoder, decode_envelope, decode_message
from applier.encoder import encode_envelope, encode_message
from applier.messages import (
    STREAMABLE,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    PrimaryKeepalive,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StandbyStatusUpdate,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    XLogData,
)
from applier.testing import message_strategies as ms

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- encode -> decode is the identity, for every type, in and out of a stream ----------------------------------

STREAMABLE_STRATEGIES = {
    "Relation": ms.relations,
    "Type": ms.types,
    "Insert": ms.inserts,
    "Update": ms.updates,
    "Delete": ms.deletes,
    "Truncate": ms.truncates,
    "Message": ms.messages,
}
OTHER_STRATEGIES = {
    "Begin": ms.begins,
    "Commit": ms.commits,
    "Origin": ms.origins,
    "Stream Start": ms.stream_starts,
    "Stream Stop": ms.stream_stops,
    "Stream Commit": ms.stream_commits,
    "Stream Abort": ms.stream_aborts,
    "Begin Prepare": ms.begin_prepares,
    "Prepare": ms.prepares,
    "Commit Prepared": ms.commit_prepareds,
    "Rollback Prepared": ms.rollback_prepareds,
    "Stream Prepare": ms.stream_prepares,
}


def _roundtrip(msg: LogicalMessage, in_stream: bool) -> None:
    wire = encode_message(msg)
    decoded = decode_message(wire, in_stream=in_stream)
    assert decoded == msg
    assert type(decoded) is type(msg)
    # decode -> encode is the identity on the encoder's bytes
    assert encode_message(decoded) == wire
    # every buffer type the decoder accepts gives the same answer
    assert decode_message(bytearray(wire), in_stream=in_stream) == msg
    assert decode_message(memoryview(b"xx" + wire + b"yy")[2:-2], in_stream=in_stream) == msg


@pytest.mark.parametrize("in_stream", [False, True], ids=["outside-stream", "in-stream"])
@pytest.mark.parametrize("name", sorted(STREAMABLE_STRATEGIES))
@FAST
@given(data=st.data())
def test_streamable_message_roundtrip(name: str, in_stream: bool, data: st.DataObject) -> None:
    msg = data.draw(STREAMABLE_STRATEGIES[name](in_stream=in_stream))
    assert (msg.xid is not None) == in_stream
    _roundtrip(msg, in_stream)


@pytest.mark.parametrize("name", sorted(OTHER_STRATEGIES))
@FAST
@given(data=st.data(), in_stream=st.booleans())
def test_other_message_roundtrip(name: str, data: st.DataObject, in_stream: bool) -> None:
    # These never carry an xid prefix, so the in_stream flag must not change how they decode.
    _roundtrip(data.draw(OTHER_STRATEGIES[name]()), in_stream)


def test_every_message_type_has_a_strategy() -> None:
    from applier.messages import MESSAGE_TYPE_BYTES

    assert len(STREAMABLE_STRATEGIES) == len(STREAMABLE)
    assert len(STREAMABLE_STRATEGIES) + len(OTHER_STRATEGIES) == len(MESSAGE_TYPE_BYTES)


@settings(max_examples=300, deadline=None)
@given(ms.logical_messages())
def test_any_message_roundtrip(msg: LogicalMessage) -> None:
    _roundtrip(msg, ms.in_stream_for(msg))


@FAST
@given(ms.envelope_messages())
def test_envelope_roundtrip(env: XLogData | PrimaryKeepalive | StandbyStatusUpdate) -> None:
    wire = encode_envelope(env)
    assert decode_envelope(wire) == env
    assert encode_envelope(decode_envelope(wire)) == wire  # type: ignore[arg-type]
    assert decode_envelope(memoryview(wire)) == env


@FAST
@given(ms.xlog_datas())
def test_xlogdata_payload_decodes(env: XLogData) -> None:
    decoded = decode_envelope(encode_envelope(env))
    assert isinstance(decoded, XLogData)
    assert type(decoded.payload) is bytes
    assert encode_message(decode_message(decoded.payload)) == env.payload


@st.composite
def _streams(draw: st.DrawFn) -> list[LogicalMessage]:
    """A plausible message sequence: ordinary transactions and stream chunks (whose changes carry xids)."""
    out: list[LogicalMessage] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            out.append(draw(ms.begins()))
            out.extend(draw(st.lists(_changes(in_stream=False), max_size=4)))
            out.append(draw(ms.commits()))
        else:
            out.append(draw(ms.stream_starts()))
            out.extend(draw(st.lists(_changes(in_stream=True), max_size=4)))
            out.append(StreamStop())
            out.append(draw(ms.stream_commits() | ms.stream_aborts()))
    return out


def _changes(*, in_stream: bool) -> st.SearchStrategy[LogicalMessage]:
    """The messages a stream chunk carries (drawn directly: filtering every message type down to these rejected
    too many draws for hypothesis's health check)."""
    return st.one_of(*(strategy(in_stream=in_stream) for strategy in STREAMABLE_STRATEGIES.values()))


@FAST
@given(_streams())
def test_message_decoder_tracks_stream_framing(stream: list[LogicalMessage]) -> None:
    decoder = MessageDecoder()
    assert [decoder.decode(encode_message(m)) for m in stream] == stream
    assert decoder.in_stream is False


def test_message_decoder_reset_and_encoding() -> None:
    decoder = MessageDecoder(encoding="latin-1")
    assert decoder.decode(b"S\x00\x00\x00\x07\x01") == StreamStart(7, True)
    assert decoder.in_stream
    decoder.reset()
    assert decoder.decode(b"O" + bytes(8) + b"caf\xe9\x00") == Origin(0, "café")
    with pytest.raises(LookupError):
        MessageDecoder(encoding="no-such-codec")


# --- byte layouts checked by hand ----------------------------------------------------------------------------------


def h(*parts: str | bytes) -> bytes:
    """Concatenate message pieces: str pieces are hex (spaces ignored), bytes pieces are literal."""
    return b"".join(bytes.fromhex(p) if isinstance(p, str) else p for p in parts)


K = TupleData(b"tnb", (b"42", None, b"\x00\x01"))
K_WIRE = h("0003", b"t", "00000002", b"42", b"n", b"b", "00000002", "0001")
NEW_WITH_TOAST = TupleData(b"tu", (b"", None))
NEW_WITH_TOAST_WIRE = h("0002", b"t", "00000000", b"u")

LAYOUTS: list[tuple[str, LogicalMessage, bytes]] = [
    # Begin: final_lsn int64, commit_time int64, xid int32
    (
        "begin",
        Begin(final_lsn=0x1_6B3748, commit_time=0x0102030405060708, xid=0x2F1),
        h(b"B", "00000000 016B3748", "01020304 05060708", "000002F1"),
    ),
    # Commit: flags int8 (0), commit_lsn, end_lsn, commit_time
    (
        "commit",
        Commit(0, commit_lsn=0x1_6B3748, end_lsn=0x1_6B3780, commit_time=-1),
        h(b"C", "00", "00000000 016B3748", "00000000 016B3780", "FFFFFFFF FFFFFFFF"),
    ),
    # Origin: origin_lsn int64, name string
    ("origin", Origin(0xA, "node1"), h(b"O", "00000000 0000000A", b"node1\0")),
    # Relation: relid, namespace, relname, replident, natts int16, per column flags, name, type oid, typmod
    (
        "relation",
        Relation(
            None,
            16384,
            "public",
            "t",
            "d",
            (RelationColumn(1, "id", 23, -1), RelationColumn(0, "v", 1043, 14)),
        ),
        h(
            b"R",
            "00004000",
            b"public\0t\0",
            b"d",
            "0002",
            "01",
            b"id\0",
            "00000017",
            "FFFFFFFF",
            "00",
            b"v\0",
            "00000413",
            "0000000E",
        ),
    ),
    (
        "relation-in-stream-pg_catalog",
        Relation(0x2F2, 1, "", "x", "f", ()),
        h(b"R", "000002F2", "00000001", b"\0x\0", b"f", "0000"),
    ),
    # Type: [xid], type oid, namespace, name
    ("type", Type(None, 16390, "public", "mood"), h(b"Y", "00004006", b"public\0mood\0")),
    ("type-in-stream", Type(7, 16390, "s", "m"), h(b"Y", "00000007", "00004006", b"s\0m\0")),
    # Insert: [xid], relid, 'N', TupleData (ncols int16, per column kind + [int32 len + bytes])
    ("insert", Insert(None, 16384, K), h(b"I", "00004000", b"N", K_WIRE)),
    ("insert-in-stream", Insert(0x2F3, 16384, K), h(b"I", "000002F3", "00004000", b"N", K_WIRE)),
    ("insert-no-columns", Insert(None, 5, TupleData(b"", ())), h(b"I", "00000005", b"N", "0000")),
    # Update: [xid], relid, optional 'K'|'O' + old TupleData, 'N' + new TupleData
    (
        "update-no-old",
        Update(None, 16384, None, None, NEW_WITH_TOAST),
        h(b"U", "00004000", b"N", NEW_WITH_TOAST_WIRE),
    ),
    (
        "update-key",
        Update(None, 16384, "K", K, NEW_WITH_TOAST),
        h(b"U", "00004000", b"K", K_WIRE, b"N", NEW_WITH_TOAST_WIRE),
    ),
    (
        "update-old-in-stream",
        Update(9, 16384, "O", K, K),
        h(b"U", "00000009", "00004000", b"O", K_WIRE, b"N", K_WIRE),
    ),
    # Delete: [xid], relid, 'K'|'O', TupleData
    ("delete-key", Delete(None, 16384, "K", K), h(b"D", "00004000", b"K", K_WIRE)),
    ("delete-old-in-stream", Delete(3, 16384, "O", K), h(b"D", "00000003", "00004000", b"O", K_WIRE)),
    # Truncate: [xid], nrelids int32, flags int8, relids
    (
        "truncate",
        Truncate(None, 3, (16384, 16390)),
        h(b"T", "00000002", "03", "00004000", "00004006"),
    ),
    ("truncate-in-stream", Truncate(4, 0, ()), h(b"T", "00000004", "00000000", "00")),
    # Message: [xid], flags int8, lsn int64, prefix string, length int32, content
    (
        "message",
        Message(None, 1, 0x1_6B3748, "pfx", b"hi\0"),
        h(b"M", "01", "00000000 016B3748", b"pfx\0", "00000003", b"hi\0"),
    ),
    (
        "message-in-stream",
        Message(5, 0, 1, "", b""),
        h(b"M", "00000005", "00", "00000000 00000001", "00", "00000000"),
    ),
    # Stream Start: xid int32, first_segment int8
    ("stream-start-first", StreamStart(0x2F1, True), h(b"S", "000002F1", "01")),
    ("stream-start-next", StreamStart(0x2F1, False), h(b"S", "000002F1", "00")),
    ("stream-stop", StreamStop(), b"E"),
    # Stream Commit: xid, flags, commit_lsn, end_lsn, commit_time
    (
        "stream-commit",
        StreamCommit(0x2F1, 0, 0x10, 0x20, 0x30),
        h(b"c", "000002F1", "00", "00000000 00000010", "00000000 00000020", "00000000 00000030"),
    ),
    # Stream Abort: xid, subxid [, abort_lsn, abort_time with streaming 'parallel']
    ("stream-abort", StreamAbort(0x2F1, 0x2F5), h(b"A", "000002F1", "000002F5")),
    (
        "stream-abort-parallel",
        StreamAbort(0x2F1, 0x2F1, 0x40, 0x50),
        h(b"A", "000002F1", "000002F1", "00000000 00000040", "00000000 00000050"),
    ),
    # Begin Prepare: prepare_lsn, end_lsn, prepare_time, xid, gid (no flags byte)
    (
        "begin-prepare",
        BeginPrepare(0x10, 0x20, 0x30, 0x2F1, "g1"),
        h(b"b", "00000000 00000010", "00000000 00000020", "00000000 00000030", "000002F1", b"g1\0"),
    ),
    # Prepare / Stream Prepare: flags, prepare_lsn, end_lsn, prepare_time, xid, gid
    (
        "prepare",
        Prepare(0, 0x10, 0x20, 0x30, 0x2F1, "g1"),
        h(b"P", "00", "00000000 00000010", "00000000 00000020", "00000000 00000030", "000002F1", b"g1\0"),
    ),
    (
        "stream-prepare",
        StreamPrepare(0, 0x10, 0x20, 0x30, 0x2F1, ""),
        h(b"p", "00", "00000000 00000010", "00000000 00000020", "00000000 00000030", "000002F1", "00"),
    ),
    # Commit Prepared: flags, commit_lsn, end_lsn, commit_time, xid, gid
    (
        "commit-prepared",
        CommitPrepared(0, 0x10, 0x20, 0x30, 0x2F1, "g1"),
        h(b"K", "00", "00000000 00000010", "00000000 00000020", "00000000 00000030", "000002F1", b"g1\0"),
    ),
    # Rollback Prepared: flags, prepare_end_lsn, rollback_end_lsn, prepare_time, rollback_time, xid, gid
    (
        "rollback-prepared",
        RollbackPrepared(0, 0x10, 0x20, 0x30, 0x40, 0x2F1, "g1"),
        h(
            b"r",
            "00",
            "00000000 00000010",
            "00000000 00000020",
            "00000000 00000030",
            "00000000 00000040",
            "000002F1",
            b"g1\0",
        ),
    ),
]


@pytest.mark.parametrize(("msg", "wire"), [(m, w) for _, m, w in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_hand_checked_layout(msg: LogicalMessage, wire: bytes) -> None:
    assert encode_message(msg) == wire
    assert decode_message(wire, in_stream=ms.in_stream_for(msg)) == msg


def test_layouts_cover_every_message_type() -> None:
    from applier.messages import MESSAGE_TYPE_BYTES

    assert {type(m) for _, m, _ in LAYOUTS} == set(MESSAGE_TYPE_BYTES)


def test_tuple_values_stay_raw_bytes() -> None:
    msg = decode_message(
        h(b"I", "00000001", b"N", "0002", b"t", "00000002", b"\xc3\xa9", b"b", "00000001", "FF")
    )
    assert isinstance(msg, Insert)
    assert msg.new.values == (b"\xc3\xa9", b"\xff")
    assert msg.new.kinds == b"tb" and msg.new.is_binary(1) and not msg.new.is_null(0)


def test_stream_start_first_segment_is_byte_equal_to_one() -> None:
    # proto.c: first_segment = (pq_getmsgbyte(in) == 1); any other value means a later segment.
    assert decode_message(h(b"S", "00000001", "02")) == StreamStart(1, False)


ENVELOPE_LAYOUTS: list[tuple[str, XLogData | PrimaryKeepalive | StandbyStatusUpdate, bytes]] = [
    # 'w' XLogData: dataStart, walEnd, sendTime, then the logical message
    (
        "xlogdata",
        XLogData(0x1_6B3748, 0x1_6B3780, 0x30, b"E"),
        h(b"w", "00000000 016B3748", "00000000 016B3780", "00000000 00000030", b"E"),
    ),
    # 'k' keepalive: walEnd, sendTime, replyRequested
    (
        "keepalive",
        PrimaryKeepalive(0x10, 0x20, True),
        h(b"k", "00000000 00000010", "00000000 00000020", "01"),
    ),
    # 'r' standby status update: write, flush, apply, sendTime, replyRequested (34 bytes, what the walsender reads)
    (
        "standby-status-update",
        StandbyStatusUpdate(0x1_6B3780, 0x1_6B3748, 0x1_6B3700, 0x0102030405060708, False),
        h(
            b"r",
            "00000000 016B3780",
            "00000000 016B3748",
            "00000000 016B3700",
            "01020304 05060708",
            "00",
        ),
    ),
]


@pytest.mark.parametrize(
    ("env", "wire"), [(e, w) for _, e, w in ENVELOPE_LAYOUTS], ids=[n for n, _, _ in ENVELOPE_LAYOUTS]
)
def test_hand_checked_envelope_layout(
    env: XLogData | PrimaryKeepalive | StandbyStatusUpdate, wire: bytes
) -> None:
    assert encode_envelope(env) == wire
    assert decode_envelope(wire) == env


def test_standby_status_update_is_34_bytes() -> None:
    assert len(encode_envelope(StandbyStatusUpdate(1, 2, 3, 4, True))) == 34


def test_keepalive_reply_requested_is_any_nonzero_byte() -> None:
    assert decode_envelope(h(b"k", "00" * 16, "02")) == PrimaryKeepalive(0, 0, True)


def test_unknown_envelope_types_are_ignored() -> None:
    # The apply loop ignores them (behaviour 6), e.g. PG19's 's' primary status update.
    assert decode_envelope(b"s" + bytes(32)) is None
    assert decode_envelope(b"?") is None


# --- the encoder refuses what the wire cannot carry -------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        Origin(0, "a\0b"),
        Begin(-1, 0, 0),
        Begin(1, 0, 2**32),
        Commit(256, 1, 1, 1),
        Relation(None, 1, "s", "t", "dd", ()),
        Update(None, 1, "K", None, TupleData(b"", ())),
        Update(None, 1, None, TupleData(b"", ()), TupleData(b"", ())),
        Delete(None, 1, "X", TupleData(b"", ())),
        StreamAbort(1, 1, 5, None),
        Insert(None, 1, TupleData(b"t", (None,))),
        Insert(None, 1, TupleData(b"n", (b"x",))),
        Insert(None, 1, TupleData(b"x", (None,))),
    ],
)
def test_encoder_rejects_unrepresentable(msg: LogicalMessage) -> None:
    with pytest.raises(ValueError):
        encode_message(msg)


def test_encoder_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode_message(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_envelope(Begin(1, 2, 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decode_message("B")  # type: ignore[arg-type]
