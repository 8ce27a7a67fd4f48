"""Helpers for the command-line tests (``tests/integration/test_cli_*.py``, and the TAP, differential, trust and
migrate tests that drive the command line): run ``applier`` as a user would (``python -m applier.cli`` in a
subprocess), read ``status --json`` and the catalog, make the tables and subscriptions a test starts from, and
run ``applier run`` in the background (the ``start_run`` fixture, offered by ``tests/integration/conftest.py``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from applier.testing import Database

APPLIER = [sys.executable, "-m", "applier.cli"]


def applier(target: Database | str | None, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``applier [--target DSN] ARGS...`` and return the finished process (stdout/stderr as text)."""
    dsn = target.dsn if isinstance(target, Database) else target
    argv = [*APPLIER, *(["--target", dsn] if dsn is not None else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def ok(target: Database | str | None, *args: str, **kwargs: Any) -> str:
    """Run applier and insist it succeeds; return its stdout."""
    res = applier(target, *args, **kwargs)
    assert res.returncode == 0, (
        f"applier {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    )
    return res.stdout


def fails(target: Database | str | None, *args: str, **kwargs: Any) -> str:
    """Run applier and insist it is refused with exit status 1; return its stderr."""
    res = applier(target, *args, **kwargs)
    assert res.returncode == 1, (
        f"applier {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    )
    assert "Traceback" not in res.stderr, res.stderr
    return res.stderr


def status(target: Database, name: str) -> dict[str, Any]:
    """``applier status NAME --json``'s one subscription."""
    (entry,) = json.loads(ok(target, "status", name, "--json"))["subscriptions"]
    return entry


def catalog_row(target: Database, name: str) -> dict[str, Any]:
    """The subscription's catalog row, read directly (cheaper than a status subprocess where status is not the
    point)."""
    with target.connect() as conn:
        cur = conn.execute(
            "SELECT *, subskiplsn::text AS skip FROM applier.subscription WHERE subname = %s", (name,)
        )
        names = [d.name for d in cur.description or []]
        return dict(zip(names, cur.fetchone() or (), strict=True))


def catalog_tables(target: Database, name: str) -> list[tuple[str, str]]:
    """``(table, state)`` of the subscription's tables, by name."""
    return [
        (r[0], r[1])
        for r in target.query(
            "SELECT r.srrelid::text, r.srsubstate FROM applier.subscription_rel r"
            " JOIN applier.subscription s USING (subid) WHERE s.subname = %s ORDER BY 1",
            (name,),
        )
    ]


def make_tables(pair: Any, *tables: str, publication: str | None = None, rows: int = 0) -> None:
    """Create ``tables`` (``id int primary key, v text``) on both sides, ``rows`` rows of each on the publisher, and a
    publication of them named ``publication`` (default: the pair's name)."""
    for t in tables:
        for db in (pair.publisher, pair.target):
            db.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        if rows:
            pair.publisher.execute(
                f"INSERT INTO {t} SELECT g, 'row ' || g FROM generate_series(1, %s) g",  # noqa: S608 - test names
                (rows,),
            )
    names = ", ".join(tables)
    pair.publisher.execute(f"CREATE PUBLICATION {publication or pair.name} FOR TABLE {names}")


def create(pair: Any, name: str, *extra: str, publication: str | None = None) -> str:
    """``applier create NAME`` against the pair; returns stdout."""
    return ok(
        pair.target, "create", name, "--publisher", pair.publisher.dsn, "--publication", publication or pair.name,
        *extra,
    )  # fmt: skip


def leftovers(pair: Any, subid: int, slot: str) -> dict[str, Any]:
    """What a subscription leaves on either side; all empty after a clean drop."""
    return {
        "slots": pair.publisher.query(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ),
        "origins": pair.target.query(
            "SELECT roname FROM pg_replication_origin WHERE roname = %s", (f"applier_{subid}",)
        ),
        "rows": pair.target.query(
            "SELECT 1 FROM applier.subscription WHERE subid = %s"
            " UNION ALL SELECT 1 FROM applier.subscription_rel WHERE subid = %s",
            (subid, subid),
        )
        if pair.target.scalar("SELECT to_regclass('applier.subscription') IS NOT NULL")
        else [],
    }


NOTHING = {"slots": [], "origins": [], "rows": []}


# --- `applier run` in the background ---------------------------------------------------------------------------

StartRun = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[StartRun]:
    """Start ``applier run ARGS...`` in the background (output to a log file); stopped with SIGTERM at the end.
    ``session=True`` starts it in a process group of its own, so that a test can kill its whole tree
    (``os.killpg``)."""
    procs: list[subprocess.Popen[str]] = []

    def start(target: Database, *args: str, session: bool = False) -> subprocess.Popen[str]:
        log = open(tmp_path / f"run-{len(procs)}.log", "w+")  # closed with the process below
        proc = subprocess.Popen([*APPLIER, "--target", target.dsn, "run", *args], stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=session)  # fmt: skip
        proc.log = log  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.log.close()  # type: ignore[attr-defined]


def run_log(proc: subprocess.Popen[str]) -> str:
    proc.log.flush()  # type: ignore[attr-defined]
    return Path(proc.log.name).read_text()  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, as a service manager would; return the exit status."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def alive(proc: subprocess.Popen[str]) -> Callable[[], bool]:
    """A wait predicate that fails fast, with the log, if the run process died."""

    def check() -> bool:
        assert proc.poll() is None, f"applier run exited with {proc.returncode}:\n{run_log(proc)}"
        return True

    return check
