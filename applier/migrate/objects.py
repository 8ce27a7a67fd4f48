"""The rest of pg_dump's post-data: rules, row-level security, statistics, ``CLUSTER ON``, comments, event triggers.

``pg_dump --section=post-data`` (compare ``pg_restore -l`` of a ``-Fc`` dump) emits, besides the indexes,
constraints and triggers of :mod:`applier.migrate.postdata`: ``RULE`` (with ``ALTER TABLE … ENABLE ALWAYS|REPLICA
RULE`` or ``DISABLE RULE``), ``ROW SECURITY`` (``ALTER TABLE … ENABLE ROW LEVEL SECURITY``; the ``FORCE`` is in the
pre-data table definition, and has no effect until the ``ENABLE``), ``POLICY``, ``STATISTICS`` (with ``ALTER
STATISTICS … SET STATISTICS`` and its owner), the ``CLUSTER ON`` of an index, the comments of each and of the
indexes, constraints and triggers (each after the step that makes its object; a materialized view's indexes, their
``CLUSTER ON`` and comments, after :mod:`applier.migrate.matviews`' step); also event triggers and publications,
which a dump restricted with ``--schema`` (as ours always is) leaves out. Publications stay the source's own; event
triggers are database-wide and move with a whole-database migration, made by the cutover (:func:`event_triggers`).

They are read from the source's catalogs inside the migration's snapshot, like every other step, with the
functions PostgreSQL gives (``pg_get_ruledef``, ``pg_get_expr`` of ``pg_policy``'s expressions,
``pg_get_statisticsobjdef``), with an empty ``search_path`` so every name comes qualified. Not pg_dump's own text
through a TOC list: that would be a second dump at the snapshot and a parse of its output into objects, while the
catalogs give each object's table (what its step waits for) directly.

Each object is one step (its own transaction with its done mark, resumable), made once **every** migrated table is
copied: a rule or a policy may name other tables and functions, and a rule enabled ``ALWAYS`` would fire on the
copy's rows; ``ENABLE ROW LEVEL SECURITY`` after the copy also keeps the policies away from it. None of them changes
what the apply does: it runs with ``session_replication_role = replica``, so an ordinary rule does not fire
(behaviour 51), and the target role the migration connects as must bypass row-level security (a superuser or
``BYPASSRLS``), as a native subscription's owner must (behaviour 50).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate import matviews
from applier.migrate.steps import Step, StepKind, step_name

__all__ = ["event_triggers", "relations", "steps"]

# every relation of the dumped schemas that the dump keeps: tables, partitioned tables, views, materialized views
_RELATIONS = """
SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND n.nspname = ANY(%s)
  AND (n.nspname, c.relname) NOT IN (SELECT * FROM unnest(%s::text[], %s::text[]))
ORDER BY c.oid
"""

_RULES = """
SELECT r.ev_class::regclass::text, r.rulename, pg_get_ruledef(r.oid), r.ev_enabled,
       obj_description(r.oid, 'pg_rewrite')
FROM pg_rewrite r WHERE r.ev_class = ANY(%s::oid[]) AND r.rulename <> '_RETURN' ORDER BY r.ev_class, r.oid
"""

_SECURED = (
    "SELECT oid::regclass::text FROM pg_class WHERE oid = ANY(%s::oid[]) AND relrowsecurity ORDER BY oid"
)

_POLICIES = """
SELECT p.polrelid::regclass::text, p.polname, p.polpermissive, p.polcmd,
       ARRAY(SELECT pg_get_userbyid(r) FROM unnest(p.polroles) r WHERE r <> 0 ORDER BY 1),
       pg_get_expr(p.polqual, p.polrelid), pg_get_expr(p.polwithcheck, p.polrelid), obj_description(p.oid, 'pg_policy')
FROM pg_policy p WHERE p.polrelid = ANY(%s::oid[]) ORDER BY p.polrelid, p.oid
"""

# stxstattarget: -1 (before 17) or NULL (17+) when not set
_STATISTICS = """
SELECT format('%%I.%%I', n.nspname, s.stxname), pg_get_statisticsobjdef(s.oid), coalesce(s.stxstattarget::int, -1),
       pg_get_userbyid(s.stxowner), obj_description(s.oid, 'pg_statistic_ext')
