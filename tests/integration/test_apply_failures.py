"""What a user sees while a remote transaction or the initial copy keeps failing (issue 16): a backoff that grows
while the *same* transaction fails, capped by ``--max-retry-interval``; ``applier status`` (text and JSON) naming the
transaction, the relation, the statement kind, the server's error, the retries and the exact skip command; and an
``applier run`` that never exits on a data error during the initial copy."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from applier.apply.testing import setup_subscription
from applier.catalog.store import CATALOG_VERSION, Catalog
from applier.retry import RetrySettingError, parse_max_retry_interval, retry_delay
from applier.testing import wait_for_catchup, wait_until
from applier.testing.cluster import free_port
from tests.support.cli import APPLIER, create, make_tables, ok, status


def _errors(target, subid: int) -> list[dict]:
    with target.connect() as conn:
        cur = conn.execute(
            "SELECT retry_count, extract(epoch FROM next_retry_at - occurred_at)::float8 AS wait, sqlstate,"
            " message_type, relation, remote_xid, finish_lsn::text AS finish_lsn, gid"
            " FROM applier.apply_error WHERE subid = %s ORDER BY id",
            (subid,),
        )
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


@pytest.mark.core
def test_retry_delay_doubles_up_to_the_cap() -> None:
    waits = [retry_delay(n, initial=0.5, cap=5.0, jitter=False) for n in range(1, 8)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert all(0.5 <= retry_delay(1, cap=5.0) <= 1.0 for _ in range(50))
    assert parse_max_retry_interval(None) == 5.0 and parse_max_retry_interval("300") == 300.0
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(RetrySettingError, match="invalid maximum retry interval"):
            parse_max_retry_interval(bad)


@pytest.mark.core
@pytest.mark.anyversion  # our backoff and status
def test_backoff_grows_while_the_same_transaction_fails_and_status_says_how_to_skip_it(pair) -> None:
    """A unique violation on the target: every attempt is recorded with its count and next attempt; the wait
    doubles up to the cap; status shows xid, finish LSN, relation, kind, SQLSTATE and the skip command, which
    works. A later, different failure starts the backoff again."""
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute("INSERT INTO t VALUES (2, 'already here')")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    pub = pair.publisher
    pub.execute("INSERT INTO t VALUES (1, 'ok')")
    pub.execute("INSERT INTO t VALUES (2, 'conflict'), (3, 'after')")
    w = s.start(retry_initial=0.05, retry_max=0.4)
    try:
        wait_until(
            lambda: len(_errors(pair.target, s.sub.subid)) >= 6, timeout=60, what="six failed attempts"
        )
        errors = _errors(pair.target, s.sub.subid)
        assert [e["retry_count"] for e in errors[:6]] == [1, 2, 3, 4, 5, 6]
        assert errors[0]["wait"] < 0.2 and all(0.3 < e["wait"] <= 0.45 for e in errors[4:6]), errors
        first = errors[0]
        assert first["sqlstate"] == "23505" and first["message_type"] == "INSERT"
        assert first["relation"] == "public.t" and first["remote_xid"] and first["gid"] is None
        assert pair.target.scalar("SELECT count(*) FROM t WHERE id = 1") == 1  # the transaction before it
        skip = f"applier alter {pair.name} --skip-lsn {first['finish_lsn']}"
        entry = status(pair.target, pair.name)
        e = entry["last_error"]
        assert e["skip_command"] == skip and e["sqlstate"] == "23505" and e["retry_count"] >= 6
        assert e["next_retry_at"] and e["finish_lsn"] == first["finish_lsn"] and e["message_type"] == "INSERT"
        assert e["resolved"] is False
        text = ok(pair.target, "status", pair.name)
        assert "SQLSTATE 23505" in text and f"in remote transaction {first['remote_xid']}" in text
        assert "during INSERT on public.t" in text and skip in text and "next attempt at" in text
        ok(pair.target, *skip.split()[1:])  # the command as status prints it
        pub.execute("INSERT INTO t VALUES (4, 'next')")
        wait_for_catchup(pub, pair.name, timeout=30)
        assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [
            (1, "ok"), (2, "already here"), (4, "next"),
        ]  # fmt: skip
        assert Catalog.connect(pair.target.dsn).require(pair.name).subskiplsn is None
        # the worker got past it: status says so, and no longer shows a next attempt or the skip command
        assert status(pair.target, pair.name)["last_error"]["resolved"] is True
        text = ok(pair.target, "status", pair.name)
        assert "resolved since" in text and "next attempt at" not in text and skip not in text
        # another transaction that fails: its own backoff, from the first step
        before = len(_errors(pair.target, s.sub.subid))
        pair.target.execute("INSERT INTO t VALUES (5, 'already here')")
        pub.execute("INSERT INTO t VALUES (5, 'conflict')")
        wait_until(
            lambda: len(_errors(pair.target, s.sub.subid)) > before, timeout=30, what="the new failure"
        )
        assert _errors(pair.target, s.sub.subid)[before]["retry_count"] == 1
    finally:
        w.stop()


@pytest.mark.core
@pytest.mark.anyversion  # our catalog's upgrade
def test_old_catalog_upgrades_itself_and_status_reads_it(pair) -> None:
    """A catalog of version 1 (no retry columns) is read by status as it is, and upgraded by run/create."""
    make_tables(pair, "t1")
    create(pair, "s", "--no-copy-data")
    subid = pair.target.scalar("SELECT subid FROM applier.subscription WHERE subname = 's'")
    pair.target.execute(
        "ALTER TABLE applier.apply_error DROP COLUMN sqlstate, DROP COLUMN gid, DROP COLUMN retry_count,"
        " DROP COLUMN next_retry_at"
    )
    pair.target.execute("DROP TABLE applier.apply_lag")  # added by version 3
    pair.target.execute("ALTER TABLE applier.subscription DROP COLUMN subgidformat")  # added by version 4
    pair.target.execute("DELETE FROM applier.catalog_version WHERE version > 1")
    pair.target.execute(
        "INSERT INTO applier.apply_error (subid, message, remote_xid, finish_lsn) VALUES (%s, 'boom', 7, '0/10')",
        (subid,),
    )
    e = status(pair.target, "s")["last_error"]
    assert (
        e["message"] == "boom"
        and e["sqlstate"] is None
        and e["skip_command"] == "applier alter s --skip-lsn 0/10"
    )
    assert status(pair.target, "s")["gid_format"] == "subscription"
    assert Catalog.connect(pair.target.dsn).ensure() == CATALOG_VERSION
    assert pair.target.scalar("SELECT subgidformat FROM applier.subscription") == "subscription"
    assert (
        pair.target.scalar(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'applier'"
            " AND table_name = 'apply_error' AND column_name IN ('sqlstate', 'gid', 'retry_count', 'next_retry_at')"
        )
        == 4
    )


def _run(pair, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    log = open(tmp_path / "run.log", "w+")  # closed by the caller through _stop
    proc = subprocess.Popen([*APPLIER, "--target", pair.target.dsn, "run", *args], stdout=log,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _sync_errors(port: int) -> float:
    """``applier_sync_errors_total`` of subscription s, as the metrics endpoint serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('applier_sync_errors_total{subscription="s"}')
    )


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    proc.log.flush()  # type: ignore[attr-defined]
    text = Path(proc.log.name).read_text()  # type: ignore[attr-defined]
    proc.log.close()  # type: ignore[attr-defined]
    return code, text


