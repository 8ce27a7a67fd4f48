"""A post-data step of a migration: what it runs, which tables' copy it waits for, which steps it follows.

Its own module, with no I/O, so that the store (:mod:`applier.migrate.store`), the modules that make steps
(:mod:`applier.migrate.postdata` and its neighbours) and the scheduler share one definition without importing each
other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Step"]


@dataclass(frozen=True)
class Step:
    step: str  # unique within the migration, e.g. "index public.a_v_idx"
    kind: str
    relnames: tuple[str, ...]  # tables (quoted, qualified) whose copy must be finished
    after: tuple[str, ...]  # steps that must be done first
    statements: tuple[str, ...]
    ord: int = 0
    done: bool = False
