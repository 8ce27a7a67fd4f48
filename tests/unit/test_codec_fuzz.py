"""The decoder on hostile input: it only ever returns a valid message or raises DecodeError.

"Valid" is checked, not assumed: a message decoded from random bytes must re-encode to the very same bytes (so no
field was invented or dropped), and every DecodeError must name the message type and an offset inside the buffer.
Also here: each validation rule PostgreSQL's ``proto.c`` applies, with the exact type and offset we report.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from applier.decoder import MESSAGE_TYPE_NAMES, decode_envelope, decode_message
from applier.encoder import encode_envelope, encode_message
from applier.errors import DecodeError
from applier.messages import MESSAGE_TYPE_BYTES, LogicalMessage, StreamAbort
from applier.testing import message_strategies as ms

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TYPE_BYTES = sorted(b[0] for b in MESSAGE_TYPE_BYTES.values())
ENVELOPE_NAMES = {ord("w"): "XLogData", ord("k"): "Primary Keepalive", ord("r"): "Standby Status Update"}


def check_error(err: DecodeError, buf: bytes, names: dict[int, str]) -> None:
    """A DecodeError must say which message type failed and where, and the offset must lie within the buffer."""
    assert 0 <= err.offset <= len(buf), (err, len(buf))
    text = str(err)
    assert err.msg_type in text and f"at byte {err.offset}" in text and err.reason in text
    if buf and buf[0] in names:
        assert err.msg_type == names[buf[0]]


def decode_or_reject(buf: bytes, in_stream: bool) -> LogicalMessage | None:
    """Decode ``buf``; the outcome must be a DecodeError or a message that re-encodes to exactly ``buf``."""
    try:
        msg = decode_message(buf, in_stream=in_stream)
    except DecodeError as err:
        check_error(err, buf, MESSAGE_TYPE_NAMES)
        return None
    wire = encode_message(msg)
    if buf[:1] == b"S":  # first_segment is "byte == 1": other non-zero bytes normalise to 0
        assert wire[:-1] == buf[:-1] and (wire[-1] == 1) == (buf[-1] == 1)
    else:
        assert wire == buf
    assert decode_message(wire, in_stream=ms.in_stream_for(msg)) == msg
    return msg


# --- random bytes ------------------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=80), st.booleans())
def test_random_bytes(buf: bytes, in_stream: bool) -> None:
    decode_or_reject(buf, in_stream)


@FUZZ
@given(st.sampled_from(TYPE_BYTES), st.binary(max_size=80), st.booleans())
def test_random_body_after_a_valid_type_byte(type_byte: int, body: bytes, in_stream: bool) -> None:
    decode_or_reject(bytes((type_byte,)) + body, in_stream)


@FUZZ
@given(st.binary(max_size=60))
def test_random_envelopes(buf: bytes) -> None:
    for candidate in (buf, b"w" + buf, b"k" + buf, b"r" + buf):
        try:
            env = decode_envelope(candidate)
        except DecodeError as err:
            check_error(err, candidate, ENVELOPE_NAMES)
            continue
        if env is None:
            assert candidate and candidate[0] not in ENVELOPE_NAMES
        else:
            wire = encode_envelope(env)
            assert decode_envelope(wire) == env
            assert wire[:-1] == candidate[:-1] or candidate[:1] == b"w" and wire == candidate


# --- every truncation of a valid message --------------------------------------------------------------------------


@SOME
@given(ms.logical_messages())
def test_every_truncation_is_rejected(msg: LogicalMessage) -> None:
    wire = encode_message(msg)
    in_stream = ms.in_stream_for(msg)
    for cut in range(len(wire)):
        prefix = wire[:cut]
        try:
            decoded = decode_message(prefix, in_stream=in_stream)
        except DecodeError as err:
            check_error(err, prefix, MESSAGE_TYPE_NAMES)
            assert err.offset <= cut
            continue
        # The one legitimate exception: a parallel-mode Stream Abort cut after subxid is a plain Stream Abort.
        assert isinstance(msg, StreamAbort) and cut == 9, (msg, cut)
        assert decoded == StreamAbort(msg.xid, msg.subxid)


@SOME
@given(ms.envelope_messages())
def test_every_envelope_truncation_is_rejected(env: object) -> None:
    wire = encode_envelope(env)  # type: ignore[arg-type]
    for cut in range(1, len(wire)):
        prefix = wire[:cut]
        if prefix[:1] == b"w" and cut > 25:
            continue  # a shorter payload is still an XLogData; its message is checked above
        with pytest.raises(DecodeError) as info:
            decode_envelope(prefix)
        check_error(info.value, prefix, ENVELOPE_NAMES)


# --- random mutations of valid messages ---------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A valid encoded message with a few bytes flipped, inserted, deleted or appended."""
    msg = draw(ms.logical_messages())
    buf = bytearray(encode_message(msg))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("flip", "set", "insert", "delete", "append")))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = draw(st.sampled_from((0x00, 0x01, 0x7F, 0x80, 0xFF, *b"ntubKONE")))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and buf:
            del buf[pos : pos + draw(st.integers(1, 4))]
        else:
            buf += draw(st.binary(min_size=1, max_size=4))
    # keep the original framing flag most of the time, but also decode with the wrong one
    in_stream = draw(st.sampled_from((ms.in_stream_for(msg),) * 3 + (not ms.in_stream_for(msg),)))
    return bytes(buf), in_stream