@pytest.mark.core
@pytest.mark.anyversion  # our retry of the copy
@pytest.mark.spark
def test_copy_conflict_is_retried_and_never_ends_run(pair, tmp_path: Path) -> None:
    """Without disable_on_error a conflicting initial copy is tried again, growing its wait, with the error in
    status; once the row is gone the copy succeeds and streaming starts, in the same ``applier run``."""
    make_tables(pair, "t1", rows=5)
    pair.target.execute("INSERT INTO t1 VALUES (3, 'in the way')")
    create(pair, "s")
    port = free_port()
    proc = _run(pair, tmp_path, "--max-retry-interval", "2", "--metrics-port", str(port))
    try:
        wait_until(lambda: (status(pair.target, "s")["last_error"] or {}).get("retry_count", 0) >= 2,
                   timeout=240, what="two failed copies")  # fmt: skip
        assert proc.poll() is None, "applier run ended on a copy conflict"
        wait_until(lambda: _sync_errors(port) >= 2, timeout=30, what="applier_sync_errors_total >= 2")
        e = status(pair.target, "s")["last_error"]
        assert "duplicate key" in e["message"] and e["message_type"] == "COPY" and e["next_retry_at"]
        assert e["relation"] == "public.t1"  # the failing table, as an apply error names it
        assert "during COPY on public.t1" in ok(pair.target, "status", "s")
        assert status(pair.target, "s")["enabled"]
        pair.target.execute("DELETE FROM t1 WHERE id = 3")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t1") == 5, timeout=240, what="the copy")
        wait_until(
            lambda: status(pair.target, "s")["last_error"]["resolved"], timeout=60, what="t1 synchronized"
        )
        pair.publisher.execute("INSERT INTO t1 VALUES (6, 'streamed')")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t1") == 6, timeout=60, what="streaming")
    finally:
        code, text = _stop(proc)
    assert code == 0, text
    assert "failure 1 of the initial copy; next attempt in" in text


@pytest.mark.spark
def test_copy_conflict_with_disable_on_error_disables_the_subscription(pair, tmp_path: Path) -> None:
    make_tables(pair, "t1", rows=5)
    pair.target.execute("INSERT INTO t1 VALUES (3, 'in the way')")
    create(pair, "s", "--disable-on-error")
    proc = _run(pair, tmp_path)
    code, text = _stop_when_done(proc)
    assert code == 0, text
    assert "has been disabled because of this error" in text and "applier alter s --enable" in text
    entry = status(pair.target, "s")
    assert not entry["enabled"] and "duplicate key" in entry["last_error"]["message"]
    assert entry["last_error"]["next_retry_at"] is None and entry["last_error"]["relation"] == "public.t1"


def _stop_when_done(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Wait for ``run`` to end by itself (every worker stopped), then collect its log."""
    started = dt.datetime.now()
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass
    assert proc.poll() is not None, f"applier run still running after {dt.datetime.now() - started}"
    return _stop(proc)
