"""Group-commit bookkeeping (:mod:`applier.apply.commit_policy`), on its own and as the Applier's commit and bulk
paths use it."""

from __future__ import annotations

from applier.apply import commit_policy
from applier.apply.commit_policy import CommitPolicy, DeferredCommit
from applier.apply.feedback import FeedbackTracker
from applier.messages import Begin, Commit, Insert
from tests.support.applier_kit import REL_T, row


def test_a_group_holds_feedback_until_taken_and_counts_only_real_groups():
    tracker = FeedbackTracker(0)
    policy = CommitPolicy(tracker, enabled=True)
    assert policy.take() is None
    assert not policy.defer(DeferredCommit(108, 1, 5, 100), 1, 3)
    assert tracker.holding and policy.size == 1 and policy.rows == 3
    assert policy.take() == DeferredCommit(108, 1, 5, 100)
    assert not tracker.holding and policy.groups == 0  # a group of one is a plain commit
    policy.defer(DeferredCommit(208, 1, 6, 200))
    policy.defer(DeferredCommit(308, 1, 7, 300), 2)
    assert policy.take() == DeferredCommit(308, 1, 7, 300) and policy.groups == 1


def test_a_full_group_asks_to_be_sent_and_room_shrinks():
    policy = CommitPolicy(FeedbackTracker(0), enabled=True)
    assert policy.room() == commit_policy.GROUP_MAX_TRANSACTIONS
    assert not policy.defer(DeferredCommit(8, 1, 1, 1), commit_policy.GROUP_MAX_TRANSACTIONS - 1)
    assert policy.room() == 1
    assert policy.defer(DeferredCommit(16, 1, 2, 9), 1)
    assert policy.room() == 1  # never less than one
    policy.take()
    assert policy.defer(DeferredCommit(24, 1, 3, 17), 1, commit_policy.GROUP_MAX_ROWS)


def test_abandon_releases_the_tracker_and_reset_forgets():
    tracker = FeedbackTracker(0)
    policy = CommitPolicy(tracker, enabled=True)
    policy.defer(DeferredCommit(8, 1, 1, 1))
    policy.abandon()
    assert policy.pending is None and not tracker.holding and policy.take() is None
    policy.defer(DeferredCommit(8, 1, 1, 1))
    policy.reset()
    assert policy.pending is None and policy.size == 0


def test_the_applier_sends_a_group_once_it_holds_the_most_rows(core_factory, monkeypatch):
    monkeypatch.setattr(commit_policy, "GROUP_MAX_ROWS", 3)
    core = core_factory(group_commit=True)
    core.feed(REL_T)
    for i in range(3):
        lsn = 100 * (i + 1)
        core.feed(Begin(lsn, 1, 10 + i), Insert(None, 1, row(i, "x")), Insert(None, 1, row(i + 10, "y")))
        core.feed(Commit(0, lsn, lsn + 8, 2))
    # 2 rows: open; 4 rows: sent with the second transaction; the third opens a new group
    assert core.target.origin_positions == [208]
    assert core.applier.group_pending and core.applier.groups == 1
