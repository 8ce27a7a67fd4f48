"""``applier verify``: it names the keys that differ (changed, missing, extra), says so for a table without a primary
key, and stays quiet about changes that are merely in flight on a busy but correct subscription."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from applier import verify
from applier.apply.testing import ApplySetup, setup_subscription
from applier.testing import wait_for_catchup
from applier.testing.pytest_plugin import ReplicationPair

SCHEMA = """
CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance numeric, tags text[], doc jsonb, blob bytea);
CREATE TABLE pair_key (a int, b text, v text, PRIMARY KEY (a, b));
CREATE TABLE nokey (x int, y text);
ALTER TABLE nokey REPLICA IDENTITY FULL;
"""

SEED = """
INSERT INTO acct SELECT g, 'owner ' || g, g * 1.25, ARRAY['t' || g % 3, NULL], jsonb_build_object('g', g),
       decode(md5(g::text), 'hex') FROM generate_series(1, 3000) g;
INSERT INTO pair_key SELECT g % 50, 'k' || g, 'v' FROM generate_series(1, 400) g;
INSERT INTO nokey SELECT g, 'y' FROM generate_series(1, 100) g;
"""

TABLES = ["public.acct", "public.pair_key", "public.nokey"]


def subscribed(pair: ReplicationPair) -> ApplySetup:
    """The tables with the same rows on both sides (as after an initial copy), every table ready."""
    for db in (pair.publisher, pair.target):
        db.execute(SCHEMA)
        db.execute(SEED)
    return setup_subscription(pair.publisher, pair.target, pair.name, TABLES, streaming="on")


def run_cli(pair: ReplicationPair, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "verify", pair.name, *args],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


@pytest.mark.core
def test_verify_names_changed_missing_and_extra_keys(pair: ReplicationPair) -> None:
    s = subscribed(pair)
    w = s.start()
    try:
        pair.publisher.execute("UPDATE acct SET owner = 'replicated' WHERE id = 10")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        ok = run_cli(pair, "--json", "--settle-timeout", "5")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert json.loads(ok.stdout)["equal"] is True

        # now break the target behind the applier's back
        pair.target.execute("UPDATE acct SET balance = balance + 1 WHERE id = 1234")
        pair.target.execute("DELETE FROM acct WHERE id = 77")
        pair.target.execute("INSERT INTO acct (id, owner) VALUES (99999, 'stray')")
        pair.target.execute("UPDATE pair_key SET v = 'w' WHERE a = 7 AND b = 'k7'")
        pair.target.execute("DELETE FROM nokey WHERE x = 5")
        res = run_cli(pair, "--json", "--settle-timeout", "5")
        assert res.returncode == 1, res.stdout + res.stderr
        doc = json.loads(res.stdout)
        tables = {t["table"]: t for t in doc["tables"]}
        acct = tables["public.acct"]
        assert {(k["kind"], k["key"]["id"]) for k in acct["keys"]} == {
            ("changed", 1234),
            ("missing", 77),
            ("extra", 99999),
        }
        assert (acct["publisher_rows"], acct["target_rows"], acct["matched"]) == (3000, 3000, 2998)
        assert [(k["kind"], k["key"]) for k in tables["public.pair_key"]["keys"]] == [
            ("changed", {"a": 7, "b": "k7"})
        ]
        nokey = tables["public.nokey"]
        assert nokey["key"] is None and nokey["differing"] >= 1 and "no primary key" in nokey["note"]

        text = run_cli(pair, "--settle-timeout", "5")
        assert text.returncode == 1
        assert "public.acct: changed row (id=1234)" in text.stdout
        assert "public.acct: missing row (id=77)" in text.stdout
        assert "public.acct: extra row (id=99999)" in text.stdout
        assert "DIFFERENT" in text.stdout
    finally:
        w.stop()


@pytest.mark.spark
def test_verify_hashes_large_tables_as_a_spark_job(pair: ReplicationPair) -> None:
    """With ``--spark-rows 0`` every keyed table's first pass runs as a Spark job: same findings, and the report
    says which tables went through Spark."""
    s = subscribed(pair)
    pair.target.execute("UPDATE acct SET balance = balance + 1 WHERE id = 1234")
    pair.target.execute("DELETE FROM acct WHERE id = 77")
    pair.target.execute("INSERT INTO pair_key VALUES (7, 'stray', 'x')")
    w = s.start()
    try:
        res = run_cli(pair, "--json", "--settle-timeout", "5", "--spark-rows", "0")
        assert res.returncode == 1, res.stdout + res.stderr
        tables = {t["table"]: t for t in json.loads(res.stdout)["tables"]}
        acct, pair_key, nokey = tables["public.acct"], tables["public.pair_key"], tables["public.nokey"]
        assert acct["spark"] and pair_key["spark"] and not nokey["spark"]
        assert {(k["kind"], k["key"]["id"]) for k in acct["keys"]} == {("changed", 1234), ("missing", 77)}
        assert (acct["publisher_rows"], acct["target_rows"]) == (3000, 2999)
        assert [(k["kind"], k["key"]) for k in pair_key["keys"]] == [("extra", {"a": 7, "b": "stray"})]
        assert nokey["equal"]
        # the text report of the same findings (one Spark start per run: not a second run)
        text = verify.format_report(_report_of(json.loads(res.stdout)))
        assert "key ranges (Spark)" in text and "DIFFERENT" in text
    finally:
        w.stop()


def _report_of(doc: dict[str, Any]) -> verify.VerifyReport:
    """The report behind ``verify --json``'s output."""
    tables = []
    for t in doc["tables"]:
        fields = {k: v for k, v in t.items() if k not in ("matched", "equal", "keys")}
        keys = [verify.DifferingKey(**k) for k in t["keys"]]
        tables.append(verify.TableReport(**fields, keys=keys))
    return verify.VerifyReport(doc["subscription"], tables)


