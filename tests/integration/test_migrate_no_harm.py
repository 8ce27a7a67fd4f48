"""Do no harm to the source (issue 43; docs/migrate.md, "What happens when it fails"), through the command line
against real servers, the source checked afterwards from a fresh session: a cutover without a live ``start`` fences
nothing; a signalled cutover unfences and says so in its exit status; ``abort`` lifts only its own fence; ``start``
refuses what ``plan`` blocks before it creates anything, and takes back what it created when it fails after that.
The random kills and signals of every verb are in test_migrate_chaos.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from applier.testing import Database, wait_until
from tests.support.cli import APPLIER
from tests.support.migrate import (
    SCHEMA,
    exit_status,
    following,
    migrate,
    phase,
    slow_pg_dump,
    start,
    wait_phase,
)

pytestmark = [
    pytest.mark.core,
    pytest.mark.anyversion,
]  # our own guards: the server's version changes nothing


def read_only(source: Database) -> bool:
    """Whether the source's database is fenced (its setting, read from a fresh session)."""
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        return conn.execute("SHOW default_transaction_read_only").fetchone()[0] == "on"  # type: ignore[index]


def writable(source: Database) -> bool:
    """Whether an application's new session can write a migrated table."""
    try:
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO acc (v) VALUES (-7)")
    except psycopg.errors.ReadOnlySqlTransaction:
        return False
    return True


def ours_on_source(source: Database, name: str = "mig") -> dict[str, list[str]]:
    """The slots and publications of migration ``name`` on the source."""
    like = f"{name}%"
    slots = source.scalar("SELECT coalesce(array_agg(slot_name::text), '{}') FROM pg_replication_slots WHERE slot_name LIKE %s", (like,))  # fmt: skip
    pubs = source.scalar("SELECT coalesce(array_agg(pubname::text), '{}') FROM pg_publication WHERE pubname LIKE %s", (like,))  # fmt: skip
    return {"slots": list(slots), "publications": list(pubs)}


