"""The status-update pacer of the apply loop (applier.apply.pacing): at once after a quiet spell, at most one per
``min_interval`` under load, a requested reply at once, and an update held back is sent by the deadline the loop's
wait is shortened to."""

from __future__ import annotations

import pytest

from applier.apply.pacing import STATUS_MIN_INTERVAL, StatusPacer


def test_first_update_and_after_a_quiet_spell_go_out_at_once() -> None:
    pacer = StatusPacer(0.01)
    assert pacer.due(100.0)
    pacer.sent(100.0)
    assert pacer.due(100.5)  # quiet for longer than min_interval: a lone transaction is reported at once
    assert not pacer.owed


def test_updates_under_load_are_held_back_and_the_wait_shortened_to_their_deadline() -> None:
    pacer = StatusPacer(0.01)
    pacer.sent(100.0)
    assert not pacer.due(100.004)
    assert pacer.owed
    assert pacer.timeout(100.004, 1.0) == pytest.approx(0.006)
    assert pacer.timeout(100.004, 0.002) == pytest.approx(0.002)  # a shorter wait is kept
    assert pacer.timeout(100.02, 1.0) == 0.0  # overdue: never negative
    assert pacer.due(100.01)
    pacer.sent(100.01)
    assert not pacer.owed
    assert pacer.timeout(100.011, 1.0) == 1.0


def test_a_requested_reply_goes_out_at_once() -> None:
    pacer = StatusPacer(0.01)
    pacer.sent(100.0)
    assert pacer.due(100.001, force=True)


def test_settled_clears_what_is_owed() -> None:
    pacer = StatusPacer(0.01)
    pacer.sent(100.0)
    assert not pacer.due(100.001)
    assert pacer.due(100.02)
    pacer.settled()  # computed, nothing changed: nothing is sent and nothing is owed
    assert not pacer.owed
    assert pacer.timeout(100.02, 0.2) == 0.2


def test_at_most_one_update_per_interval_under_a_steady_load() -> None:
    """800 loop iterations a second for one second (a steady 400 tps two-phase load) send at most 1 /
    STATUS_MIN_INTERVAL updates, against 800 without pacing."""
    pacer = StatusPacer()
    sent = 0
    for i in range(800):
        now = 10.0 + i / 800
        if pacer.due(now):
            pacer.sent(now)
            sent += 1
    assert sent <= 1 / STATUS_MIN_INTERVAL + 1
    assert sent >= 1 / STATUS_MIN_INTERVAL / 2
