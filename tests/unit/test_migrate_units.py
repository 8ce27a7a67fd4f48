"""The pure parts of ``applier migrate``: the selection rules, the choice of pg_dump, every blocker and warning rule
of :func:`applier.migrate.plan.assess` (on hand-made facts, no server), the post-data scheduling rule, the phase
state machine and the edits to pg_dump's script."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from applier.migrate.plan import (
    PUBLIC_DEFAULT_OWNER,
    SourceFacts,
    SourcePrivileges,
    TargetFacts,
    TargetPrivileges,
    assess,
)
from applier.migrate.postdata import LeftOut, Step, ready, step_costs, table_weights
from applier.migrate.schema import TargetRoles, edit_script, pattern, without_unrestorable
from applier.migrate.selection import Selection, select_tables
from applier.migrate.state import PHASES, TRANSITIONS, MigrationError, Phase, advance
from applier.migrate.steps import CUTOVER_KINDS, StepKind, step_name
from applier.migrate.tools import DumpTools, choose
from tests.support.plan_facts import PG18, source, table, target


def codes(findings: list) -> list[str]:
    return [f.code for f in findings]


def blockers(
    s: SourceFacts | None = None, t: TargetFacts | None = None, tools: DumpTools | None = PG18
) -> list[str]:
    return codes(assess(s or source(), t or target(), Selection(), tools).blockers)


def test_a_clean_migration_has_no_blocker_and_no_warning() -> None:
    plan = assess(source(), target(), Selection(), PG18)
    assert plan.ok and plan.blockers == []
    assert codes(plan.warnings) == []


def test_a_source_that_refuses_the_ddl_capture_is_a_warning_with_the_ways_out() -> None:
    """Issue 39: start follows without the capture, so schema changes are not replayed: a warning, not a
    blocker, naming why and the roles that may install it."""
    plan = assess(
        source(ddl_capture_refused="role mig may not create event triggers"), target(), Selection(), PG18
    )
    assert plan.ok and codes(plan.warnings) == ["ddl"]
    (w,) = plan.warnings
    assert "role mig may not create event triggers" in w.message and "not be replayed" in w.message
    assert "rds_superuser" in w.hint and "cloudsqlsuperuser" in w.hint


def test_each_blocker_alone() -> None:
    assert blockers(source(wal_level="replica")) == ["wal_level"]
    assert blockers(source(max_replication_slots=2, slots_used=1)) == ["replication_slots"]
    assert blockers(source(max_replication_slots=2, slots_used=0)) == []
    assert blockers(source(max_wal_senders=3, wal_senders_used=2)) == ["wal_senders"]
    assert blockers(t=target(max_prepared_transactions=0)) == ["max_prepared_transactions"]
    no_key = table(has_pk=False, identity_usable=False, updates_deletes=1)
    assert blockers(source(tables=[no_key])) == ["no_identity"]
    assert blockers(source(extensions={"plpgsql": "1.0", "pgcrypto": "1.3"})) == ["extension"]
    assert blockers(source(roles=["postgres", "app"])) == ["role"]
    assert blockers(t=target(existing_tables=["public.t"])) == ["target_table"]
    assert blockers(t=target(free_bytes=99_999_999)) == ["disk"]
    assert blockers(t=target(free_bytes=100_000_000)) == []
    assert blockers(tools=None) == ["pg_dump"]
    assert blockers(source(read_only=True)) == ["read_only"]  # a fenced source: start could create nothing
    assert blockers(source(tables=[])) == ["no_tables"]  # start refuses an empty selection: so does plan
    assert (
        blockers(source(tables=[table(kind="p")])) == []
    )  # partitioned tables migrate (their leaves as tables)


def test_a_table_without_key_blocks_only_when_it_gets_updates_or_deletes() -> None:
    quiet = table(has_pk=False, identity_usable=False, updates_deletes=0)
    plan = assess(source(tables=[quiet]), target(), Selection(), PG18)
    assert plan.ok and "no_identity_yet" in codes(plan.warnings)
    full = table(has_pk=False, replica_identity="f", identity_usable=True, updates_deletes=9)
    plan = assess(source(tables=[full]), target(), Selection(), PG18)
    assert plan.ok and "identity_full" in codes(plan.warnings)
    # a partitioned parent has no statistics of its own; its leaves are judged
    parent = table(kind="p", has_pk=False, identity_usable=False, updates_deletes=0)
    assert blockers(source(tables=[parent])) == []  # whatever its key: the leaves replicate, not the parent


def test_each_missing_privilege_is_named_with_its_fix() -> None:
    mig = dict(role="mig", database="db", superuser=False)
    assert blockers(source(privileges=SourcePrivileges(**mig))) == []  # type: ignore[arg-type]
    lacking = SourcePrivileges(**mig, replication=False, rds_replication=True, create_on_database=False,  # type: ignore[arg-type]
                               not_owned=("public.t",), unreadable=("public.t", "public.s"), signal_backend=False,
                               read_all_stats=False)  # fmt: skip
    plan = assess(source(privileges=lacking), target(), Selection(), PG18)
    assert codes(plan.blockers) == ["source_replication", "source_create", "source_ownership", "source_select",
                                    "source_select"]  # fmt: skip
    hints = [b.hint for b in plan.blockers]
    assert hints[0] == "ALTER ROLE mig REPLICATION; (on RDS: GRANT rds_replication TO mig;)"
    assert (
        hints[1] == "GRANT CREATE ON DATABASE db TO mig;" and "ALTER TABLE public.t OWNER TO mig" in hints[2]
    )
    assert hints[3:] == ["GRANT SELECT ON public.t TO mig;", "GRANT SELECT ON public.s TO mig;"]
    assert {"source_signal_backend", "source_read_all_stats"} <= set(codes(plan.warnings))

    t_lacking = TargetPrivileges(**mig, create_on_database=False, schemas_without_create=("public",),  # type: ignore[arg-type]
                                 set_replication_role=False, missing_functions=("f(text)",),
                                 untrusted_extensions=("pgcrypto", "other"), ownable=("mig",))  # fmt: skip
    plan = assess(
        source(extensions={"plpgsql": "1.0", "pgcrypto": "1.3"}, roles=["mig", "gone"],
               role_uses={"mig": ["owner"], "gone": ["grant"]}),
        target(privileges=t_lacking, roles=["mig"], available_extensions={"plpgsql": ["1.0"], "pgcrypto": ["1.3"]}),
        Selection(), PG18)  # fmt: skip
    assert codes(plan.blockers) == ["target_create", "target_schema", "target_replication_role",
                                    "target_origin_functions", "target_extension"]  # fmt: skip
    assert [b.hint for b in plan.blockers][:4] == [
        "GRANT CREATE ON DATABASE db TO mig;", "GRANT CREATE ON SCHEMA public TO mig;",
        "GRANT SET ON PARAMETER session_replication_role TO mig;", "GRANT EXECUTE ON FUNCTION f(text) TO mig;",
    ]  # fmt: skip
    # a role the target lacks: only a warning when it is an owner or grantee and the target role is no superuser
    assert "owner" in codes(plan.warnings)
    assert "role" in blockers(
        source(roles=["gone"], role_uses={"gone": ["policy"]}), target(privileges=t_lacking)
    )
    assert "role" in blockers(
        source(roles=["gone"], role_uses={"gone": ["grant"]})
    )  # a superuser target: as before
    stats = source(roles=["other"], role_uses={"other": ["owner", "statistics"]})
    assert blockers(stats, target(roles=["other"], privileges=t_lacking)).count("target_owner") == 1


def test_the_public_schemas_default_owner_before_15_is_no_owner_warning() -> None:
    """A source older than 15 has the bootstrap superuser own its public schema by default (15 made it
    pg_database_owner): a target without superuser keeps its own public schema's owner, without a warning in plan or
    start; another object of that role still warns, and a superuser target still needs the role."""
    mig = dict(role="mig", database="db", superuser=False)
    t_mig = TargetPrivileges(**mig, ownable=("mig",))  # type: ignore[arg-type]
    public = {"rdsadmin": [PUBLIC_DEFAULT_OWNER]}
    for roles in (["mig"], ["mig", "rdsadmin"]):  # the role missing on the target, or there but not ownable
        plan = assess(source(roles=["rdsadmin"], role_uses=public), target(privileges=t_mig, roles=roles),
                      Selection(), PG18)  # fmt: skip
        assert plan.blockers == [] and "owner" not in codes(plan.warnings), roles
        more = source(roles=["rdsadmin"], role_uses={"rdsadmin": ["owner", PUBLIC_DEFAULT_OWNER]})
        assert "owner" in codes(
            assess(more, target(privileges=t_mig, roles=roles), Selection(), PG18).warnings
        )
    assert "role" in blockers(source(roles=["rdsadmin"], role_uses=public))  # a superuser target: as before

    script = "ALTER SCHEMA public OWNER TO rdsadmin;\nALTER TABLE public.t OWNER TO rdsadmin;\n"
    roles = TargetRoles(superuser=False, roles=frozenset({"mig"}), ownable=frozenset({"mig"}))
    out, said = without_unrestorable(script, roles, "rdsadmin")
    assert out.strip() == "" and said == [
        "1 object(s) of role rdsadmin are owned by the migrating role instead (the role does not exist on the "
        "target, or the migrating role may not hand objects to it)"
    ]
    assert without_unrestorable(script, roles)[1][0].startswith(
        "2 object(s) of role rdsadmin"
    )  # 15 and later
    superuser = TargetRoles(True, frozenset(), frozenset())
    assert without_unrestorable(script, superuser, "rdsadmin") == (script, [])


def test_warnings() -> None:
    plan = assess(
        source(tables=[table(persistence="u")], materialized_views=["public.mv"], large_objects=3,
               extensions={"plpgsql": "1.0", "hstore": "1.7"}, version_num=180001),
        target(available_extensions={"plpgsql": ["1.0"], "hstore": ["1.8"]}, version_num=170001),
        Selection(), PG18,
    )  # fmt: skip
    assert plan.ok
    assert codes(plan.warnings) == ["unlogged", "materialized_view", "large_objects", "extension_version",
                                    "downgrade"]  # fmt: skip


def test_row_security_and_event_trigger_warnings() -> None:
    rls = source(row_security=["public.acct"], event_triggers=["log_ddl"])
    plan = assess(rls, target(bypass_rls=False), Selection(), PG18)
    assert plan.ok and codes(plan.warnings)[:2] == ["row_security", "event_trigger"]
    assert "BYPASSRLS" in plan.warnings[0].hint and "end of the cutover" in plan.warnings[1].message
    # a superuser (or BYPASSRLS) target role is not held back; with --schema the event triggers stay behind
    plan = assess(rls, target(), Selection.of(["public"], None, None), PG18)
    assert "row_security" not in codes(plan.warnings)
    assert [w.message for w in plan.warnings if w.code == "event_trigger"] == [
        "event trigger(s) log_ddl are database-wide: not migrated with --schema or --table, as pg_dump"
    ]


def test_the_estimate_is_bytes_over_rate() -> None:
    plan = assess(source(tables=[table(), table("u")]), target(), Selection(), PG18)
    assert plan.copy_seconds == 2 * 80_000_000 / 30e6
    assert plan.index_seconds == 2 * 20_000_000 / 15e6
    j = plan.to_json()
    assert j["estimate"]["copy_seconds"] == 5.3 and "MB/s" in j["estimate"]["how"]
    assert j["totals"]["tables"] == 2 and j["ok"] is True


def test_pg_dump_must_be_at_least_the_source_major() -> None:
    found = [DumpTools(Path("/a"), 15), DumpTools(Path("/b"), 18), DumpTools(Path("/c"), 17)]
    assert choose(found, 15) == found[0]
    assert choose(found, 16) == found[1]
    assert choose(found, 19) is None
    assert choose([], 15) is None


def test_selection_patterns() -> None:
    sel = Selection.of(["app*"], ["orders*", "billing.inv?ice"], ["*_old"])
    assert sel.covers("app", "orders_2024")
    assert not sel.covers("app", "orders_old")
    assert not sel.covers("public", "orders")
    assert not sel.covers("appx", "invoice")  # billing is not a selected schema
    assert Selection.of(["billing"], ["billing.inv?ice"], None).covers("billing", "invoice")
    everything = Selection()
    assert everything.covers("public", "t") and everything.covers("Mixed Case", "T t")
    for system in ("pg_catalog", "information_schema", "pg_toast", "applier", "pg_temp_3"):
        assert not everything.covers_schema(system)


names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=6)


@given(names, names, st.lists(names, max_size=3), st.lists(names, max_size=3))
def test_an_exclusion_always_wins_and_no_pattern_means_everything(
    schema: str, rel: str, include: list[str], exclude: list[str]
) -> None:
    sel = Selection.of(None, include, [*exclude, rel])
    assert not sel.covers(schema, rel)
    assert Selection.of(None, None, None).covers(schema, rel) == (schema not in ("applier",))
    if not include and rel not in exclude:
        assert Selection.of(None, None, exclude).covers(schema, rel) == (schema != "applier")


# --- post-data scheduling ----------------------------------------------------------------------------------------


def _steps() -> list[Step]:
    """Two tables; b references a: the fk waits for a's key to be attached, the validation for the fk."""
    return [
        Step("key a.pk", "key", ("a",), (), ("..",), 0),
        Step("attach a.pk", "attach", ("a",), ("key a.pk",), ("..",), 1),
        Step("index a.v", "index", ("a",), (), ("..",), 2),
        Step("key b.pk", "key", ("b",), (), ("..",), 3),
        Step("attach b.pk", "attach", ("b",), ("key b.pk",), ("..",), 4),
        Step("fk b.a", "fk", ("b", "a"), ("attach a.pk",), ("..",), 5),
        Step("validate b.a", "validate", ("b", "a"), ("fk b.a",), ("..",), 6),
        Step("trigger b.t", "trigger", ("b",), (), ("..",), 7),
    ]


