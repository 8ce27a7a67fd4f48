"""Which route the next message(s) of a batch take to the apply core: the one place that chooses.

The apply loop (:mod:`applier.apply.loop`) reads XLogData undecoded, a batch at a time, and asks :func:`plan` where
message ``i`` goes, and how far the same route reaches:

* ``BULK`` — a Begin that starts whole plain transactions which may be applied a batch at a time
  (:mod:`applier.apply.bulk`, ``Applier.apply_bulk``); the core says how far it got, and when it applied nothing
  the loop takes the Begin as ``ONE``;
* ``SPOOL`` — a run of changes inside a stream chunk, spooled with one write (``Applier.spool_batch``);
* ``COPY_LANE`` — a run of at least :data:`VECTOR_MIN` Inserts while a COPY is open for their table, converted into
  COPY text at once (:mod:`applier.apply.copytext`, ``Applier.handle_insert_run``);
* ``ONE`` — each message alone, as ``apply_dispatch`` would (worker.c): a stretch of them, up to the next message
  that may take another route (a Begin when bulk apply is possible, an Insert that starts a run long enough for the
  COPY lane, a Stream Start), so that the planner is asked once per stretch rather than once per message.

The planner is pure: it looks at the batch's message type bytes (``kinds``) and at the few facts of the core's state
the loop hands it (in a stream, spooling one, and, only asked when the kind makes them matter, whether bulk apply is
ready and whether a COPY lane is open). It does no I/O and changes nothing, so it is tested on its own
(tests/unit/test_route.py) and the loop stays a loop.
"""

from __future__ import annotations

import enum
import operator
import re
from collections.abc import Callable, Sequence

from applier.apply.handlers import VECTOR_MIN
from applier.messages import (
    BEGIN_PREPARE_TYPE,
    BEGIN_TYPE,
    INSERT_TYPE,
    SPOOLED_TYPES,
    STREAM_START_TYPE,
    XLOG_ENVELOPE,
)

#: per message type byte: 1 for the changes a stream chunk spools
_SPOOLED = bytes(1 if t in SPOOLED_TYPES else 0 for t in range(256))
#: over a batch's type bytes: where a run of spooled changes ends
_NOT_SPOOLED = re.compile(b"[^" + b"".join(re.escape(bytes([t])) for t in sorted(SPOOLED_TYPES)) + b"]")
#: over a batch's type bytes: where a run of Inserts ends
_NOT_INSERT = re.compile(b"[^" + re.escape(bytes([INSERT_TYPE])) + b"]")
#: outside a stream, where a stretch of messages that go one by one ends: at the next message that may take another
#: route (a Begin, when bulk apply is possible; the first Insert of a run long enough for the COPY lane), or that
#: starts a stream (the routes differ inside one). The state of the core that the routes depend on matters only there.
_B, _I, _S = (re.escape(bytes([t])) for t in (BEGIN_TYPE, INSERT_TYPE, STREAM_START_TYPE))
_REPLAN_BULK = re.compile(b"%s|%s|%s{%d}" % (_B, _S, _I, VECTOR_MIN))
_REPLAN = re.compile(b"%s|%s{%d}" % (_S, _I, VECTOR_MIN))
_TYPE_BYTE = operator.itemgetter(XLOG_ENVELOPE)


class Route(enum.Enum):
    ONE = "one message"
    BULK = "bulk"
    SPOOL = "spool"
    COPY_LANE = "COPY lane"


def kinds_of(messages: Sequence[bytes]) -> bytes:
    """The pgoutput type byte of each XLogData read undecoded (envelope included), gathered at C speed."""
    return bytes(map(_TYPE_BYTE, messages))


#: Bulk apply is tried on a read batch only when it holds at least this many transactions (bulk.MIN_TRANSACTIONS,
#: 8, still bounds each bulk run within it). Planning a run costs a fixed 1.5-2 ms of small-array numpy work per
#: table and column whatever its length: on tpcb-like transactions (four tables, 17 columns) a batch of 10 cost
#: 230 µs of CPU per transaction in bulk against 80 one by one, 32: 98 against 72, 64: 69 against 62, 100: 41
#: against 61 (docs/performance.md). Under a live load a round reads a few transactions, and a worker that fell a
#: little behind reads tens: there bulk apply tripled the CPU per transaction, and so fell further behind. Where
#: the break-even lies depends on the tables: 100 would suit tpcb-like transactions, but apply_bench's backlog of
#: small update+insert transactions then fell to 0.68-0.84 of native in single runs (0.92-1.17 before; its reads
#: presumably come in batches of tens where the walsender is the slower side); at 32 it kept its spread (0.81-1.12).
BULK_WORTHWHILE = 32


def bulk_worthwhile(kinds: bytes, min_transactions: int = BULK_WORTHWHILE) -> bool:
    """Whether a batch holds enough whole transactions for bulk apply to be tried on it at all
    (:data:`BULK_WORTHWHILE`)."""
    return len(kinds) >= 3 * min_transactions and kinds.count(BEGIN_TYPE) >= min_transactions


def has_prepares(kinds: bytes) -> bool:
    """Whether a batch of several messages holds a BEGIN PREPARE (its records may be batched, its decision folded)."""
    return len(kinds) > 1 and BEGIN_PREPARE_TYPE in kinds


def _run_end(pattern: re.Pattern[bytes], kinds: bytes, i: int) -> int:
    end = pattern.search(kinds, i + 1)
    return len(kinds) if end is None else end.start()


def plan(
    kinds: bytes,
    i: int,
    in_stream: bool,
    spooling: bool,
    bulk_ready: Callable[[], bool] | None,
    copy_lane: Callable[[], object | None],
) -> tuple[Route, int]:
    """The route of message ``i`` of a batch whose type bytes are ``kinds``, and the index after the last message
    that takes it with it (for ``BULK`` the core decides how far it gets: ``i + 1`` is returned; ``ONE`` may cover
    several messages, each to go alone, up to the next one that may need another route).

    ``in_stream``: between Stream Start and Stream Stop; ``spooling``: a stream chunk is open in the core;
    ``bulk_ready``: ``None`` when bulk apply is off or not worth it for this batch, else asked only at a Begin;
    ``copy_lane``: ``Applier.copy_lane`` (not ``None`` while a COPY takes the Inserts), asked only at an Insert
    outside a stream."""
    kind = kinds[i]
    if in_stream:
        if spooling and _SPOOLED[kind]:
            return Route.SPOOL, _run_end(_NOT_SPOOLED, kinds, i)
        return Route.ONE, i + 1
    if kind == BEGIN_TYPE and bulk_ready is not None and bulk_ready():
        return Route.BULK, i + 1
    last = i  # of the stretch, at least
    if kind == INSERT_TYPE:
        end = _run_end(_NOT_INSERT, kinds, i)
        if copy_lane() is not None:
            if end - i >= VECTOR_MIN:
                return Route.COPY_LANE, end
        else:  # the next VECTOR_MIN go one by one (a COPY that opens meanwhile takes them so), then ask again
            last = min(i + VECTOR_MIN, end) - 1
    elif kind == STREAM_START_TYPE:
        return Route.ONE, i + 1  # alone: the routes differ inside a stream
    return Route.ONE, _run_end(_REPLAN if bulk_ready is None else _REPLAN_BULK, kinds, last)
