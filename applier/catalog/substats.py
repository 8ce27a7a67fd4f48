"""The subscription's counters as PostgreSQL 18's ``pg_stat_subscription_stats`` names them
(``applier.subscription_stats``, since catalog version 12): ``apply_error_count``, ``sync_error_count``, the
``confl_*`` conflicts and ``stats_reset``. A part of :class:`applier.catalog.store.Catalog`, kept apart for its size.

Each count is one short statement in a transaction of its own on the catalog's connection, made only when an error
or a conflict happens: a transaction without either sends nothing more, and a count made while the apply
transaction is open survives its rollback (PostgreSQL counts every attempt, and so do we).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from applier.catalog.schema import STATS_COLUMNS, subscription_stats

#: PostgreSQL 18's conflict kinds, as the ``confl_*`` columns name them
CONFLICT_KINDS = tuple(name.removeprefix("confl_") for name in STATS_COLUMNS if name.startswith("confl_"))


def zero_stats() -> dict[str, Any]:
    """The counters of a subscription that never counted anything (and was never reset)."""
    return {**dict.fromkeys(STATS_COLUMNS, 0), "stats_reset": None}


class SubscriptionStats:
    """The methods of :class:`~applier.catalog.store.Catalog` on the subscription's counters (it provides
    ``engine`` and ``_conn``)."""

    engine: sa.Engine

    def _conn(self, conn: sa.Connection | None) -> AbstractContextManager[sa.Connection]:  # pragma: no cover
        raise NotImplementedError

    def count_stats(self, subid: int, counts: dict[str, int]) -> None:
        """Add ``counts`` (column name -> how many) to the subscription's counters: one upsert in a transaction of
        its own, not waited for on disk (``synchronous_commit`` off: a crash of the target may lose the last
        counts, as it loses PostgreSQL's own statistics)."""
        unknown = set(counts) - set(STATS_COLUMNS)
        if unknown:
            raise ValueError(f"not a subscription counter: {', '.join(sorted(unknown))}")
        stmt = pg.insert(subscription_stats).values(subid=subid, **counts)
        stmt = stmt.on_conflict_do_update(
            index_elements=[subscription_stats.c.subid],
            set_={name: subscription_stats.c[name] + n for name, n in counts.items()},
        )
        with self.engine.begin() as c:
            c.execute(sa.text("SET LOCAL synchronous_commit = off"))
            c.execute(stmt)

    def subscription_stats(self, subid: int, conn: sa.Connection | None = None) -> dict[str, Any]:
        """The counters (zero when nothing was counted yet, and on a catalog older than version 12)."""
        with self._conn(conn) as c:
            if not c.execute(
                sa.text("SELECT to_regclass('applier.subscription_stats') IS NOT NULL")
            ).scalar():
                return zero_stats()
            row = (
                c.execute(sa.select(subscription_stats).where(subscription_stats.c.subid == subid))
                .mappings()
                .first()
            )
            if row is None:
                return zero_stats()
            return {name: row[name] for name in (*STATS_COLUMNS, "stats_reset")}

    def reset_stats(self, subid: int, conn: sa.Connection | None = None) -> None:
        """``pg_stat_reset_subscription_stats``: every counter to zero, ``stats_reset`` to now."""
        zeros = dict.fromkeys(STATS_COLUMNS, 0)
        stmt = pg.insert(subscription_stats).values(subid=subid, stats_reset=sa.func.now(), **zeros)
        stmt = stmt.on_conflict_do_update(
            index_elements=[subscription_stats.c.subid], set_={"stats_reset": sa.func.now(), **zeros}
        )
        with self._conn(conn) as c:
            c.execute(stmt)
