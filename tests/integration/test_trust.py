"""The apply never lends its rights (issue 26): with ``run_as_owner = false`` (the default) a change or a copy that
would run code controlled by a role the apply role does not trust fails, through the usual failure path, with an
error that names the table, the object and its owner; the untrusted role stays unprivileged and what was applied
before stays. With ``run_as_owner = true`` the owner's code runs, as PostgreSQL's subscriber runs it with that
option. docs/security.md has the threat model; applier/catalog/trust.py the check.

Each test plays the attack a table owner can mount against an apply role that is a superuser (what most
deployments use): code that runs ``ALTER ROLE <owner> SUPERUSER`` when a replicated change reaches the table."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg import sql

from applier.apply.testing import ApplySetup, setup_subscription
from applier.testing import wait_for_catchup, wait_until
from tests.support.cli import APPLIER, applier, ok, status
from tests.support.trust import escalating_function, evil_trigger, owned_table, superuser

pytestmark = pytest.mark.core


def _refused(s: ApplySetup, *words: str) -> dict[str, Any]:
    """Wait until the worker's last error is the trust check's refusal naming ``words``; return it."""

    def refused() -> dict[str, Any] | None:
        e = status(s.target, s.name)["last_error"]
        return e if e and "runs no code that a role" in e["message"] and not e["resolved"] else None

    wait_until(refused, timeout=60, what="the trust check's refusal in status")
    e = refused()
    assert e is not None and e["sqlstate"] == "42501", e
    for w in words:
        assert w in e["message"], (w, e["message"])
    assert "run_as_owner=true" in e["message"]  # the way out, from the error's hint
    return e


def test_trigger_attached_while_the_worker_runs_is_refused_and_nothing_is_lost(pair, mallory) -> None:
    """The apply path: a row applied, then the owner attaches an ALWAYS trigger; the next change is refused
    (the guard's plan was cached for the table: the new trigger must invalidate it), the owner stays
    unprivileged, the first row stays, and once the trigger is gone the change is applied, exactly once."""
    owned_table(pair, mallory)
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'before')")
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        evil_trigger(pair, mallory)
        pair.publisher.execute("INSERT INTO t VALUES (2, 'after')")
        e = _refused(s, "public.t", "trigger evil", f"owned by role {mallory}")
        assert e["relation"] == "public.t" and e["message_type"] == "INSERT"
        assert not superuser(pair, mallory)
        assert pair.target.query("SELECT id FROM t ORDER BY id") == [(1,)]
        pair.target.execute("DROP TRIGGER evil ON t")
        wait_until(
            lambda: pair.target.scalar("SELECT count(*) FROM t") == 2, timeout=60, what="row 2 applied"
        )
    finally:
        w.stop()
    assert pair.target.query("SELECT id, v FROM t ORDER BY id") == [(1, "before"), (2, "after")]
    assert not superuser(pair, mallory)


def test_trigger_attached_after_many_updates_and_deletes_is_refused(pair, mallory) -> None:
    """A table without domains: its prepared UPDATE and DELETE carry the check themselves (no guard). Each is run
    in ten transactions first, so that PostgreSQL has switched to its cached generic plan: a trigger attached then
    must make it plan again, and so check, before the statement runs (one for UPDATE, then one for DELETE)."""
    owned_table(pair, mallory)
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 30) g")
        for i in range(1, 11):  # one transaction each
            pair.publisher.execute("UPDATE t SET v = 'u' WHERE id = %s", (i,))
            pair.publisher.execute("DELETE FROM t WHERE id = %s", (i + 10,))
        wait_for_catchup(pair.publisher, pair.name, timeout=60)
        for event, change in (("UPDATE", "UPDATE t SET v = 'evil' WHERE id = 21"), ("DELETE", "DELETE FROM t WHERE id = 22")):  # fmt: skip
            evil_trigger(pair, mallory, f"BEFORE {event}")
            pair.publisher.execute(change)
            e = _refused(s, "public.t", "trigger evil", f"owned by role {mallory}")
            assert e["message_type"] == event
            assert not superuser(pair, mallory)
            pair.target.execute("DROP TRIGGER evil ON t")
            pair.target.execute("DROP FUNCTION public.evil()")
            wait_for_catchup(pair.publisher, pair.name, timeout=60)
    finally:
        w.stop()
    assert pair.target.query("SELECT id, v FROM t ORDER BY id") == pair.publisher.query(
        "SELECT id, v FROM t ORDER BY id"
    )
    assert not superuser(pair, mallory)


def test_default_of_a_column_the_publisher_does_not_send_is_refused(pair, mallory) -> None:
    """The owner's volatile function as the DEFAULT of a column only the target has."""
    escalating_function(pair, mallory, "stamp()", "text", "'x'")
    owned_table(pair, mallory, ", extra text DEFAULT public.stamp()")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        _refused(s, "default of column extra", f"runs function public.stamp() owned by role {mallory}")
        assert not superuser(pair, mallory)
        assert pair.target.scalar("SELECT count(*) FROM t") == 0
    finally:
        w.stop()


def test_always_rule_and_domain_constraint_are_refused(pair, mallory) -> None:
    """A rule enabled ALWAYS on the owner's table, then (once it is dropped) a CHECK on a domain the owner owns,
    added while the worker runs: a domain constraint does not touch the table, so only the guard's dependency on
    the domain can notice it."""
    escalating_function(pair, mallory, "ok(int)", "boolean", "true")
    pair.target.execute("CREATE DOMAIN public.pos AS int")
    pair.target.execute(sql.SQL("ALTER DOMAIN public.pos OWNER TO {}").format(sql.Identifier(mallory)))
    pair.publisher.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.target.execute("CREATE TABLE t (id public.pos PRIMARY KEY, v text)")
    pair.target.execute(sql.SQL("ALTER TABLE t OWNER TO {}").format(sql.Identifier(mallory)))
    pair.target.execute("CREATE RULE audit AS ON INSERT TO t DO ALSO SELECT 1")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS RULE audit")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        _refused(s, "rule audit", "is a rule of a table whose owner")
        pair.target.execute("DROP RULE audit ON t")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") == 1, timeout=60, what="row 1")
        # NOT VALID: checking the rows there would run the function with the test's own (superuser) rights
        pair.target.execute("ALTER DOMAIN public.pos ADD CONSTRAINT c CHECK (public.ok(VALUE)) NOT VALID")
        pair.publisher.execute("INSERT INTO t VALUES (2, 'two')")
        _refused(s, "constraint c of domain public.pos", f"owned by role {mallory}")
        assert pair.target.scalar("SELECT count(*) FROM t") == 1
        assert not superuser(pair, mallory)
    finally:
        w.stop()


def test_trusted_trigger_keeps_working_and_a_replaced_one_is_refused(pair, mallory) -> None:
    """The benign case: an ALWAYS audit trigger owned by the apply role on a table another role owns runs. The
    owner then replaces the trigger with one of its own (CREATE OR REPLACE TRIGGER, while the worker runs): the
    next change is refused."""
    owned_table(pair, mallory)
    pair.target.execute("CREATE TABLE audit (id int)")
    pair.target.execute(
        "CREATE FUNCTION public.audit() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN INSERT INTO public.audit VALUES (NEW.id); RETURN NEW; END $$"
    )
    pair.target.execute("CREATE TRIGGER audit AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION public.audit()")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER audit")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        wait_until(
            lambda: pair.target.scalar("SELECT count(*) FROM audit") == 1, timeout=60, what="audit row"
        )
        escalating_function(pair, mallory, "evil()", "trigger", "NEW")
        pair.target.execute(
            "CREATE OR REPLACE TRIGGER audit AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION public.evil()"
        )
        # a replaced trigger is enabled ORIGIN again: make it fire for replicated rows
        pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER audit")
        pair.publisher.execute("INSERT INTO t VALUES (2, 'two')")
        _refused(s, "trigger audit", f"runs function public.evil() owned by role {mallory}")
        assert not superuser(pair, mallory)
        assert pair.target.scalar("SELECT count(*) FROM t") == 1
    finally:
        w.stop()


