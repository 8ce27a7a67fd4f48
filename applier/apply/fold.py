"""Prepared transactions whose outcome has already arrived: folded into one plain transaction.

A backlog of two-phase transactions (a subscriber catching up, a migration following its source) reaches the
worker as BEGIN PREPARE ... PREPARE followed at once by that transaction's COMMIT PREPARED or ROLLBACK PREPARED, all
in one read. Applied as PostgreSQL's apply worker does, each costs the target two WAL flushes: PREPARE TRANSACTION
and COMMIT PREPARED are always flushed, whatever ``synchronous_commit`` says. The prepared state they pay for is
never usable, since the decision is already in hand. So such a transaction is *folded*:

- decided COMMIT PREPARED: its changes are applied as a plain transaction, committed (origin progress included)
  at the COMMIT PREPARED's end LSN, like any commit, and it may share a group commit;
- decided ROLLBACK PREPARED: its changes are not applied at all; only its position counts as applied.

The result on the target is the one PREPARE + COMMIT/ROLLBACK PREPARED would leave, and progress stays exactly
once: the one local commit carries the origin past both messages, and a crash before it replays both. A transaction
whose decision has not arrived yet (the usual case of live traffic) is prepared as before.

This module is the pure part: which transactions of one read are decided, from their bytes
(:func:`decided_prepares`), and which BEGIN PREPARE the core folds (:class:`Folding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from applier.decoder import decode_message
from applier.errors import DecodeError
from applier.messages import BeginPrepare, CommitPrepared, Prepare, RollbackPrepared

#: message types that start, end or interrupt a transaction: B, b, C, P, K, r, S, E, c, p, A
_BOUNDARY = frozenset(b"BbCPKrSEcpA")


@dataclass(frozen=True, slots=True)
class Decision:
    """What a BEGIN PREPARE must match to be folded, and how its transaction ends."""

    prepare_end_lsn: int
    prepare_time: int
    commit: bool  # COMMIT PREPARED (else ROLLBACK PREPARED)


def decided_prepares(messages: Sequence[bytes | memoryview], offset: int = 0) -> dict[int, Decision]:
    """The remote xids of the prepared transactions in ``messages`` (pgoutput messages starting at ``offset`` of
    each item, in stream order) whose BEGIN PREPARE, PREPARE and COMMIT/ROLLBACK PREPARED all three are there, the
    last directly after the PREPARE, and agree with each other (xid, GID, prepare LSNs and time).

    Anything else (a decision in a later read, another transaction in between, bytes that do not decode) is left
    out: that transaction is prepared as usual, and the handlers report any malformed message in stream order."""
    decided: dict[int, Decision] = {}
    kinds = [m[offset] if len(m) > offset else -1 for m in messages]
    count = len(kinds)
    i = 0
    while i < count:
        if kinds[i] != 98:  # 'b'
            i += 1
            continue
        j = i + 1
        while j < count and kinds[j] not in _BOUNDARY:
            j += 1
        if j + 1 >= count or kinds[j] != 80 or kinds[j + 1] not in (75, 114):  # 'P', then 'K' or 'r'
            i = j
            continue
        try:
            begin, prepare, end = (decode_message(bytes(messages[k][offset:])) for k in (i, j, j + 1))
        except DecodeError:
            i = j + 2
            continue
        if (
            isinstance(begin, BeginPrepare)
            and isinstance(prepare, Prepare)
            and begin.xid == prepare.xid == end.xid  # type: ignore[union-attr]
            and begin.gid == prepare.gid == end.gid  # type: ignore[union-attr]
            and begin.prepare_lsn == prepare.prepare_lsn
            and begin.end_lsn == prepare.end_lsn
            and begin.prepare_time == prepare.prepare_time
            and (
                isinstance(end, CommitPrepared)
                or (
                    isinstance(end, RollbackPrepared)
                    and end.prepare_end_lsn == prepare.end_lsn
                    and end.prepare_time == prepare.prepare_time
                )
            )
        ):
            decided[begin.xid] = Decision(
                prepare.end_lsn, prepare.prepare_time, isinstance(end, CommitPrepared)
            )
        i = j + 2
    return decided


class Folding:
    """The folding strategy of one apply core: the decided transactions the worker found in the batch being
    applied (:attr:`decided`, by remote xid) and the one being applied folded now (:attr:`current`)."""

    __slots__ = ("decided", "current")

    def __init__(self) -> None:
        self.decided: dict[int, Decision] = {}
        self.current: Decision | None = None

    def begin(self, m: BeginPrepare, allowed: bool) -> Decision | None:
        """At BEGIN PREPARE: the transaction's decision if it is folded (its decision is here and agrees, and
        ``allowed``: not skipped, grouping possible), else None (it is prepared as usual)."""
        decision = self.decided.pop(m.xid, None) if self.decided else None
        if (
            decision is None
            or decision.prepare_end_lsn != m.end_lsn
            or decision.prepare_time != m.prepare_time
            or not allowed
        ):
            return None
        self.current = decision
        return decision

    def ends(self, xid: int, commit: bool, remote_xid: int | None) -> bool:
        """Whether a COMMIT (``commit``) or ROLLBACK PREPARED of ``xid`` ends the transaction being folded."""
        current = self.current
        return current is not None and current.commit is commit and xid == remote_xid

    def reset(self) -> None:
        self.current = None
        self.decided.clear()
