"""Row changes end to end: a real publisher, our worker, a real target."""

from __future__ import annotations

import pytest

from applier.apply.testing import setup_subscription
from applier.testing import assert_tables_equal, wait_for_catchup

pytestmark = pytest.mark.core


def test_insert_update_delete(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 500) g")
        pair.publisher.execute("UPDATE t SET v = 'x' WHERE id % 3 = 0")
        pair.publisher.execute("UPDATE t SET id = id + 1000 WHERE id % 7 = 0")
        pair.publisher.execute("DELETE FROM t WHERE id % 5 = 0")
        wait_for_catchup(pair.publisher, pair.name, timeout=30)
        assert_tables_equal(pair.publisher, pair.target, "public.t")
    finally:
        w.stop()
