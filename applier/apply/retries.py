"""Retries between the apply worker's sessions: the backoff, and what a failed remote transaction leaves behind.

An error that may go away by itself (a server restarting, a unique violation someone fixes, a missing table someone
creates) ends the session; the next one starts after an exponential backoff (tenacity, applier.retry) that grows
while the same remote transaction keeps failing and starts again once a session commits past it. An apply error is
recorded in the catalog with its context (behaviour 54), logged with the command that skips it, and disables the
subscription when ``disable_on_error`` says so (behaviour 101). After a failed session that grouped commits, the
transactions it received are applied one per local transaction, so that the error names exactly one.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable
from typing import Any, NoReturn

import psycopg
import sqlalchemy.exc
import tenacity

from applier.apply import conflicts, unique_conflicts
from applier.apply.context import ApplyError, ErrorContext
from applier.apply.housekeeping import Outcome
from applier.catalog.store import CatalogError, Subscription
from applier.errors import ApplierError, ProtocolError
from applier.lsn import format_lsn
from applier.retry import retry_delay


class ApplyWorkerError(ApplierError):
    """An error waiting will not fix; the message says what to do."""


def skip_command(subname: str, finish_lsn: int) -> str:
    """The command that skips the remote transaction finishing at ``finish_lsn`` (behaviours 97-100)."""
    return f"applier alter {shlex.quote(subname)} --skip-lsn {format_lsn(finish_lsn)}"


class SessionRetries:
    """The backoff and the failure records of one worker. ``worker`` is the
    :class:`~applier.apply.worker.ApplyWorker`: its subscription name, log, stop event, stats, metrics, catalog."""

    def __init__(self, worker: Any, *, initial: float, cap: float) -> None:
        self.worker, self.initial, self.cap = worker, initial, cap
        self.failures = 0
        #: (xid, finish LSN) of the remote transaction that failed last, while it keeps failing: the backoff grows
        #: until a session commits past it (or another one fails)
        self.failing: tuple[int | None, int] | None = None
        #: the wait apply_failed computed (and recorded) for the retry that follows it
        self.planned_delay: float | None = None
        #: after a session ended by an error, remote transactions up to what it had received are applied one local
        #: transaction each, so that an error recurring there names exactly one remote transaction
        self.ungrouped_until = 0
        self.grouped_session = False  # the last session grouped transactions finishing after grouped_after
        self.grouped_after = 0

    def run(self, attempt: Callable[[], Outcome]) -> Outcome:
        """``attempt`` until it returns, retrying what may get better by waiting."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self.retryable),
            wait=self.backoff,
            sleep=self.worker.stop.wait,
            before_sleep=self.before_sleep,
            reraise=True,
        )
        return retrying(attempt)

    # --- sessions --------------------------------------------------------------------------------------------
    def session_started(self, group_commit: bool) -> None:
        self.grouped_session = group_commit
        self.grouped_after = self.ungrouped_until

    def session_failed(self, last_received: int) -> None:
        self.ungrouped_until = max(self.ungrouped_until, last_received)

    def progress(self, transactions: int, good_origin_lsn: int) -> None:
        """A session committed ``transactions``: past the one that failed (if one did), the next failure starts the
        backoff again, so an occasional one after hours of work is retried quickly."""
        if transactions and (self.failing is None or good_origin_lsn > self.failing[1]):
            self.failures = 0
            self.failing = None

    # --- failures --------------------------------------------------------------------------------------------
    def apply_failed(self, exc: ApplierError) -> Outcome:
        """Record an apply error; disable the subscription if it says so (behaviour 101), else let it retry."""
        w = self.worker
        ctx: ErrorContext | None = exc.context if isinstance(exc, ApplyError) else None
        if (
            self.grouped_session
            and ctx is not None
            and ctx.finish_lsn
            and ctx.finish_lsn > self.grouped_after
        ):
            # the failing remote transaction may have shared its local transaction with others (group commit), which
            # the error then rolled back too: retry at once, applying what this session received one remote
            # transaction per local one, and let that attempt record the error (and disable the subscription) for
            # the one transaction it concerns, with everything before it committed, as the native worker would;
            # that attempt also counts it (once, as the native worker's apply_error_count would)
            w.log.warning(
                'logical replication apply worker for subscription "%s" will apply the transactions '
                "it received one by one after: %s",
                w.subname,
                exc,
            )
            self.ungrouped_until = max(self.ungrouped_until, ctx.finish_lsn)
            return Outcome.RESTART
        self._count(exc)
        failing = (ctx.xid, ctx.finish_lsn) if ctx is not None and ctx.finish_lsn else None
        if failing != self.failing:
            self.failures = 0  # another transaction: its own backoff starts from the beginning
        self.failing = failing
        delay = self.planned_delay = self.next_delay()
        sqlstate = exc.sqlstate if isinstance(exc, ApplyError) else None
        sub: Subscription | None = None
        try:
            sub = w.catalog.get(w.subname)
            if sub is None:
                return Outcome.DROPPED
            self._record(sub, exc, ctx, sqlstate, None if sub.subdisableonerr else delay)
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as db_exc:  # the target is down: retry anyway
            w.log.warning("could not record the error in the catalog: %s", db_exc)
        disable = sub is not None and sub.subdisableonerr
        self.log_failure(exc, ctx, sqlstate, None if disable else delay)
        if sub is not None and disable:
            return self._disable(sub, exc)
        raise exc

    def stop_subscription(self, sub: Subscription, message: str) -> NoReturn:
        """Disable the subscription and record why (``applier status`` shows it), then end the worker with the
        error: waiting cannot make right a publisher that lacks our slot or our history (applier.apply.failover),
        and retrying would loop. ``NAME`` in ``message`` becomes the subscription's name."""
        w = self.worker
        message = message.replace("NAME", sub.subname)
        self._count(ApplyWorkerError(message))
        try:
            w.catalog.record_error(sub.subid, message, message_type="START_REPLICATION")
            w.catalog.update_subscription(sub.subid, subenabled=False)
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as exc:
            w.log.warning("could not record the error and disable the subscription: %s", exc)
        raise ApplyWorkerError(message)

    def _count(self, exc: BaseException) -> None:
        if isinstance(exc, ApplyError) and exc.unique is not None:
            self._report_unique(exc)
        stats = self.worker.stats
        stats.errors += 1
        stats.last_error = str(exc)
        self.worker.metrics.error(exc)

    def _report_unique(self, exc: ApplyError) -> None:
        """A unique violation is an ``insert_exists``, ``update_exists`` or ``multiple_unique_conflicts`` conflict
        (applier.apply.unique_conflicts): which one, logged in PostgreSQL 18's words; counted with the error."""
        w = self.worker
        details: list[str] = []
        try:
            raw = w.catalog.engine.raw_connection()
            try:
                exc.conflict_kind, details = unique_conflicts.report(raw.driver_connection, exc)
            finally:
                with contextlib.suppress(Exception):
                    raw.driver_connection.rollback()
                raw.close()
        except Exception as db_exc:  # noqa: BLE001 - the target is down, or the rows are gone: report what is known
            exc.conflict_kind, details = unique_conflicts.kind_of(exc), [exc.unique[3]]
            w.log.warning("could not read the conflicting rows: %s", db_exc)
        ctx, (schema, table, _index, _detail) = exc.context, exc.unique
        relation = (ctx.relation if ctx else None) or f"{schema}.{table}"
        context = f"\nCONTEXT:  {ctx.describe()}" if ctx is not None else ""
        w.log.error("%s%s", conflicts.message(exc.conflict_kind, relation, details), context)

    def _record(
        self,
        sub: Subscription,
        exc: ApplierError,
        ctx: ErrorContext | None,
        sqlstate: str | None,
        retry_in: float | None,
    ) -> None:
        """The error with its context into the catalog, for ``applier status`` (behaviour 54)."""
        message = exc.message if isinstance(exc, ApplyError) else str(exc)
        if ctx is not None and (detail := ctx.detail()) is not None:
            message = f"{message}\n{detail}"
        self.worker.catalog.record_error(
            sub.subid,
            message,
            remote_xid=ctx.xid if ctx else None,
            finish_lsn=ctx.finish_lsn if ctx else None,
            message_type=ctx.message_type if ctx else None,
            relation=ctx.relation if ctx else None,
            sqlstate=sqlstate,
            gid=ctx.gid if ctx else None,
            retry_count=self.failures,
            retry_in=retry_in,
        )

    def _disable(self, sub: Subscription, exc: ApplierError) -> Outcome:
        w = self.worker
        try:
            w.catalog.update_subscription(sub.subid, subenabled=False)
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as db_exc:  # the target is down: retry anyway
            w.log.warning("could not disable the subscription: %s", db_exc)
            raise exc from None
        w.log.info('subscription "%s" has been disabled because of an error', w.subname)
        return Outcome.DISABLED

    def log_failure(
        self, exc: ApplierError, ctx: ErrorContext | None, sqlstate: str | None, delay: float | None
    ) -> None:
        """The error line of a failed remote transaction: what failed, where, when we try again and how to skip
        it; with ``--log-format json`` each part is a field of its own."""
        subname = self.worker.subname
        fields: dict[str, Any] = {"subscription": subname, "sqlstate": sqlstate, "retry_count": self.failures}
        text = str(exc)
        if sqlstate:
            text = f"{text}\nSQLSTATE: {sqlstate}"
        if ctx is not None and ctx.finish_lsn:
            skip = skip_command(subname, ctx.finish_lsn)
            fields.update(
                remote_xid=ctx.xid,
                finish_lsn=format_lsn(ctx.finish_lsn),
                gid=ctx.gid,
                relation=ctx.relation,
                message_type=ctx.message_type,
                skip_command=skip,
            )
            if ctx.gid:
                text += f"\nprepared transaction GID: {ctx.gid}"
            text += f"\nto skip this remote transaction: {skip}"
        if delay is not None:
            fields["retry_in"] = round(delay, 3)
            text += f"\nfailure {self.failures} of this transaction; next attempt in {delay:.1f} s"
        self.worker.log.error(
            'logical replication apply worker for subscription "%s": %s',
            subname,
            text,
            extra={"failure": fields},
        )

    # --- tenacity's hooks ------------------------------------------------------------------------------------
    @staticmethod
    def retryable(exc: BaseException) -> bool:
        if isinstance(exc, ApplyWorkerError | CatalogError):
            return False
        # SQLAlchemy wraps the catalog's driver errors (a target restarting shows up there first)
        return isinstance(exc, ApplierError | psycopg.Error | sqlalchemy.exc.DBAPIError | OSError)

    def next_delay(self) -> float:
        """Count one more failure in a row and return the wait before the next attempt (applier.retry)."""
        self.failures += 1
        return retry_delay(self.failures, initial=self.initial, cap=self.cap)

    def backoff(self, retry_state: Any) -> float:
        """The wait before the next session: what :meth:`apply_failed` computed and recorded for an apply error,
        else the next step of the backoff. It grows while failures follow each other and starts again after a
        session that made progress (past the failing remote transaction, when one failed)."""
        planned, self.planned_delay = self.planned_delay, None
        return planned if planned is not None else self.next_delay()

    def before_sleep(self, retry_state: tenacity.RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, ApplyError | ProtocolError) or exc is None:
            return
        w = self.worker
        self._count(exc)
        delay = retry_state.upcoming_sleep
        w.log.warning(
            'logical replication apply worker for subscription "%s" will retry in %.1f s: %s',
            w.subname,
            delay,
            exc,
        )
        if w.subid is not None and not isinstance(exc, psycopg.OperationalError | sqlalchemy.exc.DBAPIError):
            # e.g. the publisher refused START_REPLICATION: worth showing in applier status (a target that is down
            # cannot record anything, so connection errors are only logged)
            with contextlib.suppress(Exception):
                w.catalog.record_error(w.subid, str(exc), retry_count=self.failures, retry_in=delay)
