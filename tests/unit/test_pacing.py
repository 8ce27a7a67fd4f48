"""Read pacing (applier.apply.pacing): when the loop waits for the walsender's output to queue up; and the status
update pacer: at once after a quiet spell, at most one per ``min_interval`` under load, a requested reply at once,
and an update held back is sent by the deadline the loop's wait is shortened to."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.apply.pacing import (
    READ_PAUSE,
    STATUS_MIN_INTERVAL,
    WAIT_FLUSH_PENDING,
    WAIT_IDLE,
    ReadPacer,
    StatusPacer,
)

PACER = ReadPacer()


def test_a_backlog_read_that_emptied_the_socket_pauses() -> None:
    assert PACER.pause_after(200, ran_dry=True, in_transaction=False) == READ_PAUSE
    assert PACER.pause_after(199, ran_dry=True, in_transaction=False) == 0.0


def test_a_large_transaction_arriving_pauses_a_small_one_caught_half_sent_does_not() -> None:
    assert PACER.pause_after(32, ran_dry=True, in_transaction=True) == READ_PAUSE
    assert PACER.pause_after(31, ran_dry=True, in_transaction=True) == 0.0
    assert PACER.pause_after(31, ran_dry=True, in_transaction=False) == 0.0


def test_no_pause_when_more_is_there_already() -> None:
    assert PACER.pause_after(5000, ran_dry=False, in_transaction=True) == 0.0


def test_only_the_first_read_of_a_round_waits_for_data() -> None:
    assert ReadPacer.wait_for_data(flush_pending=False, first_read=True) == WAIT_IDLE
    assert ReadPacer.wait_for_data(flush_pending=True, first_read=True) == WAIT_FLUSH_PENDING
    assert ReadPacer.wait_for_data(flush_pending=True, first_read=False) == 0.0


@given(got=st.integers(0, 10_000), ran_dry=st.booleans(), in_txn=st.booleans())
def test_the_pause_is_all_or_nothing_and_grows_with_the_read(got: int, ran_dry: bool, in_txn: bool) -> None:
    pause = PACER.pause_after(got, ran_dry, in_txn)
    assert pause in (0.0, READ_PAUSE)
    assert PACER.pause_after(got + 1, ran_dry, in_txn) >= pause  # a larger read never pauses less
    assert PACER.pause_after(got, ran_dry, True) >= PACER.pause_after(got, ran_dry, False)


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