#: A source as :func:`select_tables` reads it: ``ev`` partitioned into ``ev_2024`` (itself partitioned into
#: ``ev_2024_h1``) and ``ev_2025``; ``other``; unlogged ``scratch``; ``keep.k`` in another schema.
_ROWS = [
    ("keep", "k", "r", "p", "keep", "k"),
    ("public", "ev", "p", "p", "public", "ev"),
    ("public", "ev_2024", "p", "p", "public", "ev"),
    ("public", "ev_2024_h1", "r", "p", "public", "ev"),
    ("public", "ev_2025", "r", "p", "public", "ev"),
    ("public", "other", "r", "p", "public", "other"),
    ("public", "scratch", "r", "u", "public", "scratch"),
]


def test_a_partition_follows_its_root_whatever_its_own_name() -> None:
    """Where plan (each table's own name) and start (the partition tree's root) used to disagree: ``--table ev``
    covered only the parent for plan, and ``--exclude-table 'ev_*'`` dropped the partitions from plan while start
    copied them. Both now ask :func:`select_tables`."""
    schemas = ["keep", "pg_catalog", "public"]
    only_ev = select_tables(Selection.of(None, ["ev"], None), schemas, _ROWS)
    assert only_ev.tables == [("public", "ev_2024_h1"), ("public", "ev_2025")]
    assert only_ev.partitioned == [("public", "ev"), ("public", "ev_2024")]
    assert only_ev.covered == {
        ("public", "ev"),
        ("public", "ev_2024"),
        ("public", "ev_2024_h1"),
        ("public", "ev_2025"),
    }
    assert ("public", "other") in only_ev.exclude and only_ev.schemas == ["keep", "public"]

    by_leaf_name = select_tables(Selection.of(None, None, ["ev_*"]), schemas, _ROWS)
    assert {("public", "ev_2024_h1"), ("public", "ev_2025")} <= set(by_leaf_name.tables)

    no_ev = select_tables(Selection.of(["public"], None, ["ev"]), schemas, _ROWS)
    assert no_ev.tables == [("public", "other")] and no_ev.schemas == ["public"]
    assert no_ev.unlogged == [("public", "scratch")] and no_ev.covered == {
        ("public", "other"),
        ("public", "scratch"),
    }
    assert no_ev.skipped == ["public.scratch is unlogged (it cannot be published): not migrated"]


