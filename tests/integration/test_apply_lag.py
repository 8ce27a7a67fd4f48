"""Apply lag, live: the lag window's summary (pure), the Prometheus histogram ``applier_apply_lag_seconds`` and the
``apply_lag`` figures of ``applier status`` (text and --json) while ``applier run`` applies, and the catalog upgrade
that adds ``applier.apply_lag``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from applier.apply.lag import PG_EPOCH_UNIX, LagWindow, nearest_rank, pg_time_to_unix
from applier.catalog.store import CATALOG_VERSION, Catalog
from applier.subscriptions import CreateOptions, create
from applier.testing import wait_until
from applier.testing.cluster import free_port


def _pg_us(unix: float) -> int:
    return int((unix - PG_EPOCH_UNIX) * 1_000_000)


def test_lag_window_summarises_the_recent_samples() -> None:
    w = LagWindow(window_s=10.0)
    assert w.summary(1000.0) is None
    w.add("commit", 0, 1000.0)  # no timestamp: no sample
    assert w.added == 0
    for i in range(100):  # lags 0.01 .. 1.00 s, confirmed at 1100 + i
        w.add("commit", _pg_us(1100.0 + i - (i + 1) / 100), 1100.0 + i)
    w.add("prepare", _pg_us(1200.0), 1199.0)  # the target's clock behind: counted as 0
    s = w.summary(1199.0)
    assert s is not None
    assert (s.last_kind, s.last_s) == ("prepare", 0.0)
    # the window keeps what was confirmed within 10 s of 1199: i = 89..99 (lags 0.90..1.00) and the prepare (0)
    assert s.samples == 12
    assert s.max_s == pytest.approx(1.0)
    assert s.p50_s == pytest.approx(0.94, rel=0.012)  # counted in buckets: within 1.1 % (applier.apply.lag)
    assert s.p99_s == pytest.approx(1.0, rel=0.012)
    # idle for longer than the window: the last sample alone remains
    idle = w.summary(5000.0)
    assert idle is not None and idle.samples == 1 and idle.p99_s == 0.0
    new = w.take_new()
    assert new["commit"].samples == 100 and new["prepare"].samples == 1
    assert w.take_new() == {}
    assert pg_time_to_unix(0) == PG_EPOCH_UNIX
    assert nearest_rank([1.0, 2.0, 3.0], 99) == 3.0 and nearest_rank([1.0, 2.0, 3.0, 4.0], 50) == 2.0


def test_a_version_1_catalog_gets_the_lag_table(pair) -> None:  # type: ignore[no-untyped-def]
    cat = Catalog.connect(pair.target.dsn)
    try:
        cat.ensure()
        pair.target.execute("DROP TABLE applier.apply_lag")
        pair.target.execute("DELETE FROM applier.catalog_version WHERE version > 1")
        assert not cat.has_lag_table()
        assert cat.ensure() == CATALOG_VERSION
        assert cat.has_lag_table()
    finally:
        cat.engine.dispose()


def _histogram_count(text: str, name: str, kind: str) -> float:
    for line in text.splitlines():
        if line.startswith("applier_apply_lag_seconds_count{") and f'subscription="{name}"' in line:
            if f'kind="{kind}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.core
@pytest.mark.anyversion  # our metrics and status
def test_histogram_and_status_show_the_apply_lag(pair) -> None:  # type: ignore[no-untyped-def]
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pair.publisher.execute("CREATE PUBLICATION lagpub FOR TABLE items")
    name = pair.name
    create(pair.target.dsn, CreateOptions(name=name, publisher=pair.publisher.dsn, publications=("lagpub",),
                                          two_phase=True, copy_data=False))  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "run", name, "--metrics-port", str(port)],
        stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    def status_json() -> dict:  # type: ignore[type-arg]
        out = subprocess.run([sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "status", name,
                              "--json"], capture_output=True, text=True, check=True).stdout  # fmt: skip
        return json.loads(out)["subscriptions"][0]  # type: ignore[no-any-return]

    try:
        wait_until(
            lambda: "applier_subscription_enabled" in scrape(), timeout=60, what="the metrics endpoint"
        )
        with pair.publisher.connect() as conn:
            for i in range(5):
                conn.execute("INSERT INTO items VALUES (%s, 'x')", (i,))
            conn.execute("BEGIN")
            conn.execute("INSERT INTO items VALUES (100, 'prepared')")
            conn.execute("PREPARE TRANSACTION 'lag1'")
            # the decision only once the PREPARE is on the target, so that it is not folded into one commit
            wait_until(lambda: pair.target.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'pg_gid_%'"),
                       timeout=60, what="the prepared transaction on the target")  # fmt: skip
            conn.execute("COMMIT PREPARED 'lag1'")
        wait_until(
            lambda: all(_histogram_count(scrape(), name, k) >= 1 for k in ("commit", "prepare", "commit_prepared")),
            timeout=60, what="apply lag observations of each kind",
        )  # fmt: skip
        st = wait_until(lambda: (s := status_json())["apply_lag"] and s["apply_lag"]["samples"] >= 1 and s,
                        timeout=60, what="the apply lag in status --json")  # fmt: skip
        lag = st["apply_lag"]
        assert set(lag) == {
            "updated_at",
            "last_s",
            "last_kind",
            "p50_s",
            "p99_s",
            "max_s",
            "samples",
            "window_s",
        }
        assert 0 <= lag["p50_s"] <= lag["p99_s"] <= lag["max_s"]
        assert lag["last_kind"] in ("commit", "prepare", "commit_prepared")
        text = subprocess.run([sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "status", name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "apply lag (publisher commit to local commit): last" in text
    finally:
        proc.terminate()
        proc.wait(60)


def test_the_catalog_watch_snapshot_only_ever_says_nothing_changed() -> None:
    """``applier.apply.housekeeping.unchanged``: a fresh snapshot equal to what the loop holds spares the synchronous re-read;
    any difference (or a stale snapshot, or tables not all ready) sends the loop to re-read as before."""
    from dataclasses import replace
    from types import SimpleNamespace

    from applier.apply.handlers import SkipState
    from applier.apply.housekeeping import WATCH_STALE, unchanged
    from applier.catalog.store import RelState, Subscription

    sub = Subscription(subid=7, subname="s", subenabled=True, subtwophasestate="e", substream="on", subbinary=False,
                       subdisableonerr=False, subskiplsn=None, suborigin="any", subslotname="s",
                       subpublications=["p"], subconninfo="host=x", subcopydata=False,
                       subslotconsistentlsn=None)  # fmt: skip
    rel = RelState(7, 16400, "public.t", "public.t", "r", None, 0, 0)
    tables = SimpleNamespace(all_ready=True, two_phase_state="e", by_oid={16400: rel})
    entry = SimpleNamespace(local=SimpleNamespace(oid=16400, bulk=True))
    applier = SimpleNamespace(bulk=True, entries={1: entry})
    skip = SkipState(0, "s")

    def watch(**changes: object) -> SimpleNamespace:
        snap = dict(at=100.0, sub=sub, states=frozenset({(16400, "r", None)}), oids=frozenset({16400}),
                    bulk_ok=frozenset({16400}))  # fmt: skip
        snap.update(changes)
        return SimpleNamespace(latest=SimpleNamespace(**snap))

    assert unchanged(watch(), sub, skip, tables, applier, 100.5)  # type: ignore[arg-type]
    assert not unchanged(SimpleNamespace(latest=None), sub, skip, tables, applier, 100.5)  # type: ignore[arg-type]
    assert not unchanged(watch(), sub, skip, tables, applier, 100.0 + WATCH_STALE + 1)  # type: ignore[arg-type]
    for changed in (
        watch(sub=None),
        watch(sub=replace(sub, subenabled=False)),
        watch(sub=replace(sub, subpublications=["p", "q"])),
        watch(sub=replace(sub, subskiplsn=123)),
        watch(sub=replace(sub, subtwophasestate="p")),
        watch(states=frozenset({(16400, "s", 99)})),
        watch(bulk_ok=frozenset()),  # a trigger enabled ALWAYS since the table was mapped
    ):
        assert not unchanged(changed, sub, skip, tables, applier, 100.5)  # type: ignore[arg-type]
    # a table mapped after the snapshot's table list was handed over was read when mapped: no re-read for it, even
    # where the snapshot (which did not look at it) has it unfit; the next snapshot covers it
    assert unchanged(watch(oids=frozenset(), bulk_ok=frozenset()), sub, skip, tables, applier, 100.5)  # type: ignore[arg-type]
    not_ready = SimpleNamespace(all_ready=False, two_phase_state="e", by_oid={16400: rel})
    assert not unchanged(watch(), sub, skip, not_ready, applier, 100.5)  # type: ignore[arg-type]
