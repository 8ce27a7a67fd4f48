"""The I/O edge to the publisher's walsender: one ``replication=database`` connection with psycopg 3.

psycopg has no replication API (behaviour 112), but since 3.3 ``START_REPLICATION`` leaves the connection in
COPY_BOTH and the CopyData stream can be driven through the libpq wrapper (``conn.pgconn``): ``get_copy_data``
(asynchronous mode, so we decide when to wait), ``consume_input``, ``put_copy_data`` and ``flush``. We wait on the
socket with a selector, never in a busy loop.

This module is deliberately thin: it speaks the walsender's commands (IDENTIFY_SYSTEM, CREATE/DROP_REPLICATION_SLOT,
START_REPLICATION) and the CopyData framing through the codec's :func:`~applier.decoder.decode_envelope` and
:func:`~applier.encoder.encode_envelope`. What to do with the messages is the apply loop's business.

Errors never carry a password: connection strings are scrubbed before they appear in any message, and libpq's
own messages are scrubbed of the password's text as well (a malformed conninfo makes libpq quote pieces of it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import select
import selectors
import socket
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from applier.conninfo import scrub
from applier.decoder import decode_envelope
from applier.encoder import encode_envelope
from applier.errors import ApplierError
from applier.lsn import format_lsn, now_pg_timestamp, parse_lsn
from applier.messages import XLOG_DATA_KIND, XLOG_ENVELOPE, PrimaryKeepalive, StandbyStatusUpdate, XLogData

__all__ = [
    "REPLICATION_SESSION_OPTIONS",
    "ReplicationConnection",
    "ReplicationConnectionError",
    "SlotInfo",
    "StreamEnded",
    "StreamOptions",
    "SystemInfo",
    "WaitingPeer",
    "protocol_version_for",
    "receive_buffer_for",
    "receive_buffer_setting",
    "scrub_conninfo",
    "start_replication_command",
]

#: The walsender's text output of dates, intervals and floats depends on these GUCs; the native worker sets exactly
#: these so that every value is unambiguous and lossless (behaviour 1).
REPLICATION_SESSION_OPTIONS = "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3"

#: what read() passes to read_undecoded: no message type is taken undecoded, so it returns the first one decoded
_NO_TYPES = bytes(256)
_NOTHING: list[bytes] = []
#: read_undecoded stops gathering at this many bytes, so what is handled together stays a few MB of arrays
UNDECODED_MAX_BYTES = 1 << 20
#: read_undecoded gathers an XLogData only when it holds at least a 5-byte message after its envelope
_MIN_UNDECODED = XLOG_ENVELOPE + 5
#: The receive buffer of a replication socket whose publisher is on this host (``APPLIER_RECEIVE_BUFFER`` sets
#: another, for any TCP publisher; ``0`` leaves the kernel's autotuning). Why: the walsender sends every message
#: with its own ``send()``, and a send into an open TCP window costs it the whole loopback round (about 1.3 µs
#: more per message, measured) while one into a closed window only queues. Autotuning grows the window to
#: megabytes, which stays open whenever the worker keeps up; 32 kB closes it, so the walsender's output queues and
#: goes out in large segments. On loopback a window that small costs no throughput (the round trip is microseconds);
#: across a network it would (window / round trip), so it is not applied there.
LOOPBACK_RECEIVE_BUFFER = 32 << 10
#: how long :meth:`ReplicationConnection.read` waits for the publisher alone before it serves its peer (the
#: target's pipeline) as well: longer than a busy stream's gaps, short beside the 0.2-1 s waits of a quiet one
PEER_GRACE = 0.01
_COPY_BOTH = pq.ExecStatus.COPY_BOTH
_COPY_IN = pq.ExecStatus.COPY_IN
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR


class ReplicationConnectionError(ApplierError):
    """The replication connection failed or dropped; reconnecting (with backoff) is the usual answer.

    ``sqlstate`` is the server's error code when the server sent one.
    """

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StreamEnded(ReplicationConnectionError):
    """The publisher ended the COPY stream: a CopyDone (e.g. the walsender shutting down) or an error it sent
    (e.g. ``pg_terminate_backend``). The native worker logs "data stream from publisher has ended" and exits to be
    restarted (behaviour 10); the connection is not usable for streaming any more.

    A subclass of :class:`ReplicationConnectionError` because the answer is the same: reconnect and resume.
    """


@dataclass(frozen=True, slots=True)
class SystemInfo:
    """The row IDENTIFY_SYSTEM returns; ``xlogpos`` is the publisher's current flush position."""

    systemid: str
    timeline: int
    xlogpos: int
    dbname: str | None


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """The row CREATE_REPLICATION_SLOT returns. ``snapshot_name`` is set only with ``snapshot="export"``."""

    slot_name: str
    consistent_point: int
    snapshot_name: str | None
    output_plugin: str


