"""``applier migrate plan``: what a migration would move, how long it would roughly take, and what stops it.

Two halves. The edges (:func:`applier.migrate.survey.gather_source` and ``gather_target``) read both servers'
catalogs inside ``READ ONLY`` transactions, so a plan provably changes nothing (no slot, no publication, no catalog
row); they cover the tables ``start`` would migrate (:func:`applier.migrate.selection.select_tables`). This module is
the core (:func:`assess`), pure: facts in, blockers and warnings out, so every rule is unit-tested without a server,
and it imports no driver (``.importlinter``).

**Blockers** (exit status 1) are conditions under which ``start`` would fail, would break the *source*, or could not
migrate the rows: a selected table without a usable key or replica identity that has received UPDATE/DELETE (those
cannot be migrated: such a table is published for INSERT and TRUNCATE only, :mod:`applier.migrate.publications`),
``wal_level`` not ``logical``, too few free replication slots or WAL senders, ``max_prepared_transactions = 0`` on
the target (the migration applies prepared transactions as prepared), an extension or role the target lacks, a
selected table that already exists on the target, too little disk on the target (only when it can be told: the
target's data directory is visible from here), no ``pg_dump`` new enough.

**Privileges** (managed services, no superuser on either side: docs/security.md, "Managed services"): each one the
connected roles lack is a finding with the statement that gives it (names quoted by the servers). Blockers: on the
source REPLICATION (or RDS's ``rds_replication``), CREATE on the database and ownership of every selected table
(``CREATE PUBLICATION ... FOR TABLE`` needs both), SELECT on the selected tables and sequences; on the target CREATE
on the database and on the selected schemas it has already, SET on ``session_replication_role``, EXECUTE on the
replication-origin functions, an extension to create that is not trusted, a role that a policy, a statistics object
or a large object names and that the target lacks. Warnings: no ``pg_signal_backend`` or ``pg_read_all_stats`` on
the source (what the cutover's fence then does instead), and on a target without superuser the owners and grantees
it lacks (objects owned by the migrating role, grants skipped: :func:`applier.migrate.schema.without_unrestorable`)
and the event triggers (skipped).

**Warnings** are what the migration will not carry by itself: tables without a key or usable replica identity that
have received no UPDATE/DELETE (published for INSERT and TRUNCATE only, so that the source keeps taking every
write: a later UPDATE/DELETE is not migrated, and the cutover copies such a table again, or refuses when it is larger
than :data:`RECOPY_MAX_BYTES`), unlogged tables (cannot be published: not migrated), materialized views (refreshed on
the target, not replicated), large objects (changes to them are not replicated: compared and copied again at the
cutover), schema changes (DDL) when the source role cannot install the DDL capture (event triggers: a superuser
or a managed service's admin role).

The time estimate is deliberately rough: heap bytes / :data:`COPY_BYTES_PER_SECOND` for the copy and index bytes /
:data:`INDEX_BYTES_PER_SECOND` for the index builds, whole-run rates with the default jobs on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from applier.humanize import human_bytes
from applier.migrate.selection import Selection
from applier.migrate.tools import DumpTools

__all__ = [
    "COPY_BYTES_PER_SECOND",
    "INDEX_BYTES_PER_SECOND",
    "PUBLIC_DEFAULT_OWNER",
    "RECOPY_MAX_BYTES",
    "Finding",
    "insert_only_ways_out",
    "Plan",
    "SourceFacts",
    "SourcePrivileges",
    "TableFacts",
    "TargetFacts",
    "TargetPrivileges",
    "assess",
    "format_plan",
]

#: Whole copy, default jobs, 2 cores: our tablesync measured 40-52 MB/s on an idle machine (bench/RESULTS.md) and
#: a migration of pgbench -s 10 copied 114 MB in 7.1 s (16 MB/s) on a loaded one: take a middle.
COPY_BYTES_PER_SECOND = 30e6
#: Index bytes built per second in that migration's post-data, roughly (21.5 MB of B-tree in a few seconds, under
#: load and overlapping the copy); GIN builds are slower.
INDEX_BYTES_PER_SECOND = 15e6
#: The largest table without a key or usable replica identity that the cutover copies again when it received
#: UPDATE/DELETE during the migration (those are not migrated: :mod:`applier.migrate.publications`). The copy runs
#: while the source is fenced, so it is write downtime: 64 MiB takes about 2 s at :data:`COPY_BYTES_PER_SECOND`,
#: within the few seconds a cutover's downtime is meant to be; a larger one is refused before the fence instead.
RECOPY_MAX_BYTES = 64 * 1024 * 1024
#: The migration's slot plus the temporary slot of the initial copy, each with its WAL sender.
SLOTS_NEEDED = 2
WAL_SENDERS_NEEDED = 2
#: How a role is named by the selection (:attr:`SourceFacts.role_uses`) when it owns the public schema as its default
#: owner before PostgreSQL 15, the bootstrap superuser (``postgres``, RDS's ``rdsadmin``): a target without superuser
#: keeps its own public schema's owner (``pg_database_owner``), without a word
#: (:func:`applier.migrate.schema.without_unrestorable`); a superuser target makes it the owner, so it must exist.
PUBLIC_DEFAULT_OWNER = "default owner of schema public"


@dataclass(frozen=True)
class TableFacts:
    schema: str
    name: str
    kind: str  # r (table) or p (partitioned)
    persistence: str  # p (permanent) or u (unlogged)
    heap_bytes: int
    total_bytes: int  # heap + TOAST + indexes
    index_bytes: int
    rows_estimate: int | None  # pg_class.reltuples; None: never analyzed
    has_pk: bool
    replica_identity: str  # d, n, f, i
    identity_usable: (
        bool  # UPDATE/DELETE can be published: a PK (default), FULL, or an existing identity index
    )
    updates_deletes: int  # pg_stat_user_tables.n_tup_upd + n_tup_del since the statistics were last reset
    indexes: int
    owner: str

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class SourcePrivileges:
    """What the role we connect to the source as may do (a superuser's by default). Names quoted by the server."""

    role: str = "postgres"
    database: str = "postgres"
    superuser: bool = True
    replication: bool = True  # REPLICATION, or a member of RDS's rds_replication
    rds_replication: bool = False  # the server has the role rds_replication (an RDS server): the fix names it
    create_on_database: bool = True  # CREATE PUBLICATION needs it
    not_owned: tuple[
        str, ...
    ] = ()  # selected tables it does not own (CREATE PUBLICATION ... FOR TABLE needs to)
    unreadable: tuple[str, ...] = ()  # selected tables and sequences without SELECT
    signal_backend: bool = True  # may end other roles' sessions (the cutover's fence)
    read_all_stats: bool = True  # sees whether other roles' sessions are inside a transaction


@dataclass(frozen=True)
class TargetPrivileges:
    """What the role we connect to the target as may do (a superuser's by default). Names quoted by the server."""

    role: str = "postgres"
    database: str = "postgres"
    superuser: bool = True
    create_on_database: bool = True  # schema applier and the migrated schemas
    schemas_without_create: tuple[str, ...] = ()  # selected schemas the target has, without CREATE on them
    set_replication_role: bool = True
    missing_functions: tuple[str, ...] = ()  # of ORIGIN_FUNCTIONS, those without EXECUTE
    untrusted_extensions: tuple[str, ...] = ()  # not installed, and only a superuser may create them
    ownable: tuple[str, ...] = ()  # roles it may make an object's owner (itself, those it may SET ROLE to)


@dataclass(frozen=True)
class SourceFacts:
    version_num: int
    wal_level: str
    max_replication_slots: int
    slots_used: int
    max_wal_senders: int
    wal_senders_used: int
    schemas: list[str]
    tables: list[TableFacts]
    indexes: list[dict[str, Any]]
    constraints: dict[str, int]  # by kind: primary key, unique, foreign key, check, exclusion
    sequences: list[str]
    large_objects: int
    extensions: dict[str, str]  # name -> installed version
    publications: list[str]
    materialized_views: list[str]
    roles: list[str]  # owners and grantees of the selected objects
    row_security: list[str] = field(default_factory=list)  # selected tables with row-level security enabled
    event_triggers: list[str] = field(default_factory=list)  # the database's (not an extension's)
    role_uses: dict[str, list[str]] = field(
        default_factory=dict
    )  # role -> owner, grant, policy, statistics, ...
    privileges: SourcePrivileges = field(default_factory=SourcePrivileges)
    read_only: bool = False  # the database makes new sessions read-only (a fence, or its owner's setting)
    ddl_capture_refused: str | None = None  # why start could not install the DDL capture (None: it can)

    @property
    def major(self) -> int:
        return self.version_num // 10000


@dataclass(frozen=True)
class TargetFacts:
    version_num: int
    max_prepared_transactions: int
    available_extensions: dict[str, list[str]]  # name -> available versions
    roles: list[str]
    existing_tables: list[str]  # selected tables (schema.name) that the target already has
    free_bytes: int | None  # None: cannot be told from here
    bypass_rls: bool = True  # the role we connect as is a superuser or has BYPASSRLS
    privileges: TargetPrivileges = field(default_factory=TargetPrivileges)

    @property
    def major(self) -> int:
        return self.version_num // 10000


@dataclass(frozen=True)
class Finding:
    code: str  # stable, for scripts: wal_level, slots, no_identity, ...
    message: str
    hint: str = ""


@dataclass
class Plan:
    source: SourceFacts
    target: TargetFacts
    selection: Selection
    tools: DumpTools | None
    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    copy_seconds: float = 0.0
    index_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.blockers

    def to_json(self) -> dict[str, Any]:
        s, t = self.source, self.target
        return {
            "ok": self.ok,
            "blockers": [asdict(f) for f in self.blockers],
            "warnings": [asdict(f) for f in self.warnings],
            "selection": self.selection.to_json(),
            "source": {
                "server_version_num": s.version_num,
                "wal_level": s.wal_level,
                "replication_slots": {"max": s.max_replication_slots, "used": s.slots_used},
                "wal_senders": {"max": s.max_wal_senders, "used": s.wal_senders_used},
                "privileges": asdict(s.privileges),
            },
            "target": {
                "server_version_num": t.version_num,
                "max_prepared_transactions": t.max_prepared_transactions,
                "free_bytes": t.free_bytes,
                "privileges": asdict(t.privileges),
            },
            "pg_dump": None
            if self.tools is None
            else {"bindir": str(self.tools.bindir), "major": self.tools.major},
            "schemas": s.schemas,
            "tables": [asdict(tf) for tf in s.tables],
            "indexes": s.indexes,
            "constraints": s.constraints,
            "sequences": s.sequences,
            "large_objects": s.large_objects,
            "extensions": s.extensions,
            "publications": s.publications,
            "materialized_views": s.materialized_views,
            "roles": s.roles,
            "totals": {
                "tables": len(s.tables),
                "heap_bytes": sum(tf.heap_bytes for tf in s.tables),
                "total_bytes": sum(tf.total_bytes for tf in s.tables),
                "index_bytes": sum(tf.index_bytes for tf in s.tables),
                "rows_estimate": sum(tf.rows_estimate or 0 for tf in s.tables),
            },
            "estimate": {
                "copy_seconds": round(self.copy_seconds, 1),
                "index_seconds": round(self.index_seconds, 1),
                "how": f"heap bytes / {COPY_BYTES_PER_SECOND / 1e6:.0f} MB/s and index bytes / "
                f"{INDEX_BYTES_PER_SECOND / 1e6:.0f} MB/s (default jobs, 2 cores); rough constants, not measured "
                "on these servers",
            },
        }


# --- the pure rules ---------------------------------------------------------------------------------------------


def _server_blockers(s: SourceFacts, t: TargetFacts) -> list[Finding]:
    """The servers' settings and state: what no selection changes."""
    out: list[Finding] = []
    if s.wal_level != "logical":
        out.append(Finding("wal_level", f'wal_level on the source is "{s.wal_level}"; a migration needs "logical"',
                           "ALTER SYSTEM SET wal_level = logical; then restart the source"))  # fmt: skip
    if s.read_only:
        out.append(Finding("read_only", "the source database makes every new session read-only "
                           "(default_transaction_read_only = on: a migration's fence, or set on purpose): start "
                           "could not create its publication, and the applications cannot write either",
                           "if it is not on purpose (a finished migration's source stays read-only): ALTER DATABASE "
                           "... RESET default_transaction_read_only"))  # fmt: skip
    free_slots = s.max_replication_slots - s.slots_used
    if free_slots < SLOTS_NEEDED:
        out.append(Finding("replication_slots", f"the source has {free_slots} free replication slot(s) "
                           f"({s.slots_used} of max_replication_slots = {s.max_replication_slots} in use); the "
                           f"migration needs {SLOTS_NEEDED}", "raise max_replication_slots (restart) or drop unused "
                           "slots"))  # fmt: skip
    free_senders = s.max_wal_senders - s.wal_senders_used
    if free_senders < WAL_SENDERS_NEEDED:
        out.append(Finding("wal_senders", f"the source has {free_senders} free WAL sender(s) ({s.wal_senders_used} "
                           f"of max_wal_senders = {s.max_wal_senders} in use); the migration needs "
                           f"{WAL_SENDERS_NEEDED}", "raise max_wal_senders (restart)"))  # fmt: skip
    if t.max_prepared_transactions == 0:
        out.append(Finding("max_prepared_transactions", "max_prepared_transactions is 0 on the target; the migration "
                           "applies the source's prepared transactions as prepared transactions",
                           "ALTER SYSTEM SET max_prepared_transactions = 100 (at least the source's); then restart "
                           "the target"))  # fmt: skip
    return out


def _blockers(
    s: SourceFacts, t: TargetFacts, tools: DumpTools | None, found: Sequence[DumpTools]
) -> list[Finding]:
    out = _server_blockers(s, t)
    if not s.tables:
        out.append(Finding("no_tables", "the selection covers no table on the source",
                           "check --schema, --table and --exclude-table against the source's tables"))  # fmt: skip
    for tf in s.tables:
        if tf.kind == "r" and not tf.identity_usable and tf.updates_deletes > 0:
            out.append(Finding("no_identity", f"table {tf.qualified} has no primary key or usable replica identity "
                               f"and has received {tf.updates_deletes} UPDATE/DELETE(s): its UPDATEs and DELETEs "
                               "cannot be migrated (without an identity they cannot be published, so it would be "
                               "published for INSERT and TRUNCATE only and the target would miss them)",
                               insert_only_ways_out(tf.qualified)))  # fmt: skip
    for name, version in sorted(s.extensions.items()):
        if name == "plpgsql":
            continue
        if name not in t.available_extensions:
            out.append(Finding("extension", f"extension {name} ({version}) is installed on the source but not "
                               "available on the target", f"install the {name} extension's files on the target "
                               "server"))  # fmt: skip
    target_roles = set(t.roles)
    for role in s.roles:
        if role not in target_roles and (t.privileges.superuser or not _owner_or_grant_only(s, role)):
            uses = ", ".join(s.role_uses.get(role, [])) or "owner or grantee"
            out.append(Finding("role", f"role {role} owns or is named by selected objects ({uses}) and does not exist "
                               "on the target", "CREATE ROLE on the target (pg_dumpall --roles-only helps)"))  # fmt: skip
    out += _source_privilege_blockers(s)
    out += _target_privilege_blockers(s, t)
    for name in t.existing_tables:
        out.append(Finding("target_table", f"table {name} already exists on the target", "migrate into an empty "
                           "database, or drop it there, or exclude it with --exclude-table"))  # fmt: skip
    need = sum(tf.total_bytes for tf in s.tables)
    if t.free_bytes is not None and need > t.free_bytes:
        out.append(Finding("disk", f"the selected tables take {human_bytes(need)} on the source, the target's disk has "
                           f"{human_bytes(t.free_bytes)} free", "free disk space on the target"))  # fmt: skip
    if tools is None:
        have = ", ".join(f"{d.bindir} ({d.major})" for d in found) or "none"
        out.append(Finding("pg_dump", f"no pg_dump of major version {s.major} or newer was found (found: {have})",
                           "set APPLIER_PG_BINDIR to the bin directory of a newer PostgreSQL client"))  # fmt: skip
    return out


def _owner_or_grant_only(s: SourceFacts, role: str) -> bool:
    """Whether selected objects name ``role`` only as their owner or in a grant: what a target without superuser
    can do without (:func:`applier.migrate.schema.without_unrestorable`); policies, statistics objects and large
    objects name their roles in statements that are not skipped."""
    return set(s.role_uses.get(role, ["owner"])) <= {"owner", "grant", PUBLIC_DEFAULT_OWNER}


def _source_privilege_blockers(s: SourceFacts) -> list[Finding]:
    p = s.privileges
    if p.superuser:
        return []
    out = []
    if not p.replication:
        fix = f"ALTER ROLE {p.role} REPLICATION;" + (f" (on RDS: GRANT rds_replication TO {p.role};)"
                                                      if p.rds_replication else "")  # fmt: skip
        out.append(Finding("source_replication", f"role {p.role} on the source may not create replication slots "
                           "nor stream (no REPLICATION)", fix))  # fmt: skip
    if not p.create_on_database:
        out.append(Finding("source_create", f"role {p.role} may not create the migration's publication (no CREATE "
                           f"on database {p.database})", f"GRANT CREATE ON DATABASE {p.database} TO {p.role};"))  # fmt: skip
    if p.not_owned:
        out.append(Finding("source_ownership", f"role {p.role} does not own {len(p.not_owned)} selected table(s) "
                           f"({', '.join(p.not_owned[:5])}{', ...' if len(p.not_owned) > 5 else ''}): CREATE "
                           "PUBLICATION ... FOR TABLE needs to own each table", "migrate as the tables' owner (or a "
                           f"member of it), or e.g. ALTER TABLE {p.not_owned[0]} OWNER TO {p.role}; for each"))  # fmt: skip
    for name in p.unreadable:
        out.append(Finding("source_select", f"role {p.role} may not read {name} on the source",
                           f"GRANT SELECT ON {name} TO {p.role};"))  # fmt: skip
    return out


def _target_privilege_blockers(s: SourceFacts, t: TargetFacts) -> list[Finding]:
    p = t.privileges
    if p.superuser:
        return []
    out = []
    if not p.create_on_database:
        out.append(Finding("target_create", f"role {p.role} may not create schemas in database {p.database} on the "
                           "target (schema applier, the migrated schemas)",
                           f"GRANT CREATE ON DATABASE {p.database} TO {p.role};"))  # fmt: skip
    for schema in p.schemas_without_create:
        out.append(Finding("target_schema", f"role {p.role} may not create objects in schema {schema} on the "
                           "target", f"GRANT CREATE ON SCHEMA {schema} TO {p.role};"))  # fmt: skip
    if not p.set_replication_role:
        out.append(Finding("target_replication_role", f"role {p.role} may not set session_replication_role on the "
                           "target (the apply runs as replica)",
                           f"GRANT SET ON PARAMETER session_replication_role TO {p.role};"))  # fmt: skip
    if p.missing_functions:
        out.append(Finding("target_origin_functions", f"role {p.role} may not call {len(p.missing_functions)} of the "
                           "replication-origin functions on the target (progress is kept in an origin)",
                           " ".join(f"GRANT EXECUTE ON FUNCTION {f} TO {p.role};" for f in p.missing_functions)))  # fmt: skip
    ownable = set(p.ownable)
    for role in s.roles:
        kept = set(s.role_uses.get(role, [])) & {"statistics", "large object"}
        if role in t.roles and role not in ownable and kept:
            out.append(Finding("target_owner", f"role {p.role} may not make role {role} the owner of the "
                               f"{' and '.join(sorted(kept))} object(s) it owns on the source (those owners are "
                               "kept)", f"GRANT {role} TO {p.role}; (PostgreSQL 16 and later: WITH SET TRUE)"))  # fmt: skip
    for name in p.untrusted_extensions:
        if name in s.extensions:
            out.append(Finding("target_extension", f"extension {name} is not trusted: only a superuser creates it on "
                               f"the target, and role {p.role} is none", f"have it created on the target before "
                               f"start (CREATE EXTENSION {name}; as a superuser, or as the service allows: RDS "
                               "rds.allowed_extensions, Cloud SQL cloudsql.supported_extensions)"))  # fmt: skip
    return out


def _privilege_warnings(s: SourceFacts, t: TargetFacts, selection: Selection) -> list[Finding]:
    out = []
    p = s.privileges
    if not p.superuser and not p.signal_backend:
        out.append(Finding("source_signal_backend", f"role {p.role} may not end other roles' sessions on the source: "
                           "at the cutover those that could write the migrated tables are kept from them by a lock "
                           "instead, and the cutover refuses (unfenced) if a transaction of theirs holds a table",
                           f"GRANT pg_signal_backend TO {p.role};"))  # fmt: skip
    if not p.superuser and not p.read_all_stats:
        out.append(Finding("source_read_all_stats", f"role {p.role} cannot see whether other roles' sessions on the "
                           "source are inside a transaction: the cutover ends them at once instead of waiting for "
                           "their transaction", f"GRANT pg_read_all_stats TO {p.role};"))  # fmt: skip
    q = t.privileges
    if q.superuser:
        return out
    target_roles, ownable = set(t.roles), set(q.ownable)
    for role in s.roles:
        uses = s.role_uses.get(role, ["owner"])
        if uses == [PUBLIC_DEFAULT_OWNER]:
            continue  # the target's public schema keeps its own owner
        if role not in target_roles and _owner_or_grant_only(s, role):
            out.append(Finding("owner", f"role {role} does not exist on the target: the objects it owns are owned by "
                               f"{q.role} there, and grants to it are skipped", "CREATE ROLE on the target before "
                               "start to keep them"))  # fmt: skip
        elif role in target_roles and role not in ownable and "owner" in uses:
            out.append(Finding("owner", f"role {q.role} may not hand objects to role {role} on the target: the "
                               f"objects {role} owns are owned by {q.role} there", f"GRANT {role} TO {q.role}; "
                               "(PostgreSQL 16 and later: WITH SET TRUE)"))  # fmt: skip
    if s.event_triggers and not (selection.schemas or selection.tables):
        out.append(Finding("event_trigger_skipped", f"event trigger(s) {', '.join(s.event_triggers)} are skipped: "
                           f"only a superuser creates event triggers, and role {q.role} on the target is none"))  # fmt: skip
    return out


def _warnings(s: SourceFacts, t: TargetFacts, selection: Selection) -> list[Finding]:
    out: list[Finding] = []
    for tf in s.tables:
        if tf.persistence == "u":
            out.append(Finding("unlogged", f"table {tf.qualified} is unlogged: it cannot be published, so it is "
                               "not migrated (neither its definition nor its rows)"))  # fmt: skip
        elif tf.kind == "r" and not tf.identity_usable:
            out.append(_insert_only(tf))
        elif tf.kind == "r" and tf.replica_identity == "f" and not tf.has_pk:
            out.append(Finding("identity_full", f"table {tf.qualified} replicates with REPLICA IDENTITY FULL and no "
                               "key: every UPDATE/DELETE scans it on the target"))  # fmt: skip
    for mv in s.materialized_views:
        out.append(Finding("materialized_view", f"materialized view {mv} is not replicated: it is refreshed on the "
                           "target after post-data and again at the cutover (its query runs within the write "
                           "downtime)"))  # fmt: skip
    if s.large_objects:
        out.append(Finding("large_objects", f"{s.large_objects} large object(s): copied at the snapshot, and the "
                           "ones changed since (changes to large objects are not replicated) copied again at the "
                           "cutover, which reads them all on both servers within the write downtime; only when no "
                           "--schema or --table is given, as pg_dump"))  # fmt: skip
    for name, version in sorted(s.extensions.items()):
        avail = t.available_extensions.get(name)
        if avail is not None and version not in avail:
            out.append(Finding("extension_version", f"extension {name} is {version} on the source; the target "
                               f"offers {', '.join(sorted(avail))}: the target's default version is created"))  # fmt: skip
    out += _object_warnings(s, t, selection)
    out += _privilege_warnings(s, t, selection)
    if t.major < s.major:
        out.append(Finding("downgrade", f"the target (PostgreSQL {t.major}) is older than the source ({s.major}): "
                           "the source's schema may use what the target cannot restore"))  # fmt: skip
    if s.ddl_capture_refused:
        out.append(_no_ddl_capture(s.ddl_capture_refused))
    return out


def _no_ddl_capture(why: str) -> Finding:
    """``ddl``: start would follow without the DDL capture (applier.ddl.capture), so schema changes on the source
    are not replayed; what then happens, and the ways out."""
    return Finding("ddl", f"schema changes (DDL) on the source will not be replayed on the target: {why}; start "
                   "follows without them, and the first change that needs DDL the target lacks stops the follow "
                   "with an error naming what to run on the target", "migrate as a superuser (or, on a managed "
                   "service, a member of its admin role: rds_superuser, cloudsqlsuperuser, neon_superuser; "
                   "Supabase: postgres), or run each DDL on the target too, before the writes that need it "
                   "(docs/migrate.md, \"Schema changes while following\")")  # fmt: skip


def insert_only_ways_out(table: str, *, started: bool = False) -> str:
    """The three ways out for a table without a key or usable replica identity, as a hint: each makes all of its
    changes migrate (the first two) or leaves it to the user (the third). Shared by plan's findings and the
    cutover's refusal, so that both name the same fixes; ``started``: the migration exists already (the cutover),
    so the fix takes an ``abort`` and a new ``start``."""
    again = ", then applier migrate abort and start again" if started else ""
    return (
        f"on the source ALTER TABLE {table} REPLICA IDENTITY FULL (or USING INDEX a unique index) or add a primary "
        f"key to {table}{again}; or leave it out with --exclude-table {table} and move it yourself"
    )


def _insert_only(tf: TableFacts) -> Finding:
    """``no_identity_yet``: published for INSERT and TRUNCATE only, so that the source keeps taking every write
    (a publication that carries its UPDATEs would make them fail there); what becomes of a later UPDATE/DELETE."""
    large = (
        f" (at {human_bytes(tf.total_bytes)} it is larger than that now)"
        if tf.total_bytes > RECOPY_MAX_BYTES
        else ""
    )
    return Finding("no_identity_yet", f"table {tf.qualified} has no primary key or usable replica identity and has "
                   "received no UPDATE/DELETE so far: it will be published for INSERT and TRUNCATE only, so the "
                   "source keeps taking every write, but an UPDATE or DELETE on it from now on will not reach the "
                   "target; the cutover then copies it again (under the fence) if it is at most "
                   f"{human_bytes(RECOPY_MAX_BYTES)}, and refuses if it is larger{large}",
                   insert_only_ways_out(tf.qualified))  # fmt: skip


def _object_warnings(s: SourceFacts, t: TargetFacts, selection: Selection) -> list[Finding]:
    """Row-level security and event triggers: both are made late (applier.migrate.objects), and both can get in
    the way of what the migration does on the target."""
    out = []
    if s.row_security and not t.bypass_rls:
        out.append(Finding("row_security", f"row-level security is enabled on {', '.join(s.row_security)}: once it "
                           "is enabled on the target (after the copy), its policies apply to the apply's writes, "
                           "because the target role is not a superuser and has no BYPASSRLS",
                           "migrate as a superuser or a role with BYPASSRLS, as a native subscription's owner "
                           "must"))  # fmt: skip
    if s.event_triggers and (selection.schemas or selection.tables):
        out.append(Finding("event_trigger", f"event trigger(s) {', '.join(s.event_triggers)} are database-wide: "
                           "not migrated with --schema or --table, as pg_dump"))  # fmt: skip
    elif s.event_triggers and t.privileges.superuser:
        out.append(Finding("event_trigger", f"event trigger(s) {', '.join(s.event_triggers)}: created on the target "
                           "at the end of the cutover (they would fire on the migration's own DDL before)"))  # fmt: skip
    return out


def assess(
    source: SourceFacts,
    target: TargetFacts,
    selection: Selection,
    tools: DumpTools | None,
    found: Sequence[DumpTools] = (),
) -> Plan:
    """The plan: blockers, warnings and the rough time estimate."""
    plan = Plan(source, target, selection, tools)
    plan.blockers = _blockers(source, target, tools, found)
    plan.warnings = _warnings(source, target, selection)
    plan.copy_seconds = sum(tf.heap_bytes for tf in source.tables) / COPY_BYTES_PER_SECOND
    plan.index_seconds = sum(tf.index_bytes for tf in source.tables) / INDEX_BYTES_PER_SECOND
    return plan


# --- text output ----------------------------------------------------------------------------------------------


def format_plan(plan: Plan) -> str:
    s, t = plan.source, plan.target
    lines = [
        f"source: PostgreSQL {s.version_num // 10000}, wal_level {s.wal_level}, slots "
        f"{s.slots_used}/{s.max_replication_slots} used, WAL senders {s.wal_senders_used}/{s.max_wal_senders} used",
        f"target: PostgreSQL {t.version_num // 10000}, max_prepared_transactions {t.max_prepared_transactions}, "
        f"free disk {'unknown' if t.free_bytes is None else human_bytes(t.free_bytes)}",
        f"pg_dump: {'none new enough' if plan.tools is None else f'{plan.tools.bindir} ({plan.tools.major})'}",
        f"schemas: {', '.join(s.schemas) or '(none)'}",
        f"tables: {len(s.tables)}",
    ]
    for tf in s.tables:
        rows = "?" if tf.rows_estimate is None else f"~{tf.rows_estimate}"
        key = (
            "pk"
            if tf.has_pk
            else {"f": "identity full", "i": "identity index"}.get(tf.replica_identity, "no key")
        )
        extra = ", unlogged" if tf.persistence == "u" else ", partitioned" if tf.kind == "p" else ""
        lines.append(
            f"  {tf.qualified}: {human_bytes(tf.total_bytes)}, {rows} rows, {tf.indexes} index(es), {key}{extra}"
        )
    c = s.constraints
    lines += [
        f"indexes: {len(s.indexes)} ({human_bytes(sum(i['bytes'] for i in s.indexes))})",
        "constraints: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in c.items()),
        f"sequences: {len(s.sequences)}",
        f"large objects: {s.large_objects}",
        "extensions: " + (", ".join(f"{k} {v}" for k, v in s.extensions.items()) or "(none)"),
        "publications: " + (", ".join(s.publications) or "(none)"),
        "materialized views: " + (", ".join(s.materialized_views) or "(none)"),
        f"estimate: copy ~{plan.copy_seconds:.0f} s, indexes ~{plan.index_seconds:.0f} s (heap bytes / "
        f"{COPY_BYTES_PER_SECOND / 1e6:.0f} MB/s and index bytes / {INDEX_BYTES_PER_SECOND / 1e6:.0f} MB/s; "
        "rough constants)",
    ]
    for w in plan.warnings:
        lines.append(f"WARNING: {w.message}" + (f"\n  HINT: {w.hint}" if w.hint else ""))
    for b in plan.blockers:
        lines.append(f"BLOCKER: {b.message}" + (f"\n  HINT: {b.hint}" if b.hint else ""))
    lines.append(f"{len(plan.blockers)} blocker(s), {len(plan.warnings)} warning(s)")
    return "\n".join(lines)
