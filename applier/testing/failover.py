"""Helpers for tests and benchmarks of a failover: a primary and its physical standby (``PostgresCluster.standby``)."""

from __future__ import annotations

from applier.testing.cluster import PostgresCluster

__all__ = ["multi_host_conninfo", "slot_synced"]


def multi_host_conninfo(primary: PostgresCluster, standby: PostgresCluster, dbname: str) -> str:
    """A conninfo of ``dbname`` that reaches whichever of the two is the primary (libpq tries the hosts in order and
    keeps the first that accepts writes), so that a client follows a promotion by reconnecting."""
    return (
        f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} user=postgres dbname={dbname}"
        " target_session_attrs=read-write"
    )


def slot_synced(primary: PostgresCluster, standby: PostgresCluster, slot: str) -> bool:
    """The standby's synchronized copy of ``slot`` (``sync_replication_slots``) is persistent and as far as the
    primary's: a promotion then loses nothing the subscriber confirmed."""
    want = primary.scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    )
    return bool(
        want
        and standby.scalar(
            "SELECT synced AND NOT temporary AND confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (want, slot),
        )
    )
