"""The route planner (applier.apply.route): which route a message of a batch takes, and how far it reaches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.apply.handlers import VECTOR_MIN
from applier.apply.route import Route, bulk_worthwhile, has_prepares, kinds_of, plan
from applier.messages import SPOOLED_TYPES, XLOG_ENVELOPE

NEVER = None  # bulk apply off, or not worth it for the batch


def no(*_: object) -> bool:
    return False


def yes(*_: object) -> bool:
    return True


def test_a_plain_message_goes_alone() -> None:
    assert plan(b"BUC", 1, False, False, yes, yes) == (Route.ONE, 2)


def test_a_begin_goes_bulk_only_when_the_core_is_ready() -> None:
    assert plan(b"BIC", 0, False, False, yes, no) == (Route.BULK, 1)
    assert plan(b"BIC", 0, False, False, no, no) == (Route.ONE, 1)
    assert plan(b"BIC", 0, False, False, NEVER, no) == (Route.ONE, 1)


def test_inserts_into_an_open_copy_go_together_when_enough() -> None:
    kinds = b"B" + b"I" * VECTOR_MIN + b"C"
    assert plan(kinds, 1, False, False, NEVER, yes) == (Route.COPY_LANE, 1 + VECTOR_MIN)
    assert plan(kinds, 2, False, False, NEVER, yes) == (Route.ONE, 3)  # the rest of the run is too short
    assert plan(kinds, 1, False, False, NEVER, no) == (Route.ONE, 2)  # no COPY open: one by one


def test_a_stream_chunks_changes_are_spooled_together() -> None:
    kinds = b"SRIIUDE"
    assert plan(kinds, 1, True, True, yes, yes) == (Route.SPOOL, 6)
    assert plan(kinds, 1, True, False, yes, yes) == (Route.ONE, 2)  # no chunk open: the core reports it
    assert plan(b"SBE", 1, True, True, yes, yes) == (Route.ONE, 2)  # never bulk inside a stream


def test_the_core_is_asked_only_where_its_answer_matters() -> None:
    asked: list[str] = []

    def bulk() -> bool:
        asked.append("bulk")
        return False

    def lane() -> bool:
        asked.append("lane")
        return False

    for i in range(5):
        plan(b"UDCMT", i, False, False, bulk, lane)
    plan(b"SIE", 1, True, True, bulk, lane)
    assert asked == []
    plan(b"BI", 0, False, False, bulk, lane)
    plan(b"BI", 1, False, False, bulk, lane)
    assert asked == ["bulk", "lane"]


def test_batch_helpers() -> None:
    messages = [b"w" + bytes(XLOG_ENVELOPE - 1) + bytes([k]) + b"...." for k in b"BIC"]
    assert kinds_of(messages) == b"BIC"
    assert has_prepares(b"bPK") and not has_prepares(b"b") and not has_prepares(b"BIC")
    assert bulk_worthwhile(b"BIC" * 40) and not bulk_worthwhile(b"BIC") and not bulk_worthwhile(b"I" * 200)


KIND = st.sampled_from(b"BCIUDTRYMSEcAbPKrp")


@given(
    kinds=st.lists(KIND, min_size=1, max_size=80).map(bytes),
    data=st.data(),
    in_stream=st.booleans(),
    spooling=st.booleans(),
    bulk=st.sampled_from([None, True, False]),
    lane=st.booleans(),
)
def test_every_route_covers_a_nonempty_stretch_of_its_own_kind(
    kinds: bytes, data: st.DataObject, in_stream: bool, spooling: bool, bulk: bool | None, lane: bool
) -> None:
    i = data.draw(st.integers(0, len(kinds) - 1))
    route, j = plan(kinds, i, in_stream, spooling, None if bulk is None else (lambda: bulk), lambda: lane)
    assert i < j <= len(kinds)
    stretch = kinds[i:j]
    if route is Route.SPOOL:
        assert in_stream and spooling and all(k in SPOOLED_TYPES for k in stretch)
        assert j == len(kinds) or kinds[j] not in SPOOLED_TYPES  # the whole run
    elif route is Route.COPY_LANE:
        assert not in_stream and lane and set(stretch) == {ord("I")} and len(stretch) >= VECTOR_MIN
        assert j == len(kinds) or kinds[j] != ord("I")
    else:
        assert j == i + 1
        if route is Route.BULK:
            assert not in_stream and bulk and kinds[i] == ord("B")


@pytest.mark.parametrize("kind", sorted(SPOOLED_TYPES))
def test_each_spooled_kind_starts_a_spool_run(kind: int) -> None:
    assert plan(bytes([kind]), 0, True, True, NEVER, no) == (Route.SPOOL, 1)
