"""applier.apply.failover's verdicts: when a session may resume on the publisher it reached, and when the
subscription must stop because that server lacks our slot or our history (issue 30)."""

from __future__ import annotations

from applier.apply.failover import Facts, PublisherSeen, decide, parse_timeline_history, switch_point

SYS = "7713404416853099137"


def facts(**kw: object) -> Facts:
    base: dict[str, object] = dict(slot="s", now=PublisherSeen(SYS, 1), wal_end=0x5000000, applied=0x3000000,
                                   slot_exists=True, slot_confirmed=0x3000000, before=PublisherSeen(SYS, 1))  # fmt: skip
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


def test_the_same_publisher_goes_on_silently() -> None:
    assert decide(facts()).stop is None and decide(facts()).note is None
    assert decide(facts(before=None)).stop is None  # the first session
    # feedback lag: the slot may trail what we applied
    assert decide(facts(slot_confirmed=0x1000000)).stop is None


def test_a_missing_slot_stops_and_says_how_to_recover() -> None:
    v = decide(facts(now=PublisherSeen(SYS, 2), switch=0x4000000, slot_exists=False, slot_confirmed=None))
    assert v.stop is not None
    assert 'replication slot "s" does not exist' in v.stop
    assert "the publisher failed over: timeline 1 ended at 0/4000000, it is now on timeline 2" in v.stop
    assert "--failover" in v.stop and "applier drop NAME" in v.stop and "disabled" in v.stop


def test_a_followed_failover_with_our_history_resumes_with_a_note() -> None:
    v = decide(facts(now=PublisherSeen(SYS, 2), switch=0x3000000, slot_confirmed=0x2000000))
    assert v.stop is None
    assert v.note is not None and "failed over" in v.note and "resuming at 0/3000000" in v.note


def test_applied_past_the_fork_point_is_a_divergence() -> None:
    v = decide(facts(now=PublisherSeen(SYS, 2), switch=0x2F00000, wal_end=0x9000000))
    assert v.stop is not None and "that timeline ended at 0/2F00000" in v.stop and "diverged" in v.stop


def test_a_wal_that_ends_before_what_we_applied_is_a_divergence() -> None:
    v = decide(facts(before=None, now=PublisherSeen(SYS, 3), wal_end=0x2000000))
    assert v.stop is not None and "has WAL up to 0/2000000" in v.stop
    assert "synchronized_standby_slots" in v.stop
    assert "timeline 3" in v.stop


def test_another_system_with_a_slot_behind_us_stops() -> None:
    v = decide(facts(now=PublisherSeen("1", 1), slot_confirmed=0x1000000))
    assert v.stop is not None and "another server" in v.stop
    assert "behind what the target has applied" in v.stop
    assert decide(facts(now=PublisherSeen("1", 1), slot_confirmed=0x3000000)).stop is None


def test_a_new_worker_reads_the_divergence_from_the_slot() -> None:
    now = PublisherSeen(SYS, 2)
    # the slot synchronized before the fork, we applied past it: from the old timeline
    v = decide(facts(before=None, now=now, switch=0x2F00000, slot_confirmed=0x2E00000, wal_end=0x9000000))
    assert v.stop is not None and "began its timeline at 0/2F00000" in v.stop and "diverged" in v.stop
    # we applied no further than the fork (synchronized_standby_slots): resume
    assert decide(facts(before=None, now=now, switch=0x3000000, slot_confirmed=0x2E00000)).stop is None
    # the slot confirmed past the fork: what we applied past it came from this timeline
    assert decide(facts(before=None, now=now, switch=0x2F00000, slot_confirmed=0x2F80000)).stop is None


def test_timeline_history() -> None:
    text = "1\t0/3000000\tno recovery target specified\n\n2\t0/5000A0\tbefore 2000-01-01\n"
    history = parse_timeline_history(text)
    assert history == {1: 0x3000000, 2: 0x5000A0}
    assert switch_point(history, 2) == 0x5000A0 and switch_point(history, 7) is None
    assert switch_point(history, None) == 0x5000A0 and switch_point({}, None) is None
