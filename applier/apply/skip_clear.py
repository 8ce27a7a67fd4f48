"""Clearing the subscription's skip-LSN once the transaction it names is done (``clear_subscription_skip_lsn``,
behaviours 97-100).

After a COMMIT the clearing rides in the local transaction being committed, so the skip and the origin progress
are one atomic step (:meth:`SkipClearing.in_transaction`). PREPARE TRANSACTION cannot include it, nor can COMMIT /
ROLLBACK PREPARED: then it is cleared in a transaction of its own, once the target has confirmed what came before
(:meth:`SkipClearing.separately`). A skip-LSN that named no transaction finishing there is cleared with
PostgreSQL's warning (``state.skip``).

Pure: the statement goes through the target's pipeline (:class:`~applier.apply.ports.ApplyTarget`); the separate
clearing is a callable the worker passes in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from applier.apply.context import ErrorContext
from applier.apply.ports import ApplyTarget
from applier.catalog import sql as catalog_sql
from applier.lsn import format_lsn
from state import skip as skiprules

_CLEAR = catalog_sql.CLEAR_SKIP_LSN


@dataclass
class SkipState:
    """The subscription's skip-LSN as this worker read it (0 = none), behaviours 97-100."""

    skip_lsn: int = 0
    subname: str = ""


class SkipClearing:
    """Clears :attr:`SkipState.skip_lsn` in the catalog when the transaction it names ends."""

    def __init__(
        self,
        subid: int,
        subname: str,
        skip: SkipState,
        target: ApplyTarget,
        clear_now: Callable[[int, int], bool],
        log: logging.Logger,
    ) -> None:
        self.subid = subid
        self.subname = subname
        self.skip = skip
        self.target = target
        self._clear_now = clear_now  # own transaction (after PREPARE / COMMIT PREPARED)
        self.log = log

    def _warn(self, skip_lsn: int, finish_lsn: int) -> None:
        warning, detail = skiprules.mistaken_skip_warning(self.subname, skip_lsn, finish_lsn)
        self.log.warning("%s\nDETAIL:  %s", warning, detail)

    def in_transaction(self, finish_lsn: int, ctx: ErrorContext) -> None:
        """Queue the clearing inside the local transaction about to be committed."""
        skip_lsn = self.skip.skip_lsn
        if not skip_lsn:
            return
        outcome = skiprules.on_transaction_end(skip_lsn, finish_lsn, True)
        if not outcome.clears:
            return
        self.skip.skip_lsn = 0

        def cleared(res: Any) -> None:
            if res is not None and res.command_tuples and outcome is skiprules.SkipOutcome.CLEAR_WITH_WARNING:
                self._warn(skip_lsn, finish_lsn)

        params = [str(self.subid).encode(), format_lsn(skip_lsn).encode()]
        self.target.pipeline.send_query(_CLEAR, params, ctx, cleared)

    def separately(self, finish_lsn: int, applied_something: bool) -> None:
        """For PREPARE and COMMIT/ROLLBACK PREPARED: clear in a transaction of its own, once the target has
        confirmed what came before."""
        skip_lsn = self.skip.skip_lsn
        outcome = skiprules.on_transaction_end(skip_lsn, finish_lsn, applied_something)
        if not outcome.clears:
            return
        self.target.pipeline.drain()
        self.skip.skip_lsn = 0
        if self._clear_now(self.subid, skip_lsn) and outcome is skiprules.SkipOutcome.CLEAR_WITH_WARNING:
            self._warn(skip_lsn, finish_lsn)
