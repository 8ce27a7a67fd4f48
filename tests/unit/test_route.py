"""The route planner (applier.apply.route): which route a message of a batch takes, and how far it reaches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.apply.handlers import VECTOR_MIN
from applier.apply.route import BULK_WORTHWHILE, Route, bulk_worthwhile, has_prepares, kinds_of, plan
from applier.messages import SPOOLED_TYPES, XLOG_ENVELOPE

NEVER = None  # bulk apply off, or not worth it for the batch


def no(*_: object) -> bool:
    return False


def yes(*_: object) -> bool:
    return True


def closed() -> None:
    return None  # Applier.copy_lane with no COPY open


def open_() -> tuple[int, int]:
    return (1 << 8) | ord("N"), 2  # Applier.copy_lane with a COPY open


def test_messages_go_one_by_one_up_to_the_next_that_may_take_another_route() -> None:
    assert plan(b"BUDCBUC", 1, False, False, yes, open_) == (Route.ONE, 4)  # up to the next Begin
    assert plan(b"BUDCBUC", 1, False, False, NEVER, open_) == (Route.ONE, 7)  # no bulk: the Begin goes too
    assert plan(b"BUICBUC", 1, False, False, yes, open_) == (Route.ONE, 4)  # a lone Insert goes too
    long_run = b"I" * VECTOR_MIN
    assert plan(b"BUC" + long_run, 0, False, False, NEVER, open_) == (Route.ONE, 3)  # up to a long run
    assert plan(b"CSRIE", 0, False, False, yes, open_) == (Route.ONE, 1)  # up to a Stream Start
    assert plan(b"SRIE", 0, False, False, yes, open_) == (Route.ONE, 1)  # which goes alone
    assert plan(b"IC" + long_run, 0, False, False, None, closed) == (Route.ONE, 2)  # an Insert, no COPY open
    assert plan(b"SEcA", 1, True, True, yes, open_) == (Route.ONE, 2)  # inside a stream: one at a time


def test_a_begin_goes_bulk_only_when_the_core_is_ready() -> None:
    assert plan(b"BICBIC", 0, False, False, yes, closed) == (Route.BULK, 1)
    assert plan(b"BICBIC", 0, False, False, no, closed) == (Route.ONE, 3)  # up to the next Begin
    assert plan(b"BICBIC", 0, False, False, NEVER, closed) == (Route.ONE, 6)


def test_inserts_into_an_open_copy_go_together_when_enough() -> None:
    kinds = b"B" + b"I" * VECTOR_MIN + b"C"
    assert plan(kinds, 1, False, False, NEVER, open_) == (Route.COPY_LANE, 1 + VECTOR_MIN)
    assert plan(kinds, 2, False, False, NEVER, open_) == (Route.ONE, 34)  # the rest of the run is too short
    assert plan(kinds, 1, False, False, NEVER, closed) == (
        Route.ONE,
        34,
    )  # no COPY open, nor room for one later
    kinds = b"B" + b"I" * (VECTOR_MIN + 1) + b"C"
    kinds = b"B" + b"I" * (3 * VECTOR_MIN) + b"C"
    assert plan(kinds, 1, False, False, NEVER, closed) == (Route.ONE, 1 + VECTOR_MIN)  # then ask again


def test_a_stream_chunks_changes_are_spooled_together() -> None:
    kinds = b"SRIIUDE"
    assert plan(kinds, 1, True, True, yes, open_) == (Route.SPOOL, 6)
    assert plan(kinds, 1, True, False, yes, open_) == (Route.ONE, 2)  # no chunk open: the core reports it
    assert plan(b"SBE", 1, True, True, yes, open_) == (Route.ONE, 2)  # never bulk inside a stream


def test_the_core_is_asked_only_where_its_answer_matters() -> None:
    asked: list[str] = []

    def bulk() -> bool:
        asked.append("bulk")
        return False

    def lane() -> None:
        asked.append("lane")
        return None

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
    assert bulk_worthwhile(b"BIC" * BULK_WORTHWHILE) and not bulk_worthwhile(b"BIC" * (BULK_WORTHWHILE - 1))
    assert not bulk_worthwhile(b"I" * 2000)


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
    route, j = plan(
        kinds,
        i,
        in_stream,
        spooling,
        None if bulk is None else (lambda: bulk),
        lambda: (1, 2) if lane else None,
    )
    assert i < j <= len(kinds)
    stretch = kinds[i:j]
    if route is Route.SPOOL:
        assert in_stream and spooling and all(k in SPOOLED_TYPES for k in stretch)
        assert j == len(kinds) or kinds[j] not in SPOOLED_TYPES  # the whole run
    elif route is Route.COPY_LANE:
        assert not in_stream and lane and set(stretch) == {ord("I")} and len(stretch) >= VECTOR_MIN
        assert j == len(kinds) or kinds[j] != ord("I")
    elif route is Route.BULK:
        assert j == i + 1 and not in_stream and bulk and kinds[i] == ord("B")
    elif in_stream or kinds[i] == ord("S"):
        assert j == i + 1
    else:  # one by one up to (not including) the next message that may take another route or start a stream
        stops = b"S" if bulk is None else b"BS"
        long_run = b"I" * VECTOR_MIN
        first = i + 1  # an Insert with no COPY open takes up to VECTOR_MIN - 1 more along, whatever follows
        while (
            kinds[i] == ord("I") and not lane and first < min(i + VECTOR_MIN, j) and kinds[first] == ord("I")
        ):
            first += 1
        assert not any(kinds[k] in stops or kinds.startswith(long_run, k) for k in range(first, j))
        assert j == len(kinds) or kinds[j] in stops or kinds.startswith(long_run, j)
        assert j > i


@pytest.mark.parametrize("kind", sorted(SPOOLED_TYPES))
def test_each_spooled_kind_starts_a_spool_run(kind: int) -> None:
    assert plan(bytes([kind]), 0, True, True, NEVER, closed) == (Route.SPOOL, 1)
