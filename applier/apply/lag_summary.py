"""The apply lag the worker measured, summarised for ``applier status`` (applier.apply.lag holds the window).

Samples go to the metrics as they come; the summary goes to the catalog (``applier.apply_lag``) at most every
``LAG_WRITE_INTERVAL`` seconds, through the session's catalog watch when there is one (off the apply loop), else
directly: a live figure, never worth failing the apply for.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from applier.apply.housekeeping import CatalogWatch
from applier.apply.lag import LagWindow
from applier.catalog.store import Catalog
from applier.metrics import APPLY_LAG_BOUNDS, WorkerMetrics

__all__ = ["LAG_WRITE_INTERVAL", "LagSummary"]

#: how often the lag summary is written to the catalog (seconds)
LAG_WRITE_INTERVAL = 2.0


class LagSummary:
    """The worker's lag window (kept across sessions) and where its summary goes."""

    def __init__(self, catalog: Catalog, metrics: WorkerMetrics, log: logging.Logger) -> None:
        self.catalog, self.metrics, self.log = catalog, metrics, log
        self.window = LagWindow(histogram_bounds=APPLY_LAG_BOUNDS)
        self._written = 0  # LagWindow.added when the summary was last written
        self._written_at = 0.0
        self._table: bool | None = None  # whether the catalog has applier.apply_lag (version 3)
        #: the session's catalog watch, which writes the summary off the apply loop
        self.watch: CatalogWatch | None = None

    def session_started(self) -> None:
        if self._table is None:
            self._table = self._ensure_table()

    def publish(self, subid: int | None, *, record: bool = True) -> None:
        """New samples to the metrics; the summary to the catalog when due (not when a session ends: the target
        may be what failed, and a connection attempt must not delay the reconnect)."""
        lag = self.window
        if lag.added == self._written:
            return
        self.metrics.observe_lag(lag.take_new())
        now = time.monotonic()
        if not (
            record and self._table and subid is not None and now - self._written_at >= LAG_WRITE_INTERVAL
        ):
            return
        self._written_at = now
        self._written = lag.added
        summary = lag.summary(time.time())
        if summary is not None and self.watch is not None:
            self.watch.lag = (subid, dataclasses.asdict(summary))
        elif summary is not None:
            try:
                self.catalog.record_lag(subid, dataclasses.asdict(summary))
            except Exception as exc:  # noqa: BLE001 - a live figure: never worth failing the apply for
                self.log.debug("could not record the apply lag: %s", exc)

    def _ensure_table(self) -> bool:
        """Whether ``applier.apply_lag`` exists, upgrading a version-1 catalog in place if needed (the upgrade
        only adds that table); False, and no lag in ``applier status``, when the upgrade is refused."""
        try:
            if not self.catalog.has_lag_table():
                self.catalog.ensure()
            return self.catalog.has_lag_table()
        except Exception as exc:  # noqa: BLE001
            self.log.warning(
                "apply lag will not show in applier status: cannot add applier.apply_lag: %s", exc
            )
            return False
