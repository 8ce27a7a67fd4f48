"""The catalog statements that other modules send themselves, as SQL text next to the schema they touch.

Most catalog access goes through :class:`applier.catalog.store.Catalog` (SQLAlchemy, a connection of its own or
the caller's). These few cannot: the apply pipeline sends its catalog writes down the libpq pipeline, in the same
local transaction as the changes they belong to and without a round trip (a table turning ready, a skip-LSN cleared
in the skipped transaction's commit, a prepared transaction's record); the Spark tasks write their exactly-once
markers on plain psycopg connections of their own; ``applier migrate`` reads and writes the catalog on the psycopg
session that also carries its own ``applier.migration`` rows, inside that session's transactions (the cutover
disables the subscription in the transaction that marks the migration done, the abort in the one that marks it
failed). Keeping the text here means a change to a table or column
(:mod:`applier.catalog.schema`, with a migration) finds every statement that names it in this package.

This module is text only and imports nothing, so the pure apply core may import it (the import-linter layers put it
below the apply core). Placeholders are those of the sender: ``$n`` for the pipeline (bytes, sent as they are),
``%s`` for psycopg's ``execute``.
"""

from __future__ import annotations

# --- the apply pipeline ($n placeholders, bytes) ----------------------------------------------------------------

#: ``clear_subscription_skip_lsn`` in the local transaction being committed, only if the user has not changed the
#: skip-LSN meanwhile (behaviours 99-100): $1 subid, $2 the skip-LSN that was acted on.
CLEAR_SKIP_LSN = (
    b"UPDATE applier.subscription SET subskiplsn = NULL WHERE subid = $1::bigint"
    b" AND subskiplsn = $2::pg_catalog.pg_lsn"
)

#: A table's new sync state in the local transaction that also advances the origin: $1 state letter, $2 LSN or
#: NULL, $3 subid, $4 the table's OID.
SET_TABLE_STATE = (
    b'UPDATE applier.subscription_rel SET srsubstate = $1::"char", srsublsn = $2::pg_catalog.pg_lsn,'
    b" srupdated = now() WHERE subid = $3::bigint AND srrelid = $4::oid::regclass"
)

#: A catch-up's commit moves its ``f`` tables' LSN to the transaction's end, in the same local transaction as the
#: caught-up rows (tablesync.live): $1 end LSN, $2 subid, $3 the tables' OIDs as an array literal.
ADVANCE_FINISHED_COPY = (
    b"UPDATE applier.subscription_rel SET srsublsn = $1::pg_catalog.pg_lsn, srupdated = now()"
    b" WHERE subid = $2::bigint AND srrelid::oid = ANY($3::oid[]) AND srsubstate = 'f'"
)

#: A transaction prepared again after a crash replaces its record.
_RECORD_UPSERT = (
    b" ON CONFLICT (gid) DO UPDATE SET subid = excluded.subid, remote_xid = excluded.remote_xid,"
    b" prepare_lsn = excluded.prepare_lsn, prepare_end_lsn = excluded.prepare_end_lsn,"
    b" prepare_time = excluded.prepare_time, recorded_at = now()"
    # never take over another subscription's record (gid_format=original: two may prepare the same publisher GID)
    b" WHERE prepared_xact.subid = excluded.subid"
)

#: The ``prepared_xact`` record of one transaction about to be prepared (behaviour 65), prepared once per session:
#: $1 gid, $2 subid, $3 remote xid, $4 prepare LSN, $5 prepare end LSN, $6 prepare time (wire µs).
RECORD_PREPARED = (
    b"INSERT INTO applier.prepared_xact (gid, subid, remote_xid, prepare_lsn, prepare_end_lsn,"
    b" prepare_time) SELECT $1::text, $2::bigint, $3::bigint, $4::pg_catalog.pg_lsn, $5::pg_catalog.pg_lsn,"
    b" $6::bigint WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts x WHERE x.gid = $1::text)"
    # (a GID already prepared here is not ours to record: the PREPARE then fails, saying it is in use)
    + _RECORD_UPSERT
)

