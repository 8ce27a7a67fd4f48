"""``applier migrate`` between managed servers: no superuser on either side (docs/security.md, "Managed services").

The roles imitate AWS RDS for PostgreSQL's documented admin role ``rds_superuser`` as a migration uses it (the
other services' admin roles, Cloud SQL's ``cloudsqlsuperuser`` and Azure's ``azure_pg_admin``, give the same
privileges that matter here):

- source: a LOGIN role with REPLICATION (RDS grants ``rds_replication``, a role that stands for it), a member of
  ``pg_read_all_stats`` (``rds_superuser`` is, through ``pg_monitor``), owner of its database and tables, and with
  or without ``pg_signal_backend`` (``rds_superuser`` has it; a role made by it need not);
- target: a LOGIN role, NOCREATEDB, owner of the target database, with SET on ``session_replication_role``,
  EXECUTE on the ``pg_replication_origin_*`` functions and ``pg_show_replication_origin_status()`` and SELECT on
  ``pg_replication_origin_status`` (what ``rds_superuser`` holds on RDS);
- the provider's own sessions (RDS's ``rdsadmin``) are a superuser's: the cluster's ``postgres``.

The fence's rule (:mod:`applier.migrate.fence`): a session the role cannot end is left connected when its role
cannot write the migrated tables, and locked out of them (``LOCK ... IN SHARE MODE`` until done) when it could; the
cutover refuses, unfenced, only when that lock does not come (such a session is inside a transaction that wrote).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from applier.privileges import ORIGIN_FUNCTIONS
from applier.testing import Database, PostgresCluster, wait_until
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.roles import drop_role
from tests.support.cli import APPLIER
from tests.support.migrate import blocker_codes, exit_status, migrate, phase, plan, wait_phase

SCHEMA = """
CREATE TABLE acc (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v int NOT NULL);
CREATE TABLE log (id serial PRIMARY KEY, acc bigint REFERENCES acc, note text);
INSERT INTO acc (v) SELECT g FROM generate_series(1, 300) g;
INSERT INTO log (acc, note) SELECT g, 'n' FROM generate_series(1, 300) g;
"""


class Managed:
    """The source's and the target's databases as the migrating role on each side (the same name on both), plus
    roles made for the sessions a test opens; every role is dropped afterwards. The source is the pair's publisher
    unless ``publisher`` names another server's database (:func:`source_server`)."""

    def __init__(self, pair: ReplicationPair, publisher: Database | None = None) -> None:
        self.pair = pair
        self.publisher = publisher or pair.publisher
        self.role = f"mig_{pair.name}"[:63]
        self.made: list[tuple[Database, str]] = []

    def _role(self, db: Database, name: str, options: str = "LOGIN") -> None:
        db.execute(sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(name)))
        self.made.append((db, name))

    def source(self, *, signal_backend: bool) -> Database:
        pub, ident = self.publisher, sql.Identifier(self.role)
        self._role(pub, self.role, "LOGIN REPLICATION")
        pub.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(ident))
        if signal_backend:
            pub.execute(sql.SQL("GRANT pg_signal_backend TO {}").format(ident))
        pub.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(pub.name), ident))
        return pub.as_user(self.role)

    def target(self) -> Database:
        self._role(self.pair.target, self.role, "LOGIN NOCREATEDB")
        return self.target_grants()

    def target_grants(self) -> Database:
        tgt, ident = self.pair.target, sql.Identifier(self.role)
        tgt.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(tgt.name), ident))
        tgt.execute(sql.SQL("GRANT SET ON PARAMETER session_replication_role TO {}").format(ident))
        for f in (*ORIGIN_FUNCTIONS, "pg_catalog.pg_show_replication_origin_status()"):
            tgt.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(sql.SQL(f), ident))
        tgt.execute(sql.SQL("GRANT SELECT ON pg_catalog.pg_replication_origin_status TO {}").format(ident))
        return tgt.as_user(self.role)

    def other(self, name: str, *grants: str) -> Database:
        """Another role on the source, granted ``grants`` (e.g. ``SELECT ON acc``); the source as that role."""
        pub = self.publisher
        full = f"{name}_{self.pair.name}"[:63]
        self._role(pub, full)
        for g in grants:
            pub.execute(sql.SQL("GRANT " + g + " TO {}").format(sql.Identifier(full)))
        return pub.as_user(full)


@pytest.fixture
def source_server(request: pytest.FixtureRequest, pair: ReplicationPair) -> Iterator[Database]:
    """The source's database as the superuser (the provider's own role): the pair's publisher, of this run's
    version; or, parametrized indirectly with ``"14"``, a database of the pair's name on the PostgreSQL 14 cluster
    (the ``pg14`` fixture), dropped afterwards."""
    if getattr(request, "param", "run") == "run":
        yield pair.publisher
        return
    cluster: PostgresCluster = request.getfixturevalue("pg14")
    db = cluster.create_database(pair.name)
    try:
        yield db
    finally:
        with cluster.connect() as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(pair.name)))


