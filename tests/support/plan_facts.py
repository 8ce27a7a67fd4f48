"""Hand-made facts for :func:`applier.migrate.plan.assess`, for the unit tests of the plan's rules without a server
(``tests/unit/test_migrate_units.py``, ``tests/unit/test_migrate_publications.py``): a clean source, target and
table, each changed by keyword where a test wants one fact different."""

from __future__ import annotations

from pathlib import Path

from applier.migrate.plan import SourceFacts, TableFacts, TargetFacts
from applier.migrate.tools import DumpTools

#: pg_dump of PostgreSQL 18, new enough for every source of the facts below
PG18 = DumpTools(Path("/pg18/bin"), 18)


def table(name: str = "t", **kw: object) -> TableFacts:
    """A table with a primary key, some updates and deletes, and sizes a copy takes seconds for."""
    base = dict(schema="public", name=name, kind="r", persistence="p", heap_bytes=80_000_000, total_bytes=100_000_000,
                index_bytes=20_000_000, rows_estimate=1000, has_pk=True, replica_identity="d", identity_usable=True,
                updates_deletes=5, indexes=1, owner="postgres")  # fmt: skip
    base.update(kw)
    return TableFacts(**base)  # type: ignore[arg-type]


def source(**kw: object) -> SourceFacts:
    """A PostgreSQL 18 source ready for a migration: logical WAL, free slots and senders, one :func:`table`."""
    base = dict(version_num=180001, wal_level="logical", max_replication_slots=10, slots_used=1, max_wal_senders=10,
                wal_senders_used=1, schemas=["public"], tables=[table()], indexes=[], constraints={}, sequences=[],
                large_objects=0, extensions={"plpgsql": "1.0"}, publications=[], materialized_views=[],
                roles=["postgres"])  # fmt: skip
    base.update(kw)
    return SourceFacts(**base)  # type: ignore[arg-type]


def target(**kw: object) -> TargetFacts:
    """A PostgreSQL 18 target ready for a migration: prepared transactions allowed, no table in the way."""
    base = dict(version_num=180001, max_prepared_transactions=10, available_extensions={"plpgsql": ["1.0"]},
                roles=["postgres"], existing_tables=[], free_bytes=None)  # fmt: skip
    base.update(kw)
    return TargetFacts(**base)  # type: ignore[arg-type]