Streaming = Literal["off", "on", "parallel"]


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What the subscription asks pgoutput for; :func:`start_replication_command` decides what is actually sent
    to a publisher of a given version (behaviour 4).

    ``proto_version=None`` picks the highest version the publisher speaks, as the native worker does; ``origin=None``
    sends no origin option at all.
    """

    publications: list[str] | tuple[str, ...]
    proto_version: int | None = None
    streaming: Streaming = "off"
    two_phase: bool = False
    origin: Literal["any", "none"] | None = None
    binary: bool = False
    messages: bool = False  # the DDL capture's logical messages (applier.ddl; a subscription with ddl on)

    def __post_init__(self) -> None:
        if isinstance(self.publications, str):
            raise TypeError("publications must be a list of names, not a single string")
        if not self.publications:
            raise ValueError("at least one publication is needed to start replication")
        if self.streaming not in ("off", "on", "parallel"):
            raise ValueError(f"streaming must be 'off', 'on' or 'parallel', not {self.streaming!r}")
        if self.origin not in (None, "any", "none"):
            raise ValueError(f"origin must be 'any' or 'none', not {self.origin!r}")


# --- pure command building -------------------------------------------------------------------------------------

#: What a publisher's pgoutput and walsender offer, by ``server_version_num``: the one place these versions live
#: (applier.subscriptions refuses options by them, applier.migrate decides two-phase by them).
STREAMING_VERSION = 140000  # protocol 2: streamed transactions; binary values
TWO_PHASE_VERSION = 150000  # protocol 3: prepared transactions decoded; CREATE_REPLICATION_SLOT's option list
ORIGIN_VERSION = 160000  # protocol 4: the origin filter; parallel streaming
FAILOVER_VERSION = 170000  # failover slots, synchronized to standbys


def protocol_version_for(server_version: int) -> int:
    """The pgoutput protocol version the native worker asks a publisher of ``server_version`` for: 4 (PG16+:
    parallel-apply abort info), 3 (PG15: two-phase), 2 (PG14: streaming), else 1. — ``set_stream_options``."""
    if server_version >= ORIGIN_VERSION:
        return 4
    if server_version >= TWO_PHASE_VERSION:
        return 3
    if server_version >= STREAMING_VERSION:
        return 2
    return 1


def _quote_ident(name: str) -> str:
    """Always-quoted identifier, as ``PQescapeIdentifier`` writes it (doubling any ``"``)."""
    return '"' + name.replace('"', '""') + '"'


def _quote_repl_literal(value: str) -> str:
    """A single-quoted literal for the replication-command grammar.

    The walsender's scanner (``repl_scanner.l``) knows only ``''`` as an escape inside quotes: no ``E''`` strings and
    no backslash escapes. So doubling single quotes is the whole job; backslashes are taken literally.
    """
    return "'" + value.replace("'", "''") + "'"


def start_replication_command(slot: str, start_lsn: int, options: StreamOptions, server_version: int) -> str:
    """The exact START_REPLICATION command the native apply worker sends (behaviour 4).

    ``START_REPLICATION SLOT "<slot>" LOGICAL <X/X> (proto_version '<n>'[, streaming 'on'|'parallel']
    [, two_phase 'on'][, origin 'any'|'none'], publication_names '"p1","p2"'[, binary 'true'])``

    * ``streaming 'parallel'`` only for a publisher ≥ 16 and streaming="parallel"; ``'on'`` for a publisher ≥ 14
      and any streaming other than "off" (so "parallel" degrades to "on" on 14/15).
    * ``two_phase 'on'`` only for a publisher ≥ 15, ``origin`` only ≥ 16, ``binary 'true'`` only ≥ 14.
    * ``messages 'true'`` only when asked (a subscription with ``ddl`` on: the capture's messages, applier.ddl):
      the native worker never asks, and pgoutput has the option from PostgreSQL 14 on.
    * Publication names are each quoted as identifiers, joined with commas, and the result quoted as a literal.
    """
    proto = (
        options.proto_version if options.proto_version is not None else protocol_version_for(server_version)
    )
    parts = [f"proto_version '{proto}'"]
    if server_version >= ORIGIN_VERSION and options.streaming == "parallel":
        parts.append("streaming 'parallel'")
    elif server_version >= STREAMING_VERSION and options.streaming != "off":
        parts.append("streaming 'on'")
    if options.two_phase and server_version >= TWO_PHASE_VERSION:
        parts.append("two_phase 'on'")
    if options.origin is not None and server_version >= ORIGIN_VERSION:
        parts.append(f"origin '{options.origin}'")
    pubnames = ",".join(_quote_ident(p) for p in options.publications)
    parts.append(f"publication_names {_quote_repl_literal(pubnames)}")
    if options.binary and server_version >= STREAMING_VERSION:
        parts.append("binary 'true'")
    if options.messages and server_version >= STREAMING_VERSION:
        parts.append("messages 'true'")
    return f"START_REPLICATION SLOT {_quote_ident(slot)} LOGICAL {format_lsn(start_lsn)} ({', '.join(parts)})"


#: CREATE_REPLICATION_SLOT's snapshot action in the syntax before PostgreSQL 15 (still accepted since)
_OLD_SNAPSHOT_WORDS = {"nothing": "NOEXPORT_SNAPSHOT", "export": "EXPORT_SNAPSHOT", "use": "USE_SNAPSHOT"}


def create_slot_command(
    name: str, temporary: bool, two_phase: bool, snapshot: str, server_version: int, *, failover: bool = False
) -> sql.Composed:
    """CREATE_REPLICATION_SLOT for pgoutput: the parenthesized options of PostgreSQL 15+, or the keywords a 14
    walsender knows (``TWO_PHASE`` there is refused by callers: pgoutput decodes prepares only from 15 on), as
    libpqwalreceiver's ``libpqrcv_create_slot`` chooses by the server's version. ``failover`` (PostgreSQL 17+,
    refused by callers before) lets a standby with ``sync_replication_slots`` keep a copy of the slot."""
    head = sql.SQL("CREATE_REPLICATION_SLOT {name} {temp}LOGICAL pgoutput").format(
        name=sql.Identifier(name), temp=sql.SQL("TEMPORARY " if temporary else "")
    )
    if server_version < TWO_PHASE_VERSION:
        words = (["TWO_PHASE"] if two_phase else []) + [_OLD_SNAPSHOT_WORDS[snapshot]]
        return sql.Composed([head, sql.SQL(" " + " ".join(words))])
    options = [sql.SQL("SNAPSHOT {}").format(sql.Literal(snapshot))]
    if two_phase:
        options.insert(0, sql.SQL("TWO_PHASE true"))
    if failover:
        options.insert(0, sql.SQL("FAILOVER true"))
    return sql.Composed([head, sql.SQL(" ({})").format(sql.SQL(", ").join(options))])


# --- password scrubbing ----------------------------------------------------------------------------------------

_URI_USERINFO = re.compile(r"(://[^:/@\s]*:)([^@\s]*)(@)")


def scrub_conninfo(conninfo: str) -> str:
    """``conninfo`` without its password, fit for messages and the catalog (``subconninfo``).

    Unparsable input is never echoed whole: where the password ends cannot be known, so everything from the
    ``password`` keyword on is cut.
    """
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        cut = _PASSWORD_START.search(conninfo)
        text = conninfo[: cut.start()] + "password=********" if cut else conninfo
        return _URI_USERINFO.sub(r"\1********\3", text)
    params.pop("password", None)
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


_PASSWORD_START = re.compile(r"password\s*=", re.IGNORECASE)
_QUOTED = re.compile(r'"([^"]*)"')


def _scrub_text(text: str, conninfo: str) -> str:
    """``text`` (typically a libpq message) without any password of ``conninfo``."""
    text = scrub(text, conninfo)
    # A malformed conninfo makes libpq quote the fragment it choked on, which may be any piece of a password:
    # hide quoted fragments that occur after the password keyword.
    start = _PASSWORD_START.search(conninfo) or _URI_USERINFO.search(conninfo)
    if start is not None:
        tail = conninfo[start.start() :]
        text = _QUOTED.sub(
            lambda m: m.group(0) if m.group(1) in ("=", "") or m.group(1) not in tail else '"***"', text
        )
    return text


# --- the connection --------------------------------------------------------------------------------------------


def _merge_options(user_options: str | None) -> str:
    """Our session options after the user's, so a user's ``-c`` settings survive but cannot override ours (the
    value formats the apply side depends on); the native worker drops the user's entirely."""
    if user_options and user_options.strip():
        return f"{user_options.strip()} {REPLICATION_SESSION_OPTIONS}"
    return REPLICATION_SESSION_OPTIONS


def receive_buffer_setting(value: str | None) -> int | None:
    """``APPLIER_RECEIVE_BUFFER``: ``None`` when unset (the default rule of :func:`receive_buffer_for`), else a
    size in bytes, ``0`` meaning the kernel's autotuning."""
    if value is None or not value.strip():
        return None
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise ReplicationConnectionError(
            f"APPLIER_RECEIVE_BUFFER must be a number of bytes (0: the kernel's autotuning), not {value!r}"
        )
    return size


def receive_buffer_for(peer: str | None, setting: int | None) -> int | None:
    """The receive buffer to set on a replication socket connected to ``peer`` (an IP address; ``None``: not
    TCP), given :func:`receive_buffer_setting`; ``None``: leave the kernel's (see
    :data:`LOOPBACK_RECEIVE_BUFFER`)."""
    if peer is None:
        return None
    if setting is not None:
        return setting or None
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (an IPv6 socket reaching 127.0.0.1)
    return LOOPBACK_RECEIVE_BUFFER if (mapped or address).is_loopback else None


def _set_receive_buffer(fd: int, setting: int | None) -> None:
    """Apply :func:`receive_buffer_for` to the connected socket ``fd`` (which stays libpq's: this is a dup)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        peer = sock.getpeername()[0] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        size = receive_buffer_for(peer, setting)
        if size is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    finally:
        sock.close()


class WaitingPeer(Protocol):
    """Another connection whose traffic must go on while :meth:`ReplicationConnection.read` waits on the publisher:
    the target session's pipeline (:class:`applier.apply.pipeline.Pipeline`).

    Why: the apply loop blocks in one place only, the wait for the publisher. If the target owes us results (or
    notices: a trigger's ``RAISE NOTICE`` per row) while we wait there, its backend blocks writing to its full
    socket, stops running what we queued, and our own unsent output waits behind it; with a quiet publisher nothing
    ends the wait but its timeout, and each round then moved the target one socket read further (issue 30: a
    subscription stalled for minutes behind a 32 kB NOTICE per row)."""

    def io_wanted(self) -> tuple[int, bool] | None:
        """``(socket, output pending)`` while the peer expects results or has output to write, else ``None``."""
        ...

    def serve(self, readable: bool) -> None:
        """Its socket is ready (``readable``, else writable): write what it can, read and take what arrived."""
        ...


#: The read end of this process's signal wake-up pipe (:func:`set_wakeup_fd`), at most one.
_WAKEUP: list[int] = []


def set_wakeup_fd(fd: int | None) -> None:
    """A descriptor that, once readable, ends an idle wait in :meth:`ReplicationConnection.read` as its timeout
    would: the apply worker's ``signal.set_wakeup_fd`` pipe, so that SIGTERM stops it at once instead of after the
    idle wait (up to a second). A wait that also serves the target's pipeline (:class:`WaitingPeer`) ignores it."""
    _WAKEUP[:] = [] if fd is None else [fd]


def _wait_socket(selector: selectors.BaseSelector, fd: int, timeout: float) -> bool:
    """Wait until the publisher's socket ``fd`` is readable (True) or ``timeout``; with a wake-up descriptor, until
    that one is readable too (drained, False: the apply loop then looks at its stop event)."""
    if not _WAKEUP:
        return bool(selector.select(timeout))
    ready = select.select([fd, _WAKEUP[0]], [], [], timeout)[0]
    if _WAKEUP[0] in ready:
        with contextlib.suppress(OSError):
            os.read(_WAKEUP[0], 512)
        return False
    return bool(ready)


class ReplicationConnection:
    """A logical-replication connection to a publisher (``replication=database``).

    Before :meth:`start_replication` it accepts replication commands and plain SQL (:attr:`connection`); after it,
    only :meth:`read`, :meth:`send_status` and :meth:`close`.
    """

    def __init__(self) -> None:
        self._conn: psycopg.Connection[Any] | None = None
        self._pgconn: Any = None
        self._selector: selectors.BaseSelector | None = None
        self._fd = -1
        self._display: str = ""
        self._streaming = False
        self._ended = False
        #: the last read_undecoded() returned because libpq's buffer and the socket were empty (no limit reached)
        self.ran_dry = False
        #: served while :meth:`read` waits (:class:`WaitingPeer`): set by the apply worker to the target's pipeline
        self.peer: WaitingPeer | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, conninfo: str, *, application_name: str | None = None, client_encoding: str = "UTF8"
    ) -> ReplicationConnection:
        """``ReplicationConnection.open(...)`` is ``ReplicationConnection()`` followed by :meth:`connect`."""
        return cls().connect(conninfo, application_name=application_name, client_encoding=client_encoding)

    def connect(
        self, conninfo: str, *, application_name: str | None = None, client_encoding: str = "UTF8"
    ) -> ReplicationConnection:
        """Connect as the native apply worker does (behaviours 1-2): ``replication=database``, the value-format
        options, ``client_encoding``, and ``application_name`` as a *fallback*, so one set in ``conninfo`` wins.
        A publisher on this host gets a small receive buffer (:data:`LOOPBACK_RECEIVE_BUFFER`).

        Raises :class:`ReplicationConnectionError` with a password-free message.
        """
        if self._conn is not None:
            raise ReplicationConnectionError("already connected")
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ReplicationConnectionError(
                f"invalid publisher connection string: {_scrub_text(str(exc), conninfo)}"
            ) from None
        self._display = scrub_conninfo(conninfo)
        receive_buffer = receive_buffer_setting(os.environ.get("APPLIER_RECEIVE_BUFFER"))
        kwargs: dict[str, Any] = {
            "replication": "database",
            "options": _merge_options(params.get("options")),
            "client_encoding": client_encoding,
        }
        if application_name is not None:
            kwargs["fallback_application_name"] = application_name
        try:
            # autocommit: replication commands cannot run inside a transaction block; prepare_threshold=None:
            # walsenders reject the extended query protocol, and only parameterless (simple) queries are sent.
            conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=None, **kwargs)
        except psycopg.Error as exc:
            raise ReplicationConnectionError(
                f"could not connect to the publisher ({self._display}): {_scrub_text(str(exc), conninfo)}",
                sqlstate=getattr(exc, "sqlstate", None),
            ) from None
        self._conn = conn
        self._pgconn = conn.pgconn
        self._fd = self._pgconn.socket
        _set_receive_buffer(self._fd, receive_buffer)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)
        return self

    def close(self) -> None:
        """Close the connection (idempotent). Safe in any state, including mid-stream."""
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self._conn is not None:
            conn, self._conn, self._pgconn = self._conn, None, None
            conn.close()

    def __enter__(self) -> ReplicationConnection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._conn is None or self._conn.closed

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The underlying psycopg connection, for plain SQL before streaming (e.g. within a ``snapshot="use"``
        transaction). Only parameterless queries work: compose values with :mod:`psycopg.sql` literals."""
        return self._require_conn()

    @property
    def server_version(self) -> int:
        """The publisher's ``server_version_num``, e.g. 180006."""
        return self._require_conn().info.server_version

    @property
    def encoding(self) -> str:
        """The Python codec of the connection's client_encoding: names, GIDs and text values arrive in it, so
        decode with ``MessageDecoder(encoding=rc.encoding)``."""
        return self._require_conn().info.encoding

    @property
    def backend_pid(self) -> int:
        """The walsender's pid (``pg_stat_replication.pid``)."""
        return self._require_conn().info.backend_pid

    def _require_conn(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise ReplicationConnectionError("replication connection is not open")
        return self._conn

    def _command(self, command: str | sql.Composable) -> list[tuple[Any, ...]]:
        """Run one replication command or SQL statement (simple protocol) and return its rows."""
        conn = self._require_conn()
        if self._streaming:
            raise ReplicationConnectionError(
                "the connection is streaming: commands are not possible any more"
            )
        try:
            cur = conn.execute(command)
            return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            text = command if isinstance(command, str) else command.as_string(conn)
            if isinstance(exc, psycopg.OperationalError) and conn.closed:
                raise ReplicationConnectionError(
                    f"publisher connection ({self._display}) lost during {text.split()[0]}: {exc}",
                    sqlstate=exc.sqlstate,
                ) from exc
            raise ReplicationConnectionError(f"{text} failed: {exc}", sqlstate=exc.sqlstate) from exc

    # -- replication commands -----------------------------------------------------------------------------
    def identify_system(self) -> SystemInfo:
        """IDENTIFY_SYSTEM, which the native worker issues right after connecting (behaviour 3)."""
        ((systemid, timeline, xlogpos, dbname),) = self._command("IDENTIFY_SYSTEM")
        return SystemInfo(str(systemid), int(timeline), parse_lsn(xlogpos), dbname)

    def timeline_history(self, timeline: int) -> str:
        """TIMELINE_HISTORY: the text of the publisher's history file of ``timeline`` (2 or later): each earlier
        timeline and the LSN where it ended (:func:`applier.apply.failover.parse_timeline_history`)."""
        ((_filename, content),) = self._command(f"TIMELINE_HISTORY {int(timeline)}")
        return (
            bytes(content).decode("utf-8", "replace")
            if isinstance(content, bytes | memoryview)
            else str(content)
        )

    def slot_confirmed_flush(self, name: str) -> tuple[bool, int | None]:
        """Whether the slot exists, and its ``confirmed_flush_lsn`` (None when it has none)."""
        rows = self._command(
            sql.SQL(
                "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = {}"
            ).format(sql.Literal(name))
        )
        if not rows:
            return False, None
        return True, parse_lsn(rows[0][0]) if rows[0][0] is not None else None

    def create_slot(
        self,
        name: str,
        *,
        temporary: bool = False,
        two_phase: bool = False,
        snapshot: Literal["nothing", "export", "use"] = "nothing",
        failover: bool = False,
    ) -> SlotInfo:
        """CREATE_REPLICATION_SLOT with pgoutput (:func:`create_slot_command`).

        ``snapshot="export"`` returns a snapshot name that other sessions can import (``SET TRANSACTION SNAPSHOT``)
        for as long as this connection stays open and runs no further command (behaviour 117). ``snapshot="use"``
        makes the snapshot this connection's own: we open the read-only REPEATABLE READ transaction it needs, and the caller
        queries through :attr:`connection` and ends it with ``COMMIT`` before streaming.

        Creating a slot waits for every transaction running on the publisher to finish, prepared ones included.
        """
        if snapshot not in ("nothing", "export", "use"):
            raise ValueError(f"snapshot must be 'nothing', 'export' or 'use', not {snapshot!r}")
        conn = self._require_conn()
        if snapshot == "use" and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            self._command("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        command = create_slot_command(
            name, temporary, two_phase, snapshot, conn.info.server_version, failover=failover
        )
        ((slot_name, consistent_point, snapshot_name, plugin),) = self._command(command)
        return SlotInfo(slot_name, parse_lsn(consistent_point), snapshot_name, plugin)

    def drop_slot(self, name: str, *, wait: bool = True) -> None:
        """DROP_REPLICATION_SLOT; ``wait`` waits for an active walsender to release it instead of failing."""
        self._command(
            sql.SQL("DROP_REPLICATION_SLOT {}{}").format(
                sql.Identifier(name), sql.SQL(" WAIT" if wait else "")
            )
        )

    def slot_exists(self, name: str) -> bool:
        """Whether a slot of that name exists on the publisher (an SQL query: database walsenders accept SQL)."""
        rows = self._command(
            sql.SQL("SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = {}").format(
                sql.Literal(name)
            )
        )
        return bool(rows)

    # -- streaming ------------------------------------------------------------------------------------------
    def start_replication(self, slot: str, start_lsn: int, options: StreamOptions) -> None:
        """Send START_REPLICATION (behaviour 4) and enter COPY_BOTH. The publisher resumes at
        max(``start_lsn``, the slot's confirmed_flush_lsn) (behaviour 5)."""
        conn = self._require_conn()
        command = start_replication_command(slot, start_lsn, options, self.server_version)
        self._command(command)
        if conn.pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
            raise ReplicationConnectionError(f"{command} did not start a COPY stream")
        self._streaming = True

    @property
    def streaming(self) -> bool:
        return self._streaming

    def read(self, timeout: float) -> XLogData | PrimaryKeepalive | None:
        """The next XLogData or keepalive, or ``None`` if nothing arrived within ``timeout`` seconds.

        Whatever libpq has already buffered is returned without touching the socket, so a burst is drained at
        the cost of one ``get_copy_data`` and one ``decode_envelope`` per message; the socket is waited on only
        when the buffer is empty. Unknown CopyData types are skipped (behaviour 6).

        Raises :class:`StreamEnded` when the publisher ends the COPY (CopyDone or an error it sent) and
        :class:`ReplicationConnectionError` when the connection drops.
        """
        pgconn = self._pgconn
        if pgconn is None or not self._streaming:
            raise ReplicationConnectionError("read() needs a started stream (call start_replication first)")
        if self._ended:
            raise StreamEnded("the replication stream has already ended")
        deadline, grace = -1.0, PEER_GRACE
        while True:
            msg = self.read_undecoded(_NOTHING, 1, _NO_TYPES)  # the first buffered message, decoded
            if msg is not None:
                return msg
            # Nothing buffered: wait for the socket, then read whatever arrived into libpq's buffer.
            now = time.monotonic()
            if deadline < 0:
                deadline = now + max(timeout, 0.0)
            remaining = deadline - now
            wanted = self.peer.io_wanted() if self.peer is not None and remaining > 0 else None
            if wanted is not None:
                if not self._wait_with_peer(remaining, grace, *wanted):
                    grace = 0.0
                    continue  # the peer was served (or the wait timed out: the next turn sees that)
            elif remaining <= 0:
                if not select.select([self._fd], [], [], 0)[0]:
                    return None
            elif not _wait_socket(self._selector, self._fd, remaining):  # type: ignore[arg-type]
                return None
            self._consume_input()

    def _wait_with_peer(self, timeout: float, grace: float, fd: int, writing: bool) -> bool:
        """Wait for the publisher's socket and :attr:`peer`'s (for reading, and for writing while it has output);
        serve the peer when its socket is ready. True when the publisher's socket is readable.

        The publisher alone first, for ``grace`` seconds: under a load its next message comes sooner, and the
        target's answers are read by the round's poll as they always were, so a busy loop makes no system call
        more than before. Only a wait that lasts longer watches both, with one ``select``."""
        if grace > 0:
            if self._selector.select(min(grace, timeout)):  # type: ignore[union-attr]
                return True
            if timeout <= grace:
                return False
            timeout -= grace
        readable, writable, _ = select.select([self._fd, fd], [fd] if writing else [], [], timeout)
        if fd in readable or writable:
            self.peer.serve(fd in readable)  # type: ignore[union-attr]
        return self._fd in readable

    def read_undecoded(
        self, into: list[bytes], limit: int, wanted: bytes, *, refill: bool = False
    ) -> XLogData | PrimaryKeepalive | None:
        """Drain libpq's buffer without decoding the messages the caller handles in bulk: every XLogData whose
        message type byte ``t`` has ``wanted[t]`` set (and that is at least 5 bytes long) is appended to ``into``
        as ``bytes``, envelope included, until ``limit`` of them, or :data:`UNDECODED_MAX_BYTES`, are there; the
        first other message is decoded and returned (it comes after everything in ``into``, in stream order).
        ``None``: the buffer is empty (:attr:`ran_dry`) or a limit was reached. Never waits on the socket (:meth:`read` does
        that); with ``refill``, an empty buffer is refilled from the socket as long as the socket has data right
        now (so a backlog comes in batches of up to the limits, not of one socket read, about 16 kB)."""
        pgconn = self._pgconn
        if pgconn is None or not self._streaming or self._ended:
            raise ReplicationConnectionError("read_undecoded() needs a started stream")
        get = pgconn.get_copy_data  # (an XLogData the caller wants goes into `into` undecoded)
        append = into.append
        size = 0
        while len(into) < limit and size < UNDECODED_MAX_BYTES:
            try:
                nbytes, data = get(1)
            except psycopg.OperationalError as exc:
                raise self._lost(exc) from None
            if nbytes >= _MIN_UNDECODED and data[0] == XLOG_DATA_KIND and wanted[data[XLOG_ENVELOPE]]:
                append(bytes(data))  # (frees libpq's buffer at once: holding thousands of them costs more)
                size += nbytes
                continue
            if nbytes > 0:
                msg = decode_envelope(data)
                if msg is not None and msg.__class__ is not StandbyStatusUpdate:
                    return msg
                continue
            if nbytes < 0:
                self._end_of_copy()
            if not refill or not select.select([self._fd], [], [], 0)[0]:
                self.ran_dry = True
                return None
            self._consume_input()
        self.ran_dry = False
        return None

    def _consume_input(self) -> None:
        """Read what the socket holds into libpq's buffer (the caller saw it readable)."""
        try:
            self._pgconn.consume_input()  # type: ignore[union-attr]
        except psycopg.OperationalError as exc:
            self._drain_after_failure()
            raise self._lost(exc) from None

    def send_status(
        self, write_lsn: int, flush_lsn: int, apply_lsn: int, *, reply_requested: bool = False
    ) -> None:
        """Send a standby status update ('r'). Mind the worker's mapping (behaviour 7): *write* carries the last
        received LSN, *flush* the last durably applied one, *apply* the end of the last applied transaction."""
        pgconn = self._pgconn
        if pgconn is None or not self._streaming:
            raise ReplicationConnectionError("send_status() needs a started stream")
        payload = encode_envelope(
            StandbyStatusUpdate(write_lsn, flush_lsn, apply_lsn, now_pg_timestamp(), reply_requested)
        )
        try:
            while pgconn.put_copy_data(payload) == 0:  # nonblocking libpq: its output buffer is full
                self._wait_writable()
            while pgconn.flush() == 1:
                self._wait_writable()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def _wait_writable(self) -> None:
        select.select([], [self._fd], [], 1.0)
        # Reading while waiting to write: a walsender blocked on its own full send buffer would deadlock us.
        self._pgconn.consume_input()

    def _end_of_copy(self) -> None:
        """``get_copy_data`` returned -1: the server sent CopyDone, or an error ended the COPY. Raise accordingly."""
        pgconn = self._pgconn
        self._ended = True
        result = pgconn.get_result()
        if result is not None and result.status == _FATAL_ERROR:
            message = (result.error_message or b"").decode("utf-8", "replace").strip()
            sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
            raise StreamEnded(
                f"data stream from publisher has ended: {message}",
                sqlstate=sqlstate.decode() if sqlstate else None,
            )
        if result is not None and result.status == _COPY_IN:
            # The walsender sent CopyDone: answer with ours, as the END of streaming.
            try:
                pgconn.put_copy_end()
                pgconn.flush()
            except psycopg.OperationalError:
                pass
            raise StreamEnded("data stream from publisher has ended: the publisher sent CopyDone")
        if result is not None and result.status == _COMMAND_OK:
            # What a walsender does when the server shuts down (WalSndDone), once we confirmed all it sent.
            tag = (result.command_status or b"").decode("ascii", "replace")
            raise StreamEnded(
                f"data stream from publisher has ended: the walsender finished ({tag}); is the publisher "
                "shutting down?"
            )
        status = "no result" if result is None else pq.ExecStatus(result.status).name
        raise StreamEnded(f"data stream from publisher has ended ({status})")

    def _drain_after_failure(self) -> None:
        """consume_input failed: libpq may still hold an error the server sent just before closing."""
        try:
            while True:
                nbytes, _ = self._pgconn.get_copy_data(1)
                if nbytes <= 0:
                    break
        except psycopg.OperationalError:
            return
        if nbytes < 0:
            self._end_of_copy()

    def _lost(self, exc: psycopg.OperationalError) -> ReplicationConnectionError:
        self._ended = True
        detail = str(exc).strip() or (self._pgconn.error_message or b"").decode("utf-8", "replace").strip()
        return ReplicationConnectionError(
            f"replication connection to the publisher ({self._display}) was lost: {detail}"
        )
