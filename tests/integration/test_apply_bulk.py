"""Bulk apply (:mod:`applier.apply.bulk`, docs/differences.md) against real servers: a backlog of small
transactions is applied a table stretch at a time, and the target still equals the publisher, for values of every
common type and of every character the array literals must escape; an Update whose row is missing is still one
``update_missing`` conflict per message, in its own transaction's context; tables that could observe the order
between tables (triggers enabled ALWAYS) and values that cannot travel as text go message by message."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import REGISTRY

from applier.apply.testing import setup_subscription
from applier.apply.worker import REREAD_INTERVAL
from applier.testing import assert_tables_equal, wait_for_catchup
from tests.support.tap import both

pytestmark = pytest.mark.core

AWKWARD = [
    "plain",
    "",
    "NULL",
    'a "quoted" word',
    "back\\slash",
    "{braces}",
    "a,b",
    " spaced ",
    "tab\there",
    "new\nline",
    "é ü 中文",
    "\\x00",
    "'single'",
]


def _sub(pair, *tables: str):
    return setup_subscription(pair.publisher, pair.target, pair.name, [f"public.{t}" for t in tables])


def _work(pair, *statements: str) -> None:
    """``CALL work(n)`` on the publisher runs n transactions of these statements (``i`` is the transaction's number)."""
    body = " ".join(statements)
    pair.publisher.execute(
        "CREATE PROCEDURE work(cnt int) LANGUAGE plpgsql AS $$"
        f" BEGIN FOR i IN 1..cnt LOOP {body} COMMIT; END LOOP; END $$"
    )


def _catch_up(pair, s, **kwargs):
    """Start a worker, let it apply what the publisher holds, stop it; its stats."""
    w = s.start(**kwargs)
    try:
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
    finally:
        w.stop()
    return w.worker.stats


def test_backlog_with_awkward_values_equals_the_publisher(pair):
    """Inserts and updates (several per key inside one batch) of many types and escape-worthy texts: applied in
    bulk, and the result equals the publisher column by column. Every 50th transaction also updates a table with
    an array column, whose values have no array type to travel in: those go message by message, in order."""
    both(
        pair,
        "CREATE TABLE k (id int PRIMARY KEY, t text, n numeric, ts timestamptz, b bytea, j jsonb, u uuid,"
        " f float8, d date, v varchar(20), c char(3))",
        "CREATE TABLE h (id bigint PRIMARY KEY, k int, note text)",
        "CREATE TABLE arr (id int PRIMARY KEY, tags text[])",
        "INSERT INTO k (id, t) SELECT g, 'start' FROM generate_series(1, 20) g",
        "INSERT INTO arr VALUES (1, NULL)",
    )
    pair.publisher.execute(
        """
        CREATE PROCEDURE work(cnt int, words text[]) LANGUAGE plpgsql AS $$
        BEGIN
          FOR i IN 1..cnt LOOP
            UPDATE k SET t = words[1 + i % array_length(words, 1)], n = i * 1.5, ts = '2026-01-01'::timestamptz
              + i * interval '1 second', b = int4send(i), j = jsonb_build_object('i', i, 's', words[1 + i % 3]),
              u = md5(i::text)::uuid, f = i / 3.0, d = '2026-01-01'::date + i, v = left(words[1 + i % 5], 20),
              c = CASE WHEN i % 3 = 0 THEN 'a' END
              WHERE id = 1 + i % 20;
            INSERT INTO h VALUES (i, 1 + i % 20, CASE WHEN i % 7 = 0 THEN NULL ELSE words[1 + i % 13] END);
            IF i % 50 = 0 THEN
              UPDATE arr SET tags = ARRAY[words[1 + i % 13], NULL] WHERE id = 1;
            END IF;
            COMMIT;
          END LOOP;
        END $$
        """
    )
    s = _sub(pair, "k", "h", "arr")
    pair.publisher.execute("CALL work(5000, %s)", (AWKWARD,))
    stats = _catch_up(pair, s)
    assert stats.errors == 0
    assert stats.bulk_transactions > 1000, stats
    exported = REGISTRY.get_sample_value("applier_bulk_transactions_total", {"subscription": pair.name})
    assert exported == stats.bulk_transactions
    assert_tables_equal(pair.publisher, pair.target, "public.k", "public.h", "public.arr")
    assert {r[0] for r in pair.target.query("SELECT DISTINCT note FROM h")} == set(AWKWARD) | {None}


@pytest.mark.anyversion  # our bulk path's conflicts
def test_missing_rows_are_one_conflict_per_update_message(pair, caplog):
    """Keys 1-5 exist on the publisher only: each of their Updates, applied in bulk, is logged and counted as an
    update_missing conflict with its own remote transaction, as the message-by-message path would."""
    both(pair, "CREATE TABLE k (id int PRIMARY KEY, n int)", "CREATE TABLE h (id int PRIMARY KEY)")
    pair.publisher.execute("INSERT INTO k SELECT g, 0 FROM generate_series(1, 50) g")
    pair.target.execute("INSERT INTO k SELECT g, 0 FROM generate_series(6, 50) g")
    _work(
        pair,
        "UPDATE k SET n = n + 1 WHERE id = 1 + i % 50;",
        "INSERT INTO h VALUES (i);",
    )
    s = _sub(pair, "k", "h")
    pair.publisher.execute("CALL work(1000)")
    missing_xids = {
        r[0] for r in pair.publisher.query("SELECT xmin::text FROM h WHERE (1 + id % 50) BETWEEN 1 AND 5")
    }
    assert len(missing_xids) == 100
    with caplog.at_level(logging.INFO, logger="applier"):
        stats = _catch_up(pair, s)
    assert stats.bulk_transactions > 500
    lines = [r.getMessage() for r in caplog.records if "conflict=update_missing" in r.getMessage()]
    assert len(lines) == 100
    logged = {line.split("in transaction ")[1].split(",")[0] for line in lines}
    assert logged == missing_xids
    assert all('relation "public.k"' in line and 'target relation "public.k"' in line for line in lines)
    assert pair.target.scalar("SELECT count(*) FROM k WHERE id <= 5") == 0
    assert pair.target.scalar("SELECT sum(n) FROM k") == pair.publisher.scalar(
        "SELECT sum(n) FROM k WHERE id > 5"
    )
    assert pair.target.scalar("SELECT count(*) FROM h") == 1000


@pytest.mark.anyversion  # our bulk path's ordering
def test_deletes_and_reinserts_of_one_key_keep_their_order(pair, caplog):
    """Deletes by key in bulk: a key deleted and inserted again inside one transaction and across transactions ends
    as on the publisher; keys the target lacks are one delete_missing conflict per Delete message."""
    both(pair, "CREATE TABLE k (id int, region text, n int, PRIMARY KEY (id, region))")
    pair.publisher.execute(
        "INSERT INTO k SELECT g, r, 0 FROM generate_series(1, 30) g, unnest('{eu,us}'::text[]) r"
    )
    pair.target.execute(
        "INSERT INTO k SELECT g, r, 0 FROM generate_series(1, 30) g, unnest('{eu,us}'::text[]) r WHERE g > 3"
    )
    _work(
        pair,
        "DELETE FROM k WHERE id = 1 + i % 30 AND region = 'eu';",
        "INSERT INTO k VALUES (1 + i % 30, 'eu', i);",
        "UPDATE k SET n = n + 1 WHERE id = 1 + (i + 7) % 30 AND region = 'us';",
        "IF i % 3 = 0 THEN DELETE FROM k WHERE id = 1 + (i + 11) % 30 AND region = 'us'; END IF;",
        "IF i % 3 = 1 THEN INSERT INTO k VALUES (1 + (i + 10) % 30, 'us', -i) ON CONFLICT DO NOTHING; END IF;",
    )
    s = _sub(pair, "k")
    pair.publisher.execute("CALL work(900)")
    with caplog.at_level(logging.INFO, logger="applier"):
        stats = _catch_up(pair, s)
    assert stats.errors == 0 and stats.bulk_transactions > 300, stats
    rows = "SELECT id, region, n FROM k WHERE NOT (id <= 3 AND region = 'us') ORDER BY 1, 2"
    assert pair.target.query(rows) == pair.publisher.query(rows)
    missing = [r.getMessage() for r in caplog.records if "conflict=delete_missing" in r.getMessage()]
    assert missing and all('relation "public.k"' in m for m in missing)


def test_unchanged_toast_values_are_kept_inside_bulk_runs(pair):
    """Updates that leave a TOASTed column alone carry it as unchanged: each is applied on its own, in its place
    among its table's bulk stretches, and keeps the target's value; the transactions still go in bulk."""
    both(
        pair, "CREATE TABLE doc (id int PRIMARY KEY, n int, big text)", "CREATE TABLE h (id int PRIMARY KEY)"
    )
    pair.publisher.execute("ALTER TABLE doc ALTER COLUMN big SET STORAGE EXTERNAL")
    for db in (pair.publisher, pair.target):
        db.execute("INSERT INTO doc SELECT g, 0, repeat(md5(g::text), 100) FROM generate_series(1, 20) g")
    _work(
        pair,
        "UPDATE doc SET n = n + 1 WHERE id = 1 + i % 20;",
        "IF i % 7 = 0 THEN UPDATE doc SET big = repeat(md5(i::text), 100) WHERE id = 1 + i % 20; END IF;",
        "INSERT INTO h VALUES (i);",
    )
    s = _sub(pair, "doc", "h")
    pair.publisher.execute("CALL work(1500)")
    stats = _catch_up(pair, s)
    assert stats.errors == 0 and stats.bulk_transactions > 500, stats
    assert_tables_equal(pair.publisher, pair.target, "public.doc", "public.h")


@pytest.mark.anyversion  # our bulk path's ordering
def test_tables_with_always_triggers_keep_the_publisher_order(pair):
    """A trigger enabled ALWAYS on the target sees every change in the publisher's order, across tables: such a
    table is never applied in bulk, nor is a transaction that touches it."""
    both(pair, "CREATE TABLE a (id int PRIMARY KEY, n int)", "CREATE TABLE b (id int PRIMARY KEY)")
    pair.target.execute("CREATE TABLE seen (seq serial, what text)")
    pair.target.execute(
        "CREATE FUNCTION note() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN INSERT INTO public.seen (what) VALUES (TG_TABLE_NAME || ' ' || NEW.id); RETURN NEW; END $$"
    )
    for t in ("a", "b"):
        pair.target.execute(
            f"CREATE TRIGGER note AFTER INSERT OR UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION note()"
        )
        pair.target.execute(f"ALTER TABLE {t} ENABLE ALWAYS TRIGGER note")
    _work(
        pair,
        "INSERT INTO a VALUES (i, 0);",
        "INSERT INTO b VALUES (i);",
        "UPDATE a SET n = 1 WHERE id = i;",
    )
    s = _sub(pair, "a", "b")
    pair.publisher.execute("CALL work(300)")
    stats = _catch_up(pair, s)
    assert stats.bulk_transactions == 0
    seen = [r[0] for r in pair.target.query("SELECT what FROM seen ORDER BY seq")]
    assert seen == [w for i in range(1, 301) for w in (f"a {i}", f"b {i}", f"a {i}")]
    assert_tables_equal(pair.publisher, pair.target, "public.a", "public.b")


@pytest.mark.anyversion  # our bulk path's re-check
def test_a_trigger_enabled_always_while_running_is_noticed(pair):
    """The first backlog goes in bulk; then a trigger is enabled ALWAYS on the target while the worker runs: once
    the worker has looked again (about once a second while idle), the next backlog reaches the trigger in the
    publisher's order."""
    both(pair, "CREATE TABLE a (id int PRIMARY KEY, n int)", "CREATE TABLE b (id int PRIMARY KEY)")
    pair.target.execute("CREATE TABLE seen (seq serial, what text)")
    pair.target.execute(
        "CREATE FUNCTION note() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN INSERT INTO public.seen (what) VALUES (TG_TABLE_NAME || ' ' || NEW.id); RETURN NEW; END $$"
    )
    pair.publisher.execute(
        "CREATE PROCEDURE work(lo int, hi int) LANGUAGE plpgsql AS $$ BEGIN FOR i IN lo..hi LOOP"
        " INSERT INTO a VALUES (i, 0); INSERT INTO b VALUES (i); UPDATE a SET n = 1 WHERE id = i; COMMIT;"
        " END LOOP; END $$"
    )
    s = _sub(pair, "a", "b")
    pair.publisher.execute("CALL work(1, 500)")
    w = s.start()
    try:
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        for t in ("a", "b"):
            pair.target.execute(
                f"CREATE TRIGGER note AFTER INSERT OR UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION note()"
            )
            pair.target.execute(f"ALTER TABLE {t} ENABLE ALWAYS TRIGGER note")
        time.sleep(3 * REREAD_INTERVAL)  # the worker's own interval, not a condition we could wait for
        pair.publisher.execute("CALL work(501, 800)")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
    finally:
        w.stop()
    assert w.worker.stats.bulk_transactions >= 100
    seen = [r[0] for r in pair.target.query("SELECT what FROM seen ORDER BY seq")]
    assert seen == [w for i in range(501, 801) for w in (f"a {i}", f"b {i}", f"a {i}")]
    assert_tables_equal(pair.publisher, pair.target, "public.a", "public.b")


def test_bulk_off_applies_message_by_message(pair):
    """``bulk=False`` (``APPLIER_BULK_APPLY=0``): the same backlog, message by message, the same result."""
    both(pair, "CREATE TABLE k (id int PRIMARY KEY, n int)")
    pair.publisher.execute("INSERT INTO k SELECT g, 0 FROM generate_series(1, 10) g")
    pair.target.execute("INSERT INTO k SELECT g, 0 FROM generate_series(1, 10) g")
    _work(pair, "UPDATE k SET n = n + i WHERE id = 1 + i % 10;")
    s = _sub(pair, "k")
    pair.publisher.execute("CALL work(500)")
    stats = _catch_up(pair, s, bulk=False)
    assert stats.bulk_transactions == 0 and stats.groups > 0
    assert_tables_equal(pair.publisher, pair.target, "public.k")