def test_verify_never_prints_a_password(pair: ReplicationPair) -> None:
    s = subscribed(pair)
    w = s.start()
    try:
        conninfo = pair.publisher.dsn + " password=s3cr3t-pw"  # trust auth: accepted and ignored
        res = run_cli(pair, "--publisher", conninfo, "--json", "--settle-timeout", "5")
        assert res.returncode == 0, res.stdout + res.stderr
        bad = run_cli(pair, "--publisher", "host=127.0.0.1 port=1 password=s3cr3t-pw connect_timeout=2")
        assert bad.returncode == 1
        assert "s3cr3t-pw" not in res.stdout + res.stderr + bad.stdout + bad.stderr
        assert "could not connect to the publisher" in bad.stderr
    finally:
        w.stop()


def test_verify_equal_while_the_publisher_is_busy(pair: ReplicationPair) -> None:
    """Inserts, updates (also of the key) and deletes keep arriving in every range while verify runs: differences
    it sees are only in flight, and the settled re-read must clear every one of them. (The keyless table stays quiet:
    whole-table hashes of a table written without pause never settle, which verify's docstring says.)"""
    s = subscribed(pair)
    w = s.start()
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            with pair.publisher.connect() as conn:
                i = 0
                while not stop.is_set():
                    i += 1
                    conn.execute("UPDATE acct SET balance = balance + 1 WHERE id %% 97 = %s", (i % 97,))
                    conn.execute("INSERT INTO acct (id, owner) VALUES (%s, 'new')", (100_000 + i,))
                    conn.execute("DELETE FROM acct WHERE id = %s", (1 + (i * 37) % 3000,))
                    conn.execute("UPDATE pair_key SET v = %s WHERE a = %s", (str(i), i % 50))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        report = verify.verify(pair.target.dsn, pair.name, settle_timeout=30, attempts=5)
        assert report.equal, verify.format_report(report)
        assert sum(tr.publisher_rows for tr in report.tables) > 0
    finally:
        stop.set()
        t.join(30)
        w.stop()
    assert not errors, errors
