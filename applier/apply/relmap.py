"""Mapping of the publisher's relations (Relation messages) onto local tables, by name (behaviours 17, 41-45).

Pure code: :class:`LocalTable` is what the target adapter reads from the target's catalogs, :class:`Relation` is
what the publisher sent; :func:`map_relation` combines the two into a :class:`RelMapEntry` or raises the error the
native worker raises (``logicalrep_rel_open`` / ``logicalrep_rel_mark_updatable``), with the same wording, so that
users and tests that know PostgreSQL's messages recognise them.

Columns are matched by name. Local columns the publisher does not send take their DEFAULT on INSERT and keep their
value on UPDATE; a published column missing locally is an error naming the table and the column(s). Values are
converted by the *local* column's type (we pass the local type OIDs as statement parameter types).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from applier.apply.missing_columns import add_columns_statement
from applier.errors import ApplierError
from applier.messages import Relation


class RelationMappingError(ApplierError):
    """The local table cannot receive the publisher's changes (missing table or column, no usable key)."""


@dataclass(frozen=True, slots=True)
class LocalColumn:
    name: str
    type_oid: int
    generated: str = ""  # pg_attribute.attgenerated: '' | 's' (stored) | 'v' (virtual, PG18)
    #: the type's array type with ',' as delimiter, 0 when none or when the type is composite (applier.apply.bulk
    #: passes values as arrays; see ``_LOCAL_TABLES`` in applier.apply.target)
    array_type: int = 0
    #: pg_attribute.attidentity: '' | 'a' (GENERATED ALWAYS AS IDENTITY) | 'd' (BY DEFAULT)
    identity: str = ""


@dataclass(frozen=True, slots=True)
class LocalTable:
    """The target table as the target's catalogs describe it."""

    oid: int
    schema: str
    name: str
    relkind: str  # 'r' table, 'p' partitioned table
    columns: tuple[LocalColumn, ...]
    #: columns of the REPLICA IDENTITY index, else of the primary key; None when there is neither
    key: tuple[str, ...] | None
    #: whole transactions may be applied to it a batch at a time (applier.apply.bulk): a plain table with no
    #: trigger or rule enabled REPLICA or ALWAYS and no column with a nondeterministic collation
    bulk: bool = False
    #: (schema, name) of every domain its columns' types hold (through arrays, ranges and composites): the guard
    #: statement of the trust check depends on them (applier.apply.target_trust, applier.catalog.trust)
    domains: tuple[tuple[str, str], ...] = ()

    @property
    def display(self) -> str:
        """``schema.name`` as PostgreSQL prints it in these errors (unquoted)."""
        return f"{self.schema}.{self.name}"


def remote_schema(rel: Relation) -> str:
    """pgoutput sends an empty namespace for ``pg_catalog`` (behaviour 17)."""
    return rel.namespace or "pg_catalog"


def missing_table_error(rel: Relation) -> RelationMappingError:
    return RelationMappingError(
        f'logical replication target relation "{remote_schema(rel)}.{rel.relname}" does not exist'
    )


@dataclass(eq=False)
class RelMapEntry:
    """One publisher relation mapped onto one local table, plus the per-relation statement cache.

    ``types`` are the local type OIDs in the publisher's column order (the order of TupleData), so the values of a
    change can be passed as statement parameters unchanged.
    """

    remote: Relation
    local: LocalTable
    names: tuple[str, ...]  # local column names, in remote order
    types: tuple[int, ...]  # local type OIDs, in remote order
    #: remote column positions of the local key (RI index / PK); None means "match the whole row" (FULL)
    key_positions: tuple[int, ...] | None
    #: why UPDATE/DELETE cannot be applied, or None when they can (checked only when one arrives, behaviour 44)
    not_updatable: str | None
    #: the local columns' array types in remote order, 0 where there is none (applier.apply.bulk passes values
    #: as arrays)
    array_types: tuple[int, ...] = ()
    #: its Inserts / Updates and Deletes may be applied a stretch at a time (applier.apply.bulk): ``LocalTable.bulk``
    #: and an array type for every published column (and, for updates and deletes, a key)
    bulk_insert: bool = False
    bulk_update: bool = False
    #: remote positions of the columns that are GENERATED ALWAYS AS IDENTITY locally: an INSERT of the publisher's
    #: values needs ``OVERRIDING SYSTEM VALUE`` and an UPDATE may assign them only while they are BY DEFAULT (the
    #: native worker writes through the executor and never meets either check)
    always_identity: tuple[int, ...] = ()
    statements: dict[Any, bytes] = field(default_factory=dict)

    @property
    def display(self) -> str:
        return self.local.display

    @property
    def relkind(self) -> str:
        return self.local.relkind