def test_nothing_is_ready_before_its_table_is_copied_and_keys_go_first() -> None:
    steps = _steps()
    assert ready(steps, set(), set(), set()) == []
    assert [s.step for s in ready(steps, {"b"}, set(), set())] == ["key b.pk", "trigger b.t"]
    first = ready(steps, {"a", "b"}, set(), set())
    assert [s.step for s in first] == ["key a.pk", "key b.pk", "index a.v", "trigger b.t"]
    assert [s.step for s in ready(steps, {"a", "b"}, set(), {"key a.pk"})] == [
        "key b.pk",
        "index a.v",
        "trigger b.t",
    ]
    # the foreign key needs both tables and the referenced key attached
    done = {"key a.pk", "key b.pk", "index a.v", "trigger b.t", "attach b.pk"}
    assert [s.step for s in ready(steps, {"b"}, done, set())] == []
    assert [s.step for s in ready(steps, {"a", "b"}, done, set())] == ["attach a.pk"]
    assert [s.step for s in ready(steps, {"a", "b"}, done | {"attach a.pk"}, set())] == ["fk b.a"]


def test_a_partitions_index_is_attached_after_the_step_that_makes_it() -> None:
    """A key's index exists after its ``attach``, an exclusion constraint's after its own ``ADD CONSTRAINT`` (the
    ``constraint`` step builds the index), a plain index after its build; none planned is an error, not a hang."""
    from applier.migrate.partitions import _leaf_step

    known = {"attach public.p1.p1_pkey", "constraint public.p1.p1_r_excl", "index public.p1_v"}
    assert _leaf_step(known, "public.p1", "public.p1_pkey", "p1_pkey", "p") == "attach public.p1.p1_pkey"
    assert (
        _leaf_step(known, "public.p1", "public.p1_r_excl", "p1_r_excl", "x")
        == "constraint public.p1.p1_r_excl"
    )
    assert _leaf_step(known, "public.p1", "public.p1_v", None, None) == "index public.p1_v"
    with pytest.raises(MigrationError, match="no step builds public.p2_r_excl"):
        _leaf_step(known, "public.p2", "public.p2_r_excl", "p2_r_excl", "x")


