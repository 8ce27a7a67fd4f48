"""bench/live_bench.py's measuring pieces: the pure ones (percentile, bounded-lag test, GID and pgbench parsing) and,
for real, the marker writer, the visibility pollers and the lag computation over a native subscription."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
from psycopg import sql

from applier.testing import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import live_bench as lb  # noqa: E402


def test_percentile_interpolates_between_ranks() -> None:
    assert lb.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert lb.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert lb.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert lb.percentile([5.0], 99) == 5.0
    assert math.isnan(lb.percentile([], 50))


def test_lag_bounded() -> None:
    steady = [(float(t), 0.01 + 0.005 * (t % 3)) for t in range(30)]
    assert lb.lag_bounded(steady)[0]
    # grows by 0.1 s per second of load: the last third is far above twice the first third and above the floor
    growing = [(float(t), 0.1 * t) for t in range(30)]
    ok, why = lb.lag_bounded(growing)
    assert not ok and "grew" in why
    # a slow growth that stays under the floor is still bounded
    assert lb.lag_bounded([(float(t), 0.01 * t) for t in range(30)])[0]
    # a marker that never arrived means the subscriber never caught up
    assert not lb.lag_bounded(steady, missing=1)[0]
    assert not lb.lag_bounded(steady[:2])[0]
    slope = lb.lag_slope(growing)
    assert slope is not None and slope == pytest.approx(0.1)


def test_gid_and_pgbench_parsing() -> None:
    assert lb.gid_xid("pg_gid_16390_7421") == 7421
    assert lb.gid_xid("live_7421") is None
    out = (
        "number of transactions actually processed: 1990\nnumber of failed transactions: 0 (0.000%)\n"
        "tps = 99.512345 (without initial connection time)\n"
    )
    assert lb.parse_pgbench(out) == {"processed": 1990, "failed": 0, "tps": 99.512345}


def test_marker_and_prepare_lag_for_real(pair) -> None:  # type: ignore[no-untyped-def]
    """Markers committed on the publisher become visible on a native subscriber's target and get a lag each; a
    prepared transaction's publisher PREPARE time is matched with its ``pg_gid_<subid>_<xid>`` on the target."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE live_marker (id integer PRIMARY KEY, at timestamptz NOT NULL)")
        db.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    pair.publisher.execute(
        sql.SQL("CREATE PUBLICATION {} FOR TABLE live_marker, t").format(sql.Identifier(pair.name))
    )
    pair.publisher.execute(
        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (pair.name,)
    )
    native = lb.NativeSubscription(
        pair.target.dsn, pair.name, pair.name, pair.name, pair.publisher.dsn, True, "on"
    )
    native.create()
    native.enable()
    writer = lb.MarkerWriter(pair.publisher, interval=0.05)
    poller = lb.VisibilityPoller(pair.target, prepared=True)
    pub_prep = lb.PublisherPreparePoller(pair.publisher)
    load_start = time.time()
    try:
        for t in (poller, pub_prep, writer):
            t.start()
        with pair.publisher.connect() as c:
            c.execute("BEGIN")
            c.execute("INSERT INTO t VALUES (1)")
            xid = int(c.execute("SELECT txid_current()").fetchone()[0])  # type: ignore[index]
            c.execute("PREPARE TRANSACTION 'live_test'")
            wait_until(
                lambda: xid in pub_prep.prepared_at and xid in poller.prepared_seen, what="the prepare"
            )
            c.execute("COMMIT PREPARED 'live_test'")
        wait_until(lambda: len(poller.visible) >= 5, what="five markers visible on the target")
    finally:
        for t in (writer, poller, pub_prep):
            t.stop.set()
            t.join()
        native.drop()
    assert writer.error is None and poller.error is None and pub_prep.error is None
    run = lb.SideRun("2pc", 1, "native")
    lb._fill_lags(run, writer.committed, poller.visible, load_start, pub_prep, poller.prepared_seen)
    assert run.markers >= 5 and run.markers - run.missing >= 5
    assert 0.0 <= run.lag["p50"] <= run.lag["p99"] <= run.lag["max"]
    assert run.prepares_seen == run.prepares_published == 1
    assert run.prepare_lag["p50"] >= 0.0
    assert len(run.series) == run.markers - run.missing
