"""The apply role's missing grants, decided from the target's answers (:mod:`applier.privileges`): exactly the
statements still needed, per PostgreSQL version, none for a superuser, and the least-privilege list that
docs/security.md shows and the test harness grants."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from applier.privileges import (
    ORIGIN_FUNCTIONS,
    TableFacts,
    TargetFacts,
    least_privilege_grants,
    missing_grants,
)

ALL_SET = TargetFacts(
    server_version=180000, role="app", database="shop", superuser=False, may_create_in_database=False,
    schema_exists=True, may_create_in_schema=True, may_use_schema=True, catalog_exists=False,
    catalog_writable=True, may_set_replication_role=True, tables=(TableFacts("public.t"),),
)  # fmt: skip


def test_nothing_missing_says_nothing():
    assert missing_grants(ALL_SET) == []


def test_a_superuser_needs_no_grant_whatever_the_facts():
    bare = dataclasses.replace(ALL_SET, superuser=True, schema_exists=False, may_set_replication_role=False,
                               missing_functions=ORIGIN_FUNCTIONS)  # fmt: skip
    assert missing_grants(bare) == []


def test_each_missing_piece_is_one_statement_for_the_role():
    facts = dataclasses.replace(
        ALL_SET, may_set_replication_role=False, missing_functions=("pg_catalog.pg_replication_origin_drop(text)",),
        tables=(TableFacts("public.t", ("TRUNCATE",)), TableFacts('"Odd"."T"', ("SELECT", "UPDATE")),
                TableFacts("public.ok")),
        unusable_schemas=('"Odd"',),
    )  # fmt: skip
    assert missing_grants(facts) == [
        "GRANT SET ON PARAMETER session_replication_role TO app;",
        "GRANT EXECUTE ON FUNCTION pg_catalog.pg_replication_origin_drop(text) TO app;",
        'GRANT USAGE ON SCHEMA "Odd" TO app;',
        "GRANT TRUNCATE ON TABLE public.t TO app;",
        'GRANT SELECT, UPDATE ON TABLE "Odd"."T" TO app;',
    ]


def test_before_15_no_grant_can_set_session_replication_role():
    (line,) = missing_grants(
        dataclasses.replace(ALL_SET, server_version=140011, may_set_replication_role=False)
    )
    assert line.startswith("-- PostgreSQL 14 lets only a superuser set session_replication_role")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"schema_exists": False, "may_create_in_schema": False},
         ["CREATE SCHEMA applier AUTHORIZATION app;", "-- or instead: GRANT CREATE ON DATABASE shop TO app;"]),
        ({"schema_exists": False, "may_create_in_schema": False, "may_create_in_database": True}, []),
        ({"may_create_in_schema": False}, ["ALTER SCHEMA applier OWNER TO app;"]),
        ({"catalog_exists": True, "may_create_in_schema": False}, []),
        ({"catalog_exists": True, "may_use_schema": False, "catalog_writable": False},
         ["GRANT USAGE ON SCHEMA applier TO app;",
          "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA applier TO app;",
          "GRANT USAGE ON ALL SEQUENCES IN SCHEMA applier TO app;"]),
    ],
)  # fmt: skip
def test_the_catalog_schema(change: dict[str, object], expected: list[str]):
    assert missing_grants(dataclasses.replace(ALL_SET, **change)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [150000, 160000, 180000])
def test_least_privilege_is_the_same_from_15_on(version: int):
    grants = least_privilege_grants(version, "app", "shop", ["public.t"])
    assert grants == [
        "CREATE SCHEMA applier AUTHORIZATION app;",
        "GRANT SET ON PARAMETER session_replication_role TO app;",
        *[f"GRANT EXECUTE ON FUNCTION {f} TO app;" for f in ORIGIN_FUNCTIONS],
        "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLE public.t TO app;",
    ]


def test_docs_show_the_same_grants():
    """docs/security.md's SQL block is what the code asks for: a grant added to one must be added to the other."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    shown = {
        re.sub(r"\s+", " ", s.strip()) for s in re.findall(r"^((?:GRANT|CREATE SCHEMA)[^;]*;)", doc, re.M)
    }
    needed = set(least_privilege_grants(180000, "apply_role", "mydb", ["public.orders"]))
    assert needed <= shown, needed - shown
