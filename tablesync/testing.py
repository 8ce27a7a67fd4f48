"""Helpers for tests and benchmarks of the initial copy: a catalog subscription without the CLI, a local Spark
session sized for tests, and a standalone entry point to run a copy in a child process (to kill it mid-copy)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from applier.catalog.store import Catalog, Subscription
from state.tables import SyncState
from state.twophase import TwoPhaseState


def subscribe(
    target_conninfo: str,
    publisher_conninfo: str,
    subname: str,
    tables: Iterable[str],
    *,
    publications: Sequence[str] = ("pub",),
    state: SyncState = SyncState.INIT,
) -> Subscription:
    """Write a subscription and its tables (in ``state``) into the target's catalog, as ``applier create`` does,
    without creating the subscription's own slot (the copy does not need it)."""
    cat = Catalog.connect(target_conninfo)
    cat.ensure()
    sub = cat.create_subscription(
        subname=subname,
        conninfo=publisher_conninfo,
        publications=list(publications),
        two_phase_state=TwoPhaseState.DISABLED,
        streaming="off",
        binary=False,
        disable_on_error=False,
        origin="any",
        slot_name=subname,
        enabled=True,
        copy_data=True,
    )
    import psycopg

    with psycopg.connect(target_conninfo, autocommit=True) as conn:
        for t in tables:
            relid = conn.execute("SELECT %s::regclass::oid::int8", (t,)).fetchone()[0]  # type: ignore[index]
            cat.add_table(sub.subid, relid, t, state)
    return sub


def local_spark(cores: int = 2, **conf: str) -> Any:
    """A local session as ``run_initial_copy`` would build it, for a test module to share."""
    from tablesync.job import spark_session

    base = {"spark.sql.shuffle.partitions": "2"}
    base.update(conf)
    return spark_session(f"local[{cores},4]", base).session


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tablesync.testing TARGET SUBNAME [--partition-bytes N] [--master M]``: run one copy and print
    its result as JSON (tests run this in a child process to kill it with SIGKILL mid-copy)."""
    from tablesync import run_initial_copy

    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("subname")
    ap.add_argument("--partition-bytes", type=int, default=None)
    ap.add_argument("--master", default=None)
    args = ap.parse_args(argv)
    kwargs: dict[str, Any] = {"progress": None, "spark_master": args.master}
    if args.partition_bytes:
        kwargs["partition_bytes"] = args.partition_bytes
    result = run_initial_copy(args.target, args.subname, **kwargs)
    json.dump(
        {
            "rows": result.rows,
            "bytes": result.bytes,
            "lsn": result.snapshot_lsn,
            "tables": len(result.tables),
        },
        sys.stdout,
    )
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
