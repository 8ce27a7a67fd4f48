"""The stall watchdog's decision (applier.apply.stall), on a made-up clock."""

from __future__ import annotations

import pytest

from applier.apply.stall import STALL_AFTER, Progress, StallWatch, stall_after_default


def test_behind_without_progress_is_reported_once_and_its_end_too() -> None:
    w = StallWatch(after=10.0)
    stuck = Progress(received=500, applied=100, unanswered=40, unsent=False)
    assert w.observe(0.0, stuck) is None
    assert w.observe(9.0, stuck) is None
    event = w.observe(10.0, stuck)
    assert event is not None and event[0] == "stalled"
    assert event[1].since == 0.0 and event[1].waiting_on == "target"
    assert w.observe(20.0, stuck) is None  # once per stall
    event = w.observe(21.0, Progress(500, 100, 39, False))  # the target answered one statement
    assert event is not None and event[0] == "resumed" and event[1].since == 0.0
    assert w.stall is None


def test_what_counts_as_progress_and_as_behind() -> None:
    w = StallWatch(after=5.0)
    w.observe(0.0, Progress(500, 100, 10, False))
    # more queued while the target answers nothing is no progress; the applied position moving is
    assert w.observe(3.0, Progress(600, 100, 20, True)) is None
    event = w.observe(5.0, Progress(600, 100, 20, True))
    assert event is not None and event[0] == "stalled"
    assert w.observe(6.0, Progress(600, 200, 20, True)) == ("resumed", event[1])
    # not behind (idle, everything applied): never a stall, however long
    for t in range(7, 100):
        assert w.observe(float(t), Progress(600, 600, 0, False)) is None
    # behind with nothing owed by the target: a remote transaction whose rest has not arrived
    w.observe(100.0, Progress(700, 600, 0, False))
    event = w.observe(106.0, Progress(700, 600, 0, False))
    assert event is not None and event[1].waiting_on == "publisher"


@pytest.mark.parametrize(
    ("value", "expected"), [("", STALL_AFTER), ("2.5", 2.5), ("0", STALL_AFTER), ("x", STALL_AFTER)]
)
def test_the_threshold_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: float
) -> None:
    monkeypatch.setenv("APPLIER_STALL_AFTER", value)
    assert stall_after_default() == expected