def status(target: Database, name: str = "mig") -> dict:  # type: ignore[type-arg]
    out = migrate(target, "status", name, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_cutover_needs_a_live_start_and_start_holds_its_migration(pair, procs, tmp_path) -> None:
    """Before: a cutover with no ``start`` fenced production for its whole timeout; two starts raced; SIGHUP
    killed start without its clean stop; status showed a cutover estimate for a migration nobody followed."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    second = subprocess.run([*APPLIER, "migrate", "start", "mig", "--source", pair.publisher.dsn, "--target",
                             pair.target.dsn], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert second.returncode == 1 and "already run by another applier migrate start" in second.stderr, second
    assert status(pair.target)["start"]["running"] is True
    proc.send_signal(signal.SIGHUP)
    assert exit_status(proc, log) == 0, log.read_text()
    assert "SIGHUP received: stopping" in log.read_text()

    doc = status(pair.target)
    assert doc["start"]["running"] is False and doc["cutover_estimate_seconds"] is None, doc
    text = migrate(pair.target, "status", "mig").stdout
    assert "start: not running; a cutover needs it" in text and "source: writable" in text, text
    began = time.monotonic()
    out = migrate(pair.target, "cutover", "mig", "--timeout", "60")
    assert out.returncode == 1 and "no applier migrate start is running" in out.stderr, out
    assert "nothing was fenced" in out.stderr, out.stderr
    assert time.monotonic() - began < 20, "the refusal came late: it must come before any fence"
    assert writable(pair.publisher) and phase(pair.target, "mig") == "following"
    assert pair.target.scalar("SELECT fenced_at FROM applier.migration WHERE name = 'mig'") is None


def test_sigterm_of_a_cutover_under_its_fence_unfences_and_exits_143(pair, procs, tmp_path) -> None:
    """Before: a SIGTERM (systemd, Kubernetes, ``timeout``) of a fenced cutover left the source read-only."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    with psycopg.connect(pair.publisher.dsn, autocommit=True) as tm:  # the fence ends this session
        tm.execute("BEGIN")
        tm.execute("INSERT INTO acc (v) VALUES (-2)")
        tm.execute("PREPARE TRANSACTION 'held'")
    cut = subprocess.Popen([*APPLIER, "migrate", "cutover", "mig", "--prepared", "wait", "--timeout", "120",
                            "--target", pair.target.dsn], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    try:
        wait_until(lambda: cut.poll() is not None or read_only(pair.publisher), timeout=90, what="the fence")
        assert cut.poll() is None, cut.communicate()[0]
        cut.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        output = cut.communicate(timeout=60)[0]
    finally:
        if cut.poll() is None:
            cut.kill()
    assert cut.returncode == 143, output
    assert time.monotonic() - signalled < 30, output
    assert "interrupted by SIGTERM" in output, output
    assert not read_only(pair.publisher) and writable(pair.publisher)
    assert phase(pair.target, "mig") == "following"
    doc = status(pair.target)
    assert doc["fence"]["fenced_at"] is None and "interrupted by SIGTERM" in (doc["error"] or ""), doc
    pair.publisher.execute("COMMIT PREPARED 'held'")
    out = migrate(pair.target, "cutover", "mig")
    assert out.returncode == 0, out.stdout + out.stderr
    assert exit_status(proc, log) == 0, log.read_text()


def test_abort_lifts_only_its_own_fence_and_finishes_into_a_closed_pipe(pair, procs, tmp_path) -> None:
    """Before: ``abort`` unfenced whatever fenced the source (a newer migration's cutover, its owner), and a
    closed output pipe (``| head -1``) stopped it half way with a traceback."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    db = pair.publisher.scalar("SELECT current_database()")
    pair.publisher.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')  # not ours
    try:
        script = (
            f"set -o pipefail; {' '.join(APPLIER)} migrate abort mig --target '{pair.target.dsn}' | head -c 0"
        )
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
        assert read_only(pair.publisher), "abort lifted a fence that was not its migration's"
    finally:
        with psycopg.connect(pair.publisher.dsn, autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = off")
            conn.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
    assert exit_status(proc, log) == 1, log.read_text()  # aborted
    assert ours_on_source(pair.publisher) == {"slots": [], "publications": []}
    assert phase(pair.target, "mig") == "failed"


def test_start_refuses_what_plan_blocks_before_creating_anything(pair, tmp_path) -> None:
    """Before: a target that already held a selected table got a publication (and sometimes a slot keeping WAL)
    on the source, then a raw error, and nothing in ``status``."""
    pair.publisher.execute(SCHEMA)
    pair.target.execute("CREATE TABLE acc (id bigint PRIMARY KEY, v int)")
    out = subprocess.run([*APPLIER, "migrate", "start", "mig", "--source", pair.publisher.dsn, "--target",
                          pair.target.dsn], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1, out
    assert "blocker(s), nothing was created" in out.stderr and "already exists on the target" in out.stderr, (
        out
    )
    assert ours_on_source(pair.publisher) == {"slots": [], "publications": []}
    assert phase(pair.target, "mig") is None


def test_a_start_that_fails_after_its_first_change_takes_it_back(pair, procs, tmp_path) -> None:
    """A failure ``plan`` cannot foresee (the target has a type of the source's name: the pre-data fails): the slot
    and publication are dropped again, ``status`` shows the error and what to do, and a start after the fix goes
    on to follow."""
    pair.publisher.execute(
        "CREATE TYPE mood AS ENUM ('calm'); " + SCHEMA + " ALTER TABLE acc ADD COLUMN m mood;"
    )
    pair.target.execute("CREATE TYPE mood AS ENUM ('other')")
    log = tmp_path / "start.log"
    first = start(pair, "mig", log=log)
    procs.append(first)
    assert exit_status(first, log) == 1, log.read_text()
    assert "already exists" in log.read_text(), log.read_text()
    assert ours_on_source(pair.publisher) == {"slots": [], "publications": []}, log.read_text()
    doc = status(pair.target)
    assert doc["phase"] == "schema" and doc["error"].startswith("start failed: "), doc
    assert "nothing of it is left on the source" in doc["error"] and "run start again" in doc["error"], doc

    pair.target.execute("DROP TYPE mood")
    again = start(pair, "mig", log=log)
    procs.append(again)
    wait_phase(pair.target, "mig", "following", again, log)
    assert status(pair.target)["error"] is None


@pytest.mark.parametrize("option", ["--table-jobs", "--index-jobs"])
def test_job_counts_below_one_are_usage_errors(option: str, tmp_path: Path) -> None:
    out = subprocess.run([*APPLIER, "migrate", "start", "m", "--source", "dbname=x", "--target", "dbname=y",
                          option, "-1"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "-1 is less than 1" in out.stderr, out


def test_a_following_start_lifts_the_fence_of_a_killed_cutover(pair, procs, tmp_path) -> None:  # noqa: F811
    """Before: ``kill -9`` of a fenced cutover left the source read-only while ``start`` went on following, and a
    second ``start`` was refused; now the running ``start`` undoes it within seconds."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    with psycopg.connect(pair.publisher.dsn, autocommit=True) as tm:
        tm.execute("BEGIN")
        tm.execute("INSERT INTO acc (v) VALUES (-3)")
        tm.execute("PREPARE TRANSACTION 'held_too'")
    cut = subprocess.Popen([*APPLIER, "migrate", "cutover", "mig", "--prepared", "wait", "--timeout", "300",
                            "--target", pair.target.dsn], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until(lambda: cut.poll() is not None or read_only(pair.publisher), timeout=90, what="the fence")
        assert cut.poll() is None
        cut.kill()
        cut.wait()
        killed = time.monotonic()
        wait_until(
            lambda: not read_only(pair.publisher), timeout=30, what="start to lift the dead cutover's fence"
        )
        assert time.monotonic() - killed < 15
    finally:
        if cut.poll() is None:
            cut.kill()
    assert writable(pair.publisher) and phase(pair.target, "mig") == "following"
    assert status(pair.target)["fence"]["fenced_at"] is None
    assert 'a cutover of migration "mig" was interrupted' in log.read_text(), log.read_text()
    pair.publisher.execute("COMMIT PREPARED 'held_too'")
    out = migrate(pair.target, "cutover", "mig")
    assert out.returncode == 0, out.stdout + out.stderr
    assert exit_status(proc, log) == 0, log.read_text()


def test_abort_rolls_back_the_migrations_prepared_transactions_on_the_target(pair, procs, tmp_path) -> None:  # noqa: F811
    """Before: an abort left the copies of the source's undecided prepared transactions prepared on the target,
    holding their locks and the xmin horizon there for good."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    with psycopg.connect(pair.publisher.dsn, autocommit=True) as tm:
        tm.execute("BEGIN")
        tm.execute("INSERT INTO acc (v) VALUES (-4)")
        tm.execute("PREPARE TRANSACTION 'open_at_abort'")
    on_target = "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
    wait_until(
        lambda: pair.target.scalar(on_target) == 1, timeout=60, what="the prepared transaction applied"
    )
    out = migrate(pair.target, "abort", "mig")
    assert out.returncode == 0, out
    assert "rolled back on the target" in out.stdout, out.stdout
    assert pair.target.scalar(on_target) == 0
    assert pair.publisher.scalar("SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'open_at_abort'") == 1
    pair.publisher.execute("ROLLBACK PREPARED 'open_at_abort'")
    assert exit_status(proc, log) == 1, log.read_text()


def test_a_password_start_could_not_keep_is_refused_before_anything(pair, tmp_path) -> None:
    """Before: a password in --source served start's own sessions, then the copy (which reads the recorded,
    password-free connection string) failed after the slot was made, leaving it to hold WAL on the source."""
    pub = pair.publisher
    pub.execute(SCHEMA)
    pub.execute("DROP ROLE IF EXISTS pw_owner")  # a role is the cluster's: an earlier run's may be there
    pub.execute("CREATE ROLE pw_owner LOGIN SUPERUSER REPLICATION PASSWORD 'sekret-9'")
    hba = Path(pub.cluster.datadir) / "pg_hba.conf"  # type: ignore[arg-type]
    before = hba.read_text()
    hba.write_text("host all pw_owner 127.0.0.1/32 scram-sha-256\nhost replication pw_owner 127.0.0.1/32 "
                   "scram-sha-256\n" + before)  # fmt: skip
    pub.execute("SELECT pg_reload_conf()")
    try:
        port = pub.scalar("SHOW port")
        source = f"host=127.0.0.1 port={port} dbname={pub.name} user=pw_owner password=sekret-9"
        env = {k: v for k, v in os.environ.items() if k not in ("PGPASSWORD", "PGPASSFILE")}
        env["PGPASSFILE"] = str(tmp_path / "none")
        out = subprocess.run([*APPLIER, "migrate", "start", "mig", "--source", source, "--target", pair.target.dsn],
                             capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    finally:
        hba.write_text(before)
        pub.execute("SELECT pg_reload_conf()")
    assert out.returncode == 1, out
    assert "asks for a password" in out.stderr and "~/.pgpass" in out.stderr, out.stderr
    assert "sekret-9" not in out.stderr + out.stdout
    assert ours_on_source(pub) == {"slots": [], "publications": []}
    assert phase(pair.target, "mig") is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_starts_whole_process_group_stops_it_cleanly(pair, procs, tmp_path, signum) -> None:  # noqa: F811
    """What systemd's default stop and a closed terminal send: the whole process group. Before: the workers' fork
    server died with it and start exited 1 ("the worker process exited with status 255 without a report"); while
    pg_dump ran, the dump's death was reported as a failure ("pg_dump ... failed: ")."""
    proc, log = following(pair, procs, tmp_path, SCHEMA)
    os.killpg(proc.pid, signum)
    assert exit_status(proc, log) == 0, log.read_text()
    assert "start again resumes" in log.read_text() and "255" not in log.read_text(), log.read_text()


def test_a_signal_to_the_group_while_pg_dump_runs_is_a_stop_not_a_failure(pair, procs, tmp_path) -> None:  # noqa: F811
    """Before: Ctrl-C in the terminal (SIGINT to the group) while pg_dump ran killed pg_dump too, and start
    reported "pg_dump of the source's schema failed: " and exited 1."""
    pair.publisher.execute(SCHEMA)
    log = tmp_path / "start.log"
    proc = start(pair, "mig", env={"APPLIER_PG_BINDIR": str(slow_pg_dump(tmp_path, pair.publisher))}, log=log)
    procs.append(proc)
    wait_until(
        lambda: (tmp_path / "dumping").exists() or proc.poll() is not None, timeout=120, what="pg_dump"
    )
    os.killpg(proc.pid, signal.SIGINT)
    assert exit_status(proc, log) == 0, log.read_text()
    assert "failed" not in log.read_text() and "start again resumes" in log.read_text(), log.read_text()
    assert ours_on_source(pair.publisher) == {"slots": [], "publications": []}
    assert status(pair.target)["error"] is None
