"""The capture's messages in the apply core (applier.ddl): each DDL statement the source ran is run on the target
at its place in the change stream, inside the local transaction of the remote one that carried it.

So it is prepared with that transaction when it is prepared, rolled back with it, applied when a streamed
transaction commits (the spool replays its messages in order, this one included), and applied exactly once: the
origin advances in the same local transaction. Everything the core read about the local tables before the
statement is forgotten after it (the relation map's local halves, the preloaded tables): the next change of a table
looks it up again, inside the same transaction, where the statement's effect is visible.

A created table joins the subscription in the same transaction: ``r`` when its rows arrive through the stream
(``CREATE TABLE``), ``i`` when it was created with rows the stream does not carry (``CREATE TABLE AS``, ``SELECT
INTO``: run here ``WITH NO DATA``, then copied by the live table sync as a table added by ``--refresh-publication``
is). An ``ALTER TABLE`` that filled the rows already there with values each server computes for itself has its
table copied again the same way (``f``). A statement that cannot be found in the client's string (DDL run by a
function, a ``DO`` block) is skipped with a WARNING that says what to run by hand; the apply goes on, and a later
change that needs it stops with the missing-column error that names it. Only messages signed with the capture's
key are run (applier.ddl.payload says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from applier.apply.apply_state import RemoteTransaction
from applier.apply.context import ErrorContext
from applier.apply.insert_sink import InsertRuns
from applier.apply.ports import ApplyTarget
from applier.apply.relmap import RelationMap
from applier.ddl.payload import PREFIX, DdlEvent, DdlPayloadError, decode_payload, verified
from applier.ddl.statements import Replay, fills_rows_anew, replay_for, without_data
from applier.lsn import format_lsn
from applier.messages import Message
from state.tables import SyncState

__all__ = ["DdlConsumer", "DdlContext", "DdlCore", "DdlReplay"]


class DdlCore(Protocol):
    """What :class:`DdlReplay` uses of the core (:class:`~applier.apply.handlers.Applier`)."""

    subid: int
    subname: str
    log: logging.Logger
    target: ApplyTarget
    tables: Any  # TableStates: .joined
    relmap: RelationMap
    inserts: InsertRuns
    tx: RemoteTransaction

    def context(self, message_type: str, relation: str | None = None) -> ErrorContext: ...


def _signed(key: bytes, content: bytes) -> bool:
    try:
        verified(key, content)
    except DdlPayloadError:
        return False
    return True


#: command tags whose table is created with rows that the stream does not carry
_WITH_ROWS = frozenset({"CREATE TABLE AS", "SELECT INTO"})


class DdlContext(ErrorContext):
    """The error context of a replayed statement: it names the statement, which the operator may have to run by
    hand in another form (an extension the target lacks, a role, a tablespace) before the retry goes on."""

    __slots__ = ("statement",)

    def __init__(self, base: ErrorContext, statement: str) -> None:
        super().__init__(base.origin, base.message_type, base.relation, base.xid, base.finish_lsn, base.gid)
        self.statement = statement

    def detail(self) -> str:
        shown = self.statement if len(self.statement) <= 300 else self.statement[:300] + "..."
        return f"replaying the source's DDL: {shown}"

    def describe(self) -> str:
        return f"{super().describe()}, {self.detail()}"


@dataclass(frozen=True)
class DdlConsumer:
    """The session's view of its capture: its ``slot``, whether it replays (``enabled``, the subscription's
    ``subddl``) and the ``key`` its messages are signed with (None: not readable). ``recheck`` raises
    :class:`applier.apply.housekeeping.Restart` when the subscription's ``subddl`` or the capture's key changed
    since the session began: a message of the capture that this session cannot take (``alter --set ddl=true`` just
    happened, or the capture was installed again) then ends the session before its transaction commits, and the
    next one applies it from the origin's position, with the new state."""

    slot: str
    enabled: bool
    key: bytes | None
    recheck: Callable[[], None]


