"""When a remote transaction's local COMMIT is sent: at once (immediate), or deferred into a group commit.

**Speed.** A backlog of small transactions costs one local commit each, and with ``synchronous_commit`` on, one WAL
flush each. With group commit (``APPLIER_GROUP_COMMIT``, on by default) consecutive plain transactions that have
already arrived share one local transaction: the :class:`~applier.apply.handlers.Applier` leaves it open after a
remote COMMIT (:meth:`CommitPolicy.defer`), and the next transactions join it, message by message or a batch at a
time (:mod:`applier.apply.bulk`, whose runs join the same group through the same call).

**Safety.** The group's one COMMIT is preceded, in the same local transaction, by the origin progress of its last
remote transaction (``pg_replication_origin_xact_setup``, behaviours 94, 113), so exactly-once holds as for a single
transaction: after a crash the whole group is replayed, or none of it. While a group is open the feedback tracker
*holds* (:attr:`~applier.apply.feedback.FeedbackTracker.holding`): nothing of it is reported flushed before it
commits. No commit is delayed: the worker ends the group (``Applier.end_group``) as soon as the publisher has
nothing more waiting, after each burst, and before any message that is not a plain transaction's; a group also ends
at :data:`GROUP_MAX_TRANSACTIONS` transactions or :data:`GROUP_MAX_ROWS` row changes. Only transactions whose commit
nothing else needs may join: no skip-LSN to clear, no table being synchronised (the sync-state pass runs after every
commit then), and none at or before :attr:`CommitPolicy.ungrouped_until` (the retry, one by one, after a failed
group, so that the transaction at fault is found and reported with its own context).

:class:`CommitPolicy` is pure bookkeeping: it decides and remembers. :class:`GroupCommit` is the core's side of it,
written once: it joins transactions to the group and sends the group's commit through the target port.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from applier.apply.apply_state import ApplyStats, RemoteTransaction
from applier.apply.context import ErrorContext
from applier.apply.feedback import FeedbackTracker
from applier.apply.ports import ApplyTarget
from state.twophase import TwoPhaseState

#: A group commit is sent after at most this many remote transactions (the worker also ends a group whenever the
#: publisher has nothing more waiting, and after each burst of messages).
GROUP_MAX_TRANSACTIONS = 1000
#: ... or once its remote transactions hold this many row changes.
GROUP_MAX_ROWS = 100_000


@dataclass(frozen=True, slots=True)
class DeferredCommit:
    """The commit a group owes: its last remote transaction's end, commit time, xid and finish LSN (the error
    context names that transaction if the COMMIT fails)."""

    end_lsn: int
    commit_time: int
    xid: int | None
    finish_lsn: int


def groupable(skip_lsn: int, tables: Any) -> bool:
    """Nothing outside the transactions needs their commits: no skip-LSN to clear, no table being synchronised
    (``tables.all_ready``: the sync-state pass runs after every commit then), two-phase not about to be enabled
    (``tables.two_phase_state`` ``p``). (``tables`` is the core's TableStates; the attributes are optional.)"""
    return (
        not skip_lsn
        and getattr(tables, "all_ready", False)
        and getattr(tables, "two_phase_state", None) != TwoPhaseState.PENDING
    )


class CommitPolicy:
    """Immediate (``enabled`` false: every remote transaction commits on its own) or group commit; see the module
    docstring. One per :class:`~applier.apply.handlers.Applier`, used by its commit path and its bulk path."""

    __slots__ = ("enabled", "ungrouped_until", "pending", "size", "rows", "groups", "_tracker")

    def __init__(self, tracker: FeedbackTracker, *, enabled: bool, ungrouped_until: int = 0) -> None:
        self._tracker = tracker
        self.enabled = enabled
        #: transactions finishing at or before this LSN are committed one by one (the retry after an error)
        self.ungrouped_until = ungrouped_until
        #: the deferred commit of the open group, or None (a plain attribute: read for every message)
        self.pending: DeferredCommit | None = None
        self.size = 0  # remote transactions in the open group
        self.rows = 0  # their row changes
        self.groups = 0  # group commits of more than one transaction sent (stats)

    def room(self) -> int:
        """How many more remote transactions the open group takes (at least one)."""
        return max(GROUP_MAX_TRANSACTIONS - self.size, 1)

    def defer(self, commit: DeferredCommit, transactions: int = 1, rows: int = 0) -> bool:
        """``transactions`` remote transactions with ``rows`` row changes joined the group, the last of them
        ending as ``commit`` says; returns whether the group is full, so the caller sends it now."""
        self.size += transactions
        self.rows += rows
        self.pending = commit
        self._tracker.holding = True  # feedback must not report these transactions before the group commits
        return self.size >= GROUP_MAX_TRANSACTIONS or self.rows >= GROUP_MAX_ROWS

    def take(self) -> DeferredCommit | None:
        """Close the group and return the commit to send now, or None when no group is open."""
        pending = self.pending
        if pending is None:
            return None
        self.pending = None
        if self.size > 1:
            self.groups += 1
        self.size = self.rows = 0
        self._tracker.holding = False
        return pending

    def abandon(self) -> None:
        """Forget the open group without sending its commit: the commit the caller sends next, in the same local
        transaction, covers it (or the session is being reset after an error)."""
        if self.pending is not None:
            self.pending = None
            self.size = self.rows = 0
            self._tracker.holding = False

    def reset(self) -> None:
        """After an error: the group's local transaction is gone with the session (the tracker forgets its
        unconfirmed entries separately)."""
        self.pending = None
        self.size = self.rows = 0


class _Inserts(Protocol):
    def flush(self) -> None: ...


class GroupCommitCore(Protocol):
    """What :class:`GroupCommit` reads of the core (:class:`~applier.apply.handlers.Applier`)."""

    origin: str
    skip: Any  # SkipState: .skip_lsn
    tables: Any  # TableStates: .all_ready, .two_phase_state
    target: ApplyTarget
    tracker: FeedbackTracker
    tx: RemoteTransaction
    stats: ApplyStats
    inserts: _Inserts


class GroupCommit:
    """The core's side of the policy: joins remote transactions to the open group and sends its commit. The one
    place that does, for transactions applied message by message (:meth:`defer`, from the commit paths) and a
    batch at a time (:meth:`join`, from :mod:`applier.apply.bulk_exec`)."""

    __slots__ = ("core", "policy")

    def __init__(self, core: GroupCommitCore, policy: CommitPolicy) -> None:
        self.core = core
        self.policy = policy

    @property
    def pending(self) -> bool:
        """A group commit is deferred: the worker calls :meth:`end` when nothing more is waiting."""
        return self.policy.pending is not None

    def may_group(self) -> bool:
        """Nothing outside the transactions needs their commits (:func:`groupable`)."""
        return groupable(self.core.skip.skip_lsn, self.core.tables)

    def join(self, commit: DeferredCommit, transactions: int, rows: int) -> None:
        """``transactions`` remote transactions joined the open group; a full group is sent at once."""
        if self.policy.defer(commit, transactions, rows):
            self.end()

    def end(self) -> None:
        """Send the deferred commit of the open group: origin progress to the last remote transaction's end and
        COMMIT, in the group's one local transaction (so exactly-once holds as for a single transaction)."""
        group = self.policy.take()
        if group is None:
            return
        core = self.core
        core.inserts.flush()
        ctx = ErrorContext(core.origin, "COMMIT", None, group.xid, group.finish_lsn)
        token = core.tracker.queued(group.end_lsn)
        core.target.commit(group.end_lsn, group.commit_time, ctx, lambda _res: core.tracker.confirmed(token))

    def defer(self, commit_lsn: int, end_lsn: int, commit_time: int) -> bool:
        """At a remote commit: leave the local transaction open so that the next remote transactions, if they have
        already arrived, join it (returns True), or not (False: the caller commits, and that commit also covers
        the open group). Only while nothing else needs this commit: not skipped, not a retry of a failed group
        (at or before :attr:`CommitPolicy.ungrouped_until`), :meth:`may_group`."""
        policy, core = self.policy, self.core
        if not policy.enabled:
            return False
        if not core.target.in_transaction and policy.pending is None:
            return False  # nothing applied and no group open: nothing to commit (as the native worker)
        if core.tx.skipping or commit_lsn <= policy.ungrouped_until or not self.may_group():
            policy.abandon()
            return False
        # an insert run (a COPY, say) stays open: the next transaction's inserts into the same table continue it
        tx = core.tx
        self.join(DeferredCommit(end_lsn, commit_time, tx.xid, tx.final_lsn), 1, sum(core.stats.pending_rows))
        return True
