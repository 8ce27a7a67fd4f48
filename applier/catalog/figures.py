"""The live figures a running worker leaves in the catalog for ``applier status``: its recent apply lag
(``applier.apply_lag``) and a stall its watchdog sees (``applier.apply_stall``). Both tables are UNLOGGED: figures
of the moment, not worth WAL. A part of :class:`applier.catalog.store.Catalog`, kept apart for its size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from applier.catalog.schema import apply_lag, apply_stall


class LiveFigures:
    """The methods of :class:`~applier.catalog.store.Catalog` on the live figures (it provides ``engine`` and
    ``_conn``)."""

    engine: sa.Engine

    def _conn(self, conn: sa.Connection | None) -> AbstractContextManager[sa.Connection]:  # pragma: no cover
        raise NotImplementedError

    def record_lag(self, subid: int, figures: dict[str, Any], conn: sa.Connection | None = None) -> None:
        """Upsert the subscription's recent apply lag (``last_s``, ``last_kind``, ``p50_s``, ``p99_s``, ``max_s``,
        ``samples``, ``window_s``): its own short transaction, not waited for on disk (an unlogged table)."""
        stmt = pg.insert(apply_lag).values(subid=subid, updated_at=sa.func.now(), **figures)
        stmt = stmt.on_conflict_do_update(
            index_elements=[apply_lag.c.subid], set_={"updated_at": sa.func.now(), **figures}
        )
        with self._conn(conn) as c:
            c.execute(stmt)

    def lag(self, subid: int, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        """What :meth:`record_lag` stored last, with ``updated_at``; None when nothing was recorded."""
        with self._conn(conn) as c:
            if not self.has_lag_table(c):  # a catalog of version 1, not upgraded yet
                return None
            row = c.execute(sa.select(apply_lag).where(apply_lag.c.subid == subid)).mappings().first()
            return dict(row) if row is not None else None

    def record_stall(self, subid: int, stall: dict[str, Any] | None) -> None:
        """Upsert the subscription's stall (``since`` as seconds ago, ``waiting_on``, ``received_lsn``,
        ``applied_lsn``, ``unanswered``), or remove it (None): the watchdog's thread, its own short transaction."""
        with self.engine.begin() as c:
            if stall is None:
                c.execute(sa.delete(apply_stall).where(apply_stall.c.subid == subid))
                return
            values = dict(
                stall, since=sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, stall["since"])
            )
            stmt = pg.insert(apply_stall).values(subid=subid, updated_at=sa.func.now(), **values)
            kept = {k: v for k, v in stall.items() if k != "since"}  # a stall's start stays as first written
            c.execute(stmt.on_conflict_do_update(
                index_elements=[apply_stall.c.subid], set_={"updated_at": sa.func.now(), **kept}
            ))  # fmt: skip

    def stall(self, subid: int, fresh_s: float, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        """The subscription's stall if its row was refreshed in the last ``fresh_s`` seconds (a killed worker
        leaves one behind); None otherwise, and on a catalog older than version 7."""
        with self._conn(conn) as c:
            if not c.execute(sa.text("SELECT to_regclass('applier.apply_stall') IS NOT NULL")).scalar():
                return None
            row = c.execute(sa.select(apply_stall).where(
                apply_stall.c.subid == subid,
                apply_stall.c.updated_at > sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, fresh_s),
            )).mappings().first()  # fmt: skip
            return dict(row) if row is not None else None

    def has_lag_table(self, conn: sa.Connection | None = None) -> bool:
        with self._conn(conn) as c:
            return bool(c.execute(sa.text("SELECT to_regclass('applier.apply_lag') IS NOT NULL")).scalar())
