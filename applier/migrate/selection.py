"""Which tables a migration covers: ``--schema S``, ``--table PAT`` and ``--exclude-table PAT``, as pg_dump's
``-n``/``-t``/``-T`` read them (shell wildcards ``*`` and ``?``; a pattern with a dot names ``schema.table``, one
without matches the table name in any selected schema).

Pure: the catalog queries hand every candidate ``(schema, table)`` to :meth:`Selection.covers`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SYSTEM_SCHEMAS", "Selection"]

#: Never migrated: PostgreSQL's own schemas, and our catalog (the target's ``applier`` schema is ours).
SYSTEM_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast", "applier"})


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
