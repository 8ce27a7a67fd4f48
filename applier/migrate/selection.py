"""Which tables a migration covers: ``--schema S``, ``--table PAT`` and ``--exclude-table PAT``, as pg_dump's
``-n``/``-t``/``-T`` read them (shell wildcards ``*`` and ``?``; a pattern with a dot names ``schema.table``, one
without matches the table name in any selected schema).

Pure: the catalog queries hand every candidate ``(schema, table)`` to :meth:`Selection.covers`. Which of the
source's tables a migration covers is :func:`select_tables`' answer alone, for ``plan`` and ``start`` both (issue
27: plan matched each table's own name while start followed a partition to its root, so they could disagree); the
query that feeds it is :func:`applier.migrate.survey.source_tables`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["SYSTEM_SCHEMAS", "Selection", "SourceTables", "TableRow", "select_tables"]

#: Never migrated: PostgreSQL's own schemas, our catalog (the target's ``applier`` schema is ours) and the DDL
#: capture's schema on a source (:data:`applier.ddl.capture_sql.SCHEMA`: never dumped nor followed).
SYSTEM_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast", "applier", "applier_capture"})


def _system(schema: str) -> bool:
    return schema in SYSTEM_SCHEMAS or schema.startswith(("pg_temp_", "pg_toast_temp_"))


def _match(pattern: str, schema: str, table: str) -> bool:
    """Case-sensitive, as identifiers are after quoting; ``schema.table`` or ``table``."""
    if "." in pattern:
        spat, tpat = pattern.split(".", 1)
        return fnmatch.fnmatchcase(schema, spat) and fnmatch.fnmatchcase(table, tpat)
    return fnmatch.fnmatchcase(table, pattern)


@dataclass(frozen=True)
class Selection:
    """Empty ``schemas``/``tables`` mean every user schema / every table in them."""

    schemas: tuple[str, ...] = ()
    tables: tuple[str, ...] = ()
    exclude_tables: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, schemas: Sequence[str] | None, tables: Sequence[str] | None, exclude: Sequence[str] | None
    ) -> Selection:
        return cls(tuple(schemas or ()), tuple(tables or ()), tuple(exclude or ()))

    def covers_schema(self, schema: str) -> bool:
        if _system(schema):
            return False
        return not self.schemas or any(fnmatch.fnmatchcase(schema, s) for s in self.schemas)

    def covers(self, schema: str, table: str) -> bool:
        """Whether table ``schema.table`` is migrated: its schema selected, a ``--table`` pattern (if any) matches
        it and no ``--exclude-table`` pattern does."""
        if not self.covers_schema(schema):
            return False
        if self.tables and not any(_match(p, schema, table) for p in self.tables):
            return False
        return not any(_match(p, schema, table) for p in self.exclude_tables)

    def to_json(self) -> dict[str, list[str]]:
        return {
            "schemas": list(self.schemas),
            "tables": list(self.tables),
            "exclude_tables": list(self.exclude_tables),
        }


#: A source table as :func:`select_tables` reads it: schema, name, relkind, relpersistence, and the schema and name
#: of its partition tree's root (itself when it is not a partition).
TableRow = tuple[str, str, str, str, str, str]


@dataclass(frozen=True)
class SourceTables:
    """What a selection covers on the source."""

    tables: list[tuple[str, str]]  # (schema, table) migrated: copied and followed
    schemas: list[str]  # schemas dumped
    exclude: list[tuple[str, str]]  # tables of those schemas that are not migrated (left out of the dump)
    skipped: list[str]  # notes
    #: migrated partitioned tables: dumped, never copied (their leaves are in ``tables``)
    partitioned: list[tuple[str, str]] = field(default_factory=list)
    #: covered but unlogged: they cannot be published, so they are not migrated (in ``exclude`` too)
    unlogged: list[tuple[str, str]] = field(default_factory=list)

    @property
    def covered(self) -> set[tuple[str, str]]:
        """Every table the selection covers, migrated or not (what ``plan`` describes and checks)."""
        return {*self.tables, *self.partitioned, *self.unlogged}


def select_tables(selection: Selection, schemas: Iterable[str], rows: Iterable[TableRow]) -> SourceTables:
    """What ``selection`` covers among the source's ``schemas`` and tables (``rows``). A partition goes with its
    partition tree's root: selected or excluded by the root's name, never by its own (docs/migrate.md,
    "Partitioned tables"). Unlogged tables cannot be published, so they are left out (with a note); partitioned
    tables are dumped but hold no rows: their leaves are the migrated tables (:mod:`applier.migrate.partitions`)."""
    out = SourceTables([], [s for s in schemas if selection.covers_schema(s)], [], [])
    for nsp, rel, kind, persistence, root_nsp, root in rows:
        if not selection.covers_schema(nsp):
            continue
        if not selection.covers(root_nsp, root):
            out.exclude.append((nsp, rel))
        elif persistence == "u":
            out.exclude.append((nsp, rel))
            out.unlogged.append((nsp, rel))
            out.skipped.append(f"{nsp}.{rel} is unlogged (it cannot be published): not migrated")
        elif kind == "p":
            out.partitioned.append((nsp, rel))
        else:
            out.tables.append((nsp, rel))
    return out
