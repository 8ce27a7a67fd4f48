"""What code a change or a copy can run on the target, and whether the apply role may run it (issue 26).

PostgreSQL 16's subscriber runs each table's changes as the table's owner inside a security-restricted operation,
so a table owner's trigger cannot use the subscription owner's rights. A client cannot do that (code run under
``SET ROLE owner`` can ``RESET ROLE``), so we refuse instead: before a change or a copy touches a table, the target
itself enumerates every piece of code that the statement can run there and raises when one is controlled by a role
the apply role does not trust (docs/security.md has the threat model; docs/reference.md the rule).

The three functions live in the catalog schema, owned by the role that created the catalog (the apply role), so no
other role can replace them, and they run with ``search_path = pg_catalog, pg_temp``:

- ``applier.untrusted_code(rel, event, cols)``: the rows of untrusted code for an ``event`` (``I``nsert of the
  columns ``cols``, ``U``pdate, ``D``elete, ``T``runcate) on ``rel``: enabled ALWAYS/REPLICA triggers (their
  functions, their WHEN clauses, their arguments when the table's owner is not trusted), ALWAYS/REPLICA rules,
  defaults of the columns not in ``cols``, generated columns, CHECK constraints, index expressions and predicates,
  the constraints of every domain a column's type holds (through arrays, composites and ranges), on the table and
  on each of its partitions. Each function they name, directly or through an operator, must be owned by the apply
  role or a superuser; built-ins are (the bootstrap superuser owns them), except the few that run SQL text, read or
  write the server's files, signal other sessions or change settings (``DENIED``), which an expression written by
  an untrusted role may not call with our rights.
- ``applier.trust_check(rel, event, cols)``: raises that as an error naming table, object, owner and the ways out,
  and PostgreSQL's own error for a table whose row-level security applies to the apply role; else true.
- ``applier.trust_ok(rel, event, cols)``: the same, declared IMMUTABLE so that the planner runs it when it plans a
  statement that calls it with constant arguments, and never again while that plan stays valid. The apply session
  puts it in each prepared INSERT, UPDATE and DELETE of a plain table, or in one prepared guard statement per table
  and kind of change where that cannot be (applier.apply.target_trust, ``TrustedStatements.embeds``): a change to the
  table's triggers, rules, policies, defaults, constraints, indexes, owner or row-security flag invalidates the
  statement's plan (a relcache invalidation), so the check runs again exactly when its answer can have changed,
  and costs nothing otherwise.

Why trusting owners and not bodies: a function is replaced (``CREATE OR REPLACE``) only by its owner, a member of
its owner or a superuser, so a function owned by the apply role or a superuser cannot become untrusted code
without one of them acting; we read which functions an object names (``pg_depend``), not what a trusted function's
body calls.
"""

from __future__ import annotations

#: the catalog's schema (applier.catalog.schema.SCHEMA, which imports this module for its migrations)
SCHEMA = "applier"

#: Built-in functions an expression written by an untrusted role may not make us call: they run SQL text
#: (``query_to_xml`` and the other ``*_to_xml*``), read or write the server's files or large objects, end or signal
#: other sessions, change settings or the role (``set_config``), or act on replication slots and origins.
DENIED_NAMES = (
    "set_config", "pg_read_file", "pg_read_binary_file", "pg_stat_file", "pg_terminate_backend",
    "pg_cancel_backend", "pg_reload_conf", "pg_rotate_logfile", "pg_promote", "pg_switch_wal",
    "pg_create_restore_point", "pg_drop_replication_slot", "pg_logical_emit_message", "pg_import_system_collations",
    "pg_log_backend_memory_contexts", "pg_file_write", "pg_file_rename", "pg_file_unlink",
)  # fmt: skip
DENIED_PATTERNS = (
    "%to\\_xml%", "pg\\_ls\\_%", "pg\\_replication\\_origin\\_%", "pg\\_create\\_%slot", "pg\\_copy\\_%slot",
    "lo\\_%", "dblink%",
)  # fmt: skip

_DENIED = "(p.proname IN (@NAMES@) OR p.proname LIKE ANY (ARRAY[@PATTERNS@]))".replace(
    "@NAMES@", ", ".join(f"'{n}'" for n in DENIED_NAMES)
).replace("@PATTERNS@", ", ".join(f"'{p}'" for p in DENIED_PATTERNS))

