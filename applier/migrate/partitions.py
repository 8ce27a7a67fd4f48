"""Partitioned tables: their leaves move as tables, their own indexes, keys, foreign keys and triggers are post-data.

How a partitioned table moves:

- **pre-data** (pg_dump) creates the parent, every partition and the ``ATTACH PARTITION … FOR VALUES`` of each, so
  the target's partition bounds are the source's;
- the **leaves** are the migrated tables: published one by one (``publish_via_partition_root`` stays false, so the
  stream names the leaf a row is in, and the target puts it in the same leaf), copied and followed like any table,
  their own indexes and keys built by :mod:`applier.migrate.postdata` as each lands;
- the **parents'** indexes are pg_dump's post-data, made as :func:`steps` here: ``CREATE INDEX … ON ONLY parent``
  (or ``ALTER TABLE ONLY parent ADD CONSTRAINT … PRIMARY KEY/UNIQUE/EXCLUDE``), instant and invalid, then ``ALTER
  INDEX parent_index ATTACH PARTITION leaf_index`` once the leaf's index (and its constraint) is built; the parent's
  index is valid once every partition's is attached. An exclusion constraint on a partitioned table (PostgreSQL 17+,
  with the partition key compared by equality) goes the same way: the leaf's copy of it is postdata's
  ``constraint`` step (its ``ADD CONSTRAINT`` builds the leaf's index), and attaching that index makes the leaf's
  constraint the parent's child, as pg_dump's ``ALTER INDEX … ATTACH PARTITION`` does. A partition's own exclusion
  constraint (not inherited; the only kind before 17) is postdata's too, and stays the partition's. Foreign keys
  from or to a parent come after the keys they need, as one validating ``ADD CONSTRAINT`` (a partitioned table
  takes no ``NOT VALID`` foreign key before PostgreSQL 18); the parents' triggers once their leaves are copied
  (PostgreSQL clones them onto the leaves).

A leaf belongs to the migration when its root partitioned table is selected (``--table``/``--exclude-table`` name
the root; a partition's own name does not matter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate.state import MigrationError
from applier.migrate.steps import Step, StepKind, step_name

__all__ = ["steps"]

# the parents' own (partitioned) indexes, with the primary key, unique or exclusion (PostgreSQL 17+) constraint
# each implements
_INDEXES = """
SELECT i.oid, format('%%I.%%I', n.nspname, i.relname), x.indrelid::regclass::text, pg_get_indexdef(i.oid),
       k.conname, pg_get_constraintdef(k.oid)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_namespace n ON n.oid = i.relnamespace
LEFT JOIN pg_constraint k ON k.conindid = i.oid AND k.conrelid = x.indrelid AND k.contype IN ('p', 'u', 'x')
WHERE x.indrelid = ANY(%s::regclass[]) ORDER BY x.indrelid, i.oid
"""

# the partitions' indexes attached to those
_CHILDREN = """
SELECT h.inhparent, c.oid, format('%%I.%%I', n.nspname, c.relname), x.indrelid::regclass::text, k.conname,
       k.contype
FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_index x ON x.indexrelid = c.oid
LEFT JOIN pg_constraint k ON k.conindid = c.oid AND k.conrelid = x.indrelid AND k.contype IN ('p', 'u', 'x')
WHERE h.inhparent = ANY(%s::oid[]) ORDER BY h.inhparent, c.oid
"""

_LEAVES = """
SELECT p::regclass::text, array_agg(t.relid::regclass::text ORDER BY t.relid)
FROM unnest(%s::regclass[]) p, pg_partition_tree(p) t WHERE t.isleaf GROUP BY 1
"""

# foreign keys from a parent, or from any migrated table to a parent (postdata leaves these out)
_FKS = """
SELECT k.conrelid::regclass::text, k.confrelid::regclass::text, k.conname, pg_get_constraintdef(k.oid)
FROM pg_constraint k
WHERE k.contype = 'f' AND k.conparentid = 0 AND (k.conrelid = ANY(%s::regclass[]) OR
      (k.confrelid = ANY(%s::regclass[]) AND k.conrelid = ANY(%s::regclass[])))
