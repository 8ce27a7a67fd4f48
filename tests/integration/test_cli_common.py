"""Helpers for the command-line tests (``tests/integration/test_cli_*.py``), and the tests of the command line itself: its help,
where the target comes from, and the exit status of a usage error.

Every test drives the real console entry point in a subprocess (``python -m applier.cli``), against the real
publisher and target of the ``pair`` fixture, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg
import pytest

from applier.testing import Database

pytestmark = pytest.mark.core

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


# --- the command line itself -----------------------------------------------------------------------------------


def test_help_explains_every_command_and_option() -> None:
    top = ok(None, "--help")
    for command in ("create", "run", "status", "alter", "drop"):
        assert command in top
    create_help = ok(None, "create", "--help")
    for option in ("--publisher", "--publication", "--two-phase", "--streaming", "--no-copy-data", "--binary",
                   "--origin", "--disable-on-error", "--slot-name", "--no-create-slot", "--disabled", "--target"):  # fmt: skip
        assert option in create_help
    alter_help = ok(None, "alter", "--help")
    for option in ("--enable", "--disable", "--skip-lsn", "--set", "--refresh-publication", "--no-copy-data"):
        assert option in alter_help
    assert "--force" in ok(None, "drop", "--help")
    assert "--json" in ok(None, "status", "--help")


def test_usage_errors_exit_2() -> None:
    res = applier(None, "alter", "s", "--enable", "--disable")
    assert res.returncode == 2
    assert "not allowed with argument" in res.stderr
    res = applier(None, "alter", "s", "--enable", "--no-copy-data")
    assert res.returncode == 2
    assert "--no-copy-data only goes with --refresh-publication" in res.stderr
    res = applier(None, "create", "s", "--publication", "p")
    assert res.returncode == 2
    assert "--publisher" in res.stderr


def test_target_comes_from_the_environment_as_for_psql(pair) -> None:
    make_tables(pair, "t_env")
    info = psycopg.conninfo.conninfo_to_dict(pair.target.dsn)
    env = dict(os.environ, PGHOST=str(info["host"]), PGPORT=str(info["port"]), PGUSER=str(info["user"]),
               PGDATABASE=str(info["dbname"]))  # fmt: skip
    out = ok(None, "create", "envsub", "--publisher", pair.publisher.dsn, "--publication", pair.name, env=env)
    assert 'created subscription "envsub"' in out
    assert pair.target.scalar("SELECT subname FROM applier.subscription") == "envsub"
    # --target after the subcommand works too, and wins over the environment
    wrong_env = dict(env, PGPORT="1")
    assert "envsub" in ok(None, "status", "--target", pair.target.dsn, env=wrong_env)


def test_no_target_says_how_to_give_one(pair) -> None:
    err = fails("host=127.0.0.1 port=1 password=hunter2", "status")
    assert "could not connect to the target" in err
    assert "--target" in err and "PGHOST" in err
    assert "hunter2" not in err