def test_run_as_owner_trusts_the_owner(pair, mallory) -> None:
    """With run_as_owner the owner's trigger runs with the apply role's rights, as the option says (native runs
    it as the apply role too with run_as_owner = true); status shows the option."""
    owned_table(pair, mallory)
    pair.target.execute("CREATE TABLE seen (id int)")
    pair.target.execute(sql.SQL("GRANT INSERT ON seen TO {}").format(sql.Identifier(mallory)))
    pair.target.execute(
        "CREATE FUNCTION public.seen() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN INSERT INTO public.seen VALUES (NEW.id); RETURN NEW; END $$"
    )
    pair.target.execute(sql.SQL("ALTER FUNCTION public.seen() OWNER TO {}").format(sql.Identifier(mallory)))
    pair.target.execute("CREATE TRIGGER seen AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION public.seen()")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER seen")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"], run_as_owner=True)
    assert status(pair.target, pair.name)["run_as_owner"] is True
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        wait_until(
            lambda: pair.target.scalar("SELECT count(*) FROM seen") == 1, timeout=60, what="trigger ran"
        )
    finally:
        w.stop()


@pytest.mark.anyversion  # our alter and the worker's new session; run_as_owner's trust is test_run_as_owner_trusts_the_owner's
def test_alter_run_as_owner_restarts_with_the_new_trust(pair, mallory) -> None:
    """``alter --set run_as_owner=true`` lets a refused change through (the worker restarts its session);
    ``=false`` refuses again; status says which."""
    owned_table(pair, mallory)
    pair.target.execute(
        "CREATE FUNCTION public.noop() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$"
    )
    pair.target.execute(sql.SQL("ALTER FUNCTION public.noop() OWNER TO {}").format(sql.Identifier(mallory)))
    pair.target.execute("CREATE TRIGGER noop BEFORE INSERT ON t FOR EACH ROW EXECUTE FUNCTION public.noop()")
    pair.target.execute("ALTER TABLE t ENABLE ALWAYS TRIGGER noop")
    s = setup_subscription(pair.publisher, pair.target, pair.name, ["public.t"])
    w = s.start()
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        _refused(s, "trigger noop")
        ok(pair.target, "alter", pair.name, "--set", "run_as_owner=true")
        assert status(pair.target, pair.name)["run_as_owner"] is True
        assert "run_as_owner true" in ok(pair.target, "status", pair.name)
        wait_until(
            lambda: pair.target.scalar("SELECT count(*) FROM t") == 1, timeout=60, what="row 1 applied"
        )
        session = _apply_backend(pair)
        ok(pair.target, "alter", pair.name, "--set", "run_as_owner=false")
        # the option takes effect when the worker starts its next session (as ALTER SUBSCRIPTION's do)
        wait_until(
            lambda: _apply_backend(pair) not in (None, session), timeout=30, what="a new apply session"
        )
        pair.publisher.execute("INSERT INTO t VALUES (2, 'two')")
        _refused(s, "trigger noop")
        assert pair.target.scalar("SELECT count(*) FROM t") == 1
    finally:
        w.stop()


