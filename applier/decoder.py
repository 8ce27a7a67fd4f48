"""Decode pgoutput logical-replication messages (protocol versions 1-4) and the streaming-replication envelope.

Pure code over bytes: no I/O, no state except in :class:`MessageDecoder`. The checks are those of PostgreSQL's
``src/backend/replication/logical/proto.c`` (``logicalrep_read_*``), plus what a C reader gets for free from
``pq_getmsg*`` and we must do by hand: truncated input, negative lengths, missing NUL terminators, undecodable
strings and, stricter than the server, trailing bytes after a complete message (a mis-framed message is a bug we
want to hear about, not silently ignore). Every failure is a :class:`~applier.errors.DecodeError` naming the message
type and the byte offset (from the start of the buffer, type byte = offset 0) where decoding failed; nothing else
escapes, so the apply loop has exactly one exception to turn into "the publisher sent garbage".

Layout of the module, for the reader who has to keep it fast (this is the hot path, hundreds of thousands of
messages a second):

* one handler per message type, ``_decode_<type>(buf, in_stream, encoding)``, found through a 256-entry table
  indexed by the type byte;
* fixed-width runs of fields are read with one precompiled ``struct.Struct.unpack_from`` at an offset into the one
  ``bytes`` object; bounds are checked by letting ``unpack_from``/indexing fail (``try`` is free in CPython 3.11+)
  and only then working out, on the slow path, which field was cut short;
* TupleData is decoded in one tight loop that allocates only the value slices it must return.
"""

from __future__ import annotations

import codecs
import dataclasses
import struct
from collections.abc import Callable

