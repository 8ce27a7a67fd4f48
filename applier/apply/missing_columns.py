"""What to run on the target when a replicated column is missing there: the statement the error names.

Without the DDL capture (a subscription without ``--ddl``, a migration whose source refused the capture, DDL run by
a function), a column added on the source reaches the target only as a Relation message that names it; the apply
stops there, as the native worker does, and retries with backoff. The error then says what to run, so the operator
need not work the type out: ``ALTER TABLE ... ADD COLUMN`` with the source's type, spelled from the built-in type's
OID and modifier (stable across PostgreSQL versions); a type of the user's own is named by its OID, to be looked up
on the source. Once it has run, the next retry reads the table again and the apply goes on by itself.

Pure: a Relation and a local table in, text out.
"""

from __future__ import annotations

from applier.messages import Relation, RelationColumn

__all__ = ["add_columns_statement", "type_name"]

#: built-in types by OID (pg_type.dat; the same on every version since 10)
_BUILTIN = {
    16: "boolean", 17: "bytea", 18: '"char"', 19: "name", 20: "bigint", 21: "smallint", 23: "integer", 25: "text",
    26: "oid", 114: "json", 142: "xml", 650: "cidr", 700: "real", 701: "double precision", 829: "macaddr",
    869: "inet", 1042: "character", 1043: "character varying", 1082: "date", 1083: "time without time zone",
    1114: "timestamp without time zone", 1184: "timestamp with time zone", 1186: "interval",
    1266: "time with time zone", 1560: "bit", 1562: "bit varying", 1700: "numeric", 2950: "uuid", 3802: "jsonb",
    3614: "tsvector", 774: "macaddr8", 600: "point", 3904: "int4range", 3926: "int8range", 3912: "daterange",
    3910: "tstzrange", 3908: "tsrange", 3906: "numrange",
}  # fmt: skip
#: array types of the common ones
_ARRAYS = {1000: 16, 1001: 17, 1016: 20, 1005: 21, 1007: 23, 1009: 25, 1015: 1043, 1014: 1042, 1182: 1082,
           1115: 1114, 1185: 1184, 1231: 1700, 2951: 2950, 3807: 3802, 199: 114, 1021: 700, 1022: 701}  # fmt: skip


def _modifier(oid: int, typmod: int) -> str:
    if typmod < 0:
        return ""
    if oid in (1042, 1043):
        return f"({typmod - 4})"
    if oid == 1700:
        precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF
        return f"({precision},{scale})"
    if oid in (1560, 1562):
        return f"({typmod})"
    if oid in (1083, 1114, 1184, 1266, 1186):
        return f"({typmod & 0xFFFF})" if oid != 1186 else ""
    return ""


def _spelled(oid: int, typmod: int) -> str:
    """A time type's precision goes after its first word (``timestamp(3) with time zone``: the grammar has no
    ``timestamp with time zone(3)``); any other modifier after the name."""
    name, modifier = _BUILTIN[oid], _modifier(oid, typmod)
    if modifier and oid in (1083, 1114, 1184, 1266):
        first, rest = name.split(" ", 1)
        return f"{first}{modifier} {rest}"
    return name + modifier


def type_name(oid: int, typmod: int) -> str | None:
    """The SQL spelling of a built-in type with its modifier, or None for any other type."""
    if oid in _BUILTIN:
        return _spelled(oid, typmod)
    if oid in _ARRAYS:
        return _spelled(_ARRAYS[oid], typmod) + "[]"
    return None


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def add_columns_statement(schema: str, table: str, remote: Relation, missing: list[str]) -> str:
    """``ALTER TABLE schema.table ADD COLUMN ...`` for the ``missing`` columns of ``remote``."""
    by_name: dict[str, RelationColumn] = {c.name: c for c in remote.columns}
    parts = []
    for name in missing:
        col = by_name[name]
        spelled = type_name(col.type_oid, col.typmod) or f"<the source's type {col.type_oid}>"
        parts.append(f"ADD COLUMN {_ident(name)} {spelled}")
    return f"ALTER TABLE {_ident(schema)}.{_ident(table)} {', '.join(parts)}"
