"""The migration's tuning knobs, read from the environment here and nowhere else below ``migrate/cli.py``
(issue 38): each is documented where its effect is (docs/migrate.md), and none is needed to run a migration.

- ``APPLIER_PG_BINDIR``: where to look first for ``pg_dump`` (docs/migrate.md, "plan": which pg_dump);
- ``APPLIER_MIGRATE_MAINTENANCE_WORK_MEM``: one ``maintenance_work_mem`` for every post-data build;
- ``APPLIER_MIGRATE_PARTITION_BYTES``: the copy's partition size (the tablesync's default otherwise);
- ``SPARK_REMOTE``: a Spark Connect server for the copy instead of a local Spark.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["maintenance_work_mem", "partition_bytes", "pg_bindir", "spark_remote"]


def pg_bindir() -> Path | None:
    value = os.environ.get("APPLIER_PG_BINDIR")
    return Path(value) if value else None


def maintenance_work_mem() -> str | None:
    return os.environ.get("APPLIER_MIGRATE_MAINTENANCE_WORK_MEM") or None


def partition_bytes() -> int:
    """0: the tablesync's own default."""
    return int(os.environ.get("APPLIER_MIGRATE_PARTITION_BYTES", "0") or 0)


def spark_remote() -> bool:
    return bool(os.environ.get("SPARK_REMOTE"))
