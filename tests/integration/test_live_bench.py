"""bench/live_bench.py's measuring pieces: the pure ones (percentile, bounded-lag test, GID and pgbench parsing) and,
for real, the marker writer, the notification listener, the pollers and the lag computation over a native
subscription and over ours."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from psycopg import sql

from applier.subscriptions import CreateOptions, create
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


def _subscribe(pair, side: str) -> subprocess.Popen[bytes] | lb.NativeSubscription:  # type: ignore[no-untyped-def]
    """Tables on both sides (the target's marker table with the bench's notify trigger), and a subscription of
    ``side``: native (two_phase, streaming) or ours (``applier run`` as a subprocess)."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE live_marker (id integer PRIMARY KEY, at timestamptz NOT NULL)")
        db.execute("CREATE TABLE t (id integer PRIMARY KEY)")
    with pair.target.connect() as c:
        lb.create_marker_notify(c)
    pair.publisher.execute(
        sql.SQL("CREATE PUBLICATION {} FOR TABLE live_marker, t").format(sql.Identifier(pair.name))
    )
    if side == "ours":
        create(pair.target.dsn, CreateOptions(name=pair.name, publisher=pair.publisher.dsn,
                                              publications=(pair.name,), two_phase=True, copy_data=False))  # fmt: skip
        return subprocess.Popen(
            [sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "run", pair.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    pair.publisher.execute(
        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (pair.name,)
    )
    native = lb.NativeSubscription(
        pair.target.dsn, pair.name, pair.name, pair.name, pair.publisher.dsn, True, "on"
    )
    native.create()
    native.enable()
    return native


@pytest.mark.parametrize("side", ["native", "ours"])
def test_marker_and_prepare_lag_for_real(pair, side: str) -> None:  # type: ignore[no-untyped-def]
    """Both apply workers fire the target's ``ENABLE ALWAYS`` marker trigger (they apply with
    ``session_replication_role = replica``), so every marker committed on the publisher reaches the listener as a
    notification, after it is visible; a prepared transaction's publisher PREPARE is matched with its
    ``pg_gid_<subid>_<xid>`` on the target by the 2 ms poll, with the server stamps beside it."""
    sub = _subscribe(pair, side)
    writer = lb.MarkerWriter(pair.publisher, interval=0.05)
    poller = lb.VisibilityPoller(pair.target)
    listener = lb.MarkerListener(pair.target)
    pub_prep = lb.PublisherPreparePoller(pair.publisher)
    tgt_prep = lb.TargetPreparePoller(pair.target)
    threads = (listener, poller, pub_prep, tgt_prep, writer)
    load_start = time.time()
    try:
        listener.start()
        assert listener.ready.wait(30)
        for t in threads[1:]:
            t.start()
        with pair.publisher.connect() as c:
            c.execute("BEGIN")
            c.execute("INSERT INTO t VALUES (1)")
            xid = int(c.execute("SELECT txid_current()").fetchone()[0])  # type: ignore[index]
            c.execute("PREPARE TRANSACTION 'live_test'")
            wait_until(
                lambda: xid in pub_prep.prepared_at and xid in tgt_prep.seen, timeout=60, what="the prepare"
            )
            c.execute("COMMIT PREPARED 'live_test'")
        wait_until(lambda: len(listener.visible) >= 5, timeout=60, what="five marker notifications")
        writer.stop.set()
        writer.join()
        last = max(writer.committed)
        wait_until(lambda: last in listener.visible, timeout=60, what="the last marker's notification")
        wait_until(lambda: last in poller.visible, timeout=60, what="the last marker visible to the poll")
    finally:
        for t in threads:
            t.stop.set()
            t.join()
        if isinstance(sub, subprocess.Popen):
            sub.terminate()
            sub.wait(60)
        else:
            sub.drop()
    assert all(t.error is None for t in threads), [t.error for t in threads]
    assert set(listener.visible) == set(writer.committed)  # every marker notified once it was applied
    run = lb.SideRun("2pc", 1, side)
    lb._fill_lags(run, writer.committed, listener.visible, load_start, pub_prep, tgt_prep, poller.visible)
    assert run.missing == 0 and run.markers >= 5
    # the writer stamps a marker once its INSERT has returned, in a thread of its own: with the GIL it can run after
    # the listener thread stamped the notification of a fast apply (CI: native's p50 at -66 µs); 1 ms bounds that
    assert -0.001 <= run.lag["p50"] <= run.lag["p99"] <= run.lag["max"]
    assert run.lag_poll["p50"] >= 0.0
    assert run.prepares_seen == run.prepares_published == 1
    # seen on the target after the publisher prepared it, and after the target's own prepare stamp
    assert 0.0 <= run.prepare_lag_stamp["p50"] <= run.prepare_lag["p50"]
    assert run.prepare_poll["polls"] > 0
    assert len(run.series) == run.markers