@settings(FUZZ, max_examples=250)
@given(mutated())
def test_mutations_decode_or_reject(case: tuple[bytes, bool]) -> None:
    buf, in_stream = case
    decode_or_reject(buf, in_stream)


# --- proto.c's validation rules, one by one ------------------------------------------------------------------------


def h(*parts: str | bytes) -> bytes:
    return b"".join(bytes.fromhex(p) if isinstance(p, str) else p for p in parts)


LSN1 = "00000000 00000001"
ZERO8 = "00000000 00000000"
TUPLE1 = h("0001", b"t", "00000001", b"x")

REJECTIONS: list[tuple[str, bytes, bool, str, int, str]] = [
    # (case, bytes, in_stream, type name, offset, substring of the reason)
    ("empty", b"", False, "logical replication", 0, "empty"),
    ("unknown type", b"Z\x00", False, "unknown 'Z' (0x5a)", 0, "invalid logical replication message type"),
    ("begin final_lsn 0", h(b"B", ZERO8, ZERO8, "00000001"), False, "Begin", 1, "final_lsn not set"),
    ("commit flags", h(b"C", "01", LSN1, LSN1, LSN1), False, "Commit", 1, "unrecognized flags 1"),
    (
        "stream commit flags",
        h(b"c", "00000001", "02", LSN1, LSN1, LSN1),
        False,
        "Stream Commit",
        5,
        "flags 2",
    ),
    (
        "begin prepare prepare_lsn 0",
        h(b"b", ZERO8, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Begin Prepare",
        1,
        "prepare_lsn not set",
    ),
    (
        "begin prepare end_lsn 0",
        h(b"b", LSN1, ZERO8, LSN1, "00000001", b"g\0"),
        False,
        "Begin Prepare",
        9,
        "end_lsn not set",
    ),
    ("prepare flags", h(b"P", "01", LSN1, LSN1, LSN1, "00000001", b"g\0"), False, "Prepare", 1, "flags 1"),
    (
        "prepare prepare_lsn 0",
        h(b"P", "00", ZERO8, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Prepare",
        2,
        "prepare_lsn is not set",
    ),
    (
        "prepare end_lsn 0",
        h(b"P", "00", LSN1, ZERO8, LSN1, "00000001", b"g\0"),
        False,
        "Prepare",
        10,
        "end_lsn is not set",
    ),
    (
        "prepare xid 0",
        h(b"P", "00", LSN1, LSN1, LSN1, "00000000", b"g\0"),
        False,
        "Prepare",
        26,
        "invalid two-phase transaction ID",
    ),
    (
        "stream prepare xid 0",
        h(b"p", "00", LSN1, LSN1, LSN1, "00000000", b"g\0"),
        False,
        "Stream Prepare",
        26,
        "in stream prepare message",
    ),
    (
        "commit prepared flags",
        h(b"K", "01", LSN1, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Commit Prepared",
        1,
        "flags 1",
    ),
    (
        "commit prepared commit_lsn 0",
        h(b"K", "00", ZERO8, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Commit Prepared",
        2,
        "commit_lsn is not set",
    ),
    (
        "commit prepared end_lsn 0",
        h(b"K", "00", LSN1, ZERO8, LSN1, "00000001", b"g\0"),
        False,
        "Commit Prepared",
        10,
        "end_lsn is not set",
    ),
    (
        "rollback prepared flags",
        h(b"r", "80", LSN1, LSN1, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Rollback Prepared",
        1,
        "flags 128",
    ),
    (
        "rollback prepared prepare_end_lsn 0",
        h(b"r", "00", ZERO8, LSN1, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Rollback Prepared",
        2,
        "prepare_end_lsn is not set",
    ),
    (
        "rollback prepared rollback_end_lsn 0",
        h(b"r", "00", LSN1, ZERO8, LSN1, LSN1, "00000001", b"g\0"),
        False,
        "Rollback Prepared",
        10,
        "rollback_end_lsn is not set",
    ),
    ("insert without N", h(b"I", "00000001", b"K", TUPLE1), False, "Insert", 5, "expected new tuple"),
    (
        "insert in stream without N",
        h(b"I", "00000007", "00000001", b"O", TUPLE1),
        True,
        "Insert",
        9,
        "got 'O'",
    ),
    (
        "update bad marker",
        h(b"U", "00000001", b"X", TUPLE1),
        False,
        "Update",
        5,
        "expected action 'N', 'O' or 'K'",
    ),
    (
        "update old tuple then no N",
        h(b"U", "00000001", b"K", TUPLE1, b"K", TUPLE1),
        False,
        "Update",
        14,
        "expected action 'N', got 'K'",
    ),
    ("update old tuple then end", h(b"U", "00000001", b"O", TUPLE1), False, "Update", 14, "truncated"),
    ("delete with N", h(b"D", "00000001", b"N", TUPLE1), False, "Delete", 5, "expected action 'O' or 'K'"),
    (
        "unknown tuple kind",
        h(b"I", "00000001", b"N", "0002", b"n", b"x"),
        False,
        "Insert",
        9,
        "unrecognized data representation type 'x'",
    ),
    (
        "negative column length",
        h(b"I", "00000001", b"N", "0001", b"t", "FFFFFFFF"),
        False,
        "Insert",
        9,
        "negative",
    ),
    (
        "column length past the end",
        h(b"I", "00000001", b"N", "0001", b"b", "00000005", b"abc"),
        False,
        "Insert",
        9,
        "needs 5 bytes, 3 left",
    ),
    ("column count past the end", h(b"D", "00000001", b"K", "0002", b"n"), False, "Delete", 9, "column 2"),
    ("truncated column count", h(b"I", "00000001", b"N", "00"), False, "Insert", 6, "column count"),
    ("truncated relid", h(b"I", "0000"), False, "Insert", 1, "relid needs 4 bytes, 2 left"),
    ("truncated xid", h(b"I", "0000"), True, "Insert", 1, "xid needs 4 bytes"),
    ("trailing bytes", h(b"I", "00000001", b"N", TUPLE1, "00"), False, "Insert", 14, "1 trailing byte"),
    ("stream stop body", b"E\x00\x00", False, "Stream Stop", 1, "2 trailing bytes"),
    ("begin trailing", h(b"B", LSN1, LSN1, "00000001", "00"), False, "Begin", 21, "trailing"),
    ("truncated begin", h(b"B", LSN1, "0000"), False, "Begin", 9, "commit_time needs 8 bytes, 2 left"),
    (
        "stream abort 12-byte body",
        h(b"A", "00000001", "00000001", "00000000"),
        False,
        "Stream Abort",
        9,
        "24",
    ),
    ("stream abort 7-byte body", h(b"A", "00000001", "000000"), False, "Stream Abort", 5, "subxid"),
    ("stream abort 26-byte body", h(b"A", "00" * 25), False, "Stream Abort", 25, "trailing"),
    ("origin without NUL", h(b"O", LSN1, b"name"), False, "Origin", 9, "NUL terminator"),
    ("origin invalid utf-8", h(b"O", LSN1, b"ab\xff\0"), False, "Origin", 11, "invalid utf-8"),
    ("relation name without NUL", h(b"R", "00000001", b"public\0t"), False, "Relation", 12, "relation name"),
    (
        "relation column cut",
        h(b"R", "00000001", b"s\0t\0", b"d", "0001", "01", b"id\0", "0000"),
        False,
        "Relation",
        16,
        "column 1 type oid needs 4 bytes, 2 left",
    ),
    ("type namespace invalid", h(b"Y", "00000001", b"\xc3\0t\0"), False, "Type", 5, "invalid utf-8"),
    (
        "truncate negative count",
        h(b"T", "FFFFFFFF", "00"),
        False,
        "Truncate",
        1,
        "negative relation count -1",
    ),
    ("truncate count too large", h(b"T", "7FFFFFFF", "00", "00000001"), False, "Truncate", 10, "truncated"),
    (
        "truncate extra relid",
        h(b"T", "00000001", "00", "00000001", "00000002"),
        False,
        "Truncate",
        10,
        "trailing",
    ),
    ("message negative length", h(b"M", "01", LSN1, b"p\0", "FFFFFFFE"), False, "Message", 12, "negative"),
    (
        "message content cut",
        h(b"M", "01", LSN1, b"p\0", "00000004", b"ab"),
        False,
        "Message",
        12,
        "needs 4 bytes",
    ),
    ("message trailing", h(b"M", "01", LSN1, b"p\0", "00000001", b"ab"), False, "Message", 17, "trailing"),
]


@pytest.mark.parametrize(
    ("buf", "in_stream", "msg_type", "offset", "reason"),
    [r[1:] for r in REJECTIONS],
    ids=[r[0] for r in REJECTIONS],
)
def test_rejection(buf: bytes, in_stream: bool, msg_type: str, offset: int, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(buf, in_stream=in_stream)
    err = info.value
    assert (err.msg_type, err.offset) == (msg_type, offset), str(err)
    assert reason in err.reason, str(err)


ENVELOPE_REJECTIONS: list[tuple[str, bytes, str, int, str]] = [
    ("empty", b"", "CopyData", 0, "empty"),
    ("xlogdata header cut", h(b"w", LSN1, "0000"), "XLogData", 9, "walEnd needs 8 bytes, 2 left"),
    ("xlogdata without message", h(b"w", LSN1, LSN1, LSN1), "XLogData", 25, "no logical replication message"),
    ("keepalive cut", h(b"k", LSN1, LSN1), "Primary Keepalive", 17, "replyRequested"),
    ("keepalive trailing", h(b"k", LSN1, LSN1, "01", "00"), "Primary Keepalive", 18, "trailing"),
    ("status update cut", h(b"r", LSN1, LSN1, LSN1, "00"), "Standby Status Update", 25, "sendTime"),
]


@pytest.mark.parametrize(
    ("buf", "msg_type", "offset", "reason"),
    [r[1:] for r in ENVELOPE_REJECTIONS],
    ids=[r[0] for r in ENVELOPE_REJECTIONS],
)
def test_envelope_rejection(buf: bytes, msg_type: str, offset: int, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_envelope(buf)
    err = info.value
    assert (err.msg_type, err.offset) == (msg_type, offset), str(err)
    assert reason in err.reason, str(err)


def test_a_huge_column_count_in_a_short_buffer_fails_fast() -> None:
    with pytest.raises(DecodeError, match="column 1 has no kind byte"):
        decode_message(h(b"I", "00000001", b"N", "FFFF"))
    with pytest.raises(DecodeError, match="column 2 flags needs 1 byte, 0 left"):
        decode_message(h(b"R", "00000001", b"s\0t\0", b"d", "FFFF", "00", b"a\0", "00000017", "FFFFFFFF"))
