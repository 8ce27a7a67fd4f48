"""The catalog statements that other modules send themselves, as SQL text next to the schema they touch.

Most catalog access goes through :class:`applier.catalog.store.Catalog` (SQLAlchemy, a connection of its own or
the caller's). These few cannot: the apply pipeline sends its catalog writes down the libpq pipeline, in the same
local transaction as the changes they belong to and without a round trip (a table turning ready, a skip-LSN cleared
in the skipped transaction's commit, a prepared transaction's record); the Spark tasks write their exactly-once
markers on plain psycopg connections of their own. Keeping the text here means a change to a table or column
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
