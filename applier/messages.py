"""Typed logical-replication messages (pgoutput protocol versions 1-4) and the streaming-replication envelope.

These are plain immutable values: the decoder produces them from bytes, the encoder turns them back into the same
bytes, and the apply loop dispatches on their type (one handler per class, as ``worker.c`` has one
``apply_handle_*`` per message byte). LSNs and timestamps keep their wire integers (uint64 LSN, int64 microseconds
since 2000-01-01) so that round trips are exact; ``applier.lsn`` converts them for people.

Messages that may appear inside a streamed transaction (Relation, Type, Insert, Update, Delete, Truncate, Message)
carry ``xid``: the subtransaction xid that pgoutput writes right after the type byte between Stream Start and Stream
Stop, and ``None`` outside a stream (behaviour 13).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- tuple data ------------------------------------------------------------------------------------------------

#: Column kinds in TupleData (behaviour 24), as the single bytes that appear on the wire.
KIND_NULL = ord("n")
KIND_UNCHANGED_TOAST = ord("u")
KIND_TEXT = ord("t")
KIND_BINARY = ord("b")
TUPLE_KINDS = frozenset({KIND_NULL, KIND_UNCHANGED_TOAST, KIND_TEXT, KIND_BINARY})


@dataclass(frozen=True, slots=True)
class TupleData:
    """One row image, columns in the publisher's attribute order.

    ``kinds`` holds one wire kind byte per column (``b"tnu"``...), ``values`` the column data: ``bytes`` for text
    and binary columns, ``None`` for NULL and unchanged-TOAST columns. Two parallel sequences rather than a tuple of
    small objects because decoding hundreds of thousands of rows a second is the hot path.
    """

    kinds: bytes
    values: tuple[bytes | None, ...]

    def __post_init__(self) -> None:
        if len(self.kinds) != len(self.values):
            raise ValueError(f"TupleData has {len(self.kinds)} kinds but {len(self.values)} values")

    def __len__(self) -> int:
        return len(self.values)

    def is_null(self, i: int) -> bool:
        return self.kinds[i] == KIND_NULL

    def is_unchanged(self, i: int) -> bool:
        return self.kinds[i] == KIND_UNCHANGED_TOAST

    def is_binary(self, i: int) -> bool:
        return self.kinds[i] == KIND_BINARY


# --- logical replication messages (inside XLogData) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Begin:
    """``B``: start of a remote transaction; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: int
    commit_time: int
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    """``C``: end of a remote transaction. ``commit_lsn`` must equal the Begin's ``final_lsn``."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True, slots=True)
class Origin:
    """``O``: the upstream transaction itself was replicated from origin ``name``."""

    origin_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    typmod: int

    @property
    def is_key(self) -> bool:
        """Part of the replica identity (all columns for REPLICA IDENTITY FULL)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Relation:
    """``R``: describes a published table; changes refer to it by the publisher's ``relid``.

    ``namespace`` is empty on the wire for ``pg_catalog``; ``replident`` is one of ``d``/``n``/``f``/``i``.
    """

    xid: int | None
    relid: int
    namespace: str
    relname: str
    replident: str
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True, slots=True)
class Type:
    """``Y``: a non-built-in type used by a later Relation. The native subscriber reads and discards it."""

    xid: int | None
    type_oid: int
    namespace: str
    typname: str


@dataclass(frozen=True, slots=True)
class Insert:
    """``I``: a new row."""

    xid: int | None
    relid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    """``U``: ``old_kind`` is ``"K"`` (old key, identity changed), ``"O"`` (old row, REPLICA IDENTITY FULL) or None."""

    xid: int | None
    relid: int
    old_kind: str | None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    """``D``: ``old_kind`` is ``"K"`` (key columns only) or ``"O"`` (the whole old row)."""

    xid: int | None
    relid: int
    old_kind: str
    old: TupleData


TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2