FROM pg_statistic_ext s JOIN pg_namespace n ON n.oid = s.stxnamespace
WHERE s.stxrelid = ANY(%s::oid[]) ORDER BY s.oid
"""

_CLUSTERED = """
SELECT x.indrelid::regclass::text, i.relname, format('%%I.%%I', n.nspname, i.relname), k.conname,
       t.relkind = 'm'
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_namespace n ON n.oid = i.relnamespace
JOIN pg_class t ON t.oid = x.indrelid
LEFT JOIN pg_constraint k ON k.conindid = x.indexrelid AND k.conrelid = x.indrelid AND k.contype IN ('p', 'u', 'x')
WHERE x.indisclustered AND x.indrelid = ANY(%s::oid[]) ORDER BY x.indrelid
"""

# the database's event triggers, not an extension's (no parameters: a single % as the server reads it)
_EVENT_TRIGGERS = """
SELECT e.evtname, e.evtevent, format('%I.%I', n.nspname, p.proname), e.evttags, e.evtenabled,
       pg_get_userbyid(e.evtowner), obj_description(e.oid, 'pg_event_trigger')
FROM pg_event_trigger e JOIN pg_proc p ON p.oid = e.evtfoid JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_event_trigger'::regclass AND d.objid = e.oid
                  AND d.deptype = 'e')
  AND n.nspname <> 'applier_capture'  -- a DDL capture of ours (applier.ddl.capture) is never migrated
ORDER BY e.oid
"""

#: The ``ord`` of the first event trigger step (after the identity steps, from 10,000: they run in ``ord`` order).
EVENT_TRIGGER_ORD = 20_000

_EVENT_STATE = {"A": "ENABLE ALWAYS", "R": "ENABLE REPLICA", "D": "DISABLE"}
# comments on the other post-data objects: indexes (not a constraint's; a materialized view's too), constraints
# made after the copy (a partition's copy of its parent's key or exclusion constraint too: postdata builds those),
# triggers. The fourth column: the index is a materialized view's.
_COMMENTS = """
SELECT 'INDEX', x.indrelid::regclass::text, format('%%I.%%I', n.nspname, i.relname), t.relkind = 'm',
       obj_description(i.oid, 'pg_class')
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_namespace n ON n.oid = i.relnamespace
JOIN pg_class t ON t.oid = x.indrelid
WHERE x.indrelid = ANY(%s::oid[]) AND obj_description(i.oid, 'pg_class') IS NOT NULL
  AND NOT EXISTS (SELECT FROM pg_constraint k WHERE k.conindid = i.oid AND k.conrelid = x.indrelid)
UNION ALL
SELECT 'CONSTRAINT', k.conrelid::regclass::text, k.conname, false, obj_description(k.oid, 'pg_constraint')
FROM pg_constraint k WHERE k.conrelid = ANY(%s::oid[]) AND obj_description(k.oid, 'pg_constraint') IS NOT NULL
  AND (k.contype IN ('p', 'u', 'x', 'f') OR (k.contype = 'c' AND NOT k.convalidated))
  AND (k.conparentid = 0 OR k.contype IN ('p', 'u', 'x'))
UNION ALL
SELECT 'TRIGGER', t.tgrelid::regclass::text, t.tgname, false, obj_description(t.oid, 'pg_trigger')
FROM pg_trigger t WHERE t.tgrelid = ANY(%s::oid[]) AND NOT t.tgisinternal AND t.tgparentid = 0
  AND obj_description(t.oid, 'pg_trigger') IS NOT NULL
