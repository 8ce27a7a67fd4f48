"""The initial table copy of a subscription, run as one Spark job at one exported snapshot.

Entry point: :func:`run_initial_copy`. See :mod:`tablesync.initial` for the steps and their guarantees,
:mod:`tablesync.planner` for the partitioning and the publication rules, :mod:`tablesync.copy` for one partition.

The heavier modules are imported lazily: Spark's Python workers import :mod:`tablesync.copy` (and so this package)
for every executor process, and should not pay for SQLAlchemy, the catalog and pyspark's session code.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tablesync.initial import (
        CopyResult,
        ExportedSnapshot,
        InitialCopy,
        TableCopy,
        TablesyncError,
        describe,
    )
    from tablesync.progress import CopyProgress

__all__ = [
    "CopyResult",
    "ExportedSnapshot",
    "InitialCopy",
    "TableCopy",
    "TablesyncError",
    "describe",
    "run_initial_copy",
]

#: 32 MiB, as :data:`tablesync.planner.DEFAULT_PARTITION_BYTES` (repeated here to keep this import light).
_DEFAULT_PARTITION_BYTES = 32 * 1024 * 1024


def __getattr__(name: str) -> Any:
    if name in ("CopyResult", "ExportedSnapshot", "InitialCopy", "TableCopy", "TablesyncError", "describe"):
        from tablesync import initial

        return getattr(initial, name)
    raise AttributeError(f"module 'tablesync' has no attribute {name!r}")


def run_initial_copy(
    target_conninfo: str,
    subname: str,
    *,
    stop: threading.Event | None = None,
    spark_master: str | None = None,
    spark_conf: Mapping[str, str] | None = None,
    progress: bool | None = None,
    reporter: CopyProgress | None = None,
    partition_bytes: int = _DEFAULT_PARTITION_BYTES,
) -> CopyResult:
    """Copy every table of subscription ``subname`` that is in state ``i``/``d``/``f``, at one snapshot.

    Tables end in ``s`` with the snapshot's LSN Y (``CopyResult.snapshot_lsn``); the apply loop, streaming from the
    subscription slot's earlier point X, skips their changes up to Y and turns them ``r`` after. Tables already
    ``s``/``r`` are left alone. Nothing to copy: returns at once without starting Spark.

    ``stop`` set while copying cancels the Spark job and returns ``CopyResult(stopped=True)``; finished partitions
    are kept, and the next call redoes unfinished tables from scratch at a new snapshot.
    ``spark_master``: ``local[N]``, ``spark://...``, ``sc://host:port`` (Spark Connect; ``SPARK_REMOTE`` is used
    when neither is given); default ``local[*,4]``. ``progress`` (on stderr): None = bars on a terminal, plain lines
    otherwise; True = bars; False = plain lines. ``reporter`` replaces that (``CopyProgress.to_log``: records in
    the caller's log). Raises :class:`TablesyncError` when the copy fails.
    """
    from tablesync.initial import InitialCopy
    from tablesync.progress import CopyProgress

    reporter = reporter or CopyProgress.for_setting(progress)
    copier = InitialCopy(
        target_conninfo, subname, stop=stop, reporter=reporter, partition_bytes=partition_bytes
    )
    return copier.run(spark_master=spark_master, spark_conf=spark_conf)
