"""The project's exception hierarchy.

Every error a user can meet says what is wrong and, where there is one, what to do; callers catch
``ApplierError`` to tell our own failures from bugs.
"""

from __future__ import annotations


class ApplierError(Exception):
    """Base class of every error this project raises on purpose."""


class ProtocolError(ApplierError):
    """The publisher sent something the protocol does not allow (PostgreSQL's PROTOCOL_VIOLATION)."""


class DecodeError(ProtocolError):
    """Malformed or truncated bytes. Names the message type and the byte offset where decoding failed."""

    def __init__(self, msg_type: str, offset: int, reason: str) -> None:
        self.msg_type = msg_type
        self.offset = offset
        self.reason = reason
        super().__init__(f"malformed {msg_type} message at byte {offset}: {reason}")
