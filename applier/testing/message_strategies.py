"""Hypothesis strategies for every pgoutput message and streaming-replication envelope.

Every strategy produces *valid* messages: values that fit their wire fields and pass the checks PostgreSQL's
``proto.c`` makes (zero flags, non-zero LSNs where required, a non-zero prepare xid, 'K'/'O' old-tuple kinds), so
``decode_message(encode_message(m)) == m`` must hold for all of them. Invalid input is the fuzz tests' job: they
start from these messages and break them.

Streamable messages (Relation, Type, Insert, Update, Delete, Truncate, Message) take ``in_stream``: ``True`` gives
them the subtransaction xid that pgoutput writes inside a stream (never 0: pgoutput writes the prefix only for a
valid xid), ``False`` gives ``xid=None``, ``None`` either. :func:`in_stream_for` tells which flag decodes a message.

::

    from hypothesis import given
    from applier.testing.message_strategies import logical_messages, in_stream_for

    @given(logical_messages())
    def test_something(msg): ...
"""

from __future__ import annotations

from hypothesis import strategies as st

from applier.encoder import encode_message
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

__all__ = [
    "begin_prepares",
    "begins",
    "commit_prepareds",
    "commits",
    "deletes",
    "envelope_messages",
    "identifiers",
    "in_stream_for",
    "inserts",
    "keepalives",
    "logical_messages",
    "lsns",
    "messages",
    "origins",
    "prepares",
    "relations",
    "rollback_prepareds",
    "standby_status_updates",
    "stream_aborts",
    "stream_commits",
    "stream_prepares",
    "stream_starts",
    "stream_stops",
    "timestamps",
    "truncates",
    "tuple_datas",
    "types",
    "updates",
    "xids",
    "xlog_datas",
]

# --- wire-width integers -----------------------------------------------------------------------------------------


def lsns(*, allow_zero: bool = True) -> st.SearchStrategy[int]:
    """uint64 LSNs; ``allow_zero=False`` where proto.c insists on a valid (non-zero) LSN."""
    return st.integers(0 if allow_zero else 1, 2**64 - 1)


def timestamps() -> st.SearchStrategy[int]:
    """int64 microseconds since 2000-01-01 (any value: the protocol does not check them)."""
    return st.integers(-(2**63), 2**63 - 1)


def xids(*, allow_zero: bool = False) -> st.SearchStrategy[int]:
    """uint32 transaction ids; valid ones are never 0 (InvalidTransactionId)."""
    return st.integers(0 if allow_zero else 1, 2**32 - 1)


_oids = st.integers(0, 2**32 - 1)
_typmods = st.integers(-(2**31), 2**31 - 1)


def identifiers(*, max_size: int = 24) -> st.SearchStrategy[str]:
    """Names, GIDs, prefixes: any text a NUL-terminated UTF-8 string can carry (no NUL, no lone surrogates)."""
    return st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=max_size)


#: GIDs: PostgreSQL's GIDSIZE is 200 bytes with the NUL, and 40 characters of UTF-8 are at most 160 bytes.
_gids = identifiers(max_size=40)


def _sub_xids(in_stream: bool | None) -> st.SearchStrategy[int | None]:
    if in_stream is None:
        return st.none() | xids()
    return xids() if in_stream else st.none()


def in_stream_for(msg: LogicalMessage) -> bool:
    """The ``in_stream`` flag that decodes ``msg``'s bytes: true exactly for streamable messages with an xid."""
    return isinstance(msg, STREAMABLE) and msg.xid is not None


# --- tuple data --------------------------------------------------------------------------------------------------


@st.composite
def tuple_datas(
    draw: st.DrawFn, *, kinds: str = "ntb", max_columns: int = 8, max_value_size: int = 40
) -> TupleData:
    """A row image. ``kinds`` are the column kinds to draw from: ``"ntb"`` for rows that carry every value
    (Insert, old tuples), ``"ntub"`` for an Update's new tuple, which may mark unchanged TOASTed values."""
    column_kinds = draw(st.lists(st.sampled_from(kinds), max_size=max_columns))
    values = tuple(
        draw(st.binary(max_size=max_value_size)) if kind in "tb" else None for kind in column_kinds
    )
    return TupleData("".join(column_kinds).encode("ascii"), values)


# --- logical replication messages --------------------------------------------------------------------------------


def begins() -> st.SearchStrategy[Begin]:
    return st.builds(Begin, lsns(allow_zero=False), timestamps(), xids(allow_zero=True))


def commits() -> st.SearchStrategy[Commit]:
    return st.builds(Commit, st.just(0), lsns(), lsns(), timestamps())


def origins() -> st.SearchStrategy[Origin]:
    return st.builds(Origin, lsns(), identifiers())


def _relation_columns() -> st.SearchStrategy[RelationColumn]:
    return st.builds(RelationColumn, st.sampled_from((0, 1)), identifiers(), _oids, _typmods)


def relations(*, in_stream: bool | None = None) -> st.SearchStrategy[Relation]:
    return st.builds(
        Relation,
        _sub_xids(in_stream),
        _oids,
        identifiers(),
        identifiers(),
        st.sampled_from("dnfi"),
        st.lists(_relation_columns(), max_size=6).map(tuple),
    )


def types(*, in_stream: bool | None = None) -> st.SearchStrategy[Type]:
    return st.builds(Type, _sub_xids(in_stream), _oids, identifiers(), identifiers())


def inserts(*, in_stream: bool | None = None) -> st.SearchStrategy[Insert]:
    return st.builds(Insert, _sub_xids(in_stream), _oids, tuple_datas())