def _apply_backend(pair: Any) -> int | None:
    """The pid of the worker's apply session on the target."""
    return pair.target.scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (f"applier {pair.name}",)
    )


@pytest.mark.anyversion  # the trust check's catalog reads are the other tests'; this is the copy's path
def test_copy_path_refused_on_the_driver(pair, mallory, tmp_path) -> None:
    """``applier create`` (with the copy) and ``applier run``: the copy into the owner's table with an ALWAYS
    INSERT trigger fails, retried, with the refusal in status; run does not exit; the owner stays unprivileged.
    The refusal ends each attempt at once, without starting Spark to meet it again. Then the trigger is dropped
    and the next attempt copies the rows. (The same refusal in a Spark task: test_tablesync_copy.py, on that
    module's shared session.)"""
    import subprocess

    owned_table(pair, mallory)
    pair.publisher.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 100) g")
    pair.publisher.execute("CREATE PUBLICATION p FOR TABLE t")
    evil_trigger(pair, mallory, "BEFORE INSERT")
    res = applier(pair.target, "create", "s", "--publisher", pair.publisher.dsn, "--publication", "p")
    assert res.returncode == 0, res.stderr
    # create says at once what will be refused, and how to trust the owner instead
    assert "table public.t: trigger evil runs function public.evil()" in res.stderr, res.stderr
    assert "changes to it will be refused" in res.stderr and "--run-as-owner" in res.stderr
    log = open(tmp_path / "run.log", "w+")
    proc = subprocess.Popen([*APPLIER, "--target", pair.target.dsn, "run", "--max-retry-interval", "2"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_until(lambda: ((status(pair.target, "s")["last_error"] or {}).get("message") or "").find(
            "runs no code that a role") >= 0, timeout=240, what="the copy refused")  # fmt: skip
        e = status(pair.target, "s")["last_error"]
        assert e["message_type"] == "COPY" and e["relation"] == "public.t" and "trigger evil" in e["message"]
        assert proc.poll() is None
        assert not superuser(pair, mallory)
        assert pair.target.scalar("SELECT count(*) FROM t") == 0
        text = (tmp_path / "run.log").read_text()
        assert "starting Spark" not in text, text[-3000:]
        pair.target.execute("DROP TRIGGER evil ON t")
        wait_until(lambda: pair.target.scalar("SELECT count(*) FROM t") == 100, timeout=240, what="the copy")
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
    assert not superuser(pair, mallory)


def test_row_level_security_is_refused_for_a_non_superuser_apply_role(pair, mallory, tmp_path) -> None:
    """A table whose RLS policy (with the owner's volatile function) applies to the apply role: refused with
    PostgreSQL's own error, as the native worker refuses it; the policy's function never runs."""
    import subprocess

    from applier.testing.roles import create_apply_role, drop_role

    owned_table(pair, mallory)
    escalating_function(pair, mallory, "visible(int)", "boolean", "true")
    pair.target.execute("ALTER TABLE t ENABLE ROW LEVEL SECURITY")
    pair.target.execute("CREATE POLICY p ON t USING (public.visible(id)) WITH CHECK (public.visible(id))")
    pair.publisher.execute("CREATE PUBLICATION p FOR TABLE t")
    role = f"a_{pair.name}"[:63]
    tgt = create_apply_role(pair.target, role, ["public.t"])
    try:
        ok(tgt, "create", "s", "--publisher", pair.publisher.dsn, "--publication", "p", "--no-copy-data")
        log = open(tmp_path / "run.log", "w+")
        proc = subprocess.Popen([*APPLIER, "--target", tgt.dsn, "run"], stdout=log, stderr=subprocess.STDOUT)
        try:
            pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")

            def refused() -> bool:
                e = status(tgt, "s")["last_error"] or {}
                return "cannot replicate into relation with row-level security enabled" in (
                    e.get("message") or ""
                )

            wait_until(refused, timeout=60, what="the RLS refusal in status")
            assert f'user "{role}"' in status(tgt, "s")["last_error"]["message"]
            assert not superuser(pair, mallory) and pair.target.scalar("SELECT count(*) FROM t") == 0
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            log.close()
        ok(tgt, "drop", "s")
    finally:
        drop_role(pair.target, role)


def test_native_subscriber_also_keeps_the_owner_unprivileged(pair, mallory) -> None:
    """The reference (PostgreSQL 16+, run_as_owner = false): the same ALWAYS trigger on the same owner's table,
    applied by the native subscriber as a superuser, runs as the owner in a security-restricted operation, so its
    ALTER ROLE fails and the change is retried without end; the owner stays unprivileged, as with us (we refuse
    before the trigger runs, and say why)."""
    if int(pair.target.cluster.scalar("SHOW server_version_num")) < 160000:
        pytest.skip("run_as_owner exists from PostgreSQL 16 (15's subscriber runs the trigger as its owner)")
    owned_table(pair, mallory)
    evil_trigger(pair, mallory)
    pair.publisher.execute("CREATE PUBLICATION p FOR TABLE t")
    name = f"n_{pair.name}"[:63]
    pair.target.execute(
        sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION p WITH (copy_data = false)").format(
            sql.Identifier(name), sql.Literal(pair.publisher.dsn)
        )
    )
    try:
        pair.publisher.execute("INSERT INTO t VALUES (1, 'one')")
        wait_until(
            lambda: pair.target.scalar(
                "SELECT apply_error_count FROM pg_stat_subscription_stats WHERE subname = %s", (name,)
            ) >= 1, timeout=60, what="the native apply worker's error",
        )  # fmt: skip
        assert not superuser(pair, mallory) and pair.target.scalar("SELECT count(*) FROM t") == 0
        assert "permission denied" in pair.target.cluster.log_tail(200)
    finally:
        pair.target.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(name)))
        pair.target.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(name)))