class DdlReplay:
    """The core's handling of capture messages (``consumer`` None: no capture, messages are ignored, as the native
    worker ignores them). A message whose signature is not the key's (any role of the source may emit one with our
    prefix) is not run: a WARNING says so, and replication goes on."""

    def __init__(self, core: DdlCore, consumer: DdlConsumer | None) -> None:
        self.core = core
        self.consumer = consumer
        #: (source statement or tag, why) of each event skipped since the session started, for status and tests
        self.skipped: list[tuple[str, str]] = []
        self.replayed = 0

    def message(self, m: Message) -> None:
        consumer = self.consumer
        if consumer is None or m.prefix != PREFIX or not m.transactional:
            return
        try:
            event = decode_payload(m.content[64:])
            if event.slot != consumer.slot:
                return  # another consumer's capture in the same source database
            if not consumer.enabled or consumer.key is None or not _signed(consumer.key, m.content):
                consumer.recheck()  # a capture (or key) newer than the session: restarts it
                if not consumer.enabled:
                    return  # ddl off: nothing replayed, as by the native worker
            verified(consumer.key or b"", m.content)
        except DdlPayloadError as exc:  # forged (any role may emit one), or no key to check it with
            self.core.log.warning('logical replication apply worker for subscription "%s" ignores a message with'
                                  ' prefix "%s" at %s: %s', self.core.subname, m.prefix, format_lsn(m.lsn), exc)  # fmt: skip
            return
        replay = replay_for(event)
        if replay.statement is None:
            self._skip(event, replay)
            return
        self._run(event, replay.statement)

    def _skip(self, event: DdlEvent, replay: Replay) -> None:
        what = ", ".join(sorted(o.identity for o in event.objects)) or event.tag
        self.skipped.append((f"{event.tag} {what}", replay.why or ""))
        self.core.log.warning(
            'logical replication apply worker for subscription "%s" could not replay %s on %s: %s; run its equivalent'
            " on the target (a change that needs it stops the apply until then)",
            self.core.subname, event.tag, what, replay.why,
        )  # fmt: skip

    def _run(self, event: DdlEvent, statement: str) -> None:
        core, target = self.core, self.core.target
        ctx = DdlContext(core.context("MESSAGE", ", ".join(sorted(event.tables)) or None), statement)
        core.inserts.flush()
        if not target.in_transaction:
            target.begin(ctx)
        with_rows = event.tag in _WITH_ROWS
        target.ddl.run(without_data(statement) if with_rows else statement, event.tag, event.search_path, ctx)
        core.relmap.forget_local()
        target.ddl.forget_tables()
        if event.dropped_tables:
            target.ddl.leave_dropped(core.subid, ctx)
        state = SyncState.INIT if with_rows else SyncState.READY
        for name in event.created_tables:
            oid = target.ddl.join(core.subid, name, state, ctx)
            if oid is not None:
                core.tables.joined(oid, name, state)
        self.replayed += 1
        if fills_rows_anew(statement):
            self._recopy(event, ctx)

    def _recopy(self, event: DdlEvent, ctx: ErrorContext) -> None:
        """An ALTER TABLE that filled the rows already there with values each server computes for itself
        (``random()``, ``now()``, a serial): the stream carries no rewritten row, so the table is copied again,
        from the source, by the live sync (``f``, in this transaction; its changes wait until it is in sync)."""
        core, created = self.core, set(event.created_tables)
        for name in sorted(event.tables - created):
            oid = core.target.ddl.recopy(core.subid, name, core.tx.final_lsn, ctx)
            if oid is not None:
                core.tables.joined(oid, name, SyncState.FINISHEDCOPY, core.tx.final_lsn)
                core.log.info('logical replication apply worker for subscription "%s": %s on %s filled its rows with'
                              " values computed on each server: the table is copied again", core.subname, event.tag,
                              name)  # fmt: skip