def updates(*, in_stream: bool | None = None) -> st.SearchStrategy[Update]:
    new = tuple_datas(kinds="ntub")
    without_old = st.builds(Update, _sub_xids(in_stream), _oids, st.none(), st.none(), new)
    with_old = st.builds(Update, _sub_xids(in_stream), _oids, st.sampled_from("KO"), tuple_datas(), new)
    return without_old | with_old


def deletes(*, in_stream: bool | None = None) -> st.SearchStrategy[Delete]:
    return st.builds(Delete, _sub_xids(in_stream), _oids, st.sampled_from("KO"), tuple_datas())


def truncates(*, in_stream: bool | None = None) -> st.SearchStrategy[Truncate]:
    return st.builds(
        Truncate, _sub_xids(in_stream), st.integers(0, 3), st.lists(_oids, max_size=6).map(tuple)
    )


def messages(*, in_stream: bool | None = None) -> st.SearchStrategy[Message]:
    """``pg_logical_emit_message`` payloads (only sent to clients that ask for ``messages 'true'``)."""
    return st.builds(
        Message, _sub_xids(in_stream), st.sampled_from((0, 1)), lsns(), identifiers(), st.binary(max_size=64)
    )


def stream_starts() -> st.SearchStrategy[StreamStart]:
    return st.builds(StreamStart, xids(), st.booleans())


def stream_stops() -> st.SearchStrategy[StreamStop]:
    return st.just(StreamStop())


def stream_commits() -> st.SearchStrategy[StreamCommit]:
    return st.builds(StreamCommit, xids(), st.just(0), lsns(), lsns(), timestamps())


def stream_aborts() -> st.SearchStrategy[StreamAbort]:
    """Both layouts: without abort info (streaming 'on') and with it (streaming 'parallel')."""
    plain = st.builds(StreamAbort, xids(), xids())
    parallel = st.builds(StreamAbort, xids(), xids(), lsns(), timestamps())
    return plain | parallel


def begin_prepares() -> st.SearchStrategy[BeginPrepare]:
    return st.builds(
        BeginPrepare,
        lsns(allow_zero=False),
        lsns(allow_zero=False),
        timestamps(),
        xids(allow_zero=True),
        _gids,
    )


def prepares() -> st.SearchStrategy[Prepare]:
    return st.builds(
        Prepare,
        st.just(0),
        lsns(allow_zero=False),
        lsns(allow_zero=False),
        timestamps(),
        xids(),
        _gids,
    )


def commit_prepareds() -> st.SearchStrategy[CommitPrepared]:
    return st.builds(
        CommitPrepared,
        st.just(0),
        lsns(allow_zero=False),
        lsns(allow_zero=False),
        timestamps(),
        xids(allow_zero=True),
        _gids,
    )


def rollback_prepareds() -> st.SearchStrategy[RollbackPrepared]:
    return st.builds(
        RollbackPrepared,
        st.just(0),
        lsns(allow_zero=False),
        lsns(allow_zero=False),
        timestamps(),
        timestamps(),
        xids(allow_zero=True),
        _gids,
    )


def stream_prepares() -> st.SearchStrategy[StreamPrepare]:
    return st.builds(
        StreamPrepare,
        st.just(0),
        lsns(allow_zero=False),
        lsns(allow_zero=False),
        timestamps(),
        xids(),
        _gids,
    )


def logical_messages(*, in_stream: bool | None = None) -> st.SearchStrategy[LogicalMessage]:
    """Any pgoutput message. ``in_stream`` applies to the streamable types (see the module docstring); the
    others decode the same either way, so ``decode_message(b, in_stream=in_stream)`` works for every draw when
    ``in_stream`` is a bool, and ``in_stream=in_stream_for(msg)`` always."""
    return st.one_of(
        begins(),
        commits(),
        origins(),
        relations(in_stream=in_stream),
        types(in_stream=in_stream),
        inserts(in_stream=in_stream),
        updates(in_stream=in_stream),
        deletes(in_stream=in_stream),
        truncates(in_stream=in_stream),
        messages(in_stream=in_stream),
        stream_starts(),
        stream_stops(),
        stream_commits(),
        stream_aborts(),
        begin_prepares(),
        prepares(),
        commit_prepareds(),
        rollback_prepareds(),
        stream_prepares(),
    )


# --- the streaming-replication envelope --------------------------------------------------------------------------


def _encoded_payloads() -> st.SearchStrategy[bytes]:
    return logical_messages(in_stream=False).map(encode_message)


def xlog_datas(payloads: st.SearchStrategy[bytes] | None = None) -> st.SearchStrategy[XLogData]:
    """XLogData envelopes; by default each carries one encoded (out-of-stream) logical message.

    Custom ``payloads`` must be non-empty: an XLogData without a message is rejected by the decoder."""
    return st.builds(
        XLogData, lsns(), lsns(), timestamps(), _encoded_payloads() if payloads is None else payloads
    )


def keepalives() -> st.SearchStrategy[PrimaryKeepalive]:
    return st.builds(PrimaryKeepalive, lsns(), timestamps(), st.booleans())


def standby_status_updates() -> st.SearchStrategy[StandbyStatusUpdate]:
    return st.builds(StandbyStatusUpdate, lsns(), lsns(), lsns(), timestamps(), st.booleans())


def envelope_messages() -> st.SearchStrategy[XLogData | PrimaryKeepalive | StandbyStatusUpdate]:
    return st.one_of(xlog_datas(), keepalives(), standby_status_updates())