ORDER BY 1, 2, 3
"""

#: the steps (of postdata and partitions) that may make a commented object, in the order tried
_MAKERS = {
    "INDEX": (StepKind.INDEX, StepKind.PARTITIONED_INDEX),
    "CONSTRAINT": (
        StepKind.ATTACH,
        StepKind.CONSTRAINT,
        StepKind.FK,
        StepKind.PARTITIONED_CONSTRAINT,
        StepKind.PARTITIONED_FK,
    ),
    "TRIGGER": (StepKind.TRIGGER, StepKind.PARTITIONED_TRIGGER),
}

#: what :func:`_rules`, :func:`_policies` and :func:`_statistics` make: a step's kind, subject and statements
_Made = tuple[StepKind, str, tuple[str, ...]]

_RULE_STATE = {"A": "ENABLE ALWAYS RULE", "R": "ENABLE REPLICA RULE", "D": "DISABLE RULE"}
_COMMAND = {"r": "SELECT", "a": "INSERT", "w": "UPDATE", "d": "DELETE", "*": "ALL"}


def relations(
    src: psycopg.Connection[Any], schemas: Sequence[str], exclude: Sequence[tuple[str, str]]
) -> list[int]:
    """The OIDs of the relations whose post-data objects move: those of ``schemas`` that the pre-data keeps (not
    in ``exclude``, ``(schema, table)``)."""
    rows = src.execute(_RELATIONS, (list(schemas), [s for s, _ in exclude], [t for _, t in exclude]))
    return [r[0] for r in rows]


def _comment(src: psycopg.Connection[Any], what: sql.Composable, text: str | None) -> list[str]:
    if text is None:
        return []
    return [(sql.SQL("COMMENT ON ") + what + sql.SQL(" IS {}").format(sql.Literal(text))).as_string(src)]


def _rules(src: psycopg.Connection[Any], rels: list[int]) -> list[_Made]:
    out = []
    for table, name, ruledef, enabled, comment in src.execute(_RULES, (rels,)):
        statements = [ruledef]
        if enabled in _RULE_STATE:
            statements.append(
                sql.SQL("ALTER TABLE {} {} {}")
                .format(sql.SQL(table), sql.SQL(_RULE_STATE[enabled]), sql.Identifier(name))
                .as_string(src)
            )
        rule = sql.SQL("RULE {} ON {}").format(sql.Identifier(name), sql.SQL(table))
        out.append((StepKind.RULE, f"{table}.{name}", (*statements, *_comment(src, rule, comment))))
    return out


def _policies(src: psycopg.Connection[Any], rels: list[int]) -> list[_Made]:
    out = []
    for (table,) in src.execute(_SECURED, (rels,)):
        enable = sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(sql.SQL(table)).as_string(src)
        out.append((StepKind.ROW_SECURITY, table, (enable,)))
    for table, name, permissive, cmd, roles, qual, check, comment in src.execute(_POLICIES, (rels,)):
        policy = sql.SQL("POLICY {} ON {}").format(sql.Identifier(name), sql.SQL(table))
        text = (
            sql.SQL("CREATE ")
            + policy
            + sql.SQL(" AS {} FOR {}").format(
                sql.SQL("PERMISSIVE" if permissive else "RESTRICTIVE"), sql.SQL(_COMMAND[cmd])
            )
        )
        if roles:
            text += sql.SQL(" TO {}").format(sql.SQL(", ").join(sql.Identifier(r) for r in roles))
        if qual is not None:
            text += sql.SQL(" USING ({})").format(sql.SQL(qual))
        if check is not None:
            text += sql.SQL(" WITH CHECK ({})").format(sql.SQL(check))
        out.append(
            (StepKind.POLICY, f"{table}.{name}", (text.as_string(src), *_comment(src, policy, comment)))
        )
    return out


def _statistics(src: psycopg.Connection[Any], rels: list[int]) -> list[_Made]:
    out = []
    for name, definition, target, owner, comment in src.execute(_STATISTICS, (rels,)):
        stat = sql.SQL("STATISTICS {}").format(sql.SQL(name))
        statements = [definition]
        if target >= 0:
            statements.append(
                (
                    sql.SQL("ALTER ") + stat + sql.SQL(" SET STATISTICS {}").format(sql.Literal(target))
                ).as_string(src)
            )
        statements.append(
            (sql.SQL("ALTER ") + stat + sql.SQL(" OWNER TO {}").format(sql.Identifier(owner))).as_string(src)
        )
        out.append((StepKind.STATISTICS, name, (*statements, *_comment(src, stat, comment))))
    return out


def _cluster(
    src: psycopg.Connection[Any], rels: list[int], tables: Sequence[str], built: dict[str, Step]
) -> list[Step]:
    """``ALTER TABLE … CLUSTER ON`` of each migrated table's clustered index, after the step that builds the index;
    ``ALTER MATERIALIZED VIEW … CLUSTER ON`` (as pg_dump writes it) of a view's, after the step that builds the
    views' indexes (:mod:`applier.migrate.matviews`), waiting for the tables that step waits for."""
    out = []
    for table, index_name, index, conname, matview in src.execute(_CLUSTERED, (rels,)):
        if matview:
            makers, what, relnames = (matviews.STEP,), "MATERIALIZED VIEW", None
        else:
            makers = (
                step_name(StepKind.INDEX, index),
                step_name(StepKind.ATTACH, f"{table}.{conname}"),
                step_name(StepKind.CONSTRAINT, f"{table}.{conname}"),
            )
            what, relnames = "TABLE", (table,)
        after = tuple(a for a in makers if a in built)
        if not after or (relnames is not None and table not in tables):
            continue  # its index is not made (a table not migrated)
        statement = sql.SQL("ALTER {} {} CLUSTER ON {}").format(
            sql.SQL(what), sql.SQL(table), sql.Identifier(index_name)
        )
        out.append(
            Step.of(
                StepKind.CLUSTER,
                table,
                relnames or built[after[0]].relnames,
                after,
                (statement.as_string(src),),
            )
        )
    return out


