"""The DDL capture's SQL built without a server (:mod:`applier.ddl.capture_sql`): shell patterns as PostgreSQL
regular expressions that match what :func:`fnmatch.fnmatchcase` matches, the names it creates on the source, and
the functions' text (the server-side behaviour is tests/integration/test_ddl_capture.py's)."""

from __future__ import annotations

import fnmatch
import re

from hypothesis import assume, given
from hypothesis import strategies as st

from applier.ddl.capture_sql import (
    BUSY,
    SCHEMA,
    Published,
    covers_schema_sql,
    covers_sql,
    glob_regex,
    names,
    trigger_function,
    worker_function,
)
from applier.ddl.payload import PREFIX
from applier.migrate.selection import SYSTEM_SCHEMAS, Selection

# what a PostgreSQL ARE and Python's re agree on for the constructs glob_regex emits (anchors, ., .*, brackets,
# escaped punctuation), so Python's re stands in for the server here
_ALPHABET = st.sampled_from(list("ab_.*?[]!^-\\$ç"))


@given(st.text(_ALPHABET, max_size=8), st.text(st.sampled_from(list("ab_.*?[]!^-\\$ç")), max_size=6))
def test_glob_regex_matches_what_fnmatch_matches(pattern: str, name: str) -> None:
    try:
        regex = re.compile(glob_regex(pattern), re.DOTALL)
    except re.error:
        assume(False)  # a bracket expression Python's re reads differently (the server test covers those)
    assert bool(regex.fullmatch(name)) == fnmatch.fnmatchcase(name, pattern), (
        pattern,
        name,
        glob_regex(pattern),
    )


def test_glob_regex_examples() -> None:
    assert glob_regex("orders*") == "^orders.*$"
    assert glob_regex("a?b") == "^a.b$"
    assert glob_regex("t[!0-9]") == "^t[^0-9]$"
    assert glob_regex("x.y[") == "^x\\.y\\[$"
    assert glob_regex("my_table") == "^my_table$"


def test_our_schema_is_never_migrated() -> None:
    assert SCHEMA in SYSTEM_SCHEMAS
    assert not Selection().covers_schema(SCHEMA)


def test_long_slot_names_fit_and_stay_apart() -> None:
    a, b = names("s" * 60 + "a"), names("s" * 60 + "b")
    for n in (a, b):
        assert all(
            len(x.encode()) <= 63
            for x in (n.end_trigger, n.drop_trigger, n.trigger_function, n.worker_function)
        )
    assert a.end_trigger != b.end_trigger and a.worker_function != b.worker_function
    assert (
        names("mig").end_trigger == "applier_ddl_mig" and names("mig").drop_trigger == "applier_ddl_mig_drop"
    )


def test_the_worker_embeds_the_selection_and_the_publications() -> None:
    text = worker_function(
        "mig", Selection(schemas=("app*",), exclude_tables=("app.tmp_*",)), ("mig", "mig_ins")
    )
    assert "SECURITY DEFINER SET search_path = pg_catalog, pg_temp" in text
    assert "'^app.*$'" in text and "'^tmp_.*$'" in text
    assert f"'{PREFIX}'" in text and f"'{BUSY}'" in text
    assert "ALTER PUBLICATION" in text and "'mig_ins'" in text
    assert "@" not in text  # every placeholder filled
    plain = worker_function("sub", Selection(), None)
    assert "ADD TABLE" not in plain


def test_the_trigger_function_runs_as_the_caller_and_reads_its_search_path() -> None:
    text = trigger_function("mig")
    assert "SECURITY DEFINER" not in text and "SET search_path" not in text
    assert (
        '"applier_capture"."ddl_mig_emit"(TG_EVENT, TG_TAG, pg_catalog.current_setting(\'search_path\'))'
        in text
    )


def test_a_pattern_cannot_end_the_function_body() -> None:
    text = worker_function("mig", Selection(tables=("$applier_capture$",)), None)
    assert text.count("$applier_capture$") == 2  # the pattern's $ are escaped in its regular expression
    quoted = covers_sql(Selection(tables=("o'brien",)), "s", "t")
    assert "''brien" in quoted  # quoted as a literal


def test_a_subscriptions_publications_are_matched_by_exact_name_and_by_oid() -> None:
    """``create --ddl``'s scope (:class:`Published`): names are literals, never patterns, so ``t*`` and a schema
    with a dot mean themselves; a listed table is also found by OID in the publications (renamed since)."""
    p = Published(("pub",), schemas=("a.b",), tables=(("s", "t*"),))
    table = covers_sql(p, "n", "r", "o")
    assert "('s', 't*')" in table and "'a.b'" in table and "~" not in table
    assert "o IN (SELECT pr.prrelid" in table and "'pub'" in table
    schema = covers_schema_sql(p, "n")
    assert "'a.b'" in schema and "'t*'" not in schema  # a listed table's schema is not covered as a whole
    assert "'{}'::text[]" in covers_schema_sql(Published(("pub",)), "n")  # nothing listed: no schema
    everything = covers_sql(Published(("pub",), all_tables=True), "n", "r", "o")
    assert "prrelid" not in everything and "pg_catalog" in everything  # every user schema
    text = worker_function("sub", p, None)
    assert "t.root_oid IN" in text and "ADD TABLE" not in text and "@" not in text