#: Every kind's step name, as stored in applier.migration_step (the key a resumed migration finds its steps by) and
#: shown by the progress lines: these never change.
_NAMES = {
    StepKind.INDEX: "index public.a_v_idx", StepKind.KEY: "key public.a.a_pkey",
    StepKind.ATTACH: "attach public.a.a_pkey", StepKind.CONSTRAINT: "constraint public.a.a_excl",
    StepKind.FK: "fk public.b.b_a_fkey", StepKind.VALIDATE: "validate public.b.b_a_fkey",
    StepKind.REPLICA_IDENTITY: "replica_identity public.a", StepKind.TRIGGER: "trigger public.a.t",
    StepKind.PARTITIONED_INDEX: "pindex public.p_v_idx", StepKind.PARTITIONED_CONSTRAINT: "pconstraint public.p.p_pkey",
    StepKind.ATTACH_PARTITION: "attach_partition public.p1_v_idx", StepKind.PARTITIONED_FK: "pfk public.p.p_a_fkey",
    StepKind.PARTITIONED_TRIGGER: "ptrigger public.p.t", StepKind.MATVIEW: "matview refresh",
    StepKind.CLUSTER: "cluster public.a", StepKind.COMMENT: "comment index public.a.a_v_idx",
    StepKind.RULE: "rule public.a.r", StepKind.ROW_SECURITY: "row_security public.a",
    StepKind.POLICY: "policy public.a.p", StepKind.STATISTICS: "statistics public.s",
    StepKind.CUTOVER_IDENTITY: "identity public.a.id", StepKind.CUTOVER_EVENT_TRIGGER: "event_trigger e",
    StepKind.CUTOVER_REFRESH: "cutover_refresh matviews",
}  # fmt: skip


