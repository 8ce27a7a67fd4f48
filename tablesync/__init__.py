"""The initial table copy of a subscription, run as one Spark job at one exported snapshot.

Entry point: :func:`run_initial_copy`. See :mod:`tablesync.initial` for the steps and their guarantees,
:mod:`tablesync.planner` for the partitioning and the publication rules, :mod:`tablesync.copy` for one partition.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from tablesync.initial import CopyResult, InitialCopy, TableCopy, TablesyncError, describe
from tablesync.planner import DEFAULT_PARTITION_BYTES
from tablesync.progress import CopyProgress

__all__ = ["CopyResult", "InitialCopy", "TableCopy", "TablesyncError", "describe", "run_initial_copy"]


def run_initial_copy(
    target_conninfo: str,
    subname: str,
    *,
    stop: threading.Event | None = None,
    spark_master: str | None = None,
    spark_conf: Mapping[str, str] | None = None,
    progress: bool | None = None,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> CopyResult:
    """Copy every table of subscription ``subname`` that is in state ``i``/``d``/``f``, at one snapshot.

    Tables end in ``s`` with the snapshot's LSN Y (``CopyResult.snapshot_lsn``); the apply loop, streaming from the
    subscription slot's earlier point X, skips their changes up to Y and turns them ``r`` after. Tables already
    ``s``/``r`` are left alone. Nothing to copy: returns at once without starting Spark.

    ``stop`` set while copying cancels the Spark job and returns ``CopyResult(stopped=True)``; finished partitions
    are kept, and the next call redoes unfinished tables from scratch at a new snapshot.
    ``spark_master``: ``local[N]``, ``spark://...``, ``sc://host:port`` (Spark Connect; ``SPARK_REMOTE`` is used
    when neither is given); default ``local[*,4]``. ``progress``: None = bars on a terminal (stderr), plain lines
    otherwise; True = bars; False = silent. Raises :class:`TablesyncError` when the copy fails.
    """
    reporter = CopyProgress.for_setting(progress)
    copier = InitialCopy(
        target_conninfo, subname, stop=stop, reporter=reporter, partition_bytes=partition_bytes
    )
    return copier.run(spark_master=spark_master, spark_conf=spark_conf)
