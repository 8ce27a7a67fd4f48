"""Do no harm to the source (issue 43): a migrated table without a primary key or usable replica identity goes in
the insert-only publication ``<name>_ins``, so that the application's UPDATE and DELETE on it keep working on the
production source while the migration follows it (they failed: "cannot update table ... because it does not have a
replica identity and publishes updates"). Its INSERTs still reach the target; once it receives UPDATE/DELETE it is
seen diverging, and copied again under the fence it equals the source's. Against real servers, through
``applier migrate start``."""

from __future__ import annotations

from typing import Any

import pytest

from applier.migrate import fence as fencing
from applier.migrate import publications, store
from applier.testing import assert_tables_equal, wait_until
from tests.support.migrate import following, stop

pytestmark = pytest.mark.core

# hits: the application's keyless log (a generated column, which a copy leaves to the target); events: no key but
# REPLICA IDENTITY FULL (every operation); ev: partitioned without a key, where one partition has a key of its own
# and the other none (a partition's own identity is what PostgreSQL checks); on the target, a trigger that refuses
# to delete the rows kept, which a copy again must not fire (the source is the authority)
SCHEMA = """
CREATE TABLE acc (id int PRIMARY KEY, v int NOT NULL);
CREATE TABLE hits (at timestamptz NOT NULL DEFAULT now(), what text NOT NULL, n int,
                   twice int GENERATED ALWAYS AS (n * 2) STORED);
CREATE TABLE events (what text);
ALTER TABLE events REPLICA IDENTITY FULL;
CREATE TABLE ev (id int NOT NULL, day date NOT NULL, v text) PARTITION BY RANGE (day);
CREATE TABLE ev_old PARTITION OF ev FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
CREATE TABLE ev_new PARTITION OF ev FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
ALTER TABLE ev_new ADD PRIMARY KEY (id);
CREATE FUNCTION keep_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'row % is kept', OLD.what; END$$;
CREATE TRIGGER hits_kept BEFORE DELETE ON hits FOR EACH ROW WHEN (OLD.what = 'kept') EXECUTE FUNCTION keep_kept();
INSERT INTO acc SELECT g, g FROM generate_series(1, 200) g;
INSERT INTO hits (what, n) SELECT CASE WHEN g <= 10 THEN 'kept' ELSE 'h' || g END, g FROM generate_series(1, 300) g;
INSERT INTO events SELECT 'e' || g FROM generate_series(1, 50) g;
INSERT INTO ev SELECT g, DATE '2024-03-01' + g, 'v' FROM generate_series(1, 400) g;
"""

INSERT_ONLY = ["public.ev_old", "public.hits"]
ALL_TABLES = ("public.acc", "public.hits", "public.events", "public.ev_old", "public.ev_new")


def _publications(db: Any) -> dict[str, tuple[bool, bool, bool, bool, list[str]]]:
    """Each publication of migration ``mig``: what it publishes (insert, update, delete, truncate) and its tables."""
    rows = db.query(
        "SELECT p.pubname, p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate,"
        " coalesce(array_agg(t.schemaname || '.' || t.tablename ORDER BY 1, 2) FILTER (WHERE t.tablename IS NOT"
        " NULL), '{}') FROM pg_publication p LEFT JOIN pg_publication_tables t ON t.pubname = p.pubname"
        " WHERE p.pubname IN ('mig', 'mig_ins') GROUP BY 1, 2, 3, 4, 5"
    )
    return {r[0]: (r[1], r[2], r[3], r[4], sorted(r[5])) for r in rows}