def test_every_step_kind_names_its_steps_as_before() -> None:
    assert set(_NAMES) == set(StepKind)
    for kind, name in _NAMES.items():
        subject = name.split(" ", 1)[1]
        step = Step.of(kind, subject, (), (), ())
        assert step.step == step_name(kind, subject) == name
        assert step.subject == subject
        assert Step(name, kind.value, (), (), ()).kind is kind  # a row read back
    assert {k for k in StepKind if k.at_cutover} == CUTOVER_KINDS
    assert all(k.value.startswith("cutover") for k in CUTOVER_KINDS)


def test_a_foreign_key_left_out_is_a_value_that_reads_as_before() -> None:
    note = LeftOut("b_a_fkey", "public.b", "public.a")
    assert note.references == "public.a"
    assert (
        str(note) == "foreign key b_a_fkey of public.b references public.a, which is not migrated: left out"
    )


@given(st.permutations(["a", "b"]), st.randoms(use_true_random=False))
def test_any_schedule_respects_every_dependency_and_finishes(arrival: list[str], rnd) -> None:
    """Tables arrive in any order and steps finish in any order: each step starts only after its tables and the
    steps it follows, and every step runs exactly once."""
    steps = _steps()
    copied: set[str] = set()
    done: list[str] = []
    running: set[str] = set()
    pending_tables = list(arrival)
    while len(done) < len(steps):
        can = ready(steps, copied, set(done), running)
        choices = [("start", s.step) for s in can] + [("finish", r) for r in running]
        if pending_tables:
            choices.append(("arrive", pending_tables[0]))
        assert choices, "stuck"
        kind, what = rnd.choice(choices)
        if kind == "arrive":
            copied.add(pending_tables.pop(0))
        elif kind == "start":
            step = next(s for s in steps if s.step == what)
            assert set(step.relnames) <= copied and set(step.after) <= set(done)
            running.add(what)
        else:
            running.remove(what)
            done.append(what)
    assert sorted(done) == sorted(s.step for s in steps)


