"""LSN and timestamp conversions shared by the codec, the catalog and the command line.

PostgreSQL prints LSNs as two hex halves (``16/B374D848``) and sends them on the wire as uint64; its timestamps
are int64 microseconds since 2000-01-01 UTC. Keeping the wire integers untouched everywhere and converting only at
the edges means a message round-trips bit-exactly.
"""

from __future__ import annotations

import datetime as _dt
import re

INVALID_LSN = 0
MAX_LSN = (1 << 64) - 1

#: Seconds between the Unix epoch and PostgreSQL's epoch (2000-01-01 UTC).
PG_EPOCH = _dt.datetime(2000, 1, 1, tzinfo=_dt.UTC)
_PG_EPOCH_UNIX_US = 946_684_800_000_000

_LSN_RE = re.compile(r"^\s*([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})\s*$")


def parse_lsn(text: str) -> int:
    """Parse ``X/Y`` into an integer; raise ``ValueError`` naming the bad input."""
    m = _LSN_RE.match(text)
    if m is None:
        raise ValueError(
            f"invalid LSN {text!r}: expected two hexadecimal numbers separated by '/', e.g. 0/16B3748"
        )
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


def format_lsn(lsn: int) -> str:
    """Format like PostgreSQL's ``%X/%X`` (no zero padding), so values compare equal to pg_lsn text output."""
    if not 0 <= lsn <= MAX_LSN:
        raise ValueError(f"LSN out of range: {lsn}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def pg_timestamp_to_datetime(us: int) -> _dt.datetime:
    """Wire timestamp (µs since 2000-01-01 UTC) to an aware datetime."""
    return PG_EPOCH + _dt.timedelta(microseconds=us)


def datetime_to_pg_timestamp(value: _dt.datetime) -> int:
    if value.tzinfo is None:
        raise ValueError("naive datetime: PostgreSQL wire timestamps are UTC, pass an aware datetime")
    delta = value - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def now_pg_timestamp() -> int:
    """The current time as a wire timestamp (for standby status updates)."""
    import time

    return time.time_ns() // 1000 - _PG_EPOCH_UNIX_US