def map_relation(remote: Relation, local: LocalTable) -> RelMapEntry:
    """Map ``remote`` onto ``local`` or raise :class:`RelationMappingError` (behaviours 42 and 44)."""
    by_name = _check_mappable(remote, local)
    names = tuple(c.name for c in remote.columns)
    types = tuple(by_name[n].type_oid for n in names)
    key_positions, not_updatable = _replica_identity(remote, local, names)
    array_types = tuple(by_name[n].array_type for n in names)
    bulk_insert = local.bulk and bool(names) and all(array_types)
    always_identity = tuple(i for i, n in enumerate(names) if by_name[n].identity == "a")
    # a bulk UPDATE assigns every column but the key: an ALWAYS identity column outside the key could not be
    key_set = set(key_positions or ()) if not_updatable is None else set()
    identity_outside_key = any(i not in key_set for i in always_identity)
    bulk_update = (
        bulk_insert and not_updatable is None and key_positions is not None and not identity_outside_key
    )
    return RelMapEntry(
        remote=remote,
        local=local,
        names=names,
        types=types,
        key_positions=key_positions if not_updatable is None else None,
        not_updatable=not_updatable,
        array_types=array_types,
        bulk_insert=bulk_insert,
        bulk_update=bulk_update,
        always_identity=always_identity,
    )


def _check_mappable(remote: Relation, local: LocalTable) -> dict[str, LocalColumn]:
    """The local columns by name, once ``local`` is a table that can take ``remote``'s columns (behaviour 42)."""
    if local.relkind not in ("r", "p"):
        raise RelationMappingError(
            f'cannot use relation "{local.display}" as logical replication target: '
            f"it is not a table or partitioned table"
        )
    by_name = {c.name: c for c in local.columns}
    missing = [c.name for c in remote.columns if c.name not in by_name]
    if missing:
        listed = ", ".join(f'"{n}"' for n in missing)
        noun = "column" if len(missing) == 1 else "columns"
        raise RelationMappingError(
            f'logical replication target relation "{local.display}" is missing replicated {noun}: {listed}'
            f"; the apply goes on by itself once {'it is' if len(missing) == 1 else 'they are'} added on the"
            " target as on the source (with its DEFAULT, if it has one: the rows already there take it):"
            f" {add_columns_statement(local.schema, local.name, remote, missing)}"
        )
    generated = [c.name for c in remote.columns if by_name[c.name].generated]
    if generated:
        listed = ", ".join(f'"{n}"' for n in generated)
        noun = "column" if len(generated) == 1 else "columns"
        raise RelationMappingError(
            f'logical replication target relation "{local.display}" has incompatible generated {noun}: {listed}'
        )
    return by_name


def _replica_identity(
    remote: Relation, local: LocalTable, names: tuple[str, ...]
) -> tuple[tuple[int, ...] | None, str | None]:
    """``(key positions in the remote tuple, None)``, or ``(…, why UPDATE/DELETE cannot be applied)``
    (``check_relation_updatable``, behaviour 44)."""
    if local.key is None:
        if remote.replident != "f":
            return None, (
                f'logical replication target relation "{local.display}" has neither REPLICA IDENTITY index nor '
                f"PRIMARY KEY and published relation does not have REPLICA IDENTITY FULL"
            )
        return None, None
    position = {n: i for i, n in enumerate(names)}
    positions = []
    for k in local.key:
        i = position.get(k)
        if i is None or not remote.columns[i].is_key:
            return tuple(positions), (
                f"publisher did not send replica identity column expected by the logical replication "
                f'target relation "{local.display}"'
            )
        positions.append(i)
    return tuple(positions), None


class RelationMap:
    """``LogicalRepRelMap``: the publisher's relations as their Relation messages described them, and their
    mapped local tables (:class:`RelMapEntry`, resolved by name at first use and dropped when the relation is
    described again)."""

    __slots__ = ("relations", "entries")

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.entries: dict[int, RelMapEntry] = {}

    def describe(self, rel: Relation) -> None:
        """``logicalrep_relmap_update``: a Relation message replaces the description and drops the mapping."""
        self.relations[rel.relid] = rel
        self.entries.pop(rel.relid, None)

    def name(self, relid: int) -> str:
        """The publisher's "schema.table" of a described relation."""
        rel = self.relations[relid]
        return f"{remote_schema(rel)}.{rel.relname}"

    def open(self, relid: int, load: Callable[[str, str], LocalTable | None]) -> RelMapEntry:
        """Map a described relation onto the local table ``load(schema, name)`` finds (raises
        :class:`RelationMappingError`, a missing table included), and remember the mapping."""
        rel = self.relations[relid]
        local = load(remote_schema(rel), rel.relname)
        if local is None:
            raise missing_table_error(rel)
        entry = self.entries[relid] = map_relation(rel, local)
        return entry

    def forget_local(self) -> None:
        """A replayed DDL changed local tables: every mapping is made again at its next use (the descriptions
        stay: pgoutput sends a Relation again only for a table changed on the publisher)."""
        self.entries.clear()

    def reset(self) -> None:
        self.relations.clear()
        self.entries.clear()