def test_index_builds_share_a_table_but_an_attach_waits_until_nothing_runs_on_it() -> None:
    """An attach queued behind a long build would hold a job slot and block the builds queued behind its lock."""
    steps = _steps()
    done = {"key a.pk"}
    assert [s.step for s in ready(steps, {"a"}, done, {"index a.v"})] == []  # attach a.pk waits for the build
    assert [s.step for s in ready(steps, {"a"}, done, set())] == ["attach a.pk", "index a.v"]
    assert [s.step for s in ready(steps, {"a"}, done, {"attach a.pk"})] == []  # and no build joins the attach
    assert [s.step for s in ready(steps, {"a"}, set(), {"index a.v"})] == ["key a.pk"]  # builds run together
    everything = {"key a.pk", "attach a.pk", "index a.v", "key b.pk", "attach b.pk", "fk b.a"}
    assert [
        s.step for s in ready(steps, {"a", "b"}, everything, {"trigger b.t"})
    ] == []  # validate: both free


def test_the_costliest_build_goes_first_and_the_heaviest_table_is_copied_first() -> None:
    steps = [
        Step("key s.pk", "key", ("s",), (), ("CREATE UNIQUE INDEX s_pkey ON public.s USING btree (id)",), 0),
        Step("attach s.pk", "attach", ("s",), ("key s.pk",), ("ALTER TABLE ... USING INDEX s_pkey",), 1),
        Step(
            "key big.pk",
            "key",
            ("big",),
            (),
            ("CREATE UNIQUE INDEX big_pkey ON public.big USING btree (id)",),
            2,
        ),
        Step(
            "index big.doc", "index", ("big",), (), ("CREATE INDEX big_doc ON public.big USING gin (doc)",), 3
        ),
        Step(
            "key acc.pk",
            "key",
            ("acc",),
            (),
            ("CREATE UNIQUE INDEX acc_pkey ON public.acc USING btree (id)",),
            4,
        ),
    ]
    pages = {"s": 10, "big": 1000, "acc": 1200}
    cost = step_costs(steps, pages)
    assert cost == {
        "key s.pk": 10,
        "attach s.pk": 0,
        "key big.pk": 1000,
        "index big.doc": 4000,
        "key acc.pk": 1200,
    }
    order = [s.step for s in ready(steps, {"s", "big", "acc"}, {"key s.pk"}, set(), cost)]
    assert order == ["attach s.pk", "index big.doc", "key acc.pk", "key big.pk"]
    # big (1000 pages, a GIN index) has more work behind its copy than acc (1200 pages, one btree)
    assert table_weights(steps, pages) == {"s": 20, "big": 6000, "acc": 2400}


