"""The one rule for dropping a replication slot with patience (:mod:`applier.slots`), shared by ``applier drop``
and ``applier migrate cutover``/``abort``, on scripted looks (no server)."""

from __future__ import annotations

from collections.abc import Callable

from applier import slots
from applier.slots import ABSENT, SlotDrop, drop_when_idle


def _script(
    looks: list[int | None], drops: list[bool]
) -> tuple[Callable[[], int | None], Callable[[], bool]]:
    """``look`` and ``drop`` that answer from the lists in turn (the last answer repeats)."""

    def look() -> int | None:
        return looks.pop(0) if len(looks) > 1 else looks[0]

    def drop() -> bool:
        return drops.pop(0) if len(drops) > 1 else drops[0]

    return look, drop


def test_an_absent_slot_is_not_dropped_and_an_idle_one_is() -> None:
    assert drop_when_idle(*_script([ABSENT], [True]), patience=0) == SlotDrop(absent=True)
    assert drop_when_idle(*_script([None], [True]), patience=0) == SlotDrop(dropped=True)


def test_a_held_slot_is_waited_for_then_dropped_or_reported_with_its_holder(monkeypatch) -> None:
    monkeypatch.setattr(slots.time, "sleep", lambda s: None)
    # held twice, then idle but taken meanwhile, then idle: dropped
    assert drop_when_idle(*_script([42, 42, None, None], [False, True]), patience=60) == SlotDrop(
        dropped=True
    )
    # held past the patience: the holder is told
    assert drop_when_idle(*_script([42], [True]), patience=0) == SlotDrop(holder=42)
