"""The cutover's sequences (:mod:`applier.migrate.sequences`, issue 28) on real servers: what is read before the
fence (which sequences, their owning columns, those columns' extremes on the target) and what under it (the
values, and the extremes again only for the tables changed since the count). A column read again must catch a
value past its sequence; a column not read again keeps its extremes from before the fence."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from applier.migrate import sequences as seqs
from applier.migrate.state import MigrationError

pytestmark = pytest.mark.core

SCHEMA = (
    "CREATE TABLE log (id serial PRIMARY KEY, note text);"
    "CREATE TABLE down (id int PRIMARY KEY); CREATE SEQUENCE down_seq INCREMENT BY -1 START 0 MAXVALUE 0 OWNED BY"
    " down.id; CREATE SEQUENCE free_seq; CREATE SEQUENCE unset_seq; CREATE SEQUENCE fresh_seq START 9;"
)


def _prepared(pair: Any) -> tuple[psycopg.Connection[Any], psycopg.Connection[Any], seqs.Owned]:
    """The schema on both servers; five rows in ``log``, ``free_seq`` at 42, ``unset_seq`` set to 7 not called,
    ``down_seq`` three steps down on the source; the same rows on the target (as the copy left them): connections
    to both, and the source's sequences."""
    for db in (pair.publisher, pair.target):
        db.execute(SCHEMA)
    pair.publisher.execute("INSERT INTO log (note) SELECT 'x' FROM generate_series(1, 5)")
    pair.publisher.execute(
        "SELECT setval('free_seq', 42), setval('unset_seq', 7, false), nextval('down_seq'), nextval('down_seq'),"
        " nextval('down_seq')"
    )
    pair.target.execute("INSERT INTO log SELECT g, 'x' FROM generate_series(1, 5) g")
    pair.target.execute("INSERT INTO down VALUES (0), (-1), (-2)")
    src = psycopg.connect(pair.publisher.dsn, autocommit=True)
    tgt = psycopg.connect(pair.target.dsn, autocommit=True)
    return src, tgt, seqs.list_source(src, lambda schema: schema == "public")


def test_sequences_are_set_and_checked_against_their_columns(pair: Any) -> None:
    src, tgt, owned = _prepared(pair)
    with src, tgt:
        assert owned.seqs == [
            "public.down_seq", "public.free_seq", "public.fresh_seq", "public.log_id_seq", "public.unset_seq"
        ]  # fmt: skip
        assert owned.owned == {
            "public.down_seq": ("public.down", "id"),
            "public.log_id_seq": ("public.log", "id"),
        }
        before = seqs.extremes(tgt, owned)
        assert before == {"public.down_seq": (0, -2), "public.log_id_seq": (5, 1)}
        values = seqs.read_values(src, owned.seqs)
        assert sorted(values) == [
            ("public.down_seq", -2, True, -1), ("public.free_seq", 42, True, 1),
            ("public.fresh_seq", 9, False, 1), ("public.log_id_seq", 5, True, 1), ("public.unset_seq", 7, False, 1),
        ]  # fmt: skip
        seqs.set_on_target(tgt, owned, values, before, changed=set())
        got = tgt.execute(
            "SELECT nextval('free_seq'), nextval('log_id_seq'), nextval('down_seq'), nextval('unset_seq'),"
            " nextval('fresh_seq')"
        ).fetchone()
        assert got == (43, 6, -3, 7, 9)


def test_a_changed_table_is_read_again_under_the_fence(pair: Any) -> None:
    """A row past the sequence that reached the target after the extremes were read: found when its table changed
    since the count (read again), not when it did not (the documented limit: nothing else may write to the new
    server before the cutover is done); with no extremes from before, every column is read."""
    src, tgt, owned = _prepared(pair)
    with src, tgt:
        before = seqs.extremes(tgt, owned)
        tgt.execute("INSERT INTO log VALUES (1000, 'past the sequence'); INSERT INTO down VALUES (-50)")
        values = seqs.read_values(src, owned.seqs)
        seqs.set_on_target(tgt, owned, values, before, changed=set())  # neither read again: not seen
        for changed, message in [
            (
                {"public.log"},
                "sequence public.log_id_seq would next give 6, but public.log.id already holds 1000",
            ),
            (
                {"public.down"},
                "sequence public.down_seq would next give -3, but public.down.id already holds -50",
            ),
            (None, "would next give"),
        ]:
            with pytest.raises(MigrationError, match=message):
                seqs.set_on_target(tgt, owned, values, None if changed is None else before, changed)