#: ``types(typ)``: every type a column of the relations ``{rels}`` (an oid list or subquery) holds, through domains,
#: arrays, ranges and composites: whose domains' constraints run when a row is written. A recursive CTE's text,
#: also used by applier.apply.target to list the domains a guard statement must depend on.
#:
#: Only types made after initdb are walked (oid >= FirstNormalObjectId, 16384): a built-in type holds only built-in
#: types, and the built-in domains (information_schema's) belong to the bootstrap superuser, so nothing below one
#: can be untrusted. Each step looks its type up by oid (``OFFSET 0`` keeps the planner from turning the lookups
#: into a hash join over all of pg_type, which cost some 40 ms a call in a database of 200 tables).
TYPE_WALK = """types(typ) AS (
  SELECT a.atttypid FROM pg_catalog.pg_attribute a WHERE a.attrelid IN ({rels}) AND a.attnum > 0
    AND NOT a.attisdropped AND a.atttypid >= 16384
  UNION
  SELECT x.sub FROM types CROSS JOIN LATERAL (
    SELECT s.sub FROM pg_catalog.pg_type t CROSS JOIN LATERAL (SELECT t.typbasetype UNION ALL SELECT t.typelem
      UNION ALL SELECT g.rngsubtype FROM pg_catalog.pg_range g WHERE g.rngtypid = t.oid
      UNION ALL SELECT a.atttypid FROM pg_catalog.pg_attribute a
        WHERE t.typtype = 'c' AND a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped) s(sub)
    WHERE t.oid = types.typ OFFSET 0) x
  WHERE x.sub >= 16384
)"""
UNTRUSTED_CODE = """
CREATE OR REPLACE FUNCTION applier.untrusted_code(rel pg_catalog.regclass, event "char", cols text[])
RETURNS TABLE (tbl text, kind text, object text, owner text, detail text)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
WITH RECURSIVE
trusted AS (SELECT r.oid FROM pg_roles r WHERE r.rolsuper OR r.rolname = current_user),
rels AS (SELECT ARRAY(SELECT rel::oid UNION SELECT t.relid::oid FROM pg_partition_tree(rel) t) AS ids),
ev AS (SELECT CASE event WHEN 'I' THEN 4 WHEN 'D' THEN 8 WHEN 'T' THEN 32
  WHEN 'U' THEN CASE WHEN (SELECT relkind FROM pg_class WHERE oid = rel) = 'p' THEN 28 ELSE 16 END END AS mask),
@TYPES@,
items AS (
  SELECT g.tgrelid AS relid, 'trigger' AS kind, quote_ident(g.tgname) AS object, c.relowner AS author,
    'pg_trigger'::regclass AS cls, g.oid AS objid, g.tgfoid AS fn, g.tgnargs > 0 AS args, false AS whole
  FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
  WHERE g.tgrelid = ANY ((SELECT ids FROM rels)::oid[]) AND g.tgenabled IN ('A', 'R') AND g.tgtype & (SELECT mask FROM ev) <> 0
  UNION ALL
  SELECT r.ev_class, 'rule', quote_ident(r.rulename), c.relowner, 'pg_rewrite'::regclass, r.oid, NULL, false, true
  FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class
  WHERE r.ev_class = rel AND r.ev_enabled IN ('A', 'R') AND r.rulename <> '_RETURN'
    AND r.ev_type = CASE event WHEN 'I' THEN '3' WHEN 'U' THEN '2' WHEN 'D' THEN '4' END
  UNION ALL
  SELECT d.adrelid, CASE WHEN a.attgenerated <> '' THEN 'generated column' ELSE 'default of column' END,
    quote_ident(a.attname), c.relowner, 'pg_attrdef'::regclass, d.oid, NULL, false, false
  FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
    JOIN pg_class c ON c.oid = d.adrelid
  WHERE d.adrelid = ANY ((SELECT ids FROM rels)::oid[]) AND NOT a.attisdropped AND event IN ('I', 'U')
    AND (a.attgenerated <> '' OR (event = 'I' AND d.adrelid = rel AND NOT a.attname = ANY (cols)))
  UNION ALL
  SELECT k.conrelid, 'check constraint', quote_ident(k.conname), c.relowner, 'pg_constraint'::regclass, k.oid,
    NULL, false, false
  FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
  WHERE k.conrelid = ANY ((SELECT ids FROM rels)::oid[]) AND k.contype = 'c' AND event IN ('I', 'U')
  UNION ALL
  SELECT i.indrelid, 'index', i.indexrelid::regclass::text, c.relowner, 'pg_class'::regclass, i.indexrelid, NULL,
    false, false
  FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
  WHERE i.indrelid = ANY ((SELECT ids FROM rels)::oid[]) AND (i.indexprs IS NOT NULL OR i.indpred IS NOT NULL)
    AND event IN ('I', 'U')
  UNION ALL
  SELECT rel, 'constraint', quote_ident(k.conname) || ' of domain ' || k.contypid::regtype::text, t.typowner,
    'pg_constraint'::regclass, k.oid, NULL, false, false
  FROM pg_constraint k JOIN pg_type t ON t.oid = k.contypid
  WHERE k.contypid IN (SELECT typ FROM types) AND k.contype = 'c'
),
calls AS (
  SELECT i.*, f.fn AS called FROM items i
  CROSS JOIN LATERAL (
    SELECT i.fn WHERE i.fn IS NOT NULL
    UNION SELECT d.refobjid FROM pg_depend d
      WHERE d.classid = i.cls AND d.objid = i.objid AND d.refclassid = 'pg_proc'::regclass
    UNION SELECT o.oprcode::oid FROM pg_depend d JOIN pg_operator o ON o.oid = d.refobjid
      WHERE d.classid = i.cls AND d.objid = i.objid AND d.refclassid = 'pg_operator'::regclass
  ) f(fn)
)
SELECT i.relid::regclass::text, i.kind, i.object, pg_get_userbyid(i.author),
  'is a rule of a table whose owner the apply role does not trust'
FROM items i WHERE i.whole AND i.author NOT IN (SELECT oid FROM trusted)
UNION ALL
SELECT c.relid::regclass::text, c.kind, c.object,
  pg_get_userbyid(CASE WHEN p.proowner IN (SELECT oid FROM trusted) THEN c.author ELSE p.proowner END),
  CASE WHEN p.proowner NOT IN (SELECT oid FROM trusted)
    THEN format('runs function %s owned by role %s', p.oid::regprocedure, quote_ident(pg_get_userbyid(p.proowner)))
    WHEN c.args THEN format('passes arguments, written by role %s, to function %s',
      quote_ident(pg_get_userbyid(c.author)), p.oid::regprocedure)
    ELSE format('calls %s, which runs SQL text or acts outside the transaction, in an expression written by role %s',
      p.oid::regprocedure, quote_ident(pg_get_userbyid(c.author))) END
FROM calls c JOIN pg_proc p ON p.oid = c.called
WHERE NOT c.whole AND (p.proowner NOT IN (SELECT oid FROM trusted)
  OR (c.author NOT IN (SELECT oid FROM trusted) AND (
    (p.pronamespace = 'pg_catalog'::regnamespace AND @DENIED@) OR p.proname LIKE 'dblink%'
    OR (c.args AND p.pronamespace <> 'pg_catalog'::regnamespace))))
$fn$
"""

