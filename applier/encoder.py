"""Encode logical-replication messages and streaming-replication envelopes into their wire bytes.

The apply loop needs only :func:`encode_envelope` for standby status updates; the rest exists so that tests can
round-trip every message, fuzz the decoder from valid starting points, and build replication streams for
benchmarks without a server. The layouts follow pgoutput's writers (``logicalrep_write_*`` in PostgreSQL's
``proto.c``), not our decoder, so that a round trip checks two independent readings of the format.

The encoder is deliberately permissive about *semantics* (it writes Commit flags of 1 or a Begin with final_lsn 0
if asked) so tests can produce messages the decoder must reject; it is strict about *representability*: a value
that does not fit its wire field, a string containing NUL, or an inconsistent TupleData raises ``ValueError``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from applier.messages import (
    TUPLE_KINDS,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    EnvelopeMessage,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    PrimaryKeepalive,
    Relation,
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

__all__ = ["encode_envelope", "encode_message"]

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U16 = struct.Struct(">H")
_BEGIN = struct.Struct(">cQqI")
_COMMIT = struct.Struct(">cBQQq")
_ORIGIN = struct.Struct(">cQ")
_RELATION_TAIL = struct.Struct(">BH")
_COLUMN_TYPE = struct.Struct(">Ii")
_TRUNCATE = struct.Struct(">iB")
_MESSAGE = struct.Struct(">BQ")
_STREAM_START = struct.Struct(">cIB")
_STREAM_COMMIT = struct.Struct(">cIBQQq")
_STREAM_ABORT = struct.Struct(">cII")
_STREAM_ABORT_PARALLEL = struct.Struct(">cIIQq")
_BEGIN_PREPARE = struct.Struct(">cQQqI")
_PREPARE = struct.Struct(">cBQQqI")
_COMMIT_PREPARED = struct.Struct(">cBQQqI")
_ROLLBACK_PREPARED = struct.Struct(">cBQQqqI")
_XLOG_DATA = struct.Struct(">cQQq")
_KEEPALIVE = struct.Struct(">cQqB")
_STATUS_UPDATE = struct.Struct(">cQQQqB")

_NEEDS_VALUE = frozenset({ord("t"), ord("b")})


def _cstring(value: str, encoding: str, what: str) -> bytes:
    """``pq_sendstring``: the encoded text plus a NUL, which is why the text itself may not contain one."""
    data = value.encode(encoding)
    if b"\x00" in data:
        raise ValueError(f"{what} contains a NUL character, which the protocol cannot carry: {value!r}")
    return data + b"\x00"


def _tuple(tup: TupleData) -> bytes:
    """``logicalrep_write_tuple``: int16 column count, then per column a kind byte and, for t/b, int32 len + data."""
    kinds, values = tup.kinds, tup.values
    out = [_U16.pack(len(values))]
    for kind, value in zip(kinds, values, strict=True):
        if kind not in TUPLE_KINDS:
            raise ValueError(f"unknown TupleData kind {kind!r}")
        if kind in _NEEDS_VALUE:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise ValueError(
                    f"TupleData kind {chr(kind)!r} needs a bytes value, got {type(value).__name__}"
                )
            out.append(bytes((kind,)))
            out.append(_I32.pack(len(value)))
            out.append(bytes(value))
        else:
            if value is not None:
                raise ValueError(f"TupleData kind {chr(kind)!r} carries no value, got {type(value).__name__}")
            out.append(bytes((kind,)))
    return b"".join(out)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else _U32.pack(xid)


def _enc_begin(m: Begin, encoding: str) -> bytes:
    return _BEGIN.pack(b"B", m.final_lsn, m.commit_time, m.xid)


def _enc_commit(m: Commit, encoding: str) -> bytes:
    return _COMMIT.pack(b"C", m.flags, m.commit_lsn, m.end_lsn, m.commit_time)


def _enc_origin(m: Origin, encoding: str) -> bytes:
    return _ORIGIN.pack(b"O", m.origin_lsn) + _cstring(m.name, encoding, "origin name")


def _enc_relation(m: Relation, encoding: str) -> bytes:
    if len(m.replident) != 1:
        raise ValueError(f"replident must be one character, got {m.replident!r}")
    out = [
        b"R",
        _xid(m.xid),
        _U32.pack(m.relid),
        _cstring(m.namespace, encoding, "namespace"),
        _cstring(m.relname, encoding, "relation name"),
        _RELATION_TAIL.pack(ord(m.replident), len(m.columns)),
    ]
    for col in m.columns:
        out.append(bytes((col.flags,)))
        out.append(_cstring(col.name, encoding, "column name"))
        out.append(_COLUMN_TYPE.pack(col.type_oid, col.typmod))
    return b"".join(out)


def _enc_type(m: Type, encoding: str) -> bytes:
    return b"".join(
        (
            b"Y",
            _xid(m.xid),
            _U32.pack(m.type_oid),
            _cstring(m.namespace, encoding, "namespace"),
            _cstring(m.typname, encoding, "type name"),
        )
    )


def _enc_insert(m: Insert, encoding: str) -> bytes:
    return b"".join((b"I", _xid(m.xid), _U32.pack(m.relid), b"N", _tuple(m.new)))


def _enc_update(m: Update, encoding: str) -> bytes:
    head = b"U" + _xid(m.xid) + _U32.pack(m.relid)
    if m.old_kind is None and m.old is None:
        return head + b"N" + _tuple(m.new)
    if m.old_kind in ("K", "O") and m.old is not None:
        return b"".join((head, m.old_kind.encode(), _tuple(m.old), b"N", _tuple(m.new)))
    raise ValueError(f"Update needs old_kind 'K' or 'O' with an old tuple, or neither; got {m.old_kind!r}")


def _enc_delete(m: Delete, encoding: str) -> bytes:
    if m.old_kind not in ("K", "O"):
        raise ValueError(f"Delete old_kind must be 'K' or 'O', got {m.old_kind!r}")
    return b"".join((b"D", _xid(m.xid), _U32.pack(m.relid), m.old_kind.encode(), _tuple(m.old)))


def _enc_truncate(m: Truncate, encoding: str) -> bytes:
    relids = struct.pack(f">{len(m.relids)}I", *m.relids)
    return b"T" + _xid(m.xid) + _TRUNCATE.pack(len(m.relids), m.flags) + relids


def _enc_message(m: Message, encoding: str) -> bytes:
    return b"".join(
        (
            b"M",
            _xid(m.xid),
            _MESSAGE.pack(m.flags, m.lsn),
            _cstring(m.prefix, encoding, "prefix"),
            _I32.pack(len(m.content)),
            bytes(m.content),
        )
    )


def _enc_stream_start(m: StreamStart, encoding: str) -> bytes:
    return _STREAM_START.pack(b"S", m.xid, 1 if m.first_segment else 0)


def _enc_stream_stop(m: StreamStop, encoding: str) -> bytes:
    return b"E"


def _enc_stream_commit(m: StreamCommit, encoding: str) -> bytes:
    return _STREAM_COMMIT.pack(b"c", m.xid, m.flags, m.commit_lsn, m.end_lsn, m.commit_time)


def _enc_stream_abort(m: StreamAbort, encoding: str) -> bytes:
    if m.abort_lsn is None and m.abort_time is None:
        return _STREAM_ABORT.pack(b"A", m.xid, m.subxid)
    if m.abort_lsn is None or m.abort_time is None:
        raise ValueError("StreamAbort needs both abort_lsn and abort_time (streaming 'parallel') or neither")
    return _STREAM_ABORT_PARALLEL.pack(b"A", m.xid, m.subxid, m.abort_lsn, m.abort_time)


def _enc_begin_prepare(m: BeginPrepare, encoding: str) -> bytes:
    head = _BEGIN_PREPARE.pack(b"b", m.prepare_lsn, m.end_lsn, m.prepare_time, m.xid)
    return head + _cstring(m.gid, encoding, "gid")


def _enc_prepare(m: Prepare, encoding: str) -> bytes:
    head = _PREPARE.pack(b"P", m.flags, m.prepare_lsn, m.end_lsn, m.prepare_time, m.xid)
    return head + _cstring(m.gid, encoding, "gid")


def _enc_commit_prepared(m: CommitPrepared, encoding: str) -> bytes:
    head = _COMMIT_PREPARED.pack(b"K", m.flags, m.commit_lsn, m.end_lsn, m.commit_time, m.xid)
    return head + _cstring(m.gid, encoding, "gid")


def _enc_rollback_prepared(m: RollbackPrepared, encoding: str) -> bytes:
    head = _ROLLBACK_PREPARED.pack(
        b"r", m.flags, m.prepare_end_lsn, m.rollback_end_lsn, m.prepare_time, m.rollback_time, m.xid
    )
    return head + _cstring(m.gid, encoding, "gid")


def _enc_stream_prepare(m: StreamPrepare, encoding: str) -> bytes:
    head = _PREPARE.pack(b"p", m.flags, m.prepare_lsn, m.end_lsn, m.prepare_time, m.xid)
    return head + _cstring(m.gid, encoding, "gid")


_ENCODERS: dict[type, Callable[[Any, str], bytes]] = {
    Begin: _enc_begin,
    Commit: _enc_commit,
    Origin: _enc_origin,
    Relation: _enc_relation,
    Type: _enc_type,
    Insert: _enc_insert,
    Update: _enc_update,
    Delete: _enc_delete,
    Truncate: _enc_truncate,
    Message: _enc_message,
    StreamStart: _enc_stream_start,
    StreamStop: _enc_stream_stop,
    StreamCommit: _enc_stream_commit,
    StreamAbort: _enc_stream_abort,
    BeginPrepare: _enc_begin_prepare,
    Prepare: _enc_prepare,
    CommitPrepared: _enc_commit_prepared,
    RollbackPrepared: _enc_rollback_prepared,
    StreamPrepare: _enc_stream_prepare,
}


def encode_message(msg: LogicalMessage, *, encoding: str = "utf-8") -> bytes:
    """The pgoutput bytes of ``msg`` (what an XLogData carries).

    Streamable messages get the xid prefix exactly when their ``xid`` is not None; StreamAbort gets the streaming
    'parallel' fields exactly when they are set. Raises ``TypeError`` for a non-message and ``ValueError`` for a
    value the wire format cannot carry.
    """
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise TypeError(f"not a logical replication message: {type(msg).__name__}")
    try:
        return encoder(msg, encoding)
    except struct.error as e:
        raise ValueError(f"cannot encode {msg!r}: a field is out of range ({e})") from None


def encode_envelope(msg: EnvelopeMessage) -> bytes:
    """The CopyData payload for an XLogData, primary keepalive or standby status update.

    ``StandbyStatusUpdate`` gives exactly what the walsender's ``ProcessStandbyReplyMessage`` reads: ``'r'``,
    write, flush and apply LSNs, the send time (µs since 2000-01-01) and the reply-requested byte — 34 bytes.
    """
    try:
        if type(msg) is StandbyStatusUpdate:
            return _STATUS_UPDATE.pack(
                b"r",
                msg.write_lsn,
                msg.flush_lsn,
                msg.apply_lsn,
                msg.send_time,
                1 if msg.reply_requested else 0,
            )
        if type(msg) is XLogData:
            return _XLOG_DATA.pack(b"w", msg.data_start, msg.wal_end, msg.send_time) + bytes(msg.payload)
        if type(msg) is PrimaryKeepalive:
            return _KEEPALIVE.pack(b"k", msg.wal_end, msg.send_time, 1 if msg.reply_requested else 0)
    except struct.error as e:
        raise ValueError(f"cannot encode {msg!r}: a field is out of range ({e})") from None
    raise TypeError(f"not a streaming-replication envelope message: {type(msg).__name__}")
