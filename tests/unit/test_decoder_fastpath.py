"""The apply loop's shortcuts through the codec decode exactly what :func:`decode_message` /
:func:`decode_envelope` decode, and reject exactly what they reject, with the same error."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from applier.decoder import decode_envelope, decode_message, decode_plain_insert, decode_plain_update
from applier.encoder import encode_message
from applier.errors import DecodeError
from applier.messages import Insert, Update
from applier.testing import message_strategies as ms


def _outcome(f, buf):
    try:
        return f(buf)
    except DecodeError as exc:
        return ("error", str(exc))


def _damaged(wire: bytearray, data: st.DataObject) -> bytes:
    """The message truncated, with bytes appended, or with one byte overwritten."""
    how = data.draw(st.sampled_from(["cut", "extra", "flip"]))
    if how == "cut":
        wire = wire[: data.draw(st.integers(1, len(wire) - 1))]
    elif how == "extra":
        wire += data.draw(st.binary(min_size=1, max_size=4))
    else:
        wire[data.draw(st.integers(1, len(wire) - 1))] = data.draw(st.integers(0, 255))
    return bytes(wire)


@given(ms.inserts(in_stream=False), st.data())
def test_plain_insert_shortcut_matches_decode_message(msg: Insert, data: st.DataObject) -> None:
    wire = bytearray(encode_message(msg))
    assert decode_plain_insert(bytes(wire)) == (msg.relid, msg.new)
    buf = _damaged(wire, data)
    full = _outcome(decode_message, buf)
    fast = _outcome(decode_plain_insert, buf)
    if isinstance(full, Insert):
        assert fast == (full.relid, full.new)
    else:
        assert fast == full


@given(ms.updates(in_stream=False), st.data())
def test_plain_update_shortcut_matches_decode_message(msg: Update, data: st.DataObject) -> None:
    """With or without an old tuple or key (the shortcut decodes those the long way); damaged, the same error."""
    wire = bytearray(encode_message(msg))
    assert decode_plain_update(bytes(wire)) == (msg.relid, msg.old, msg.new)
    buf = _damaged(wire, data)
    full = _outcome(decode_message, buf)
    fast = _outcome(decode_plain_update, buf)
    if isinstance(full, Update):
        assert fast == (full.relid, full.old, full.new)
    else:
        assert fast == full


@given(st.binary(min_size=1, max_size=40), st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1))
def test_envelope_from_memoryview_matches_bytes(payload: bytes, start: int, end: int) -> None:
    wire = b"w" + struct.pack(">QQq", start, end, 7) + payload
    for buf in (wire, wire[:25], wire[:10]):
        assert _outcome(decode_envelope, memoryview(buf)) == _outcome(decode_envelope, buf)
