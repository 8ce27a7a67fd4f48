"""Polling helpers: tests wait on conditions (an LSN reached, a row visible), never on fixed sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from applier.testing.cluster import Database, PostgresCluster

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition a test waited for never came true; the message says which and what was last seen."""


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 60.0, interval: float = 0.02, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; raise :class:`WaitTimeout` after ``timeout``.

    Exceptions raised by the predicate count as "not yet" (a server may be restarting) and are reported at the end.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - reported below
            last = exc
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last result: {last!r}")
        time.sleep(interval)


def wait_for_catchup(
    publisher: PostgresCluster | Database,
    application_name: str,
    *,
    timeout: float = 90.0,
    target_lsn: str | None = None,
) -> str:
    """Wait until ``pg_stat_replication`` shows ``application_name`` streaming with replay_lsn ≥ the publisher's
    current WAL position (taken once, at the call), as PostgreSQL's TAP ``wait_for_catchup`` does. Returns that LSN.
    """
    cluster = publisher.cluster if isinstance(publisher, Database) else publisher
    lsn = target_lsn or cluster.scalar("SELECT pg_current_wal_lsn()::text")

    def caught_up() -> bool:
        return bool(
            cluster.scalar(
                "SELECT replay_lsn >= %s::pg_lsn FROM pg_stat_replication"
                " WHERE application_name = %s AND state = 'streaming'",
                (lsn, application_name),
            )
        )

    wait_until(caught_up, timeout=timeout, what=f"{application_name!r} to replay up to {lsn}")
    return lsn