# --- phases ------------------------------------------------------------------------------------------------------


def test_phases_move_forward_and_a_failed_cutover_goes_back_to_following() -> None:
    assert advance("schema", "copy") == "copy"
    assert advance("copy", "following") == "following"
    assert advance("following", "cutover") == "cutover"
    assert advance("cutover", "following") == "following"
    assert advance("cutover", "done") == "done"
    for bad in [("schema", "following"), ("copy", "done"), ("following", "done"), ("done", "following"),
                ("done", "failed"), ("following", "nonsense")]:  # fmt: skip
        with pytest.raises(MigrationError):
            advance(*bad)
    for p in PHASES:
        if p is not Phase.DONE:
            assert advance(p, "failed") == "failed"


@given(st.lists(st.sampled_from([*PHASES, "nonsense"]), max_size=30))
def test_any_walk_of_the_phases_obeys_the_transition_table(moves: list[str]) -> None:
    """Whatever order the verbs (start, cutover, abort, a crash and a resume) try moves in: a move is allowed exactly
    when the table says so, an allowed one lands on the phase asked, a refused one changes nothing, and nothing
    leaves ``done``."""
    here = Phase.SCHEMA
    for new in moves:
        allowed = new in PHASES and Phase(new) in TRANSITIONS[here]
        if allowed:
            here = advance(here, new)
            assert here == new and isinstance(here, Phase)
        else:
            with pytest.raises(MigrationError):
                advance(here, new)
        if here is Phase.DONE:
            assert TRANSITIONS[here] == {Phase.DONE}


# --- the pg_dump script ---------------------------------------------------------------------------------------


def test_the_script_loses_psql_meta_commands_and_creates_schemas_only_if_missing() -> None:
    script = "\\restrict Ab1\nCREATE SCHEMA public;\nCREATE SCHEMA \"My S\";\nCREATE TABLE t (x text DEFAULT '\\restrict x');\n\\unrestrict Ab1\n"
    assert edit_script(script) == (
        '\nCREATE SCHEMA IF NOT EXISTS public;\nCREATE SCHEMA IF NOT EXISTS "My S";\n'
        "CREATE TABLE t (x text DEFAULT '\\restrict x');\n\n"
    )
    assert (
        edit_script("SET a = 0;\nSET transaction_timeout = 0;\nSET b = 'x';\n", ["a", "b"])
        == "SET a = 0;\n\nSET b = 'x';\n"
    )
    assert pattern("public", "t") == '"public"."t"'
    assert pattern('we"ird', "T*") == '"we""ird"."T*"'


def test_a_target_without_superuser_gets_the_script_without_what_it_could_not_run() -> None:
    script = (
        "CREATE TABLE public.t (id int);\n"
        "ALTER TABLE public.t OWNER TO mig;\n"
        'ALTER TABLE public.u OWNER TO "Gone Owner";\n'
        "GRANT SELECT ON TABLE public.t TO reader;\n"
        "GRANT SELECT ON TABLE public.t TO gone WITH GRANT OPTION;\n"
        "REVOKE ALL ON TABLE public.t FROM gone;\n"
        "GRANT SELECT ON TABLE public.t TO PUBLIC;\n"
        "ALTER DEFAULT PRIVILEGES FOR ROLE mig IN SCHEMA public GRANT SELECT ON TABLES TO gone;\n"
        "SET SESSION AUTHORIZATION other;\n"
        "RESET SESSION AUTHORIZATION;\n"
        "COMMENT ON EXTENSION plpgsql IS 'x';\n"
    )
    roles = TargetRoles(superuser=False, roles=frozenset({"mig", "reader"}), ownable=frozenset({"mig"}))
    out, said = without_unrestorable(script, roles)
    assert [line for line in out.splitlines() if line] == [
        "CREATE TABLE public.t (id int);",
        "ALTER TABLE public.t OWNER TO mig;",
        "GRANT SELECT ON TABLE public.t TO reader;",
        "GRANT SELECT ON TABLE public.t TO PUBLIC;",
    ]
    assert said[0].startswith("1 object(s) of role Gone Owner are owned by the migrating role")
    assert said[1] == "3 grant(s) naming role gone skipped: the role does not exist on the target"
    assert "SESSION AUTHORIZATION" in said[2] and "COMMENT ON EXTENSION" in said[3]
    assert without_unrestorable(script, TargetRoles(True, frozenset(), frozenset())) == (script, [])