@dataclass(frozen=True, slots=True)
class Truncate:
    """``T``: one TRUNCATE statement over several relations. The subscriber never cascades (behaviour 49)."""

    xid: int | None
    flags: int
    relids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.flags & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.flags & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class Message:
    """``M``: a ``pg_logical_emit_message`` payload; only sent when the client asks for ``messages 'true'``."""

    xid: int | None
    flags: int
    lsn: int
    prefix: str
    content: bytes

    @property
    def transactional(self) -> bool:
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class StreamStart:
    """``S``: a chunk of in-progress transaction ``xid`` (top-level) follows, until Stream Stop."""

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """``E``: end of a chunk. No body."""


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """``c``: streamed transaction ``xid`` committed; replay its spool in one local transaction."""

    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """``A``: ``subxid == xid`` aborts the whole streamed transaction, otherwise one subtransaction.

    ``abort_lsn``/``abort_time`` are present only when the client asked for ``streaming 'parallel'`` (protocol 4);
    the decoder tells by the message length, never by the protocol version (behaviour 28).
    """

    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_time: int | None = None


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    """``b``: start of a transaction that the publisher prepared (two-phase)."""

    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """``P``: end of a prepared transaction. The publisher's ``gid`` is not used for the local GID (behaviour 62)."""

    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    """``K``: COMMIT PREPARED on the publisher."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    """``r``: ROLLBACK PREPARED; apply only if our prepared xact was prepared at ``prepare_end_lsn``/``prepare_time``."""

    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_time: int
    rollback_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    """``p``: a streamed transaction was prepared; same layout as Prepare."""

    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


LogicalMessage = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | Message
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)

#: The type byte of each message class (behaviour 12).
MESSAGE_TYPE_BYTES: dict[type, bytes] = {
    Begin: b"B",
    Commit: b"C",
    Origin: b"O",
    Relation: b"R",
    Type: b"Y",
    Insert: b"I",
    Update: b"U",
    Delete: b"D",
    Truncate: b"T",
    Message: b"M",
    StreamStart: b"S",
    StreamStop: b"E",
    StreamCommit: b"c",
    StreamAbort: b"A",
    BeginPrepare: b"b",
    Prepare: b"P",
    CommitPrepared: b"K",
    RollbackPrepared: b"r",
    StreamPrepare: b"p",
}

#: Messages that carry the subtransaction xid prefix inside a stream (behaviour 13).
STREAMABLE = (Relation, Type, Insert, Update, Delete, Truncate, Message)


# --- the streaming-replication envelope (CopyData payloads) ----------------------------------------------------

#: The CopyData kinds of the streaming replication protocol: the first byte of each CopyData message.
XLOG_DATA_KIND = ord("w")
KEEPALIVE_KIND = ord("k")
STATUS_UPDATE_KIND = ord("r")
#: An XLogData's envelope (kind, dataStart, walEnd, sendTime): its pgoutput message starts at this offset, so
#: ``raw[XLOG_ENVELOPE]`` is the message type byte of an XLogData read undecoded.
XLOG_ENVELOPE = 25

#: pgoutput message type bytes the apply loop routes on without decoding (the others: :data:`MESSAGE_TYPES`).
BEGIN_TYPE = ord("B")
INSERT_TYPE = ord("I")
UPDATE_TYPE = ord("U")
BEGIN_PREPARE_TYPE = ord("b")
STREAM_START_TYPE = ord("S")
#: The changes a stream chunk spools undecoded, decoded once at replay (Relation, Type and the row changes).
SPOOLED_TYPES = frozenset(b"RYIUDTM")


@dataclass(frozen=True, slots=True)
class XLogData:
    """``w``: one logical message (``payload``) at WAL position ``data_start``."""

    data_start: int
    wal_end: int
    send_time: int
    payload: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    """``k``: the walsender's heartbeat; ``reply_requested`` demands a status update now."""

    wal_end: int
    send_time: int
    reply_requested: bool


@dataclass(frozen=True, slots=True)
class StandbyStatusUpdate:
    """``r``: our feedback. Note the worker's mapping (behaviour 7): write = last received, apply = last applied."""

    write_lsn: int
    flush_lsn: int
    apply_lsn: int
    send_time: int
    reply_requested: bool = False


EnvelopeMessage = XLogData | PrimaryKeepalive | StandbyStatusUpdate
