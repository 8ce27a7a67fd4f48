"""``applier migrate`` and the DDL capture on its source (issue 39, docs/migrate.md "Schema changes while
following"): ``start`` installs it before its slot and never copies it to the target, ``abort`` removes it,
``--no-ddl`` installs nothing, and a source role that may not create event triggers gets ``plan``'s warning and a
``start`` that follows without the capture, saying why in ``status``. (What the capture emits:
test_ddl_capture.py; the replay: the apply's tests.)"""

from __future__ import annotations

import json
from pathlib import Path

from psycopg import sql

from applier.ddl import capture
from applier.ddl.capture_sql import SCHEMA
from applier.testing import Database
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.roles import drop_role
from tests.support.migrate import exit_status, migrate, plan, start, stop, wait_phase

TABLES = """
CREATE TABLE acc (id int PRIMARY KEY, v int);
CREATE TABLE notes (n text);
INSERT INTO acc SELECT g, g FROM generate_series(1, 50) g;
INSERT INTO notes VALUES ('a');
"""


def _ours(db: Database) -> dict[str, int]:
    """What of a capture a database holds: our schema, event triggers (any), functions named like ours."""
    return {
        "schema": db.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (SCHEMA,)),
        "event_triggers": db.scalar("SELECT count(*) FROM pg_event_trigger"),
        "functions": db.scalar("SELECT count(*) FROM pg_proc WHERE proname LIKE 'ddl\\_mig%%'"),
    }


NOTHING = {"schema": 0, "event_triggers": 0, "functions": 0}


def _status(pair: ReplicationPair) -> dict[str, object]:
    res = migrate(pair.target, "status", "mig", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def _subddl(target: Database) -> bool:
    return bool(target.scalar("SELECT subddl FROM applier.subscription WHERE subname = 'mig'"))


def test_start_installs_it_before_the_slot_the_target_gets_none_and_abort_removes_it(
    pair: ReplicationPair, procs: list, tmp_path: Path
) -> None:
    pair.publisher.execute(TABLES)
    log = tmp_path / "start.log"
    procs.append(start(pair, "mig", log=log))
    wait_phase(pair.target, "mig", "following", procs[0], log)
    said = log.read_text()
    assert said.index("DDL capture installed") < said.index("slot mig created"), said
    with pair.publisher.connect() as conn:
        assert len(capture.installed(conn, "mig")) == 4
    assert _ours(pair.target) == NOTHING  # neither pre-data nor post-data copied it
    doc = _status(pair)
    assert doc["ddl"] is True and doc["ddl_why_not"] is None
    assert _subddl(pair.target)

    stop(
        procs[0], log
    )  # (an abort while start runs raced its worker for the origin once: not this test's subject)
    res = migrate(pair.target, "abort", "mig")
    assert res.returncode == 0, res.stderr
    assert "DDL capture of mig removed from the source" in res.stdout + res.stderr
    assert _ours(pair.publisher) == NOTHING
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0


def test_no_ddl_installs_nothing(pair: ReplicationPair, procs: list, tmp_path: Path) -> None:
    pair.publisher.execute(TABLES)
    log = tmp_path / "start.log"
    procs.append(start(pair, "mig", "--no-ddl", log=log))
    wait_phase(pair.target, "mig", "following", procs[0], log)
    assert _ours(pair.publisher) == NOTHING
    doc = _status(pair)
    assert doc["ddl"] is False and doc["ddl_why_not"] == "turned off (start --no-ddl)"
    assert not _subddl(pair.target)
    stop(procs[0], log)
    assert migrate(pair.target, "abort", "mig").returncode == 0


def test_a_role_that_may_not_create_event_triggers_is_warned_then_followed_without(
    pair: ReplicationPair, procs: list, tmp_path: Path
) -> None:
    """No superuser on the source (the rights a migration needs otherwise): ``plan`` warns (not a blocker),
    ``start`` follows without the capture, ``status`` says why, and nothing of a capture is on the source."""
    pair.publisher.execute(TABLES)
    role = f"mig_{pair.name}"[:63]
    pair.publisher.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION").format(sql.Identifier(role)))
    pair.target.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))  # owns the tables there too
    try:
        for stmt in (
            "GRANT CREATE ON DATABASE {db} TO {r}",
            "ALTER TABLE acc OWNER TO {r}",
            "ALTER TABLE notes OWNER TO {r}",
        ):
            pair.publisher.execute(
                sql.SQL(stmt).format(db=sql.Identifier(pair.name), r=sql.Identifier(role))  # type: ignore[arg-type]
            )
        source = pair.publisher.as_user(role)
        status, doc, _ = plan(source, pair.target)
        assert status == 0, doc["blockers"]
        (ddl,) = [w for w in doc["warnings"] if w["code"] == "ddl"]
        assert "may not create event triggers" in ddl["message"] and "rds_superuser" in ddl["hint"]

        log = tmp_path / "start.log"
        procs.append(start(pair, "mig", log=log, source=source))
        wait_phase(pair.target, "mig", "following", procs[0], log)
        assert "schema changes (DDL) on the source are not replayed" in log.read_text()
        assert _ours(pair.publisher) == NOTHING
        now = _status(pair)
        assert now["ddl"] is False and "may not create event triggers" in str(now["ddl_why_not"])
        assert not _subddl(pair.target)
        stop(procs[0], log)
        assert migrate(pair.target, "abort", "mig").returncode == 0
    finally:
        drop_role(pair.publisher, role)
        drop_role(pair.target, role)


def test_a_start_that_fails_in_its_schema_phase_removes_the_capture(
    pair: ReplicationPair, procs: list, tmp_path: Path
) -> None:
    """The pre-data fails (the target has a type of the source's name) after the capture was installed: the undo
    takes it back with the slot and publications."""
    pair.publisher.execute(
        "CREATE TYPE mood AS ENUM ('calm');" + TABLES + "ALTER TABLE acc ADD COLUMN m mood;"
    )
    pair.target.execute("CREATE TYPE mood AS ENUM ('other')")
    log = tmp_path / "start.log"
    procs.append(start(pair, "mig", log=log))
    assert exit_status(procs[0], log) == 1, log.read_text()
    assert "DDL capture installed" in log.read_text() and "DDL capture of mig removed" in log.read_text()
    assert _ours(pair.publisher) == NOTHING
    assert "nothing of it is left on the source" in str(_status(pair)["error"])


def test_the_cutover_removes_it(pair: ReplicationPair, procs: list, tmp_path: Path) -> None:
    pair.publisher.execute(TABLES)
    log = tmp_path / "start.log"
    procs.append(start(pair, "mig", "--cutover", log=log))
    assert exit_status(procs[0], log, timeout=180) == 0, log.read_text()
    assert "DDL capture of mig removed from the source" in log.read_text()
    assert _ours(pair.publisher) == NOTHING
    assert _status(pair)["phase"] == "done"
