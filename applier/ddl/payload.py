"""The capture's message: one per DDL command the source ran inside the selection, as the source's event trigger
emits it with ``pg_logical_emit_message(true, PREFIX, payload)`` (transactional: it is decoded inside its
transaction, at its place among the row changes, prepared and streamed transactions included).

The payload is a JSON object (version 1)::

    {"v": 1,
     "slot": "<the consumer's slot name>",      # several consumers of one database each have their own capture
     "tag": "ALTER TABLE",                       # TG_TAG of ddl_command_end
     "n": 2,                                     # the n-th ddl_command_end since the client's statement started
     "ts": "2026-12-06 10:00:00.123456+00",      # statement_timestamp(): one per client message
     "query": "ALTER TABLE ...; ...",            # current_query(): the client's whole string
     "search_path": "\"$user\", public",         # the session's search_path when the command ran
     "objects": [{"type": "table", "schema": "public", "identity": "public.t",
                  "table": "public.t",           # the table the object belongs to (itself, a column's, an index's)
                  "dropped": false}, ...]}       # dropped: from pg_event_trigger_dropped_objects()

The message is signed: its content is the hex SHA-256 of ``key || sha256(key || json)`` (64 bytes) followed by the
JSON. Any role of the source database may call ``pg_logical_emit_message`` with our prefix (PostgreSQL grants it to
PUBLIC), and what the apply replays runs on the target as the apply role: only the capture's function knows the
key (a sequence only its owner reads, applier.ddl.capture), and the consumer reads it over its own streaming
connection. Nested hashing, as HMAC does, so that no suffix can be added to a signed message.

Pure: bytes in, values out; a payload that is not this is a :class:`DdlPayloadError` naming what is wrong (never a
KeyError from deep inside the apply).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

__all__ = [
    "PREFIX",
    "VERSION",
    "DdlEvent",
    "DdlObject",
    "DdlPayloadError",
    "decode_payload",
    "encode_payload",
]

#: The logical message prefix of every capture (the slot in the payload tells consumers apart).
PREFIX = "applier.ddl"
VERSION = 1


class DdlPayloadError(ValueError):
    """A message under :data:`PREFIX` that is not a capture payload this version reads."""


@dataclass(frozen=True, slots=True)
class DdlObject:
    type: str
    schema: str | None
    identity: str
    table: str | None = None
    dropped: bool = False


@dataclass(frozen=True, slots=True)
class DdlEvent:
    slot: str
    tag: str
    n: int
    ts: str
    query: str
    search_path: str
    objects: tuple[DdlObject, ...] = ()

    @property
    def statement_key(self) -> tuple[str, str]:
        """The client message this command came from: its timestamp and text (two messages of one text in one
        transaction have two timestamps)."""
        return (self.ts, self.query)

    @property
    def tables(self) -> frozenset[str]:
        """The tables the command touched (created, altered or dropped), as the source printed their identity."""
        return frozenset(o.table for o in self.objects if o.table is not None)

    @property
    def created_tables(self) -> tuple[str, ...]:
        return tuple(
            o.identity for o in self.objects if o.type == "table" and not o.dropped and self.tag in _CREATES
        )

    @property
    def dropped_tables(self) -> tuple[str, ...]:
        return tuple(o.identity for o in self.objects if o.type == "table" and o.dropped)


#: Command tags that create a table (its rows then arrive through the stream, or it is copied when it has some).
_CREATES = frozenset({"CREATE TABLE", "CREATE TABLE AS", "SELECT INTO"})


def _str(obj: dict[str, object], key: str, *, optional: bool = False) -> str | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise DdlPayloadError(f"DDL capture payload: {key!r} is {type(value).__name__}, not a string")
    return value


def _object(raw: object) -> DdlObject:
    if not isinstance(raw, dict):
        raise DdlPayloadError(f"DDL capture payload: an object is {type(raw).__name__}, not an object")
    return DdlObject(
        type=_str(raw, "type") or "",
        schema=_str(raw, "schema", optional=True),
        identity=_str(raw, "identity") or "",
        table=_str(raw, "table", optional=True),
        dropped=bool(raw.get("dropped", False)),
    )


def decode_payload(content: bytes) -> DdlEvent:
    """The event of one capture message; :class:`DdlPayloadError` when ``content`` is not one."""
    try:
        raw = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DdlPayloadError(f"DDL capture payload is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise DdlPayloadError("DDL capture payload is not a JSON object")
    if raw.get("v") != VERSION:
        raise DdlPayloadError(
            f"DDL capture payload version {raw.get('v')!r}; this applier reads version {VERSION}"
        )
    n = raw.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DdlPayloadError(f"DDL capture payload: 'n' is {n!r}, not a positive integer")
    objects = raw.get("objects", [])
    if not isinstance(objects, list):
        raise DdlPayloadError("DDL capture payload: 'objects' is not a list")
    return DdlEvent(
        slot=_str(raw, "slot") or "",
        tag=_str(raw, "tag") or "",
        n=n,
        ts=_str(raw, "ts") or "",
        query=_str(raw, "query") or "",
        search_path=_str(raw, "search_path") or "",
        objects=tuple(_object(o) for o in objects),
    )


def encode_payload(event: DdlEvent) -> bytes:
    """The bytes the source's capture emits for ``event`` (tests and the property test's round trip)."""
    objects = [
        {"type": o.type, "schema": o.schema, "identity": o.identity, "table": o.table, "dropped": o.dropped}
        for o in event.objects
    ]
    raw = {
        "v": VERSION, "slot": event.slot, "tag": event.tag, "n": event.n, "ts": event.ts, "query": event.query,
        "search_path": event.search_path, "objects": objects,
    }  # fmt: skip
    return json.dumps(raw).encode("utf-8")


def sign(key: bytes, body: bytes) -> bytes:
    """The content of a signed message (what the capture's function emits)."""
    inner = hashlib.sha256(key + body).digest()
    return hashlib.sha256(key + inner).hexdigest().encode() + body


def verified(key: bytes, content: bytes) -> bytes:
    """The JSON of a signed message; :class:`DdlPayloadError` when its signature is not ``key``'s (a message any
    role of the source could have emitted)."""
    if len(content) < 64 or not hmac.compare_digest(sign(key, content[64:])[:64], content[:64]):
        raise DdlPayloadError("DDL capture message with a wrong signature (not emitted by the capture)")
    return content[64:]