def test_domain_constraints_are_found_through_arrays_composites_ranges_and_domains(pair, mallory) -> None:
    """The type walk (applier.catalog.trust.TYPE_WALK) reaches a domain's constraint however deep a column holds
    the domain: in an array, a composite, a range, an array of a composite, a domain over the domain. Each table's
    INSERT check names the constraint; a table of built-in types only has nothing to report."""
    from applier.catalog.store import Catalog

    Catalog.connect(pair.target.dsn).ensure()
    escalating_function(pair, mallory, "ok(int)", "boolean", "true")
    with pair.target.connect() as c:
        c.execute("CREATE DOMAIN public.pos AS int CHECK (public.ok(VALUE))")
        c.execute(sql.SQL("ALTER DOMAIN public.pos OWNER TO {}").format(sql.Identifier(mallory)))
        c.execute("CREATE DOMAIN public.pos2 AS public.pos")
        c.execute("CREATE TYPE public.pair AS (a int, b public.pos)")
        c.execute("CREATE TYPE public.posrange AS RANGE (subtype = public.pos)")
        columns = {"t_array": "public.pos[]", "t_comp": "public.pair", "t_range": "public.posrange",
                   "t_comparr": "public.pair[]", "t_dom": "public.pos2", "t_plain": "int[]"}  # fmt: skip
        for table, type_ in columns.items():
            c.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, x {type_})")
        for table in columns:
            found = c.execute(
                "SELECT kind, object FROM applier.untrusted_code(%s::regclass, 'I', '{id,x}')", (table,)
            ).fetchall()
            want = [] if table == "t_plain" else [("constraint", "pos_check of domain public.pos")]
            assert found == want, (table, found)
