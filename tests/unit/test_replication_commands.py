"""The replication commands a publisher of each version is sent (PostgreSQL 14 knows only the older keyword syntax
of CREATE_REPLICATION_SLOT, and no two-phase or origin options in START_REPLICATION): issue 31."""

from __future__ import annotations

import pytest

from applier.replication import StreamOptions, create_slot_command, start_replication_command


@pytest.mark.parametrize(
    ("snapshot", "version", "tail"),
    [
        ("export", 140023, " EXPORT_SNAPSHOT"),
        ("use", 140023, " USE_SNAPSHOT"),
        ("nothing", 140023, " NOEXPORT_SNAPSHOT"),
        ("export", 150018, " (SNAPSHOT 'export')"),
        ("nothing", 180001, " (SNAPSHOT 'nothing')"),
    ],
)
def test_create_slot_command_by_version(snapshot: str, version: int, tail: str) -> None:
    text = create_slot_command("s", True, False, snapshot, version).as_string(None)
    assert text == 'CREATE_REPLICATION_SLOT "s" TEMPORARY LOGICAL pgoutput' + tail


def test_create_slot_two_phase_by_version() -> None:
    assert (
        create_slot_command("s", False, True, "nothing", 150000)
        .as_string(None)
        .endswith("(TWO_PHASE true, SNAPSHOT 'nothing')")
    )
    assert (
        create_slot_command("s", False, True, "nothing", 140000)
        .as_string(None)
        .endswith("pgoutput TWO_PHASE NOEXPORT_SNAPSHOT")
    )


def test_start_replication_on_14_asks_protocol_2_without_two_phase_or_origin() -> None:
    options = StreamOptions(
        publications=["p"], streaming="parallel", two_phase=True, origin="none", binary=True
    )
    command = start_replication_command("s", 0, options, 140023)
    assert command == (
        "START_REPLICATION SLOT \"s\" LOGICAL 0/0 (proto_version '2', streaming 'on', "
        "publication_names '\"p\"', binary 'true')"
    )
