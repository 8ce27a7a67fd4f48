"""Which statement of the client's string a captured DDL event is (applier.ddl.statements), and the capture's
payload codec (applier.ddl.payload): pure, no server."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.ddl.payload import DdlEvent, DdlObject, DdlPayloadError, decode_payload, encode_payload
from applier.ddl.statements import code_names, fills_rows_anew, replay_for, without_data


def event(query: str, n: int = 1, tag: str = "ALTER TABLE", **kw: object) -> DdlEvent:
    return DdlEvent(slot="s", tag=tag, n=n, ts="t", query=query, search_path="public", **kw)  # type: ignore[arg-type]


def test_a_lone_statement_is_itself() -> None:
    assert replay_for(event("ALTER TABLE t ADD c int")).statement == "ALTER TABLE t ADD c int"
    assert (
        replay_for(event("-- why\nCOMMENT ON TABLE t IS 'x'", tag="COMMENT")).statement
        == "COMMENT ON TABLE t IS 'x'"
    )
    assert replay_for(event("create unique index if not exists i on t (c)", tag="CREATE INDEX")).statement


def test_the_nth_event_is_the_nth_ddl_statement_of_the_string_skipping_dml_and_global_objects() -> None:
    q = (
        "/* release 42 */ BEGIN; INSERT INTO t VALUES (1); ALTER TABLE t ADD c int; CREATE ROLE r;"
        " COMMENT ON DATABASE d IS 'x'; UPDATE t SET c = 1; CREATE INDEX i ON t (c); COMMIT"
    )
    assert replay_for(event(q, 1)).statement == "ALTER TABLE t ADD c int"
    assert replay_for(event(q, 2, "CREATE INDEX")).statement == "CREATE INDEX i ON t (c)"
    assert replay_for(event(q, 3, "CREATE INDEX")).statement is None


def test_dollar_quotes_and_comments_do_not_split_a_statement() -> None:
    q = "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$; -- a ; comment\nDROP TABLE x"
    assert replay_for(event(q, 1, "CREATE FUNCTION")).statement.startswith("CREATE FUNCTION f()")  # type: ignore[union-attr]
    assert replay_for(event(q, 2, "DROP TABLE")).statement == "DROP TABLE x"


def test_ddl_from_code_is_never_guessed() -> None:
    do = replay_for(event("DO $$ BEGIN EXECUTE 'ALTER TABLE t ADD c int'; END $$"))
    assert do.statement is None and "DO" in (do.why or "")
    # a function called by a SELECT ran the DDL: the first DDL statement of the string is another kind
    called = replay_for(event("SELECT make_partitions(); CREATE INDEX i ON t (c)", 1, "CREATE TABLE"))
    assert called.statement is None
    assert replay_for(event("SELECT f()", 1)).statement is None


def test_concurrently_is_dropped_for_a_transaction_block() -> None:
    got = replay_for(event("create index concurrently if not exists i on s.t (c)", 1, "CREATE INDEX"))
    assert got.statement is not None and "CONCURRENTLY" not in got.statement.upper()
    assert "IF NOT EXISTS" in got.statement.upper()
    detach = replay_for(event("ALTER TABLE p DETACH PARTITION p1 CONCURRENTLY"))
    assert detach.statement is not None and "CONCURRENTLY" not in detach.statement.upper()


def test_a_table_with_rows_is_created_without_them() -> None:
    assert without_data("CREATE TABLE n AS SELECT * FROM t").endswith("WITH NO DATA")
    assert without_data("SELECT a, b INTO n FROM t WHERE a > 1").startswith("CREATE TABLE n AS SELECT")
    assert without_data("CREATE TABLE plain (a int)") == "CREATE TABLE plain (a int)"


def test_an_unparsable_string_says_so() -> None:
    got = replay_for(event("ALTER TABLE t ADD COLUMN"))
    assert got.statement is None and "parse" in (got.why or "")


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_objects = st.builds(DdlObject, _text, st.none() | _text, _text, st.none() | _text, st.booleans())


@given(st.builds(DdlEvent, _text, _text, st.integers(1, 2**31), _text, _text, _text, st.tuples(_objects)))
def test_payload_round_trips(ev: DdlEvent) -> None:
    assert decode_payload(encode_payload(ev)) == ev


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\xff", "not JSON"), (b"[]", "not a JSON object"), (b'{"v": 2}', "version 2"),
        (b'{"v": 1, "n": 0}', "'n' is 0"), (b'{"v": 1, "n": 1, "slot": 3}', "'slot' is int"),
    ],
)  # fmt: skip
def test_a_bad_payload_is_named(raw: bytes, words: str) -> None:
    with pytest.raises(DdlPayloadError, match=words):
        decode_payload(raw)


def test_the_code_an_alter_table_runs_on_existing_rows_is_named_for_the_trust_rule() -> None:
    functions, operators = code_names(
        "ALTER TABLE t ADD COLUMN c int DEFAULT s.f(1) + g(2), ALTER COLUMN v TYPE int USING length(v),"
        " ADD CHECK (h(c) OPERATOR(s.===) 0)"
    )
    assert set(functions) == {("s", "f"), ("", "g"), ("", "length"), ("", "h")}
    assert ("", "+") in operators and ("s", "===") in operators
    assert code_names("CREATE INDEX i ON t (f(c))") == ((), ())  # runs as the table's owner


@pytest.mark.parametrize(
    ("statement", "anew"),
    [
        ("ALTER TABLE t ADD COLUMN c int DEFAULT 5", False), ("ALTER TABLE t ADD c text DEFAULT 'x'::text", False),
        ("ALTER TABLE t ADD c int", False), ("ALTER TABLE t ALTER v TYPE bigint USING v::bigint", False),
        ("ALTER TABLE t ADD CHECK (f(c) > 0)", False), ("CREATE TABLE n (c serial)", False),
        ("ALTER TABLE t ADD r float8 DEFAULT random()", True), ("ALTER TABLE t ADD c timestamptz DEFAULT now()", True),
        ("ALTER TABLE t ADD c timestamptz DEFAULT current_timestamp", True), ("ALTER TABLE t ADD c serial", True),
        ("ALTER TABLE t ADD c int GENERATED ALWAYS AS IDENTITY", True),
        ("ALTER TABLE t ALTER v TYPE int USING length(v)", True),
    ],
)  # fmt: skip
def test_an_alter_that_fills_rows_with_values_each_server_computes_is_told(
    statement: str, anew: bool
) -> None:
    assert fills_rows_anew(statement) is anew