#: The records of finished prepared transactions of subscription $1 (what ``Catalog.reconcile_prepared`` removes).
#: Queued on the apply pipeline (``applier.apply.target_catalog``), it runs after every statement queued before it,
#: so every PREPARE already sent has run and no record of a transaction about to be prepared looks finished.
RECONCILE_PREPARED = (
    b"DELETE FROM applier.prepared_xact p WHERE p.subid = $1::bigint"
    b" AND NOT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts x WHERE x.gid = p.gid)"
)

#: The records of several transactions in one statement: the same columns as :data:`RECORD_PREPARED`, $2 the
#: subid, the others as arrays (distinct GIDs).
RECORD_PREPARED_MANY = (
    b"INSERT INTO applier.prepared_xact (gid, subid, remote_xid, prepare_lsn, prepare_end_lsn,"
    # (unqualified: the multi-array form exists only as FROM syntax; pg_catalog is searched first anyway)
    b" prepare_time) SELECT g, $2::bigint, x, p, e, t FROM unnest($1::text[],"
    b" $3::bigint[], $4::pg_catalog.pg_lsn[], $5::pg_catalog.pg_lsn[], $6::bigint[]) AS r(g, x, p, e, t)"
    + _RECORD_UPSERT
)

# --- psycopg execute (%s placeholders) ----------------------------------------------------------------------------

#: The recorded prepared transactions of subscription %s that still exist on the target: gid, prepare end LSN
#: (text), prepare time.
PREPARED_TRANSACTIONS = (
    "SELECT p.gid, p.prepare_end_lsn::text, p.prepare_time FROM applier.prepared_xact p"
    " JOIN pg_catalog.pg_prepared_xacts x ON x.gid = p.gid WHERE p.subid = %s"
)

#: A Spark task's exactly-once marker of one partition (subid, relname, snapshot, part): its rows and bytes.
PARTITION_MARKER = (
    "SELECT rows, bytes FROM applier.tablesync_partition"
    " WHERE subid = %s AND relname = %s AND snapshot = %s AND part = %s"
)

#: The copy generation's claim row (part -1), locked so that a newer generation's claim waits for this task.
PARTITION_CLAIM = (
    "SELECT 1 FROM applier.tablesync_partition"
    " WHERE subid = %s AND relname = %s AND snapshot = %s AND part = %s FOR SHARE"
)

#: The marker a partition's rows commit with: subid, relname, snapshot, part, rows, bytes.
INSERT_PARTITION_MARKER = (
    "INSERT INTO applier.tablesync_partition (subid, relname, snapshot, part, rows, bytes)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
)

#: Whether the catalog exists in this database (no parameters).
CATALOG_EXISTS = "SELECT to_regclass('applier.subscription') IS NOT NULL"

#: Every subscription's id (no parameters).
SUBSCRIPTION_IDS = "SELECT subid FROM applier.subscription"

# --- applier migrate (psycopg execute, %s placeholders, the caller's session and transaction) -------------------

#: The subscription named %s: its subid and slot name (no row: it does not exist).
SUBSCRIPTION_ID_AND_SLOT = "SELECT subid, subslotname FROM applier.subscription WHERE subname = %s"

#: How subscription %s (subid) names its prepared transactions: ``subscription`` or ``original``.
SUBSCRIPTION_GID_FORMAT = "SELECT subgidformat FROM applier.subscription WHERE subid = %s"
SUBSCRIPTION_TWO_PHASE_STATE = "SELECT subtwophasestate FROM applier.subscription WHERE subid = %s"

#: Disable subscription %s (subid): a running worker sees it and stops.
DISABLE_SUBSCRIPTION = "UPDATE applier.subscription SET subenabled = false WHERE subid = %s"

