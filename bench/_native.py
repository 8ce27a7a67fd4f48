"""PostgreSQL's own subscriber, driven the way a backlog benchmark needs it.

The subscription is created *disabled* over a slot that already exists (``create_slot = false``,
``copy_data = false``), so the publisher's workload piles up in that slot while nobody applies; ``enable()`` then
starts the native apply worker over the whole backlog, exactly as ``applier run`` starts ours.

With ``two_phase = on`` and ``create_slot = false`` the subscription starts in the tri-state ``p``; because every
table is ready at once (no copy), the worker's first start already streams with two-phase and sets ``e``
(``run_apply_worker``), so no restart happens inside the timed part. The slot is created two-phase by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql


@dataclass
class NativeSubscription:
    """``CREATE SUBSCRIPTION name ... WITH (enabled = false, create_slot = false, copy_data = false)``."""

    dsn: str  # the subscriber database
    name: str
    slot: str
    publication: str
    publisher_dsn: str
    two_phase: bool
    streaming: str  # "off" | "on" | "parallel"

    def create(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(
                sql.SQL(
                    "CREATE SUBSCRIPTION {name} CONNECTION {conn} PUBLICATION {pub} WITH (enabled = false,"
                    " create_slot = false, copy_data = false, slot_name = {slot}, streaming = {streaming},"
                    " two_phase = {two_phase}, binary = false)"
                ).format(
                    name=sql.Identifier(self.name),
                    conn=sql.Literal(self.publisher_dsn),
                    pub=sql.Identifier(self.publication),
                    slot=sql.Literal(self.slot),
                    streaming=sql.Literal(self.streaming),
                    two_phase=sql.Literal(self.two_phase),
                )
            )

    def _alter(self, what: str) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(sql.SQL("ALTER SUBSCRIPTION {} " + what).format(sql.Identifier(self.name)))

    def enable(self) -> None:
        self._alter("ENABLE")

    def disable(self) -> None:
        self._alter("DISABLE")

    def worker_pid(self, conn: psycopg.Connection) -> int | None:
        """The leader apply worker (``relid IS NULL``; no parallel apply workers with ``streaming = on``)."""
        row = conn.execute(
            "SELECT pid FROM pg_catalog.pg_stat_subscription WHERE subname = %s AND relid IS NULL"
            " AND pid IS NOT NULL ORDER BY pid LIMIT 1",
            (self.name,),
        ).fetchone()
        return int(row[0]) if row else None

    def two_phase_state(self) -> str:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            row = c.execute(
                "SELECT subtwophasestate::text FROM pg_catalog.pg_subscription WHERE subname = %s",
                (self.name,),
            ).fetchone()
        return str(row[0]) if row else "?"

    def drop(self) -> None:
        """Disable, detach from the slot (the publisher's database is dropped with its slots anyway), drop."""
        with psycopg.connect(self.dsn, autocommit=True) as c:
            ident = sql.Identifier(self.name)
            exists = c.execute(
                "SELECT 1 FROM pg_catalog.pg_subscription WHERE subname = %s", (self.name,)
            ).fetchone()
            if not exists:
                return
            c.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(ident))
            c.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(ident))
            c.execute(sql.SQL("DROP SUBSCRIPTION {}").format(ident))