TRUST_CHECK = """
CREATE OR REPLACE FUNCTION applier.trust_check(rel pg_catalog.regclass, event "char", cols text[])
RETURNS boolean LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  found text[];
BEGIN
  IF event <> 'T' AND row_security_active(rel) THEN
    RAISE EXCEPTION 'user "%" cannot replicate into relation with row-level security enabled: "%"',
      current_user, rel::text USING ERRCODE = 'feature_not_supported',
      HINT = 'Disable row-level security on the table, or apply as a role that bypasses it (its owner, a role '
        'with BYPASSRLS or a superuser).';
  END IF;
  SELECT array_agg(format('table %s: %s %s %s', u.tbl, u.kind, u.object, u.detail) ORDER BY u.tbl, u.kind, u.object)
    INTO found FROM applier.untrusted_code(rel, event, cols) u;
  IF found IS NOT NULL THEN
    RAISE EXCEPTION '%; the apply role "%" runs no code that a role other than itself or a superuser controls',
      found[1], current_user
      USING ERRCODE = 'insufficient_privilege', DETAIL = array_to_string(found, E'\n'),
      HINT = 'Make the apply role (or a superuser) own that code, or drop or disable it; or trust the owners of the '
        'subscription''s tables: applier alter SUBSCRIPTION --set run_as_owner=true (docs/security.md).';
  END IF;
  RETURN true;
END
$fn$
"""

TRUST_OK = """
CREATE OR REPLACE FUNCTION applier.trust_ok(rel pg_catalog.regclass, event "char", cols text[])
RETURNS boolean LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  RETURN applier.trust_check(rel, event, cols);
END
$fn$
"""

UNTRUSTED_CODE = UNTRUSTED_CODE.replace(
    "@TYPES@", TYPE_WALK.replace("{rels}", "SELECT unnest(ids) FROM rels) AND event IN ('I', 'U'")
).replace("@DENIED@", _DENIED)

#: What ``applier create`` warns of before any change arrives: for each table (``:relids``), the code that an
#: INSERT of every column, an UPDATE or a DELETE would be refused for, and whether row-level security applies.
UNTRUSTED_TABLES = """
SELECT u.tbl, u.kind, u.object, u.owner, u.detail
FROM unnest(CAST(:relids AS pg_catalog.oid[])) AS r(oid)
CROSS JOIN LATERAL (
  SELECT * FROM applier.untrusted_code(r.oid::pg_catalog.regclass, 'I', ARRAY(SELECT a.attname::text
    FROM pg_catalog.pg_attribute a WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped))
  UNION SELECT * FROM applier.untrusted_code(r.oid::pg_catalog.regclass, 'U', '{}')
  UNION SELECT * FROM applier.untrusted_code(r.oid::pg_catalog.regclass, 'D', '{}')
  UNION SELECT r.oid::pg_catalog.regclass::text, 'row-level security', '', '', 'applies to the apply role'
    WHERE pg_catalog.row_security_active(r.oid::pg_catalog.regclass)
) u
ORDER BY 1, 2, 3
"""

#: The statements that create (or replace) the functions, in order: the catalog's migrations run them.
FUNCTIONS = (UNTRUSTED_CODE, TRUST_CHECK, TRUST_OK)
