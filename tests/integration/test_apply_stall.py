"""No silent stall (issue 30, item 6): a target whose trigger answers every applied row with a large NOTICE.

pgcopydb's ``pipeline-deadlock.sql`` replays thousands of small transactions into a table whose ``ENABLE REPLICA``
trigger raises a 32 kB NOTICE per row. On the pipelined target connection the notices are output the target backend
must write before it reads on; if the worker stops reading the target's socket while it waits on the publisher, the
backend blocks on its full send buffer and the worker waits on a publisher that has nothing more to send. Here the
publisher goes quiet right after the load, so the target must catch up within a bounded time all the same.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from applier import subscriptions
from applier.apply.testing import setup_subscription
from applier.testing import wait_for_catchup, wait_until

pytestmark = [pytest.mark.core, pytest.mark.anyversion]  # how the loop reads the target's socket

#: rows, one small transaction each, and the NOTICE each of them raises on the target
ROWS = 5000
NOTICE_BYTES = 32 * 1024
#: how long the target may take after the publisher's last commit (it takes well under a second with the fix)
CATCH_UP_S = 15

_WAITING_FOR_LOCK = (
    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'public.deadlock'::regclass"
)
_TRIGGER = f"""
CREATE FUNCTION noisy() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE NOTICE '%', repeat('n', {NOTICE_BYTES});
    RETURN NEW;
END $$;
CREATE TRIGGER noisy BEFORE INSERT OR UPDATE ON deadlock FOR EACH ROW EXECUTE FUNCTION noisy();
ALTER TABLE deadlock ENABLE REPLICA TRIGGER noisy;
"""


def test_many_small_transactions_into_a_noisy_trigger_catch_up(pair) -> None:  # type: ignore[no-untyped-def]
    """One transaction per client round trip, as psql replays pgcopydb's file: the worker reads them as they come,
    a few per round, and the target falls behind by however many rows its notices were not read for. Before the
    fix, once the publisher went quiet, the target's backend sat in ``ClientWrite`` and the worker drained one
    socket read (one or two notices) per round of a 0.2 s wait: about 10 rows a second, ``flush_lsn`` frozen (the
    WAL positions query is queued behind them). How far behind it was when the load ended varied from run to run:
    this failed in most runs before the fix (see the commit), never after it."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE deadlock (id int PRIMARY KEY, v text)")
    pair.target.execute(_TRIGGER)
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.deadlock"])
    w = s.start()
    try:
        with pair.publisher.connect() as conn:
            for i in range(1, ROWS + 1):
                conn.execute("INSERT INTO deadlock VALUES (%s, %s)", (i, f"v{i}"))
        # the publisher is quiet from here on: only the target's side can move the worker on
        wait_for_catchup(pair.publisher, pair.name, timeout=CATCH_UP_S)
        assert pair.target.scalar("SELECT count(*) FROM deadlock") == ROWS
        assert not pair.target.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'ClientWrite' AND datname = current_database()"
        )
    finally:
        w.stop()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> logging.LogRecord | None:
    return next((r for r in caplog.records if text in r.getMessage()), None)


def _looks(w, n: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until the worker's stall watchdog has looked ``n`` more times (a condition, not a sleep)."""
    start = w.worker.watchdog.looks
    wait_until(lambda: w.worker.watchdog.looks >= start + n, timeout=30, what=f"{n} looks of the watchdog")


def test_a_stall_is_reported_with_what_the_worker_waits_on(pair, caplog) -> None:  # type: ignore[no-untyped-def]
    """What is left for the watchdog (applier.apply.stall): a lock on the target holds the worker's INSERT, so it is
    behind with no progress; after ``stall_after`` a WARNING names the target, once, the stall counter counts it,
    and a line says when it moves again. An idle worker is never reported."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE held (id int PRIMARY KEY)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.held"])
    logger = logging.getLogger("applier.test.stall")
    labels = {"subscription": pair.name, "waiting_on": "target"}
    caplog.set_level(logging.INFO, logger=logger.name)
    w = s.start(logger=logger, stall_after=1.0)
    try:
        pair.publisher.execute("INSERT INTO held VALUES (0)")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)  # the table's first use is behind us
        _looks(w, 3)  # three of the watchdog's looks at an idle worker
        assert _said(caplog, "no progress") is None  # idle is not stalled
        with pair.target.connect(autocommit=False) as lock:
            lock.execute("LOCK TABLE held IN SHARE MODE")  # INSERT waits; the worker's lookups do not
            pair.publisher.execute("INSERT INTO held VALUES (1)")
            record = wait_until(lambda: _said(caplog, "no progress"), timeout=30, what="the stall warning")
            assert record.levelno == logging.WARNING
            assert "waiting on the target (" in record.getMessage()
            assert (REGISTRY.get_sample_value("applier_apply_stalls_total", labels) or 0) >= 1
            # applier status shows it too, with what the worker waits on
            shown = wait_until(lambda: subscriptions.status(pair.target.dsn, pair.name)[0]["stalled"], timeout=10,
                               what="the stall in status")  # fmt: skip
            assert shown["waiting_on"] == "target" and shown["unanswered"] >= 1 and shown["since"]
            assert "STALLED since" in subscriptions.format_status(
                subscriptions.status(pair.target.dsn, pair.name)
            )
            _looks(w, 2)  # two more looks while still stalled
            assert sum("no progress" in r.getMessage() for r in caplog.records) == 1  # once per stall
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        wait_until(lambda: _said(caplog, "making progress again"), timeout=30, what="the end of the stall")
        stalled = REGISTRY.get_sample_value(
            "applier_apply_stalled_seconds_total", {"subscription": pair.name}
        )
        assert stalled is not None and stalled >= 1.0
        assert subscriptions.status(pair.target.dsn, pair.name)[0]["stalled"] is None  # gone with the stall
    finally:
        w.stop()