#: Delete subscription %s's row (subid; the rows of its tables, prepared transactions,
#: errors and lag go with it: ON DELETE CASCADE). The caller drops the
#: origin, in the same transaction.
DELETE_SUBSCRIPTION = "DELETE FROM applier.subscription WHERE subid = %s"

#: The tables of the subscription named %s, as ``format('%I.%I')`` prints them, in that order.
SUBSCRIPTION_TABLE_NAMES = (
    "SELECT format('%%I.%%I', n.nspname, c.relname) FROM applier.subscription_rel r"
    " JOIN applier.subscription s USING (subid) JOIN pg_class c ON c.oid = r.srrelid"
    " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE s.subname = %s ORDER BY 1"
)

#: The tables of the subscription named %s whose initial copy is finished (state ``f``, ``s`` or ``r``), as
#: ``format('%I.%I')`` prints them.
SUBSCRIPTION_COPIED_TABLE_NAMES = (
    "SELECT format('%%I.%%I', n.nspname, c.relname) FROM applier.subscription_rel r"
    " JOIN applier.subscription s USING (subid) JOIN pg_class c ON c.oid = r.srrelid"
    " JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE s.subname = %s AND r.srsubstate IN ('f', 's', 'r')"
)

#: The tables of the subscription named %s with their sync state letter, rows and bytes copied: name (as
#: ``format('%I.%I')`` prints it), srsubstate, srrows, srbytes, ordered by name.
SUBSCRIPTION_TABLE_PROGRESS = (
    "SELECT format('%%I.%%I', n.nspname, c.relname), r.srsubstate, r.srrows, r.srbytes"
    " FROM applier.subscription_rel r JOIN applier.subscription s USING (subid)"
    " JOIN pg_class c ON c.oid = r.srrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE s.subname = %s ORDER BY 1"
)

#: The total size (``pg_table_size``, int8, 0 when none) of the tables of the subscription named %s.
SUBSCRIPTION_TABLES_SIZE = (
    "SELECT coalesce(sum(pg_table_size(r.srrelid)), 0)::int8 FROM applier.subscription_rel r"
    " JOIN applier.subscription s USING (subid) WHERE s.subname = %s"
)

#: The GIDs of subscription %s's (subid) transactions prepared on the target: its ``prepared_xact`` records whose
#: transaction exists, oldest first.
PREPARED_ON_TARGET = (
    "SELECT x.gid FROM pg_prepared_xacts x JOIN applier.prepared_xact p ON p.gid = x.gid WHERE p.subid = %s"
    " ORDER BY x.prepared, x.gid"
)


#: the conflict log table's rows of a local transaction (applier.apply.conflict_table): the rows as one JSON
#: array ($1), the remote commit time as on the wire ($2: µs since 2000-01-01 UTC)
INSERT_CONFLICT_LOG = (
    b"INSERT INTO applier.conflict_log (subid, relid, schemaname, relname, conflict_type, remote_xid,"
    b" remote_commit_lsn, remote_commit_ts, remote_origin, replica_identity, remote_tuple, local_conflicts)"
    b" SELECT r.subid, r.relid, r.schemaname, r.relname, r.conflict_type, r.remote_xid, r.remote_commit_lsn,"
    b" '2000-01-01 00:00:00+00'::timestamptz + $2::bigint * '1 microsecond'::interval, r.remote_origin,"
    b" r.replica_identity, r.remote_tuple, r.local_conflicts"
    b" FROM pg_catalog.json_populate_recordset(NULL::applier.conflict_log, $1::json) r"
)

#: A table created by a replayed DDL joins the subscription in the apply's local transaction (applier.apply.target_ddl):
#: $1 subid, $2 the table's name as the source printed it, $3 the same (the remote name), $4 its state.
JOIN_CREATED_TABLE = (
    b"INSERT INTO applier.subscription_rel (subid, srrelid, srremotename, srsubstate, srsublsn)"
    b' SELECT $1::bigint, c.oid::regclass, $3, $4::"char", NULL FROM pg_catalog.pg_class c'
    b" WHERE c.oid = pg_catalog.to_regclass($2) ON CONFLICT DO NOTHING RETURNING srrelid::oid"
)
#: A table dropped by a replayed DDL leaves its row pointing at no table: the row goes, in the same transaction
#: (PostgreSQL removes pg_subscription_rel's row with the table, through the dependency). $1 subid.
LEAVE_DROPPED_TABLES = (
    b"DELETE FROM applier.subscription_rel r WHERE r.subid = $1::bigint"
    b" AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = r.srrelid::oid)"
)

