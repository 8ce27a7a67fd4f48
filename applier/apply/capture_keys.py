"""The key of a subscription's DDL capture as the apply worker's sessions see it (applier.ddl; an I/O edge).

Each session reads the key before it streams, on its own streaming connection (a database walsender answers SQL),
as the role that owns it: the capture's messages are signed with it, and only those are replayed
(applier.apply.ddl_replay). A capture message this session cannot take (the subscription's ``subddl`` turned on, or
the capture installed again with a new key, since the session began) makes it look again, on the catalog and on a
connection of its own to the publisher, and restart when something changed: the next session then applies that
transaction, from the origin's position, with the new key.
"""

from __future__ import annotations

import logging

import psycopg

from applier.apply.ddl_replay import DdlConsumer
from applier.apply.housekeeping import Restart
from applier.catalog.store import Catalog, Subscription
from applier.ddl import capture
from applier.replication import ReplicationConnection

__all__ = ["CaptureKeys"]


def _slot(sub: Subscription) -> str:
    return sub.subslotname or sub.subname


class CaptureKeys:
    """The worker's capture key, across its sessions."""

    def __init__(self, catalog: Catalog, log: logging.Logger) -> None:
        self.catalog = catalog
        self.log = log
        self.key: bytes | None = None

    def read(self, repl: ReplicationConnection, sub: Subscription) -> None:
        """Before the session streams: the key, or None (a WARNING: nothing is replayed) when the capture is gone
        or the streaming role may not read it."""
        self.key = None
        if not sub.subddl:
            return
        try:
            row = repl.connection.execute(capture.key_query(_slot(sub))).fetchone()
        except psycopg.Error as exc:
            self.log.warning('logical replication apply worker for subscription "%s" replays no schema change: '
                             "cannot read its DDL capture's key on the publisher: %s", sub.subname, exc)  # fmt: skip
            return
        self.key = row[0].encode() if row else None

    def consumer(self, sub: Subscription) -> DdlConsumer:
        return DdlConsumer(_slot(sub), sub.subddl, self.key, lambda: self.recheck(sub))

    def recheck(self, sub: Subscription) -> None:
        """Raise :class:`Restart` when ``subddl`` or the key changed since the session began."""
        fresh = self.catalog.get(sub.subname)
        if fresh is None:
            return
        key = None
        if fresh.subddl:
            try:
                with psycopg.connect(sub.subconninfo, autocommit=True, connect_timeout=10) as conn:
                    row = conn.execute(capture.key_query(_slot(sub))).fetchone()
                    key = row[0].encode() if row else None
            except psycopg.Error:
                key = self.key  # cannot tell: as it was
        if fresh.subddl != sub.subddl or key != self.key:
            self.log.info('logical replication apply worker for subscription "%s" will restart because its DDL'
                          " capture changed", sub.subname)  # fmt: skip
            raise Restart()
