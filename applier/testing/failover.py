"""Helpers for tests and benchmarks of a failover: a primary and its physical standby (``PostgresCluster.standby``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from psycopg import sql

from applier.testing.cluster import PostgresBinaries, PostgresCluster

__all__ = ["multi_host_conninfo", "primary_with_standby", "slot_synced"]


@contextlib.contextmanager
def primary_with_standby(
    binaries: PostgresBinaries,
    prefix: str,
    slot: str,
    *,
    standby_settings: Mapping[str, str] | None = None,
    primary_settings: Mapping[str, str] | None = None,
) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A primary (``<prefix>primary``) and its physical standby (``<prefix>standby``, streaming from ``slot``), both
    destroyed afterwards. ``primary_settings`` are set on the primary once the standby runs (ALTER SYSTEM and a
    reload: ``synchronized_standby_slots`` or ``synchronous_standby_names`` name the standby)."""
    primary = PostgresCluster(binaries, name=f"{prefix}primary").start()
    standby = None
    try:
        standby = primary.standby(f"{prefix}standby", slot=slot, settings=dict(standby_settings or {}))
        for name, value in (primary_settings or {}).items():
            primary.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        if primary_settings:
            primary.reload()
        yield primary, standby
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


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