def test_a_keyless_table_takes_every_write_on_the_source(pair, procs, tmp_path) -> None:
    """Published insert-only, followed, seen diverging, copied again under the fence, both publications dropped."""
    pub, tgt = pair.publisher, pair.target
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    assert (
        "publication mig_ins: 2 table(s)" in log.read_text() and "INSERT and TRUNCATE only" in log.read_text()
    )
    assert _publications(pub) == {
        "mig": (True, True, True, True, ["public.acc", "public.ev_new", "public.events"]),
        "mig_ins": (True, False, False, True, INSERT_ONLY),
    }
    assert sorted(tgt.scalar("SELECT subpublications FROM applier.subscription WHERE subname = 'mig'")) == [
        "mig",
        "mig_ins",
    ]
    assert_tables_equal(pub, tgt, *ALL_TABLES)
    with tgt.connect() as t:
        m = store.load(t, "mig")
    assert m is not None and sorted(m.notes["insert_only"]["tables"]) == INSERT_ONLY

    # the application's inserts follow; with no UPDATE/DELETE yet, nothing diverges
    pub.execute("INSERT INTO hits (what, n) SELECT 'late' || g, g FROM generate_series(1, 20) g")
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM hits") == 320, timeout=60, what="the inserts")
    with pub.connect() as src:
        assert publications.diverging(src, m) == []

    # as the application would, on the source: UPDATE and DELETE on the keyless tables work (they failed before);
    # the table with a key of its own, and the one with REPLICA IDENTITY FULL, replicate them as before
    with pub.connect() as app:
        app.execute("UPDATE hits SET n = n + 1000 WHERE what LIKE 'h1%'")
        app.execute("DELETE FROM hits WHERE what LIKE 'h2%'")
        app.execute("UPDATE ev SET v = 'changed' WHERE id % 3 = 0")  # both partitions
        app.execute("DELETE FROM events WHERE what = 'e1'")
        app.execute("INSERT INTO hits (what, n) VALUES ('after', 1)")
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM hits WHERE what = 'after'") == 1, timeout=60,
               what="the insert after the updates")  # fmt: skip
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM events") == 49, timeout=60, what="the delete")
    assert_tables_equal(pub, tgt, "public.acc", "public.events", "public.ev_new")
    assert pub.scalar("SELECT count(*) FROM hits") < tgt.scalar("SELECT count(*) FROM hits")  # not migrated

    # status: both keyless tables diverge (the statistics reach pg_stat_user_tables within about a second)
    def seen() -> list[str]:
        with pub.connect() as src:
            return [d.table for d in publications.diverging(src, m)]

    wait_until(lambda: seen() == INSERT_ONLY, timeout=30, what="the insert-only tables diverging")
    with pub.connect() as src:
        report = publications.report(src, m)
        found = publications.diverging(src, m)
    assert [(r["table"], r["recopy"], r["statistics_reset"]) for r in report] == [
        ("public.ev_old", True, False),
        ("public.hits", True, False),
    ]
    assert all(r["updates_deletes"] > 0 and r["bytes"] > 0 for r in report)
    assert publications.refuse_before_fence(found) is None  # small: copied again
    refusal = publications.refuse_before_fence(found, limit_bytes=1)
    assert refusal is not None and "ALTER TABLE public.hits REPLICA IDENTITY FULL" in refusal

    # the cutover's part: under the fence, once the target has caught up, copy them again (the target's trigger,
    # which would refuse the DELETE of the kept rows, does not fire)
    assert tgt.scalar("SELECT tgenabled FROM pg_trigger WHERE tgname = 'hits_kept'") == "O"
    with fencing.open_source(pub.dsn) as src, tgt.connect() as target:
        fencing.fence(src)
        try:
            said: list[str] = []
            copied = publications.recopy(src, target, found, said.append)
        finally:
            fencing.unfence(src)
    assert copied == {
        "public.ev_old": pub.scalar("SELECT count(*) FROM ev_old"),
        "public.hits": pub.scalar("SELECT count(*) FROM hits"),
    }
    assert len(said) == 2 and "copied again: public.hits" in said[1]
    assert_tables_equal(pub, tgt, *ALL_TABLES)
    assert tgt.scalar("SELECT count(*) FROM hits WHERE what = 'kept'") == 10  # the trigger did not fire

    stop(proc, log)
    with fencing.open_source(pub.dsn) as src:
        publications.drop(src, "mig", said.append)
    assert _publications(pub) == {}
    assert said[-1] == "publication mig, mig_ins dropped from the source"