@pytest.fixture
def managed(pair: ReplicationPair, source_server: Database) -> Iterator[Managed]:
    m = Managed(pair, source_server)
    yield m
    # the cutover leaves the old server fenced (read-only), where dropping the roles needs to write
    with source_server.connect() as conn:
        conn.execute("SET default_transaction_read_only = off")
        conn.execute(
            sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(
                sql.Identifier(source_server.name)
            )
        )
    for db, role in reversed(m.made):
        drop_role(db, role)


def _start(src: Database, tgt: Database, name: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - the child writes it; closed with the test's tmp_path
    return subprocess.Popen([*APPLIER, "migrate", "start", name, "--source", src.dsn, "--target", tgt.dsn, *extra],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _idle(db: Database) -> psycopg.Connection:
    conn = db.connect()
    conn.execute("SELECT 1")
    return conn


def test_cutover_without_superuser_refuses_a_writer_it_cannot_end_then_locks_it_out(
    pair,
    managed,
    procs,
    tmp_path,
) -> None:
    """Source role without pg_signal_backend. Open on the source at the cutover: the provider's superuser session
    (idle), a reader's (cannot write: left alone) and an application role's inside a transaction that wrote to a
    migrated table (could write, cannot be ended, and its lock keeps ours away): the cutover refuses with the
    sessions and the fix, unfenced, the migration still following. Once that transaction commits the cutover
    succeeds: the writers are locked out of the tables until done, the reader left, and the record says so."""
    src = managed.source(signal_backend=False)
    tgt = managed.target()
    src.execute(SCHEMA)
    app = managed.other("app", "SELECT, INSERT, UPDATE ON acc", "USAGE ON SEQUENCE acc_id_seq")
    reader = managed.other("reader", "SELECT ON acc, log")
    log = tmp_path / "start.log"
    proc = _start(src, tgt, "mig", log)
    procs.append(proc)
    wait_phase(pair.target, "mig", "following", proc, log)

    provider = _idle(pair.publisher)  # a superuser's session: rdsadmin's on RDS
    reading = _idle(reader)
    writing = app.connect(autocommit=False)
    writing.execute("INSERT INTO acc (v) VALUES (1001)")  # ROW EXCLUSIVE on acc, held until it commits
    pids = {
        name: c.info.backend_pid
        for name, c in (("provider", provider), ("reader", reading), ("app", writing))
    }
    try:
        res = migrate(tgt, "cutover", "mig", "--timeout", "5")
        assert res.returncode == 1, res.stdout + res.stderr
        err = res.stderr
        assert "could write the migrated tables" in err and "cannot end them" in err, err
        assert f"pid {pids['app']}" in err and f"pid {pids['provider']}" in err and "superuser" in err
        assert f"pid {pids['reader']}" not in err.split("Fix:")[0].split("cannot end them:")[1], err
        assert "GRANT pg_signal_backend TO" in err and "unfenced" in err, err
        assert phase(pair.target, "mig") == "following"
        pair.publisher.execute("INSERT INTO log (note) VALUES ('after the refusal')")  # a new session writes
        for c in (provider, reading):  # nobody was ended
            assert c.execute("SELECT 1").fetchone() == (1,)

        writing.commit()  # the transaction ends, its session stays
        cut = subprocess.Popen([*APPLIER, "migrate", "cutover", "mig", "--target", tgt.dsn, "--timeout", "60"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        lines: list[str] = []
        late: dict[str, int] = {}

        def write_late() -> None:  # the superuser's session (not read-only: it connected before the fence)
            provider.execute("INSERT INTO log (note) VALUES ('late')")
            late["after_lines"] = len(lines)

        assert cut.stdout is not None
        writer = threading.Thread(target=write_late, daemon=True)
        for line in cut.stdout:
            lines.append(line)
            if "table(s) locked IN SHARE MODE on the source" in line:
                writer.start()  # it waits for the lock: no write reaches the tables during the cutover
        assert cut.wait() == 0, "".join(lines)
        out = "".join(lines)
        writer.join(timeout=30)
        assert "after_lines" in late, out  # it went through once the cutover released the lock
        assert "fence: 0 session(s) ended" in out
        assert "left 1 session(s) connected that cannot be ended and cannot write" in out
        assert f"pid {pids['reader']}" in out
        assert "2 session(s) that could write the migrated tables cannot be ended" in out
        assert "locked IN SHARE MODE" in out and "WARNING: the lock on the migrated tables is released" in out
        assert exit_status(proc, log) == 0, log.read_text()
    finally:
        for c in (provider, reading, writing):
            c.close()

    assert tgt.query("SELECT * FROM acc ORDER BY id") == src.query("SELECT * FROM acc ORDER BY id")
    # the late write, tried while the tables were locked, reached only the old server: had it passed before the end
    # position it would be on the target, between it and the verification the counts would have differed (the
    # cutover then fails); it waited for the lock, released once the migration was done (the WARNING says so)
    late_rows = "SELECT * FROM log WHERE note = 'late'"
    assert len(src.query(late_rows)) == 1 and tgt.query(late_rows) == []
    assert tgt.query("SELECT * FROM log ORDER BY id") == src.query(
        "SELECT * FROM log WHERE note <> 'late' ORDER BY id"
    )
    assert (1001,) in {(r[1],) for r in tgt.query("SELECT * FROM acc")}
    doc = json.loads(migrate(tgt, "status", "mig", "--json").stdout)
    fence = doc["notes"]["fence"]
    assert doc["phase"] == "done"
    assert {s["pid"] for s in fence["left"]} == {pids["reader"]}
    assert {s["pid"] for s in fence["held_off"]} == {pids["provider"], pids["app"]}
    # the grants to roles the target lacks were skipped, said and recorded; the others kept
    assert f"grant(s) naming role {app.user} skipped" in log.read_text()
    assert any(app.user in line for line in doc["notes"]["skipped"])
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0


@pytest.mark.parametrize("source_server", [pytest.param("run", marks=pytest.mark.core), "14"], indirect=True)
def test_start_cutover_without_superuser_leaves_the_providers_session(
    pair,
    source_server,
    managed,
    procs,
    tmp_path,
) -> None:
    """The issue's case: ``start --cutover`` between non-superusers (source with pg_signal_backend) while a
    superuser's session is open on the source, from a source of this run's version and from PostgreSQL 14 (issue
    31: "15 → 18 and 14 → 18"). The plan passes (from 14 without a word on the public schema, which the bootstrap
    superuser owns there by default); the application's session is ended, the superuser's cannot be: the migrated
    tables are locked against it until done, and the cutover completes."""
    src = managed.source(signal_backend=True)
    tgt = managed.target()
    src.execute(SCHEMA)
    app = managed.other("app", "SELECT, INSERT ON acc", "USAGE ON SEQUENCE acc_id_seq")
    status, doc, _ = plan(src, tgt)
    assert status == 0, doc["blockers"]
    assert doc["source"]["server_version_num"] // 10000 == source_server.cluster.binaries.major
    # before 15 the bootstrap superuser owns the public schema by default: the target keeps its own, unsaid
    assert not [w for w in doc["warnings"] if "role postgres" in w["message"]], doc["warnings"]
    provider = _idle(source_server)
    application = _idle(app)
    pids = {"provider": provider.info.backend_pid, "app": application.info.backend_pid}
    try:
        log = tmp_path / "start.log"
        proc = _start(src, tgt, "mig", log, "--cutover")
        procs.append(proc)
        assert exit_status(proc, log, timeout=300) == 0, log.read_text()
        out = log.read_text()
        assert "fence: 1 session(s) ended" in out, out
        assert "of role postgres" not in out, out
        assert f"pid {pids['provider']} (role postgres, superuser)" in out
        assert "locked IN SHARE MODE" in out
        assert provider.execute("SELECT 1").fetchone() == (1,)  # still connected
        with pytest.raises(psycopg.OperationalError):
            application.execute("SELECT 1")
    finally:
        provider.close()
        application.close()
    assert tgt.query("SELECT * FROM acc ORDER BY id") == src.query("SELECT * FROM acc ORDER BY id")
    assert tgt.query("SELECT * FROM log ORDER BY id") == src.query("SELECT * FROM log ORDER BY id")
    assert tgt.scalar("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE relname = 'acc'") == managed.role
    assert tgt.scalar("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'public'") == (
        "pg_database_owner"
    )
    record = json.loads(migrate(tgt, "status", "mig", "--json").stdout)
    assert record["phase"] == "done"
    fence = record["notes"]["fence"]
    assert [s["pid"] for s in fence["held_off"]] == [pids["provider"]]
    assert [s["pid"] for s in fence["ended"]] == [pids["app"]]
    wait_until(
        lambda: source_server.scalar("SELECT count(*) FROM pg_replication_slots") == 0, what="slot gone"
    )


@pytest.mark.core
def test_plan_names_each_missing_privilege_with_its_fix(pair, managed) -> None:
    """Roles that have nothing but LOGIN (and SELECT on one table): every privilege the migration needs is a
    blocker with the statement that gives it, exit 1; granted as the test above grants them, the plan passes, and
    what a managed target does without (an owner it lacks) is a warning."""
    pub, tgt = pair.publisher, pair.target
    pub.execute(SCHEMA + "CREATE TABLE hidden (id int PRIMARY KEY);")
    role, ident = managed.role, sql.Identifier(managed.role)
    for db in (pub, tgt):
        managed._role(db, role)
    pub.execute(sql.SQL("GRANT SELECT ON acc, log, log_id_seq TO {}").format(ident))
    status, doc, _ = plan(pub.as_user(role), tgt.as_user(role))
    assert status == 1
    assert blocker_codes(doc) == sorted([
        "source_replication", "source_create", "source_ownership", "source_select", "source_select",
        "target_create", "target_schema", "target_replication_role", "target_origin_functions",
    ])  # fmt: skip
    hints = {b["code"]: b["hint"] for b in doc["blockers"]}
    db = pub.name  # quote_ident leaves it as it is
    assert hints["source_replication"] == f"ALTER ROLE {role} REPLICATION;"
    assert hints["source_create"] == f"GRANT CREATE ON DATABASE {db} TO {role};"
    assert f"OWNER TO {role}" in hints["source_ownership"]
    assert {b["hint"] for b in doc["blockers"] if b["code"] == "source_select"} == {
        f"GRANT SELECT ON public.hidden TO {role};",
        f"GRANT SELECT ON public.acc_id_seq TO {role};",
    }
    assert hints["target_schema"] == f"GRANT CREATE ON SCHEMA public TO {role};"
    assert hints["target_replication_role"] == f"GRANT SET ON PARAMETER session_replication_role TO {role};"
    assert hints["target_origin_functions"].count("GRANT EXECUTE ON FUNCTION") == 8
    assert {"source_signal_backend", "source_read_all_stats"} <= {w["code"] for w in doc["warnings"]}

    # the text output says the same, with each fix
    res = subprocess.run([*APPLIER, "migrate", "plan", "--source", pub.as_user(role).dsn, "--target",
                          tgt.as_user(role).dsn], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 1 and f"HINT: GRANT pg_signal_backend TO {role};" in res.stdout, res.stdout

    # as the managed services' admin role has it: only warnings left (an owner the target lacks among them)
    pub.execute(sql.SQL("ALTER ROLE {} REPLICATION").format(ident))
    pub.execute(sql.SQL("GRANT pg_signal_backend, pg_read_all_stats TO {}").format(ident))
    pub.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(pub.name), ident))
    pub.execute(sql.SQL("ALTER TABLE acc OWNER TO {}; ALTER TABLE log OWNER TO {}").format(ident, ident))
    other = managed.other("owner")
    pub.execute(sql.SQL("ALTER TABLE hidden OWNER TO {}").format(sql.Identifier(other.user)))
    pub.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(other.user), ident))
    managed.target_grants()
    status, doc, _ = plan(pub.as_user(role), tgt.as_user(role))
    assert status == 0, doc["blockers"]
    owner = [w for w in doc["warnings"] if w["code"] == "owner"]
    assert len(owner) == 1 and other.user in owner[0]["message"] and role in owner[0]["message"]


def test_different_role_names_own_the_target_and_abort_cleans_the_source(
    pair,
    managed,
    procs,
    tmp_path,
) -> None:
    """The source's owner does not exist on the target (another role migrates into it): the objects are owned by
    the target's role (--no-owner), which start says and records; abort as the non-superuser source role drops the
    slot and publication it made and unfences."""
    src = managed.source(signal_backend=False)
    src.execute(SCHEMA)
    other = f"tgt_{pair.name}"[:63]
    managed.role, source_role = other, managed.role
    tgt = managed.target()
    log = tmp_path / "start.log"
    proc = _start(src, tgt, "mig", log)
    procs.append(proc)
    wait_phase(pair.target, "mig", "following", proc, log)
    assert f"object(s) of role {source_role} are owned by the migrating role instead" in log.read_text()
    assert tgt.scalar("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE relname = 'acc'") == other
    src.execute("INSERT INTO acc (v) VALUES (5)")
    wait_until(lambda: tgt.scalar("SELECT count(*) FROM acc WHERE v = 5") == 2, what="the insert followed")
    doc = json.loads(migrate(tgt, "status", "mig", "--json").stdout)
    assert any(source_role in line for line in doc["notes"]["skipped"])

    res = migrate(tgt, "abort", "mig")
    assert res.returncode == 0, res.stdout + res.stderr
    assert exit_status(proc, log) != 0
    assert pair.publisher.scalar("SELECT count(*) FROM pg_replication_slots") == 0
    assert pair.publisher.scalar("SELECT count(*) FROM pg_publication") == 0
