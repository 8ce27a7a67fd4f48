"""The pure parts of the migration's two publications (issue 43, "do no harm to the source"): the insert-only
publication's name within PostgreSQL's 63 bytes, the cutover's refusal for a diverging table too large to copy again
under the fence, ``status``'s JSON of a diverging table, and plan's findings for a table without a key or usable
replica identity (what start does with it, and the ways out)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from applier.migrate.plan import RECOPY_MAX_BYTES, assess
from applier.migrate.publications import Diverging, insert_only_name, names, refuse_before_fence
from applier.migrate.selection import Selection
from tests.support.plan_facts import PG18, source, table, target

#: what a migration's name may be (applier migrate start refuses any other): 1-63 of [a-z0-9_]
MIGRATION_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=63)


def test_the_insert_only_publication_is_the_name_and_ins() -> None:
    assert names("mig") == ["mig", "mig_ins"]
    assert insert_only_name("a" * 59) == "a" * 59 + "_ins"  # 63 bytes: as it is


def test_a_long_name_is_cut_so_that_the_insert_only_name_fits_63_bytes() -> None:
    long = "m" * 60 + "xyz"  # 63 bytes, the longest a migration's name may be
    assert insert_only_name(long) == "m" * 59 + "_ins"
    assert len(insert_only_name(long).encode()) == 63


@given(MIGRATION_NAMES)
def test_every_migration_name_gives_a_distinct_insert_only_name_that_fits(name: str) -> None:
    main, ins = names(name)
    assert main == name and ins != main
    assert len(ins.encode()) <= 63 and ins.endswith("_ins")
    assert ins.startswith(name[:59])


def _diverging(table_: str, size: int, changes: int | None = 3) -> Diverging:
    schema, name = table_.split(".")
    return Diverging(table_, schema, name, changes, size)


def test_no_refusal_when_every_diverging_table_is_small_enough_to_copy_again() -> None:
    assert refuse_before_fence([]) is None
    assert refuse_before_fence([_diverging("public.log", RECOPY_MAX_BYTES)]) is None
    assert refuse_before_fence([_diverging("public.log", 10 << 20)], limit_bytes=20 << 20) is None


def test_the_refusal_names_each_large_table_and_the_three_ways_out() -> None:
    small = _diverging("public.small", 1 << 20)
    big = _diverging("public.audit", RECOPY_MAX_BYTES + 1, changes=12)
    reset = _diverging("app.events", 3 * RECOPY_MAX_BYTES, changes=None)
    message = refuse_before_fence([small, big, reset])
    assert message is not None
    assert message.startswith("2 table(s) without a primary key or usable replica identity")
    assert "public.small" not in message  # copied again, not a reason to refuse
    assert "public.audit (64.0 MB: 12 row(s) updated or deleted)" in message
    assert "app.events (192.0 MB: its statistics were reset" in message
    assert "64.0 MB the cutover copies again while the source is fenced" in message
    for t in ("public.audit", "app.events"):
        assert f"ALTER TABLE {t} REPLICA IDENTITY FULL" in message
        assert f"add a primary key to {t}" in message
        assert f"--exclude-table {t}" in message
    assert message.count("applier migrate abort") == 2


def test_a_lower_limit_refuses_a_smaller_table() -> None:
    message = refuse_before_fence([_diverging("public.log", 2 << 20)], limit_bytes=1 << 20)
    assert message is not None and "larger than the 1.0 MB" in message


def test_status_shows_a_diverging_table_as_json() -> None:
    doc = [d.to_json() for d in (_diverging("public.log", 8192), _diverging("public.big", 1 << 30, None))]
    assert json.loads(json.dumps(doc)) == [
        {"table": "public.log", "updates_deletes": 3, "statistics_reset": False, "bytes": 8192, "recopy": True},
        {"table": "public.big", "updates_deletes": None, "statistics_reset": True, "bytes": 1 << 30,
         "recopy": False},
    ]  # fmt: skip


# --- plan -------------------------------------------------------------------------------------------------------


def test_a_keyless_table_without_updates_is_published_insert_only_and_the_warning_names_the_ways_out() -> (
    None
):
    quiet = table("log", has_pk=False, identity_usable=False, updates_deletes=0, total_bytes=1 << 20)
    plan = assess(source(tables=[quiet]), target(), Selection(), PG18)
    assert plan.ok
    (w,) = [w for w in plan.warnings if w.code == "no_identity_yet"]
    assert "published for INSERT and TRUNCATE only" in w.message
    assert "will not reach the target" in w.message and "copies it again" in w.message
    assert "fail on the source" not in w.message  # it no longer would
    assert "larger than that now" not in w.message
    assert "ALTER TABLE public.log REPLICA IDENTITY FULL" in w.hint
    assert "applier migrate abort" not in w.hint and "add a primary key" in w.hint  # nothing to abort yet
    assert "--exclude-table public.log" in w.hint


def test_the_warning_says_when_the_table_is_already_too_large_to_copy_again() -> None:
    big = table(
        "log", has_pk=False, identity_usable=False, updates_deletes=0, total_bytes=RECOPY_MAX_BYTES + 1
    )
    (w,) = [
        w
        for w in assess(source(tables=[big]), target(), Selection(), PG18).warnings
        if w.code == "no_identity_yet"
    ]
    assert "at 64.0 MB it is larger than that now" in w.message


def test_a_keyless_table_with_updates_still_blocks_because_they_cannot_be_migrated() -> None:
    busy = table("log", has_pk=False, identity_usable=False, updates_deletes=4)
    (b,) = assess(source(tables=[busy]), target(), Selection(), PG18).blockers
    assert b.code == "no_identity"
    assert "cannot be migrated" in b.message and "fail on the source" not in b.message
    assert "ALTER TABLE public.log REPLICA IDENTITY FULL" in b.hint and "--exclude-table public.log" in b.hint
