"""Read pacing (applier.apply.pacing): when the loop waits for the walsender's output to queue up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from applier.apply.pacing import READ_PAUSE, WAIT_FLUSH_PENDING, WAIT_IDLE, ReadPacer

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
