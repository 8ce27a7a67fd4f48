"""The tests of the command line itself: its help, where the target comes from, and the exit status of a usage
error. (The helpers the command-line tests share are in :mod:`tests.support.cli`.)

Every test drives the real console entry point in a subprocess (``python -m applier.cli``), against the real
publisher and target of the ``pair`` fixture, as a user would.
"""

from __future__ import annotations

import os

import psycopg
import pytest

from tests.support.cli import applier, fails, make_tables, ok

pytestmark = [pytest.mark.core, pytest.mark.anyversion]  # our help, usage errors and PG* environment


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
