"""Reading the facts the planner needs from the publisher (inside the copy's snapshot) and from the target.

Kept apart from :mod:`tablesync.planner` so that the rules stay pure; every query here is a catalog read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from tablesync.planner import DEFAULT_BLOCK_SIZE, ColumnType, PlanError, PublishedRow, RemoteTable


class _TypeFacts:
    """Resolves a type OID to a :class:`ColumnType` on one server, caching per connection.

    The OIDs that a binary value carries are collected recursively: an array carries its element type's OID
    (``array_send`` writes ``ARR_ELEMTYPE``, a domain's own OID for arrays of domains), a composite carries each
    field's type OID, and either may nest further. Domains are transparent (``domain_recv`` reads the base type).
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._rows: dict[int, tuple[str, int, int, int, int, str, bool]] = {}
        self._fields: dict[int, list[int]] = {}

    def _row(self, oid: int) -> tuple[str, int, int, int, int, str, bool]:
        if oid not in self._rows:
            row = self.conn.execute(
                "SELECT typtype::text, typbasetype::int8, typelem::int8, typlen::int4, typrelid::int8,"
                " format_type(oid, NULL), typsend <> 0 AND typreceive <> 0 FROM pg_type WHERE oid = %s",
                (oid,),
            ).fetchone()
            if row is None:
                raise PlanError(f"type {oid} does not exist")
            self._rows[oid] = row  # type: ignore[assignment]
        return self._rows[oid]

    def _field_types(self, relid: int) -> list[int]:
        if relid not in self._fields:
            self._fields[relid] = [
                r[0]
                for r in self.conn.execute(
                    "SELECT atttypid::int8 FROM pg_attribute WHERE attrelid = %s AND attnum > 0"
                    " AND NOT attisdropped ORDER BY attnum",
                    (relid,),
                ).fetchall()
            ]
        return self._fields[relid]

    def embedded(self, oid: int, depth: int = 0) -> tuple[int, ...]:
        if depth > 20:
            return ()
        typtype, base, elem, typlen, typrelid, _name, _io = self._row(oid)
        if typtype == "d":
            return self.embedded(base, depth + 1)
        if elem and typlen == -1:
            return (elem, *self.embedded(elem, depth + 1))
        if typtype == "c" and typrelid:
            out: list[int] = []
            for f in self._field_types(typrelid):
                out.append(f)
                out.extend(self.embedded(f, depth + 1))
            return tuple(out)
        return ()

    def binary_io(self, oid: int) -> bool:
        """The type has binary send/receive functions, and so has every type its values are made of (a domain's
        base type, an array's element type, a composite's field types: their send/recv call those)."""
        typtype, base, _elem, _typlen, typrelid, _name, io = self._row(oid)
        if not io:
            return False
        if typtype == "d":
            return self.binary_io(base)
        return all(self._row(t)[6] for t in self.embedded(oid))

    def column_type(self, oid: int) -> ColumnType:
        name = self._row(oid)[5]
        emb = self.embedded(oid)
        return ColumnType(
            name=name, oid=oid, embeds_oid=bool(emb), embedded_oids=emb, binary_io=self.binary_io(oid)
        )


def resolve_relation(conn: psycopg.Connection[Any], name: str) -> tuple[int, str, str, str] | None:
    """(oid, schema, table, relkind) of a schema-qualified name, quoted as ``regclass`` prints it or plain."""
    row = conn.execute(
        "SELECT c.oid::int8, n.nspname::text, c.relname::text, c.relkind::text FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
        (name,),
    ).fetchone()
    if row is None and "." in name:  # an unquoted mixed-case name, stored as is
        schema, table = name.split(".", 1)
        row = conn.execute(
            "SELECT c.oid::int8, n.nspname::text, c.relname::text, c.relkind::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        ).fetchone()
    return row  # type: ignore[return-value]


#: ``server_version_num`` from which a publication can publish stored generated columns (PostgreSQL 18).
PUBLISHED_GENERATED_COLUMNS = 180000


def relation_columns(conn: psycopg.Connection[Any], relid: int) -> list[tuple[str, int, bool]]:
    """(name, type OID, generated) of every live column, in attnum order."""
    return [
        (r[0], r[1], r[2])
        for r in conn.execute(
            "SELECT attname::text, atttypid::int8, attgenerated <> '' FROM pg_attribute"
            " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (relid,),
        ).fetchall()
    ]


def fetch_remote_table(
    conn: psycopg.Connection[Any], remote_name: str, publications: Sequence[str]
) -> RemoteTable:
    """Read one published table's columns, types, publication rows and size on the publisher.

    Run inside the transaction that imported the copy's snapshot, so what we read is what the copy will see.
    """
    rel = resolve_relation(conn, remote_name)
    if rel is None:
        raise PlanError(f'table "{remote_name}" does not exist on the publisher')
    oid, schema, table, relkind = rel
    facts = _TypeFacts(conn)
    # As PostgreSQL 18's fetch_remote_table_info: up to 17 a generated column is never published (its attribute
    # query has "AND a.attgenerated = ''"); from 18 every column may be, and the publication decides through its
    # column list below, pg_get_publication_tables' attrs (pg_publication_tables.attnames): a stored generated
    # column is in it when the publication's column list names it, or, without a list, when the publication has
    # publish_generated_columns = stored (pg_publication.pubgencols = 's'); a virtual one never is.
    gencols = conn.info.server_version >= PUBLISHED_GENERATED_COLUMNS
    cols = [(n, t) for n, t, generated in relation_columns(conn, oid) if gencols or not generated]
    if conn.info.server_version >= 150000:
        rows = conn.execute(
            "SELECT pubname::text, attnames::text[], rowfilter FROM pg_publication_tables"
            " WHERE pubname = ANY(%s) AND schemaname = %s AND tablename = %s ORDER BY pubname",
            (list(publications), schema, table),
        ).fetchall()
    else:  # no column lists or row filters before 15
        rows = conn.execute(
            "SELECT pubname::text, NULL::text[], NULL::text FROM pg_publication_tables"
            " WHERE pubname = ANY(%s) AND schemaname = %s AND tablename = %s ORDER BY pubname",
            (list(publications), schema, table),
        ).fetchall()
    published = tuple(PublishedRow(r[0], None if r[1] is None else tuple(r[1]), r[2]) for r in rows)
    if relkind == "p":
        size_sql = (
            "SELECT coalesce(sum(pg_relation_size(relid)), 0)::int8 / current_setting('block_size')::int8,"
            " current_setting('block_size')::int8 FROM pg_partition_tree(%s::oid::regclass) WHERE isleaf"
        )
    else:
        # relpages is only as fresh as the last VACUUM/ANALYZE (0 for a table just loaded); the file size is exact.
        size_sql = (
            "SELECT greatest(c.relpages::int8, pg_relation_size(c.oid) / current_setting('block_size')::int8),"
            " current_setting('block_size')::int8 FROM pg_class c WHERE c.oid = %s"
        )
    pages, block = conn.execute(size_sql, (oid,)).fetchone()  # type: ignore[misc]
    return RemoteTable(
        schema=schema,
        name=table,
        relkind=relkind,
        columns=tuple(n for n, _ in cols),
        types={n: facts.column_type(t) for n, t in cols},
        published=published,
        pages=int(pages),
        block_size=int(block or DEFAULT_BLOCK_SIZE),
    )


def fetch_target_table(
    conn: psycopg.Connection[Any], relid: int, columns: Sequence[str]
) -> tuple[str, str, dict[str, ColumnType]]:
    """(schema, table, types of ``columns``) of the target table.

    ``columns`` (the publisher's, in its order) must all exist on the target and none may be generated there: the
    checks and words of PostgreSQL 18's ``logicalrep_rel_open`` (``logicalrep_report_missing_or_gen_attrs``), which
    its ``copy_table`` meets before the COPY, as the apply path does (:func:`applier.apply.relmap.map_relation`).
    A published generated column thus lands in an ordinary column of the target, as natively."""
    row = conn.execute(
        "SELECT n.nspname::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = %s",
        (relid,),
    ).fetchone()
    if row is None:
        raise PlanError(f"target table with OID {relid} does not exist any more")
    schema, table = row
    facts = _TypeFacts(conn)
    live = {n: (t, g) for n, t, g in relation_columns(conn, relid)}
    missing = [c for c in columns if c not in live]
    if missing:
        raise PlanError(_columns_error(schema, table, "is missing replicated", missing))
    generated = [c for c in columns if live[c][1]]
    if generated:
        raise PlanError(_columns_error(schema, table, "has incompatible generated", generated))
    return schema, table, {c: facts.column_type(live[c][0]) for c in columns}


def _columns_error(schema: str, table: str, what: str, columns: Sequence[str]) -> str:
    """``logical replication target relation "s.t" <what> column(s): "a", "b"`` (PostgreSQL's ``errmsg_plural``)."""
    noun = "column" if len(columns) == 1 else "columns"
    listed = ", ".join(f'"{c}"' for c in columns)
    return f'logical replication target relation "{schema}.{table}" {what} {noun}: {listed}'