def test_large_objects_differences_and_selection() -> None:
    from applier.migrate.largeobjects import LargeObject, differences, selected

    def lo(oid: int, md5: str = "a", owner: str = "u", acl=None) -> LargeObject:
        return LargeObject(oid, owner, acl, 3, md5)

    source = {1: lo(1), 2: lo(2, "b"), 3: lo(3, owner="v"), 4: lo(4, acl=(("", "SELECT", False),)), 6: lo(6)}
    target = {1: lo(1), 2: lo(2), 3: lo(3), 4: lo(4), 5: lo(5)}
    assert differences(source, target) == ([2, 3, 4, 6], [5])  # contents, owner, privileges, new; unlinked
    assert differences(source, source) == ([], [])
    assert selected({"schemas": [], "tables": [], "exclude_tables": ["x"]})
    assert not selected({"schemas": ["app"], "tables": [], "exclude_tables": []})
    assert not selected({"schemas": [], "tables": ["t"], "exclude_tables": []})


def test_cutover_estimate_adds_up_its_steps() -> None:
    from applier.migrate.estimate import APPLY_BYTES_PER_SECOND, FENCE_SECONDS, Inputs, cutover_seconds

    assert cutover_seconds(Inputs(None, None, None, 0, 0, 0, 0)) is None  # the lag cannot be told
    idle = cutover_seconds(Inputs(0, 0.0, None, 0, 0, 0, 0))
    assert idle is not None and idle["total"] == FENCE_SECONDS and idle["catch_up"] == 0
    behind = cutover_seconds(Inputs(50_000_000, 1.0, 25e6, 10, 300_000_000, 0, 0))
    assert behind is not None and behind["catch_up"] == 2.0 and behind["verify"] == 2.0
    assert behind["total"] == round(FENCE_SECONDS + 2.0 + 0.05 + 2.0, 3)
    unmeasured = cutover_seconds(Inputs(10_000_000, None, None, 0, 0, 0, 0))
    assert unmeasured is not None and unmeasured["catch_up"] == 10_000_000 / APPLY_BYTES_PER_SECOND
    slow = cutover_seconds(Inputs(1000, 7.5, 1e9, 0, 0, 0, 0))  # the source's lag in seconds is a floor
    assert slow is not None and slow["catch_up"] == 7.5


def test_status_text_says_what_a_cutover_would_cost_now() -> None:
    from applier.migrate.status import format_status

    doc = {"name": "m", "phase": "following", "lag_bytes": 0, "lag_seconds": 0.0, "post_data": {"done": 1, "total": 1},
           "times": {}, "error": None, "tables": [], "cutover_estimate_seconds": 2.25, "cutover_running": False,
           "start": {"running": True, "holder": "applier migrate start m"},
           "fence": {"fenced_at": None, "source_read_only": False},
           "cutover_estimate": {"fence": 0.2, "catch_up": 0.0, "sequences": 0.05, "verify": 2.0, "total": 2.25}}  # fmt: skip
    text = format_status(doc)
    assert "a cutover now: ~2.2s of write downtime (fence 0.2s, sequences 0.1s, verify 2.0s)" in text, text
    assert "start: running (applier migrate start m)" in text and "source: writable" in text, text
    doc["cutover_estimate"] = None  # the lag cannot be told: no line
    assert "a cutover now" not in format_status(doc)
    doc["start"] = {"running": False, "holder": None}
    doc["fence"] = {"fenced_at": "2026-12-06 07:00:00+00", "source_read_only": True}
    text = format_status(doc)
    assert "start: not running; a cutover needs it" in text, text
    assert "source: fenced by this migration since 2026-12-06 07:00:00+00: read-only" in text, text
