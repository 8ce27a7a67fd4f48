"""What the unit tests of the apply core share: two local tables and their publisher relations, row images, table
states, and :func:`make_core`, an :class:`~applier.apply.handlers.Applier` wired to a recording fake target."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from applier.apply.feedback import FeedbackTracker
from applier.apply.handlers import Applier, SkipState, TableStates
from applier.apply.relmap import LocalColumn, LocalTable
from applier.apply.spool import Spool
from applier.encoder import encode_message
from applier.messages import (
    Begin,
    BeginPrepare,
    Commit,
    Insert,
    Prepare,
    Relation,
    RelationColumn,
    StreamStart,
    StreamStop,
    TupleData,
)
from applier.testing.fake_target import FakeTarget
from state.tables import SyncState

#: the local tables of the unit tests: public.t (id key, v) and public.u (id key), oids 1001 and 1002
T = LocalTable(1001, "public", "t", "r", (LocalColumn("id", 23), LocalColumn("v", 25)), ("id",))
U = LocalTable(1002, "public", "u", "r", (LocalColumn("id", 23),), ("id",))
#: their publisher relations (remote relids 1 and 2)
REL_T = Relation(
    None, 1, "public", "t", "d", (RelationColumn(1, "id", 23, -1), RelationColumn(0, "v", 25, -1))
)
REL_U = Relation(None, 2, "public", "u", "d", (RelationColumn(1, "id", 23, -1),))


def row(*values: object) -> TupleData:
    """A text row image; ``None`` is a NULL."""
    return TupleData(
        b"".join(b"n" if v is None else b"t" for v in values),
        tuple(None if v is None else str(v).encode() for v in values),
    )


@dataclass
class FakeTables(TableStates):
    """Table states: every table ready except those in ``not_ready`` (local oid -> the LSN from which it takes
    changes, as a SYNCDONE table's ``relstate_lsn``; 0 = never)."""

    not_ready: dict[int, int] = field(default_factory=dict)
    after: list[int] = field(default_factory=list)
    joins: list[tuple[int, str, SyncState]] = field(default_factory=list)
    two_phase_state: str = "e"

    @property
    def all_ready(self) -> bool:
        return not self.not_ready

    def should_apply(self, local_oid: int, remote_final_lsn: int) -> bool:
        lsn = self.not_ready.get(local_oid)
        return lsn is None or (lsn != 0 and remote_final_lsn > lsn)

    def after_transaction(self, current_lsn: int) -> None:
        self.after.append(current_lsn)

    def joined(self, local_oid: int, name: str, state: SyncState, lsn: int | None = None) -> None:
        self.joins.append((local_oid, name, state))


@dataclass
class Core:
    """An Applier wired to a fake target, a real tracker and a real spool (in a temporary directory)."""

    applier: Applier
    target: FakeTarget
    tracker: FeedbackTracker
    tables: FakeTables
    skip: SkipState
    cleared: list[tuple[int, int]]

    def feed(self, *messages: object) -> None:
        """Hand the messages over as the worker does: each with its raw bytes (inside a stream chunk the
        streamable ones carry their subtransaction xid, and are spooled by those bytes)."""
        for m in messages:
            self.applier.handle(m, encode_message(m))  # type: ignore[arg-type]

    def feed_all(self, messages: Iterable[object]) -> None:
        self.feed(*messages)


def make_core(
    directory: Path,
    *,
    tables: tuple[LocalTable, ...] = (T, U),
    not_ready: dict[int, int] | None = None,
    skip_lsn: int = 0,
    **options: object,
) -> Core:
    """An Applier (subid 7) over a fake target holding ``tables``; ``options`` go to the Applier."""
    target = FakeTarget(tables)
    tracker = FeedbackTracker(0)
    states = FakeTables(dict(not_ready or {}))
    skip = SkipState(skip_lsn, "sub")
    cleared: list[tuple[int, int]] = []

    def clear(subid: int, lsn: int) -> bool:
        cleared.append((subid, lsn))
        return True

    applier = Applier(
        subid=7, subname="sub", target=target, tracker=tracker, spool=Spool(directory, 7),
        tables=states, skip=skip, clear_skip_lsn=clear, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return Core(applier, target, tracker, states, skip, cleared)


# --- messages of whole transactions, for the tests of the core and of its strategies ------------------------------

XID = 500


def plain(xid: int, lsn: int, *changes: object) -> list[object]:
    """A plain transaction: BEGIN (final LSN ``lsn``), the changes, COMMIT ending at ``lsn + 8``."""
    return [Begin(lsn, 1000 + xid, xid), *changes, Commit(0, lsn, lsn + 8, 2000 + xid)]


def prepared(xid: int, lsn: int, *changes: object) -> list[object]:
    """BEGIN PREPARE .. PREPARE of a transaction prepared at ``lsn`` (its PREPARE ends at ``lsn + 8``)."""
    gid = f"pub_{xid}"
    return [
        BeginPrepare(lsn, lsn + 8, 3000 + xid, xid, gid),
        *changes,
        Prepare(0, lsn, lsn + 8, 3000 + xid, xid, gid),
    ]


def ins(relid: int, *values: object, xid: int | None = None) -> Insert:
    return Insert(xid, relid, row(*values))


def stream_chunk(xid: int, *changes: object, first: bool = True) -> list[object]:
    return [StreamStart(xid, first), *changes, StreamStop()]


#: a third table, marked for the bulk path (applier.apply.bulk), with its columns' array types
B = replace(T, oid=1003, name="b", bulk=True,
            columns=(LocalColumn("id", 23, array_type=1007), LocalColumn("v", 25, array_type=1009)))  # fmt: skip
REL_B = replace(REL_T, relid=3, relname="b")
