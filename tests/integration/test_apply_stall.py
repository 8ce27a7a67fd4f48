"""No silent stall (issue 30, item 6): a target whose trigger answers every applied row with a large NOTICE.

pgcopydb's ``pipeline-deadlock.sql`` replays thousands of small transactions into a table whose ``ENABLE REPLICA``
trigger raises a 32 kB NOTICE per row. On the pipelined target connection the notices are output the target backend
must write before it reads on; if the worker stops reading the target's socket while it waits on the publisher, the
backend blocks on its full send buffer and the worker waits on a publisher that has nothing more to send. Here the
publisher goes quiet right after the load, so the target must catch up within a bounded time all the same.
"""

from __future__ import annotations

import pytest

from applier.apply.testing import setup_subscription
from applier.testing import wait_for_catchup

pytestmark = pytest.mark.core

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