def _comments(src: psycopg.Connection[Any], rels: list[int], built: dict[str, Step]) -> list[Step]:
    """``COMMENT ON`` the indexes, constraints and triggers that other steps make, each after its object's step (a
    materialized view's index after the views' step; an object left out, such as a foreign key to a table not
    migrated, keeps no comment)."""
    out = []
    for what, table, name, matview, text in src.execute(_COMMENTS, (rels, rels, rels)):
        subject = name if what == "INDEX" else f"{table}.{name}"
        makers = (matviews.STEP,) if matview else tuple(step_name(k, subject) for k in _MAKERS[what])
        after = [a for a in makers if a in built][:1]
        if not after:
            continue
        target = (
            sql.SQL(name)
            if what == "INDEX"
            else sql.SQL("{} ON {}").format(sql.Identifier(name), sql.SQL(table))
        )
        statement = sql.SQL("COMMENT ON {} {} IS {}").format(sql.SQL(what), target, sql.Literal(text))
        out.append(
            Step.of(
                StepKind.COMMENT,
                f"{what.lower()} {table}.{name}",
                built[after[0]].relnames,
                tuple(after),
                (statement.as_string(src),),
            )
        )
    return out


def steps(
    src: psycopg.Connection[Any],
    schemas: Sequence[str],
    exclude: Sequence[tuple[str, str]],
    tables: Sequence[str],
    built: Sequence[Step],
    first: int,
) -> list[Step]:
    """The steps of the objects this module covers. ``src`` is inside the snapshot with an empty ``search_path``;
    ``tables``: every migrated table (quoted; the rules, policies and statistics wait for all of them); ``built``:
    the other post-data steps (a ``CLUSTER ON`` follows its index's); ``first``: the first step's ``ord``."""
    rels = relations(src, schemas, exclude)
    if not rels:
        return []
    made_by = {s.step: s for s in built}
    clustered = [*_cluster(src, rels, tables, made_by), *_comments(src, rels, made_by)]
    made = [*_rules(src, rels), *_policies(src, rels), *_statistics(src, rels)]
    out = [Step.of(kind, subject, tuple(tables), (), statements) for kind, subject, statements in made]
    return [
        Step(s.step, s.kind, s.relnames, s.after, s.statements, first + i)
        for i, s in enumerate([*clustered, *out])
    ]


def event_triggers(src: psycopg.Connection[Any]) -> list[Step]:
    """The source's event triggers as steps of kind ``cutover_event_trigger``, made by the cutover after its own
    DDL (the identity columns' ``ALTER TABLE``) and nothing before: an event trigger fires on DDL, and the post-data
    steps and the cutover are DDL the source never ran. Only for a migration of the whole database (as pg_dump
    dumps them only without ``--schema``/``--table``): they are database-wide."""
    out = []
    for name, event, function, tags, enabled, owner, comment in src.execute(_EVENT_TRIGGERS):
        trigger = sql.SQL("EVENT TRIGGER {}").format(sql.Identifier(name))
        text = sql.SQL("CREATE ") + trigger + sql.SQL(" ON {}").format(sql.Identifier(event))
        if tags:
            text += sql.SQL(" WHEN TAG IN ({})").format(sql.SQL(", ").join(sql.Literal(t) for t in tags))
        text += sql.SQL(" EXECUTE FUNCTION {}()").format(sql.SQL(function))
        statements = [text.as_string(src)]
        if enabled in _EVENT_STATE:
            statements.append(
                (sql.SQL("ALTER ") + trigger + sql.SQL(" " + _EVENT_STATE[enabled])).as_string(src)
            )
        statements.append(
            (sql.SQL("ALTER ") + trigger + sql.SQL(" OWNER TO {}").format(sql.Identifier(owner))).as_string(
                src
            )
        )
        statements += _comment(src, trigger, comment)
        out.append(
            Step.of(
                StepKind.CUTOVER_EVENT_TRIGGER, name, (), (), tuple(statements), EVENT_TRIGGER_ORD + len(out)
            )
        )
    return out
