"""What an operator sees of `applier run`: Prometheus metrics that move with the workload and a lag that returns to
zero, JSON log lines without passwords, and a clean, quick exit on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from applier.subscriptions import CreateOptions, create
from applier.testing import wait_until
from applier.testing.cluster import free_port

pytestmark = [pytest.mark.core, pytest.mark.anyversion]  # metrics, logs and signals are ours alone


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_move_and_lag_returns_to_zero_and_logs_are_json(pair):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pair.publisher.execute("CREATE PUBLICATION obs FOR TABLE items")
    name = pair.name
    create(pair.target.dsn, CreateOptions(name=name, publisher=pair.publisher.dsn, publications=("obs",),
                                          two_phase=True, copy_data=False))  # fmt: skip
    port = free_port()
    target = pair.target.dsn + " password=hunter2-secret"  # trust auth ignores it; it must never be printed
    proc = subprocess.Popen(
        [sys.executable, "-m", "applier.cli", "--target", target, "run", name, "--metrics-port", str(port),
         "--log-format", "json"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()

        wait_until(lambda: _metric(scrape(), "applier_subscription_enabled", subscription=name) == 1, timeout=60,
                   what="the metrics endpoint")  # fmt: skip
        with pair.publisher.connect() as conn:
            for i in range(20):
                conn.execute("INSERT INTO items VALUES (%s, 'x')", (i,))
            conn.execute("BEGIN")
            conn.execute("INSERT INTO items VALUES (100, 'prepared')")
            conn.execute("PREPARE TRANSACTION 'obs1'")
            conn.execute("COMMIT PREPARED 'obs1'")

        def applied() -> bool:
            text = scrape()
            commits = (
                _metric(text, "applier_transactions_applied_total", subscription=name, kind="commit") or 0
            )
            committed_prepared = _metric(
                text, "applier_transactions_applied_total", subscription=name, kind="commit_prepared"
            )
            rows = _metric(text, "applier_rows_applied_total", subscription=name, operation="insert") or 0
            return commits >= 20 and (committed_prepared or 0) >= 1 and rows >= 21

        wait_until(applied, timeout=60, what="the transaction counters to count the workload")
        wait_until(lambda: _metric(scrape(), "applier_lag_bytes", subscription=name) == 0, timeout=60,
                   what="lag to return to zero")  # fmt: skip
        text = scrape()
        assert _metric(text, "applier_two_phase_state", subscription=name, state="e") == 1
        assert _metric(text, "applier_prepared_transactions_pending", subscription=name) == 0
        assert pair.target.scalar("SELECT count(*) FROM items") == 21
    finally:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        stopped_in = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    assert stopped_in < 10
    assert "hunter2-secret" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, "stderr lines that are not JSON records:\n" + "\n".join(not_json[:60])
    records = [json.loads(line) for line in lines]
    assert records and all({"ts", "level", "message"} <= r.keys() for r in records)
    assert any(re.search(r"started|streaming", r["message"]) for r in records), records[:5]


def test_the_initial_copy_reports_its_progress_as_log_records(pair):
    """`run`'s stderr is its log: the copy's notes and per-table lines are records there (they were plain lines,
    which broke `--log-format json`)."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pair.publisher.execute("INSERT INTO items SELECT g, 'x' FROM generate_series(1, 5000) g")
    pair.publisher.execute("CREATE PUBLICATION obs FOR TABLE items")
    name = pair.name
    create(pair.target.dsn, CreateOptions(name=name, publisher=pair.publisher.dsn, publications=("obs",)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "run", name, "--log-format", "json"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM items") == 5000, timeout=120,
                   what="the initial copy")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), "\n".join(lines)
    messages = [json.loads(line)["message"] for line in lines]
    assert f'subscription "{name}": public.items: done, 5,000 rows' in "\n".join(messages), messages
    assert any(m.startswith(f'subscription "{name}": snapshot ') for m in messages), messages


def test_a_refused_run_says_why_in_a_json_record(pair):
    res = subprocess.run(
        [sys.executable, "-m", "applier.cli", "--target", pair.target.dsn, "run", "nosuch", "--log-format", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1
    (line,) = [line for line in res.stderr.splitlines() if line.strip()]
    record = json.loads(line)
    assert record["level"] == "error" and 'subscription "nosuch" does not exist' in record["message"], record
