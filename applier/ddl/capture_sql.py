"""The capture's SQL, built from its parameters without a server: names of what it creates on the source, the
selection as SQL (shell patterns as regular expressions), and the text of its two functions.

Pure (no connection; :mod:`psycopg.sql` only quotes), so that every rule is unit-tested; :mod:`applier.ddl.capture`
runs what this builds. The emission rules are :mod:`applier.ddl.payload`'s contract.

Why two functions per consumer, not one: the event trigger's function must read the *caller's* ``search_path``
(the payload's), and a function with ``SET search_path`` (what makes a ``SECURITY DEFINER`` function safe) sees its
own. So the trigger function (:func:`trigger_function`, no rights of its own, no ``SET``) reads it and hands it to
the worker (:func:`worker_function`: ``SECURITY DEFINER`` owned by the installing role, ``SET search_path =
pg_catalog, pg_temp``), which may emit messages and alter the migration's publications whoever ran the DDL. Called
outside an event trigger, the worker fails (``pg_event_trigger_ddl_commands()`` refuses), so nobody can make it
emit anything.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from applier.ddl.payload import PREFIX, VERSION
from applier.migrate.selection import SYSTEM_SCHEMAS, Selection
from applier.migrate.survey import IDENTITY_USABLE

__all__ = [
    "BUSY",
    "SCHEMA",
    "Names",
    "Published",
    "Scope",
    "covers_schema_sql",
    "covers_sql",
    "glob_regex",
    "names",
    "trigger_function",
    "worker_function",
]

#: Our schema on the source: the capture's functions live here (never migrated: it is in ``SYSTEM_SCHEMAS``).
SCHEMA = "applier_capture"
#: The transaction-local setting that is ``on`` while a capture alters a publication (or installs or removes
#: itself): every consumer's capture then neither emits nor counts (shared by all, so one's ALTER PUBLICATION is
#: no DDL to the others).
BUSY = f"{SCHEMA}.busy"
_NAME_BYTES = 63  # NAMEDATALEN - 1


def _fit(name: str) -> str:
    """``name``, or when longer than PostgreSQL keeps, its start and a hash of the whole (the server would cut it
    silently, and two long slot names could then share a trigger)."""
    if len(name.encode()) <= _NAME_BYTES:
        return name
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:10]
    return name.encode()[: _NAME_BYTES - 11].decode(errors="ignore") + "_" + digest


class Names:
    """What the capture of one consumer (slot) creates on the source, and the settings it keeps per session."""

    def __init__(self, slot: str) -> None:
        self.slot = slot
        self.trigger_function = _fit(f"ddl_{slot}")  # in SCHEMA
        self.worker_function = _fit(f"ddl_{slot}_emit")  # in SCHEMA
        self.end_trigger = _fit(f"applier_ddl_{slot}")  # event triggers: one namespace per database
        self.drop_trigger = _fit(f"applier_ddl_{slot}_drop")
        # the key that signs its messages (applier.ddl.payload): a sequence, which only its owner may read and
        # which logical decoding never sends (a table would be published by a FOR ALL TABLES publication)
        self.key = _fit(f"ddl_{slot}_key")
        # custom settings: the ordinal of the last ddl_command_end in the client's statement, the objects the
        # current command dropped (sql_drop runs before its ddl_command_end)
        self.counter = f"{SCHEMA}.n_{slot}"
        self.dropped = f"{SCHEMA}.dropped_{slot}"


def names(slot: str) -> Names:
    return Names(slot)


# --- the selection in SQL ------------------------------------------------------------------------------------


def _regex_char(c: str) -> str:
    """One literal character in a PostgreSQL regular expression (ARE): ASCII punctuation escaped."""
    return "\\" + c if c.isascii() and not c.isalnum() and c != "_" else c


def _bracket(body: str) -> str:
    """A ``[...]`` of a shell pattern as an ARE bracket expression (``!`` negates; ``\\`` and ``[`` literal)."""
    negate = body.startswith("!")
    if negate:
        body = body[1:]
    body = body.replace("\\", "\\\\").replace("[", "\\[")
    if not negate and body.startswith("^"):
        body = "\\" + body
    return "[" + ("^" if negate else "") + body + "]"


def glob_regex(pattern: str) -> str:
    """``pattern`` (as :func:`fnmatch.fnmatchcase` reads it: ``*``, ``?``, ``[seq]``, ``[!seq]``) as an anchored
    PostgreSQL regular expression that matches exactly the same names (``[`` without its ``]`` is literal)."""
    out, i, n = ["^"], 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i + (1 if pattern[i : i + 1] == "!" else 0)
            j += 1 if pattern[j : j + 1] == "]" else 0
            j = pattern.find("]", j)
            if j < 0:
                out.append("\\[")
            else:
                out.append(_bracket(pattern[i:j]))
                i = j + 1
        else:
            out.append(_regex_char(c))
    return "".join(out) + "$"


def _lit(value: str) -> str:
    return sql.Literal(value).as_string()


def _any(operand: str, patterns: Sequence[str]) -> str:
    return f"{operand} ~ ANY (ARRAY[{', '.join(_lit(glob_regex(p)) for p in patterns)}]::text[])"


def _system_sql(nsp: str) -> str:
    listed = ", ".join(_lit(s) for s in sorted({*SYSTEM_SCHEMAS, SCHEMA, "pg_temp"}))
    return f"({nsp} IN ({listed}) OR {nsp} LIKE 'pg\\_temp\\_%' OR {nsp} LIKE 'pg\\_toast\\_temp\\_%')"


@dataclass(frozen=True)
class Published:
    """What a subscription's publications cover, by exact names, for its capture (``create --ddl``): a
    subscription has no patterns, and a name may hold ``*``, ``?``, ``[`` or a dot, which a :class:`Selection`
    pattern would read otherwise. ``all_tables``: every user schema (``FOR ALL TABLES``); ``schemas``: ``TABLES IN
    SCHEMA``; ``tables``: ``FOR TABLE`` as (schema, name) when the capture was installed; ``publications``: their
    names, so that a table of theirs is found by OID too when its DDL runs (renamed since, or added to a
    publication later): the stream keeps sending its rows, so its DDL must follow them."""

    publications: tuple[str, ...] = ()
    all_tables: bool = False
    schemas: tuple[str, ...] = ()
    tables: tuple[tuple[str, str], ...] = ()


#: What a capture covers: a migration's patterns, or a subscription's publications.
Scope = Selection | Published


def _texts(values: Sequence[str]) -> str:
    return f"ARRAY[{', '.join(_lit(v) for v in values)}]::text[]" if values else "'{}'::text[]"


# a table that one of the publications names (FOR TABLE), by OID
_IN_PUBLICATIONS = """@OID@ IN (SELECT pr.prrelid FROM pg_publication_rel pr JOIN pg_publication pp
  ON pp.oid = pr.prpubid WHERE pp.pubname = ANY (@PUBS@))"""


def _published_sql(p: Published, nsp: str, rel: str | None, oid: str | None) -> str:
    """:class:`Published` as SQL: the schema alone (``rel`` None) or a table (by name, or by ``oid`` when given)."""
    if p.all_tables:
        return f"(NOT {_system_sql(nsp)})"
    parts = [f"{nsp}::text = ANY ({_texts(p.schemas)})"]
    if rel is not None and p.tables:
        pairs = ", ".join(f"({_lit(s)}, {_lit(t)})" for s, t in p.tables)
        parts.append(f"({nsp}::text, {rel}::text) IN ({pairs})")
    if oid is not None and p.publications:
        parts.append(_fill(_IN_PUBLICATIONS, {"OID": oid, "PUBS": _texts(p.publications)}))
    return f"(NOT {_system_sql(nsp)} AND ({' OR '.join(parts)}))"


def covers_schema_sql(selection: Scope, nsp: str) -> str:
    """A boolean SQL expression over the text expression ``nsp``: :meth:`Selection.covers_schema`, or for
    :class:`Published` the schemas whose every table is published."""
    if isinstance(selection, Published):
        return _published_sql(selection, nsp, None, None)
    chosen = f" AND {_any(nsp, selection.schemas)}" if selection.schemas else ""
    return f"(NOT {_system_sql(nsp)}{chosen})"


def _table_match(pattern: str, nsp: str, rel: str) -> str:
    if "." in pattern:
        spat, tpat = pattern.split(".", 1)
        return f"({nsp} ~ {_lit(glob_regex(spat))} AND {rel} ~ {_lit(glob_regex(tpat))})"
    return f"{rel} ~ {_lit(glob_regex(pattern))}"


def covers_sql(selection: Scope, nsp: str, rel: str, oid: str | None = None) -> str:
    """A boolean SQL expression over the text expressions ``nsp`` and ``rel``: :meth:`Selection.covers`, or for
    :class:`Published` whether the publications publish the table (``oid``: the table's, where it still exists)."""
    if isinstance(selection, Published):
        return _published_sql(selection, nsp, rel, oid)
    parts = [covers_schema_sql(selection, nsp)]
    if selection.tables:
        parts.append("(" + " OR ".join(_table_match(p, nsp, rel) for p in selection.tables) + ")")
    if selection.exclude_tables:
        parts.append("NOT (" + " OR ".join(_table_match(p, nsp, rel) for p in selection.exclude_tables) + ")")
    return "(" + " AND ".join(parts) + ")"


# --- the functions ---------------------------------------------------------------------------------------------

#: The types of dropped objects that belong to a table whose schema and name begin their ``address_names``.
_ON_A_TABLE = ("table column", "table constraint", "trigger", "policy", "rule", "default value")

# sql_drop: the original, non-temporary objects the command dropped, inside the selection, each with its table
_DROPPED = """
  SELECT coalesce(jsonb_agg(jsonb_build_object('type', o.object_type, 'schema', o.schema_name,
           'identity', o.object_identity, 'table', t.ident, 'dropped', true) ORDER BY o.ordinality), '[]'::jsonb)
    INTO v_found
    FROM pg_event_trigger_dropped_objects() WITH ORDINALITY AS o
    LEFT JOIN LATERAL (
      SELECT quote_ident(o.address_names[1]) || '.' || quote_ident(o.address_names[2]) AS ident,  -- NULL-safe
             o.address_names[1] AS nsp, o.address_names[2] AS rel
       WHERE (o.object_type = 'table' AND cardinality(o.address_names) = 2)
          OR (o.object_type IN (@ON_A_TABLE@) AND cardinality(o.address_names) >= 3)) t ON true
    LEFT JOIN LATERAL (
      SELECT rn.nspname, rc.relname FROM pg_class rc JOIN pg_namespace rn ON rn.oid = rc.relnamespace
       WHERE rc.oid = (SELECT coalesce(pg_partition_root(x), x) FROM to_regclass(t.ident) AS x)) r ON true
   WHERE o.original AND NOT o.is_temporary
     AND CASE WHEN t.ident IS NOT NULL THEN @COVERS_DROPPED@
              WHEN o.object_type = 'schema' THEN @COVERS_SCHEMA_NAME@
              WHEN o.schema_name IS NOT NULL THEN @COVERS_SCHEMA_DROPPED@
              ELSE false END;"""

# ddl_command_end: the objects of the command inside the selection, each with its table (a partition decided by its
# tree's root, as the migration's selection does), and the tables among them
_COMMANDS = """
  SELECT coalesce(jsonb_agg(jsonb_build_object('type', c.object_type, 'schema', c.schema_name,
           'identity', c.object_identity, 'table', t.ident, 'dropped', false) ORDER BY c.ordinality), '[]'::jsonb),
         coalesce(array_agg(DISTINCT t.oid) FILTER (WHERE t.oid IS NOT NULL), '{}'::oid[])
    INTO v_found, v_tables
    FROM pg_event_trigger_ddl_commands() WITH ORDINALITY AS c
    LEFT JOIN LATERAL (SELECT CASE c.classid
        WHEN 'pg_class'::regclass::oid THEN (SELECT CASE WHEN k.relkind IN ('i', 'I') AND c.objsubid = 0
                 THEN (SELECT x.indrelid FROM pg_index x WHERE x.indexrelid = k.oid) ELSE k.oid END
               FROM pg_class k WHERE k.oid = c.objid)
        WHEN 'pg_constraint'::regclass::oid THEN (SELECT nullif(k.conrelid, 0) FROM pg_constraint k WHERE k.oid = c.objid)
        WHEN 'pg_trigger'::regclass::oid THEN (SELECT k.tgrelid FROM pg_trigger k WHERE k.oid = c.objid)
        WHEN 'pg_policy'::regclass::oid THEN (SELECT k.polrelid FROM pg_policy k WHERE k.oid = c.objid)
        WHEN 'pg_attrdef'::regclass::oid THEN (SELECT k.adrelid FROM pg_attrdef k WHERE k.oid = c.objid)
        WHEN 'pg_rewrite'::regclass::oid THEN (SELECT k.ev_class FROM pg_rewrite k WHERE k.oid = c.objid)
        WHEN 'pg_statistic_ext'::regclass::oid THEN (SELECT k.stxrelid FROM pg_statistic_ext k WHERE k.oid = c.objid)
        END AS relid) k ON true
    LEFT JOIN LATERAL (
      SELECT rel.oid, format('%I.%I', n.nspname, rel.relname) AS ident, rel.relpersistence,
             rn.nspname AS root_nsp, rc.relname AS root_rel, rc.oid AS root_oid
        FROM pg_class rel JOIN pg_namespace n ON n.oid = rel.relnamespace
        JOIN pg_class rc ON rc.oid = coalesce(pg_partition_root(rel.oid), rel.oid)
        JOIN pg_namespace rn ON rn.oid = rc.relnamespace
       WHERE rel.oid = k.relid AND rel.relkind IN ('r', 'p')) t ON true
   WHERE NOT c.in_extension
     AND CASE WHEN t.oid IS NOT NULL THEN t.relpersistence = 'p' AND @COVERS_ROOT@
              WHEN c.object_type = 'schema' THEN @COVERS_SCHEMA_OBJECT@
              WHEN c.schema_name IS NOT NULL THEN @COVERS_SCHEMA_COMMAND@
              ELSE false END;"""

# the covered tables of the command (and the leaves of a partitioned one) that are not in the publication their
# replica identity calls for: moved or added there, as the migration's publications are made
# (applier.migrate.publications); a failure is a WARNING to the one who ran the DDL, never their error, but for
# their own lock_timeout (the table would otherwise exist without joining: its rows never migrated)
_PUBLISH = """
  FOR v_row IN
    SELECT format('%I.%I', n.nspname, c.relname) AS ident, @IDENTITY_USABLE@ AS usable,
           EXISTS (SELECT FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                    WHERE p.pubname = @MAIN@ AND pr.prrelid = c.oid) AS in_main,
           EXISTS (SELECT FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                    WHERE p.pubname = @INS@ AND pr.prrelid = c.oid) AS in_ins
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid IN (SELECT x FROM unnest(v_tables) AS x
                     UNION SELECT pt.relid FROM unnest(v_tables) AS x, pg_partition_tree(x) AS pt WHERE pt.isleaf)
       AND c.relkind = 'r' AND c.relpersistence = 'p'
       AND EXISTS (SELECT FROM pg_publication WHERE pubname = @MAIN@)
  LOOP
    CONTINUE WHEN v_row.usable = v_row.in_main AND (v_row.in_main OR v_row.in_ins);
    BEGIN
      PERFORM set_config(@BUSY@, 'on', true);
      IF v_row.usable THEN
        IF v_row.in_ins THEN EXECUTE format('ALTER PUBLICATION %I DROP TABLE %s', @INS@, v_row.ident); END IF;
        EXECUTE format('ALTER PUBLICATION %I ADD TABLE %s', @MAIN@, v_row.ident);
      ELSE
        IF v_row.in_main THEN EXECUTE format('ALTER PUBLICATION %I DROP TABLE %s', @MAIN@, v_row.ident); END IF;
        EXECUTE format('ALTER PUBLICATION %I ADD TABLE %s', @INS@, v_row.ident);
      END IF;
      PERFORM set_config(@BUSY@, 'off', true);
    EXCEPTION WHEN lock_not_available THEN
      RAISE;  -- the session's lock_timeout (the publication is locked by another open or prepared transaction
              -- that added a table): its DDL fails, rather than the table joining without its rows
    WHEN OTHERS THEN
      RAISE WARNING 'applier: table % could not join the publication of migration %: %', v_row.ident, @SLOT@, SQLERRM;
    END;
  END LOOP;"""

_WORKER = """
CREATE OR REPLACE FUNCTION @SCHEMA@.@WORKER@(p_event text, p_tag text, p_path text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $applier_capture$
DECLARE
  v_key text := md5(statement_timestamp()::text || ' ' || coalesce(current_query(), ''));
  v_counter text;
  v_n int := 1;
  v_found jsonb;
  v_dropped jsonb;
  v_tables oid[];
  v_row record;
  v_body bytea;
  v_secret bytea;
BEGIN
  IF current_setting(@BUSY@, true) = 'on' OR p_event NOT IN ('ddl_command_end', 'sql_drop') THEN
    RETURN;  -- our own ALTER PUBLICATION, install or removal: neither emitted nor counted
  END IF;
  IF p_event = 'sql_drop' THEN  -- kept for this command's ddl_command_end, which comes next
@DROPPED_QUERY@
    PERFORM set_config(@DROPPED@, (coalesce(nullif(current_setting(@DROPPED@, true), ''), '[]')::jsonb
                                   || v_found)::text, true);
    RETURN;
  END IF;
  -- the ordinal of this ddl_command_end in the client's statement, emitted or not (a session setting, so that a
  -- COMMIT inside a multi-statement string does not restart it)
  v_counter := current_setting(@COUNTER@, true);
  IF split_part(v_counter, ' ', 1) = v_key THEN
    v_n := split_part(v_counter, ' ', 2)::int + 1;
  END IF;
  PERFORM set_config(@COUNTER@, v_key || ' ' || v_n, false);
  v_dropped := coalesce(nullif(current_setting(@DROPPED@, true), ''), '[]')::jsonb;
  IF v_dropped <> '[]'::jsonb THEN
    PERFORM set_config(@DROPPED@, '', true);
  END IF;
@COMMANDS_QUERY@
  v_found := v_found || v_dropped;
  IF v_found = '[]'::jsonb AND p_tag NOT IN ('GRANT', 'REVOKE') THEN
    RETURN;  -- nothing of the selection (a GRANT names no object here: the apply decides)
  END IF;
@PUBLISH@
  v_body := convert_to(jsonb_build_object('v', @VERSION@, 'slot', @SLOT@, 'tag', p_tag,
    'n', v_n, 'ts', statement_timestamp()::text, 'query', current_query(), 'search_path', p_path,
    'objects', v_found)::text, 'UTF8');
  v_secret := convert_to((SELECT k.last_value FROM @SCHEMA@.@KEY@ k)::text, 'UTF8');
  -- signed (applier.ddl.payload.sign): any role may emit a message with our prefix; only this function knows the key
  PERFORM pg_logical_emit_message(true, @PREFIX@,
    convert_to(encode(sha256(v_secret || sha256(v_secret || v_body)), 'hex'), 'UTF8') || v_body);
END
$applier_capture$"""

_TRIGGER = """
CREATE OR REPLACE FUNCTION @SCHEMA@.@TRIGGER@() RETURNS event_trigger
LANGUAGE plpgsql AS $applier_capture$
BEGIN
  -- no EXCEPTION block here: it would make a subtransaction of the message, which PostgreSQL 15 decodes after the
  -- rows that follow it in the transaction (seen in CI); the worker's own queries must not fail instead
  PERFORM @SCHEMA@.@WORKER@(TG_EVENT, TG_TAG, pg_catalog.current_setting('search_path'));
END
$applier_capture$"""


def _fill(template: str, values: dict[str, str], *, partial: bool = False) -> str:
    """``template`` with each ``@KEY@`` replaced by ``values[KEY]``, in one pass (a value, which may hold a user's
    pattern, is never scanned again); ``partial``: keys not in ``values`` stay for a later pass."""

    def value(m: re.Match[str]) -> str:
        return values.get(m.group(1), m.group(0)) if partial else values[m.group(1)]

    return re.sub(r"@([A-Z_]+)@", value, template)


def _checked(text: str) -> str:
    """A function's text, refused when a value (a pattern) would end its dollar-quoted body early."""
    if text.count("$applier_capture$") != 2:
        raise ValueError("a selection pattern contains $applier_capture$, which cannot be embedded")
    return text


def _ident(name: str) -> str:
    return sql.Identifier(name).as_string()


def worker_function(slot: str, selection: Scope, publications: tuple[str, str] | None) -> str:
    """``CREATE OR REPLACE FUNCTION`` of the worker of ``slot``'s capture: the emission rules of
    :mod:`applier.ddl.payload` for ``selection``, and with ``publications`` (the migration's every-operation and
    insert-only ones) a covered table created or given a key while following put in the one its identity calls
    for."""
    n = names(slot)
    s = selection
    values = {
        "ON_A_TABLE": ", ".join(_lit(t) for t in _ON_A_TABLE),
        "COVERS_DROPPED": covers_sql(s, "coalesce(r.nspname, t.nsp)", "coalesce(r.relname, t.rel)"),
        "COVERS_SCHEMA_NAME": covers_schema_sql(s, "o.object_name"),
        "COVERS_SCHEMA_DROPPED": covers_schema_sql(s, "o.schema_name"),
        "COVERS_ROOT": covers_sql(s, "t.root_nsp", "t.root_rel", "t.root_oid"),
        "COVERS_SCHEMA_OBJECT": covers_schema_sql(
            s, "(SELECT ns.nspname FROM pg_namespace ns WHERE ns.oid = c.objid)"
        ),
        "COVERS_SCHEMA_COMMAND": covers_schema_sql(s, "c.schema_name"),
    }
    skeleton = _fill(
        _WORKER,
        {
            "DROPPED_QUERY": _DROPPED,
            "COMMANDS_QUERY": _COMMANDS,
            "PUBLISH": "" if publications is None else _PUBLISH,
        },
        partial=True,
    )
    values.update(
        {
            "IDENTITY_USABLE": IDENTITY_USABLE,
            "MAIN": _lit(publications[0]) if publications else "NULL",
            "INS": _lit(publications[1]) if publications else "NULL",
            "SCHEMA": _ident(SCHEMA),
            "WORKER": _ident(n.worker_function),
            "KEY": _ident(n.key),
            "BUSY": _lit(BUSY),
            "DROPPED": _lit(n.dropped),
            "COUNTER": _lit(n.counter),
            "SLOT": _lit(slot),
            "PREFIX": _lit(PREFIX),
            "VERSION": str(VERSION),
        }
    )
    return _checked(_fill(skeleton, values))


def trigger_function(slot: str) -> str:
    """``CREATE OR REPLACE FUNCTION`` of the event triggers' function of ``slot``'s capture: it runs as whoever
    ran the DDL, reads their ``search_path`` and hands the event to the worker (the module's docstring says why)."""
    n = names(slot)
    values = {
        "SCHEMA": _ident(SCHEMA),
        "TRIGGER": _ident(n.trigger_function),
        "WORKER": _ident(n.worker_function),
    }
    return _checked(_fill(_TRIGGER, values))