from applier.errors import DecodeError
from applier.messages import (
    KEEPALIVE_KIND,
    STATUS_UPDATE_KIND,
    XLOG_DATA_KIND,
    XLOG_ENVELOPE,
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

__all__ = [
    "MESSAGE_TYPE_NAMES",
    "MessageDecoder",
    "decode_envelope",
    "decode_message",
    "decode_plain_insert",
]

Buffer = bytes | bytearray | memoryview

#: Human names of the message types, as used in every DecodeError (and by the apply loop's error context).
MESSAGE_TYPE_NAMES: dict[int, str] = {
    ord("B"): "Begin",
    ord("C"): "Commit",
    ord("O"): "Origin",
    ord("R"): "Relation",
    ord("Y"): "Type",
    ord("I"): "Insert",
    ord("U"): "Update",
    ord("D"): "Delete",
    ord("T"): "Truncate",
    ord("M"): "Message",
    ord("S"): "Stream Start",
    ord("E"): "Stream Stop",
    ord("c"): "Stream Commit",
    ord("A"): "Stream Abort",
    ord("b"): "Begin Prepare",
    ord("P"): "Prepare",
    ord("K"): "Commit Prepared",
    ord("r"): "Rollback Prepared",
    ord("p"): "Stream Prepare",
}

_MARK_NEW = ord("N")
_MARK_KEY = ord("K")
_MARK_OLD = ord("O")


# --- small helpers (slow paths and non-hot reads) ----------------------------------------------------------------


def _show(byte: int) -> str:
    """A wire byte for an error message: the character when printable, always the hex value."""
    return f"{chr(byte)!r} (0x{byte:02x})" if 0x20 < byte < 0x7F else f"0x{byte:02x}"


class _Fixed:
    """A run of fixed-width fields read with one precompiled Struct.

    Keeps each field's name and width so that, when the buffer is too short, the error can say which field was cut
    off and where it starts, rather than just "struct.error".
    """

    __slots__ = ("_unpack_from", "fields")

    def __init__(self, *fields: tuple[str, str]) -> None:
        fmt = ">" + "".join(code for _, code in fields)
        s = struct.Struct(fmt)
        self._unpack_from = s.unpack_from
        self.fields = tuple((name, struct.calcsize(">" + code)) for name, code in fields)

    def unpack(self, buf: bytes, off: int, msg_type: str, what: str = "") -> tuple[int, ...]:
        """Unpack the run at ``off``; ``what`` prefixes the field names in errors (e.g. "column 3 ")."""
        try:
            return self._unpack_from(buf, off)
        except struct.error:
            raise self.truncated(buf, off, msg_type, what) from None

    def truncated(self, buf: bytes, off: int, msg_type: str, what: str = "") -> DecodeError:
        """The DecodeError for a buffer that ends inside this run, naming the first field that does not fit."""
        n = len(buf)
        for name, width in self.fields:
            if off + width > n:
                return DecodeError(
                    msg_type, off, f"truncated: {what}{name} needs {_nbytes(width)}, {n - off} left"
                )
            off += width
        raise AssertionError("_Fixed.truncated called on a buffer that is long enough")  # pragma: no cover


def _nbytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"


def _string(buf: bytes, off: int, msg_type: str, field: str, encoding: str) -> tuple[str, int]:
    """Read a NUL-terminated string (``pq_getmsgstring``); return it and the offset after the NUL."""
    end = buf.find(b"\x00", off)
    if end < 0:
        raise DecodeError(
            msg_type, off, f"{field}: string has no NUL terminator before the end of the message"
        )
    try:
        return buf[off:end].decode(encoding), end + 1
    except UnicodeDecodeError as e:
        raise DecodeError(msg_type, off + e.start, f"{field}: invalid {encoding} ({e.reason})") from None


def _trailing(buf: bytes, off: int, msg_type: str) -> DecodeError:
    extra = len(buf) - off
    return DecodeError(
        msg_type, off, f"{extra} trailing byte{'s' if extra != 1 else ''} after a complete message"
    )


def _byte(buf: bytes, off: int, msg_type: str, field: str) -> int:
    if off >= len(buf):
        raise DecodeError(msg_type, off, f"truncated: {field} needs 1 byte, 0 left")
    return buf[off]


def _xid_prefix(buf: bytes, in_stream: bool, msg_type: str) -> tuple[int | None, int]:
    """The subtransaction xid that streamed changes carry after the type byte (behaviour 13)."""
    if not in_stream:
        return None, 1
    (xid,) = _XID.unpack(buf, 1, msg_type)
    return xid, 5


def _tuple_truncated(buf: bytes, off: int, msg_type: str, col: int) -> DecodeError:
    """Slow path of :func:`_read_tuple`: the buffer ended inside column ``col`` (0-based) starting at ``off``."""
    n = len(buf)
    if off >= n:
        return DecodeError(msg_type, off, f"truncated TupleData: column {col + 1} has no kind byte")
    left = n - off - 1
    return DecodeError(
        msg_type, off + 1, f"truncated TupleData: column {col + 1} length needs 4 bytes, {left} left"
    )


def _bad_value_length(buf: bytes, off: int, msg_type: str, col: int, length: int) -> DecodeError:
    """Slow path of :func:`_read_tuple`: the int32 length at ``off`` is negative or runs past the end."""
    if length < 0:
        return DecodeError(msg_type, off, f"column {col + 1} has negative length {length}")
    left = len(buf) - off - 4
    return DecodeError(
        msg_type, off, f"truncated TupleData: column {col + 1} needs {length} bytes, {left} left"
    )


# Fast construction for the per-row objects and the XLogData around each. The dataclasses are frozen, so their
# generated ``__init__`` goes through ``object.__setattr__`` per field (plus ``TupleData.__post_init__``): about
# 300 ns per object, more than decoding a column. Setting the slots through their descriptors builds an identical,
# equal object in half the time. The decoder guarantees what ``__post_init__`` checks (one kind per value), and
# ``_check_fast_constructors`` fails at import if a field is ever added to or renamed in these classes.
_new = object.__new__


def _check_fast_constructors() -> None:
    for cls, names in (
        (TupleData, ("kinds", "values")),
        (Insert, ("xid", "relid", "new")),
        (Update, ("xid", "relid", "old_kind", "old", "new")),
        (Delete, ("xid", "relid", "old_kind", "old")),
        (XLogData, ("data_start", "wal_end", "send_time", "payload")),
        (Begin, ("final_lsn", "commit_time", "xid")),
        (Commit, ("flags", "commit_lsn", "end_lsn", "commit_time")),
    ):
        if tuple(f.name for f in dataclasses.fields(cls)) != names:
            raise RuntimeError(
                f"applier.decoder: {cls.__name__}'s fields changed; update its _make_* function"
            )


_check_fast_constructors()
_set_kinds = TupleData.kinds.__set__  # type: ignore[attr-defined]
_set_values = TupleData.values.__set__  # type: ignore[attr-defined]
_set_ins_xid = Insert.xid.__set__  # type: ignore[attr-defined]
_set_ins_relid = Insert.relid.__set__  # type: ignore[attr-defined]
_set_ins_new = Insert.new.__set__  # type: ignore[attr-defined]
_set_upd_xid = Update.xid.__set__  # type: ignore[attr-defined]
_set_upd_relid = Update.relid.__set__  # type: ignore[attr-defined]
_set_upd_old_kind = Update.old_kind.__set__  # type: ignore[attr-defined]
_set_upd_old = Update.old.__set__  # type: ignore[attr-defined]
_set_upd_new = Update.new.__set__  # type: ignore[attr-defined]
_set_del_xid = Delete.xid.__set__  # type: ignore[attr-defined]
_set_del_relid = Delete.relid.__set__  # type: ignore[attr-defined]
_set_del_old_kind = Delete.old_kind.__set__  # type: ignore[attr-defined]
_set_del_old = Delete.old.__set__  # type: ignore[attr-defined]
_set_xl_data_start = XLogData.data_start.__set__  # type: ignore[attr-defined]
_set_xl_wal_end = XLogData.wal_end.__set__  # type: ignore[attr-defined]
_set_xl_send_time = XLogData.send_time.__set__  # type: ignore[attr-defined]
_set_xl_payload = XLogData.payload.__set__  # type: ignore[attr-defined]
_set_begin_final_lsn = Begin.final_lsn.__set__  # type: ignore[attr-defined]
_set_begin_commit_time = Begin.commit_time.__set__  # type: ignore[attr-defined]
_set_begin_xid = Begin.xid.__set__  # type: ignore[attr-defined]
_set_commit_flags = Commit.flags.__set__  # type: ignore[attr-defined]
_set_commit_commit_lsn = Commit.commit_lsn.__set__  # type: ignore[attr-defined]
_set_commit_end_lsn = Commit.end_lsn.__set__  # type: ignore[attr-defined]
_set_commit_commit_time = Commit.commit_time.__set__  # type: ignore[attr-defined]


def _make_tuple(kinds: bytes, values: tuple[bytes | None, ...]) -> TupleData:
    t = _new(TupleData)
    _set_kinds(t, kinds)
    _set_values(t, values)
    return t


def _make_insert(xid: int | None, relid: int, new: TupleData) -> Insert:
    m = _new(Insert)
    _set_ins_xid(m, xid)
    _set_ins_relid(m, relid)
    _set_ins_new(m, new)
    return m


def _make_update(
    xid: int | None, relid: int, old_kind: str | None, old: TupleData | None, new: TupleData
) -> Update:
    m = _new(Update)
    _set_upd_xid(m, xid)
    _set_upd_relid(m, relid)
    _set_upd_old_kind(m, old_kind)
    _set_upd_old(m, old)
    _set_upd_new(m, new)
    return m


def _make_delete(xid: int | None, relid: int, old_kind: str, old: TupleData) -> Delete:
    m = _new(Delete)
    _set_del_xid(m, xid)
    _set_del_relid(m, relid)
    _set_del_old_kind(m, old_kind)
    _set_del_old(m, old)
    return m


def _make_begin(final_lsn: int, commit_time: int, xid: int) -> Begin:
    m = _new(Begin)
    _set_begin_final_lsn(m, final_lsn)
    _set_begin_commit_time(m, commit_time)
    _set_begin_xid(m, xid)
    return m


def _make_commit(flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> Commit:
    m = _new(Commit)
    _set_commit_flags(m, flags)
    _set_commit_commit_lsn(m, commit_lsn)
    _set_commit_end_lsn(m, end_lsn)
    _set_commit_commit_time(m, commit_time)
    return m


def _make_xlogdata(data_start: int, wal_end: int, send_time: int, payload: bytes) -> XLogData:
    m = _new(XLogData)
    _set_xl_data_start(m, data_start)
    _set_xl_wal_end(m, wal_end)
    _set_xl_send_time(m, send_time)
    _set_xl_payload(m, payload)
    return m


_KIND_AND_LENGTH = struct.Struct(">Bi").unpack_from


def _read_tuple(buf: bytes, off: int, msg_type: str) -> tuple[TupleData, int]:
    """Read TupleData (``logicalrep_read_tuple``); return it and the offset after it. The hot loop of the codec.

    Bounds are not tested per column: reading past the end raises IndexError/struct.error, turned into a precise
    DecodeError on the slow path, with ``off`` still at the column that did not fit. The column count is uint16,
    as ``pq_getmsgint(in, 2)`` reads it; a huge count in a short buffer stops at the buffer's end.
    """
    n = len(buf)
    if off + 2 > n:
        left = max(n - off, 0)
        raise DecodeError(msg_type, off, f"truncated TupleData: column count needs 2 bytes, {left} left")
    ncols = (buf[off] << 8) | buf[off + 1]
    off += 2
    # At most 65535 columns, so preallocating is bounded (0.5 MB) even when the count is a lie.
    values: list[bytes | None] = [None] * ncols
    kinds = bytearray(ncols)
    kind_and_length = _KIND_AND_LENGTH
    i = 0
    try:
        for i in range(ncols):
            kind = buf[off]
            if kind == 116 or kind == 98:  # 't' text, 'b' binary: int32 length + data
                kind, length = kind_and_length(buf, off)
                start = off + 5
                end = start + length
                if length < 0 or end > n:
                    raise _bad_value_length(buf, off + 1, msg_type, i, length)
                values[i] = buf[start:end]
                off = end
            elif kind == 110 or kind == 117:  # 'n' NULL, 'u' unchanged TOASTed value: no data
                off += 1
            else:
                raise DecodeError(
                    msg_type,
                    off,
                    f"unrecognized data representation type {_show(kind)} in column {i + 1}",
                )
            kinds[i] = kind
    except (IndexError, struct.error):
        raise _tuple_truncated(buf, off, msg_type, i) from None
    return _make_tuple(bytes(kinds), tuple(values)), off


# --- fixed-width runs ----------------------------------------------------------------------------------------------

_XID = _Fixed(("xid", "I"))
_RELID = _Fixed(("relid", "I"))
_CHANGE_HEAD = _Fixed(("relid", "I"), ("tuple marker", "B"))
_STREAM_CHANGE_HEAD = _Fixed(("xid", "I"), ("relid", "I"), ("tuple marker", "B"))
_RELID_MARKER = struct.Struct(">IB").unpack_from
_XID_RELID_MARKER = struct.Struct(">IIB").unpack_from
_BEGIN = _Fixed(("final_lsn", "Q"), ("commit_time", "q"), ("xid", "I"))
_COMMIT = _Fixed(("flags", "B"), ("commit_lsn", "Q"), ("end_lsn", "Q"), ("commit_time", "q"))
_ORIGIN = _Fixed(("origin_lsn", "Q"))
_RELATION_TAIL = _Fixed(("replident", "B"), ("natts", "H"))
_COLUMN_FLAGS = _Fixed(("flags", "B"))
_COLUMN_TYPE = _Fixed(("type oid", "I"), ("typmod", "i"))
_TYPE = _Fixed(("type oid", "I"))
_TRUNCATE = _Fixed(("nrelids", "i"), ("flags", "B"))
_MESSAGE = _Fixed(("flags", "B"), ("lsn", "Q"))
_MESSAGE_LEN = _Fixed(("content length", "i"))
_STREAM_START = _Fixed(("xid", "I"), ("first_segment", "B"))
_STREAM_COMMIT = _Fixed(
    ("xid", "I"), ("flags", "B"), ("commit_lsn", "Q"), ("end_lsn", "Q"), ("commit_time", "q")
)
_STREAM_ABORT = _Fixed(("xid", "I"), ("subxid", "I"))
_STREAM_ABORT_PARALLEL = _Fixed(("xid", "I"), ("subxid", "I"), ("abort_lsn", "Q"), ("abort_time", "q"))
_BEGIN_PREPARE = _Fixed(("prepare_lsn", "Q"), ("end_lsn", "Q"), ("prepare_time", "q"), ("xid", "I"))
_PREPARE = _Fixed(("flags", "B"), ("prepare_lsn", "Q"), ("end_lsn", "Q"), ("prepare_time", "q"), ("xid", "I"))
_COMMIT_PREPARED = _Fixed(
    ("flags", "B"), ("commit_lsn", "Q"), ("end_lsn", "Q"), ("commit_time", "q"), ("xid", "I")
)
_ROLLBACK_PREPARED = _Fixed(
    ("flags", "B"),
    ("prepare_end_lsn", "Q"),
    ("rollback_end_lsn", "Q"),
    ("prepare_time", "q"),
    ("rollback_time", "q"),
    ("xid", "I"),
)


# --- one handler per message type ----------------------------------------------------------------------------------
# Each takes the whole message (type byte at offset 0) as bytes, whether the message arrived inside a stream, and
# the string encoding; each ends by checking that the message was consumed exactly.


def _decode_begin(buf: bytes, in_stream: bool, encoding: str) -> Begin:
    final_lsn, commit_time, xid = _BEGIN.unpack(buf, 1, "Begin")
    if final_lsn == 0:
        raise DecodeError("Begin", 1, "final_lsn not set in begin message")
    if len(buf) != 21:
        raise _trailing(buf, 21, "Begin")
    return _make_begin(final_lsn, commit_time, xid)


def _decode_commit(buf: bytes, in_stream: bool, encoding: str) -> Commit:
    flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack(buf, 1, "Commit")
    if flags != 0:
        raise DecodeError("Commit", 1, f"unrecognized flags {flags} in commit message")
    if len(buf) != 26:
        raise _trailing(buf, 26, "Commit")
    return _make_commit(flags, commit_lsn, end_lsn, commit_time)


def _decode_origin(buf: bytes, in_stream: bool, encoding: str) -> Origin:
    (origin_lsn,) = _ORIGIN.unpack(buf, 1, "Origin")
    name, off = _string(buf, 9, "Origin", "origin name", encoding)
    if off != len(buf):
        raise _trailing(buf, off, "Origin")
    return Origin(origin_lsn, name)


def _decode_relation(buf: bytes, in_stream: bool, encoding: str) -> Relation:
    t = "Relation"
    xid, off = _xid_prefix(buf, in_stream, t)
    (relid,) = _RELID.unpack(buf, off, t)
    namespace, off = _string(buf, off + 4, t, "namespace", encoding)
    relname, off = _string(buf, off, t, "relation name", encoding)
    replident, natts = _RELATION_TAIL.unpack(buf, off, t)
    off += 3
    columns = []
    for i in range(natts):
        (flags,) = _COLUMN_FLAGS.unpack(buf, off, t, f"column {i + 1} ")
        name, off = _string(buf, off + 1, t, f"column {i + 1} name", encoding)
        type_oid, typmod = _COLUMN_TYPE.unpack(buf, off, t, f"column {i + 1} ")
        off += 8
        columns.append(RelationColumn(flags, name, type_oid, typmod))
    if off != len(buf):
        raise _trailing(buf, off, t)
    return Relation(xid, relid, namespace, relname, chr(replident), tuple(columns))


def _decode_type(buf: bytes, in_stream: bool, encoding: str) -> Type:
    xid, off = _xid_prefix(buf, in_stream, "Type")
    (type_oid,) = _TYPE.unpack(buf, off, "Type")
    namespace, off = _string(buf, off + 4, "Type", "namespace", encoding)
    typname, off = _string(buf, off, "Type", "type name", encoding)
    if off != len(buf):
        raise _trailing(buf, off, "Type")
    return Type(xid, type_oid, namespace, typname)


def _change_head(buf: bytes, in_stream: bool, msg_type: str) -> tuple[int | None, int, int, int]:
    """``[xid] relid marker`` that starts Insert/Update/Delete; returns xid, relid, marker and the offset after it."""
    try:
        if in_stream:
            xid, relid, marker = _XID_RELID_MARKER(buf, 1)
            return xid, relid, marker, 10
        relid, marker = _RELID_MARKER(buf, 1)
        return None, relid, marker, 6
    except struct.error:
        head = _STREAM_CHANGE_HEAD if in_stream else _CHANGE_HEAD
        raise head.truncated(buf, 1, msg_type) from None


def _decode_insert(buf: bytes, in_stream: bool, encoding: str) -> Insert:
    xid, relid, action, off = _change_head(buf, in_stream, "Insert")
    if action != _MARK_NEW:
        raise DecodeError("Insert", off - 1, f"expected new tuple 'N' but got {_show(action)}")
    new, off = _read_tuple(buf, off, "Insert")
    if off != len(buf):
        raise _trailing(buf, off, "Insert")
    return _make_insert(xid, relid, new)


def decode_plain_insert(buf: bytes) -> tuple[int, TupleData]:
    """An Insert outside a stream, as ``(relid, new tuple)``: what :func:`decode_message` checks and raises, without
    building the :class:`Insert` (the apply loop's fast path for rows that go into an open COPY)."""
    try:
        relid, action = _RELID_MARKER(buf, 1)
    except struct.error:
        raise _CHANGE_HEAD.truncated(buf, 1, "Insert") from None
    if action != _MARK_NEW:
        raise DecodeError("Insert", 5, f"expected new tuple 'N' but got {_show(action)}")
    new, off = _read_tuple(buf, 6, "Insert")
    if off != len(buf):
        raise _trailing(buf, off, "Insert")
    return relid, new


def decode_plain_update(buf: bytes) -> tuple[int, TupleData | None, TupleData]:
    """An Update outside a stream, as ``(relid, old tuple or None, new tuple)``: what :func:`decode_message` checks
    and raises, without building the :class:`Update` (the apply loop's path for the usual Update, whose key did
    not change: no old tuple)."""
    try:
        relid, action = _RELID_MARKER(buf, 1)
    except struct.error:
        raise _CHANGE_HEAD.truncated(buf, 1, "Update") from None
    if action != _MARK_NEW:
        m = _decode_update(buf, False, "")  # an old tuple or key first (or a bad marker, raised there)
        return m.relid, m.old, m.new
    new, off = _read_tuple(buf, 6, "Update")
    if off != len(buf):
        raise _trailing(buf, off, "Update")
    return relid, None, new


def _decode_update(buf: bytes, in_stream: bool, encoding: str) -> Update:
    xid, relid, action, off = _change_head(buf, in_stream, "Update")
    old_kind: str | None
    old: TupleData | None
    if action == _MARK_NEW:
        old_kind = old = None
    elif action == _MARK_KEY or action == _MARK_OLD:
        old_kind = "K" if action == _MARK_KEY else "O"
        old, off = _read_tuple(buf, off, "Update")
        action = _byte(buf, off, "Update", "the 'N' new-tuple marker")
        if action != _MARK_NEW:
            raise DecodeError("Update", off, f"expected action 'N', got {_show(action)}")
        off += 1
    else:
        raise DecodeError("Update", off - 1, f"expected action 'N', 'O' or 'K', got {_show(action)}")
    new, off = _read_tuple(buf, off, "Update")
    if off != len(buf):
        raise _trailing(buf, off, "Update")
    return _make_update(xid, relid, old_kind, old, new)


def _decode_delete(buf: bytes, in_stream: bool, encoding: str) -> Delete:
    xid, relid, action, off = _change_head(buf, in_stream, "Delete")
    if action != _MARK_KEY and action != _MARK_OLD:
        raise DecodeError("Delete", off - 1, f"expected action 'O' or 'K', got {_show(action)}")
    old, off = _read_tuple(buf, off, "Delete")
    if off != len(buf):
        raise _trailing(buf, off, "Delete")
    return _make_delete(xid, relid, "K" if action == _MARK_KEY else "O", old)


def _decode_truncate(buf: bytes, in_stream: bool, encoding: str) -> Truncate:
    t = "Truncate"
    xid, off = _xid_prefix(buf, in_stream, t)
    nrelids, flags = _TRUNCATE.unpack(buf, off, t)
    if nrelids < 0:
        raise DecodeError(t, off, f"negative relation count {nrelids}")
    off += 5
    need = 4 * nrelids
    left = len(buf) - off
    if left < need:
        raise DecodeError(
            t, off + (left // 4) * 4, f"truncated: {nrelids} relids need {need} bytes, {left} left"
        )
    if left > need:
        raise _trailing(buf, off + need, t)
    relids = struct.unpack_from(f">{nrelids}I", buf, off)
    return Truncate(xid, flags, relids)


def _decode_logical_decoding_message(buf: bytes, in_stream: bool, encoding: str) -> Message:
    t = "Message"
    xid, off = _xid_prefix(buf, in_stream, t)
    flags, lsn = _MESSAGE.unpack(buf, off, t)
    prefix, off = _string(buf, off + 9, t, "prefix", encoding)
    (length,) = _MESSAGE_LEN.unpack(buf, off, t)
    if length < 0:
        raise DecodeError(t, off, f"negative content length {length}")
    off += 4
    end = off + length
    if end > len(buf):
        raise DecodeError(t, off - 4, f"truncated: content needs {length} bytes, {len(buf) - off} left")
    if end != len(buf):
        raise _trailing(buf, end, t)
    return Message(xid, flags, lsn, prefix, buf[off:end])


def _decode_stream_start(buf: bytes, in_stream: bool, encoding: str) -> StreamStart:
    xid, first_segment = _STREAM_START.unpack(buf, 1, "Stream Start")
    if len(buf) != 6:
        raise _trailing(buf, 6, "Stream Start")
    # proto.c: first_segment = (byte == 1); any other value means "not the first".
    return StreamStart(xid, first_segment == 1)


def _decode_stream_stop(buf: bytes, in_stream: bool, encoding: str) -> StreamStop:
    if len(buf) != 1:
        raise _trailing(buf, 1, "Stream Stop")
    return _STREAM_STOP


_STREAM_STOP = StreamStop()


def _decode_stream_commit(buf: bytes, in_stream: bool, encoding: str) -> StreamCommit:
    xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack(buf, 1, "Stream Commit")
    if flags != 0:
        raise DecodeError("Stream Commit", 5, f"unrecognized flags {flags} in commit message")
    if len(buf) != 30:
        raise _trailing(buf, 30, "Stream Commit")
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time)


def _decode_stream_abort(buf: bytes, in_stream: bool, encoding: str) -> StreamAbort:
    # The abort_lsn/abort_time pair is sent only under streaming 'parallel' (pgoutput's write_abort_info), not per
    # protocol version, so the body length is the only reliable way to tell the two layouts apart (behaviour 28).
    n = len(buf)
    if n == 9:
        xid, subxid = _STREAM_ABORT.unpack(buf, 1, "Stream Abort")
        return StreamAbort(xid, subxid)
    if n == 25:
        xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_PARALLEL.unpack(buf, 1, "Stream Abort")
        return StreamAbort(xid, subxid, abort_lsn, abort_time)
    if n < 9:
        raise _STREAM_ABORT.truncated(buf, 1, "Stream Abort")
    if n < 25:
        raise DecodeError(
            "Stream Abort",
            9,
            f"body is {n - 1} bytes: expected 8 (xid, subxid) or 24 (plus streaming 'parallel' abort_lsn, abort_time)",
        )
    raise _trailing(buf, 25, "Stream Abort")


def _decode_begin_prepare(buf: bytes, in_stream: bool, encoding: str) -> BeginPrepare:
    t = "Begin Prepare"
    prepare_lsn, end_lsn, prepare_time, xid = _BEGIN_PREPARE.unpack(buf, 1, t)
    if prepare_lsn == 0:
        raise DecodeError(t, 1, "prepare_lsn not set in begin prepare message")
    if end_lsn == 0:
        raise DecodeError(t, 9, "end_lsn not set in begin prepare message")
    gid, off = _string(buf, 29, t, "gid", encoding)
    if off != len(buf):
        raise _trailing(buf, off, t)
    return BeginPrepare(prepare_lsn, end_lsn, prepare_time, xid, gid)


def _read_prepare_common(
    buf: bytes, t: str, wire_name: str, encoding: str
) -> tuple[int, int, int, int, int, str]:
    """``logicalrep_read_prepare_common``: shared by Prepare and Stream Prepare, identical layout and checks."""
    flags, prepare_lsn, end_lsn, prepare_time, xid = _PREPARE.unpack(buf, 1, t)
    if flags != 0:
        raise DecodeError(t, 1, f"unrecognized flags {flags} in {wire_name} message")
    if prepare_lsn == 0:
        raise DecodeError(t, 2, f"prepare_lsn is not set in {wire_name} message")
    if end_lsn == 0:
        raise DecodeError(t, 10, f"end_lsn is not set in {wire_name} message")
    if xid == 0:
        raise DecodeError(t, 26, f"invalid two-phase transaction ID in {wire_name} message")
    gid, off = _string(buf, 30, t, "gid", encoding)
    if off != len(buf):
        raise _trailing(buf, off, t)
    return flags, prepare_lsn, end_lsn, prepare_time, xid, gid


def _decode_prepare(buf: bytes, in_stream: bool, encoding: str) -> Prepare:
    return Prepare(*_read_prepare_common(buf, "Prepare", "prepare", encoding))


def _decode_stream_prepare(buf: bytes, in_stream: bool, encoding: str) -> StreamPrepare:
    return StreamPrepare(*_read_prepare_common(buf, "Stream Prepare", "stream prepare", encoding))


def _decode_commit_prepared(buf: bytes, in_stream: bool, encoding: str) -> CommitPrepared:
    t = "Commit Prepared"
    flags, commit_lsn, end_lsn, commit_time, xid = _COMMIT_PREPARED.unpack(buf, 1, t)
    if flags != 0:
        raise DecodeError(t, 1, f"unrecognized flags {flags} in commit prepared message")
    if commit_lsn == 0:
        raise DecodeError(t, 2, "commit_lsn is not set in commit prepared message")
    if end_lsn == 0:
        raise DecodeError(t, 10, "end_lsn is not set in commit prepared message")
    gid, off = _string(buf, 30, t, "gid", encoding)
    if off != len(buf):
        raise _trailing(buf, off, t)
    return CommitPrepared(flags, commit_lsn, end_lsn, commit_time, xid, gid)


def _decode_rollback_prepared(buf: bytes, in_stream: bool, encoding: str) -> RollbackPrepared:
    t = "Rollback Prepared"
    flags, prepare_end_lsn, rollback_end_lsn, prepare_time, rollback_time, xid = _ROLLBACK_PREPARED.unpack(
        buf, 1, t
    )
    if flags != 0:
        raise DecodeError(t, 1, f"unrecognized flags {flags} in rollback prepared message")
    if prepare_end_lsn == 0:
        raise DecodeError(t, 2, "prepare_end_lsn is not set in rollback prepared message")
    if rollback_end_lsn == 0:
        raise DecodeError(t, 10, "rollback_end_lsn is not set in rollback prepared message")
    gid, off = _string(buf, 38, t, "gid", encoding)
    if off != len(buf):
        raise _trailing(buf, off, t)
    return RollbackPrepared(flags, prepare_end_lsn, rollback_end_lsn, prepare_time, rollback_time, xid, gid)


_Handler = Callable[[bytes, bool, str], LogicalMessage]

_HANDLER_BY_TYPE: dict[str, _Handler] = {
    "B": _decode_begin,
    "C": _decode_commit,
    "O": _decode_origin,
    "R": _decode_relation,
    "Y": _decode_type,
    "I": _decode_insert,
    "U": _decode_update,
    "D": _decode_delete,
    "T": _decode_truncate,
    "M": _decode_logical_decoding_message,
    "S": _decode_stream_start,
    "E": _decode_stream_stop,
    "c": _decode_stream_commit,
    "A": _decode_stream_abort,
    "b": _decode_begin_prepare,
    "P": _decode_prepare,
    "K": _decode_commit_prepared,
    "r": _decode_rollback_prepared,
    "p": _decode_stream_prepare,
}

#: Dispatch table indexed by the type byte; ``None`` for bytes that are not a message type.
_HANDLERS: tuple[_Handler | None, ...] = tuple(_HANDLER_BY_TYPE.get(chr(i)) for i in range(256))


def _as_bytes(buf: Buffer) -> bytes:
    """One ``bytes`` object to read from: ``find`` and slicing must work and slices must be ``bytes``."""
    if isinstance(buf, bytearray | memoryview):
        return bytes(buf)
    raise TypeError(f"expected bytes, bytearray or memoryview, got {type(buf).__name__}")


# --- public API ------------------------------------------------------------------------------------------------------


def decode_message(buf: Buffer, *, in_stream: bool = False, encoding: str = "utf-8") -> LogicalMessage:
    """Decode one pgoutput message (the payload of an XLogData).

    ``in_stream`` says the message arrived between Stream Start and Stream Stop, where Relation, Type, Insert,
    Update, Delete, Truncate and Message carry the subtransaction xid after the type byte; the decoder cannot tell
    from the bytes alone, so the caller (or :class:`MessageDecoder`) must. ``encoding`` decodes the NUL-terminated
    strings (names, GIDs, prefixes): the walsender sends them in the connection's ``client_encoding``. Column
    values are left as raw ``bytes`` for the target's input/receive functions.

    Raises :class:`DecodeError` (and nothing else) for anything PostgreSQL would reject, and for truncated input or
    trailing bytes.
    """
    if type(buf) is not bytes:
        buf = _as_bytes(buf)
    if not buf:
        raise DecodeError("logical replication", 0, "empty message: no type byte")
    handler = _HANDLERS[buf[0]]
    if handler is None:
        raise DecodeError(
            f"unknown {_show(buf[0])}", 0, f"invalid logical replication message type {_show(buf[0])}"
        )
    return handler(buf, in_stream, encoding)


class MessageDecoder:
    """Stateful convenience over :func:`decode_message` that follows Stream Start / Stream Stop itself.

    Only framing state is kept (are we inside a stream chunk?); protocol-order checks such as a duplicate Stream
    Start belong to the apply loop, which knows what it was doing. Create a new one (or :meth:`reset`) after a
    reconnect, because a stream chunk never spans connections.
    """

    __slots__ = ("encoding", "in_stream")

    def __init__(self, *, encoding: str = "utf-8", in_stream: bool = False) -> None:
        codecs.lookup(encoding)  # fail now with LookupError, not on the first string of the stream
        self.encoding = encoding
        self.in_stream = in_stream

    def reset(self) -> None:
        """Forget any open stream chunk (new connection)."""
        self.in_stream = False

    def decode(self, buf: Buffer) -> LogicalMessage:
        """Decode one message, passing ``in_stream`` as the stream framing so far requires."""
        msg = decode_message(buf, in_stream=self.in_stream, encoding=self.encoding)
        kind = type(msg)
        if kind is StreamStart:
            self.in_stream = True
        elif kind is StreamStop:
            self.in_stream = False
        return msg


_XLOG_DATA = _Fixed(("dataStart", "Q"), ("walEnd", "Q"), ("sendTime", "q"))
_KEEPALIVE = _Fixed(("walEnd", "Q"), ("sendTime", "q"), ("replyRequested", "B"))
_STATUS_UPDATE = _Fixed(
    ("write", "Q"), ("flush", "Q"), ("apply", "Q"), ("sendTime", "q"), ("replyRequested", "B")
)
_XLOG_DATA_UNPACK = struct.Struct(">QQq").unpack_from


def decode_envelope(buf: Buffer) -> XLogData | PrimaryKeepalive | StandbyStatusUpdate | None:
    """Decode one CopyData payload of the streaming-replication protocol.

    ``w`` XLogData, ``k`` primary keepalive, and ``r`` standby status update (what we send; decoded for tests and
    tools). Any other type byte returns ``None``: the native apply loop silently ignores unknown types (behaviour
    6), which is what lets newer servers add some (PG19's ``s``). Truncated or over-long known types, and an
    XLogData without a message in it, raise :class:`DecodeError`.
    """
    if type(buf) is not bytes:
        if type(buf) is memoryview and len(buf) > XLOG_ENVELOPE and buf[0] == XLOG_DATA_KIND:
            # what libpq hands over: copy only the message out of it, not the whole envelope and then the message
            data_start, wal_end, send_time = _XLOG_DATA_UNPACK(buf, 1)
            return _make_xlogdata(data_start, wal_end, send_time, bytes(buf[XLOG_ENVELOPE:]))
        buf = _as_bytes(buf)
    if not buf:
        raise DecodeError("CopyData", 0, "empty CopyData message: no type byte")
    t = buf[0]
    if t == XLOG_DATA_KIND:
        try:
            data_start, wal_end, send_time = _XLOG_DATA_UNPACK(buf, 1)
        except struct.error:
            raise _XLOG_DATA.truncated(buf, 1, "XLogData") from None
        if len(buf) == XLOG_ENVELOPE:
            raise DecodeError(
                "XLogData", XLOG_ENVELOPE, "no logical replication message after the XLogData header"
            )
        return _make_xlogdata(data_start, wal_end, send_time, buf[XLOG_ENVELOPE:])
    if t == KEEPALIVE_KIND:
        wal_end, send_time, reply = _KEEPALIVE.unpack(buf, 1, "Primary Keepalive")
        if len(buf) != 18:
            raise _trailing(buf, 18, "Primary Keepalive")
        return PrimaryKeepalive(wal_end, send_time, reply != 0)
    if t == STATUS_UPDATE_KIND:
        write, flush, apply, send_time, reply = _STATUS_UPDATE.unpack(buf, 1, "Standby Status Update")
        if len(buf) != 34:
            raise _trailing(buf, 34, "Standby Status Update")
        return StandbyStatusUpdate(write, flush, apply, send_time, reply != 0)
    return None