#: The functions and operators a replayed ALTER TABLE would run, owned by a role the trust rule does not trust (not
#: the apply role, not a superuser: the trusted set of applier.catalog.trust), as the target resolves their names
#: (with the statement's search_path set): $1 function schemas ('' when unqualified), $2 their names, $3 operator
#: schemas, $4 operator names. Rows: what, owner.
UNTRUSTED_DDL_CODE = (
    b"WITH trusted AS (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolsuper OR r.rolname = current_user),"
    b" named AS (SELECT * FROM unnest($1::text[], $2::text[]) AS q(nsp, name)),"
    b" ops AS (SELECT * FROM unnest($3::text[], $4::text[]) AS q(nsp, name))"
    b" SELECT p.oid::regprocedure::text, pg_catalog.pg_get_userbyid(p.proowner) FROM pg_catalog.pg_proc p"
    b" JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace JOIN named q ON q.name = p.proname"
    b" AND (q.nsp = n.nspname OR (q.nsp = '' AND n.nspname = ANY(pg_catalog.current_schemas(true))))"
    b" WHERE p.proowner NOT IN (SELECT oid FROM trusted)"
    b" UNION ALL SELECT o.oid::regoperator::text, pg_catalog.pg_get_userbyid(p.proowner)"
    b" FROM pg_catalog.pg_operator o JOIN pg_catalog.pg_proc p ON p.oid = o.oprcode"
    b" JOIN pg_catalog.pg_namespace n ON n.oid = o.oprnamespace JOIN ops q ON q.name = o.oprname"
    b" AND (q.nsp = n.nspname OR (q.nsp = '' AND n.nspname = ANY(pg_catalog.current_schemas(true))))"
    b" WHERE p.proowner NOT IN (SELECT oid FROM trusted) OR o.oprowner NOT IN (SELECT oid FROM trusted)"
)

#: The subscription's newest apply error while the worker has not got past it (its remote transaction not applied
#: yet: the origin is before its finish LSN), for ``migrate status``: %(subid)s, %(origin)s the origin's name.
#: Rows: message, occurred_at, retry_count, next_retry_at, finish_lsn.
SUBSCRIPTION_CURRENT_ERROR = (
    "SELECT e.message, e.occurred_at, e.retry_count, e.next_retry_at, e.finish_lsn::text FROM applier.apply_error e"
    " WHERE e.subid = %(subid)s AND e.finish_lsn IS NOT NULL AND e.finish_lsn > coalesce((SELECT"
    " pg_replication_origin_progress(roname, false) FROM pg_replication_origin WHERE roname = %(origin)s), '0/0')"
    " AND e.id = (SELECT max(id) FROM applier.apply_error WHERE subid = %(subid)s)"
)

#: A table a replayed ALTER filled anew (a volatile default, a serial: applier.ddl.statements.fills_rows_anew) is
#: copied again: state ``f`` (at the remote transaction's LSN), in the DDL's local transaction, which the live sync
#: empties and copies at a snapshot of its own (tablesync.live.LiveCopy). $1 subid, $2 the table's name as the
#: source printed it, $3 the LSN.
RECOPY_TABLE = (
    b"UPDATE applier.subscription_rel SET srsubstate = 'f', srsublsn = $3::pg_catalog.pg_lsn, srupdated = now()"
    b" WHERE subid = $1::bigint AND srrelid = pg_catalog.to_regclass($2) RETURNING srrelid::oid"
)