ORDER BY k.conrelid, k.oid
"""

_TRIGGERS = """
SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)
FROM pg_trigger t WHERE t.tgrelid = ANY(%s::regclass[]) AND NOT t.tgisinternal AND t.tgparentid = 0
ORDER BY t.tgrelid, t.oid
"""


def _leaf_step(leaf_steps: set[str], table: str, index: str, conname: str | None, contype: str | None) -> str:
    """The name of the postdata step after which a leaf's index (and its constraint) exists: a key's attach, an
    exclusion constraint's own ``ADD CONSTRAINT`` (it builds the index), or the index's build."""
    name = step_name(StepKind.INDEX, index)
    if conname:
        kind = StepKind.CONSTRAINT if contype == "x" else StepKind.ATTACH
        name = step_name(kind, f"{table}.{conname}")
    if name not in leaf_steps:
        raise MigrationError(f"post-data: no step builds {index} of partition {table} (expected {name!r})")
    return name


def steps(src: psycopg.Connection[Any], parents: Sequence[str], tables: Sequence[str], leaf_steps: Sequence[Step],
          first: int) -> list[Step]:  # fmt: skip
    """The post-data steps of the partitioned ``parents`` (quoted), given the migrated ``tables`` (the leaves among
    them) and postdata's steps for those; foreign keys to a parent included (postdata leaves them out). ``src`` is
    inside the snapshot with an empty ``search_path``; ``first``: the first step's ``ord``."""
    if not parents:
        return []
    known = {s.step for s in leaf_steps}
    leaves = {p: list(ls) for p, ls in src.execute(_LEAVES, (list(parents),))}
    keys: dict[str, list[str]] = {}  # table -> the steps after which its keys are complete
    for s in leaf_steps:
        if s.kind == StepKind.ATTACH:
            keys.setdefault(s.relnames[0], []).append(s.step)
    out: list[Step] = []

    def add(
        kind: StepKind, subject: str, relnames: Sequence[str], after: Sequence[str], statement: str
    ) -> str:
        out.append(Step.of(kind, subject, tuple(relnames), tuple(after), (statement,), first + len(out)))
        return out[-1].step

    own: dict[
        int, tuple[str, str, str]
    ] = {}  # partitioned index oid -> (its step, its table, its quoted name)
    for oid, index, table, indexdef, conname, condef in src.execute(_INDEXES, (list(parents),)):
        if conname:
            alter = sql.SQL("ALTER TABLE ONLY {} ADD CONSTRAINT {} ").format(
                sql.SQL(table), sql.Identifier(conname)
            )
            kind, subject, statement = (
                StepKind.PARTITIONED_CONSTRAINT,
                f"{table}.{conname}",
                alter.as_string(src) + condef,
            )
        else:
            kind, subject, statement = StepKind.PARTITIONED_INDEX, index, indexdef
        name = add(kind, subject, leaves.get(table, ()), (), statement)
        own[oid] = (name, table, index)
        keys.setdefault(table, []).append(name)
    for parent_oid, child_oid, child, child_table, con, contype in src.execute(_CHILDREN, (list(own),)):
        parent_step, parent_table, index = own[parent_oid]
        child_step = (
            own[child_oid][0] if child_oid in own else _leaf_step(known, child_table, child, con, contype)
        )
        name = add(StepKind.ATTACH_PARTITION, child, leaves.get(parent_table, ()), (parent_step, child_step),
                   f"ALTER INDEX {index} ATTACH PARTITION {child}")  # fmt: skip
        keys.setdefault(parent_table, []).append(name)
    fks = src.execute(_FKS, (list(parents), list(parents), [*tables, *parents])).fetchall()
    for table, reftable, conname, condef in fks:
        if reftable not in leaves and reftable not in tables:
            continue  # to a table not migrated: left out, as postdata does
        add_fk = sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} ").format(sql.SQL(table), sql.Identifier(conname))
        add(StepKind.PARTITIONED_FK, f"{table}.{conname}", [*leaves.get(table, [table]), *leaves.get(reftable, [reftable])],
            keys.get(reftable, ()), add_fk.as_string(src) + condef)  # fmt: skip
    for table, tgname, tgdef in src.execute(_TRIGGERS, (list(parents),)):
        add(StepKind.PARTITIONED_TRIGGER, f"{table}.{tgname}", leaves.get(table, ()), (), tgdef)
    return out
