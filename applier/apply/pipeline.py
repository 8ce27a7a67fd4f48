"""libpq pipeline mode with our own queue of pending results: the transport of the target session.

Every queued statement keeps its own :class:`~applier.apply.context.ErrorContext` and completion callback; results
are read back in batches, and the first error of a pipeline segment is raised once its segment has been read (see
:mod:`applier.apply.target` for why we drive libpq directly).
"""

from __future__ import annotations

import select
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import pq

from applier.apply.context import ApplyError, ErrorContext

_S = pq.ExecStatus
_F = pq.DiagnosticField
_OK = (_S.COMMAND_OK, _S.TUPLES_OK, _S.EMPTY_QUERY)

#: How many statements may be queued without reading results before we wait for some.
MAX_IN_FLIGHT = 4000

_SYNC = object()
#: ``on_ok`` of an UPDATE/DELETE: a result of 0 rows goes to :attr:`Pipeline.on_missing_row` with its context
CHECK_ROWS: Any = object()


class TargetConnectionError(psycopg.OperationalError):
    """The target connection was lost (the worker reconnects with backoff)."""


def _result_error(res: pq.PGresult | Any, ctx: ErrorContext | None, row: Any = None) -> ApplyError:
    msg = (res.error_message or b"").decode("utf-8", "replace").strip()
    if msg.startswith("ERROR:"):
        msg = msg[6:].strip()
    sqlstate = res.error_field(pq.DiagnosticField.SQLSTATE)
    err = ApplyError(msg, ctx, sqlstate=sqlstate.decode() if sqlstate else None)
    # a unique violation: what applier.apply.unique_conflicts needs to report the conflict
    if sqlstate == b"23505":
        fields = (_F.SCHEMA_NAME, _F.TABLE_NAME, _F.CONSTRAINT_NAME, _F.MESSAGE_DETAIL)
        err.unique = tuple((res.error_field(f) or b"").decode("utf-8", "replace") for f in fields)
        err.remote = row
    return err


class Pipeline:
    """libpq pipeline mode over a non-blocking connection, with our own queue of pending results.

    Each queued statement has a context (for errors) and an optional ``on_ok(result)`` callback. The first error of
    a pipeline segment is kept and raised by :meth:`drain` / :meth:`poll` once its segment has been read: the
    caller then abandons the transaction (rolls back) as a whole, so nothing after it matters.
    """

    def __init__(self, pgconn: Any) -> None:
        self.pgconn = pgconn
        self._pending: deque[Any] = deque()  # (ctx, on_ok) tuples and _SYNC markers
        self._current: list[Any] = []  # results of the statement at the head of the queue
        self._error: ApplyError | None = None
        self.active = False
        #: roughly how many bytes libpq holds that have not been written to the socket yet
        self.unflushed = 0
        #: called with the context of an UPDATE/DELETE that found no row (queued with ``on_ok=CHECK_ROWS``)
        #: (and the statement's (entry, search tuple, new tuple) when it carries them, for the report's DETAIL)
        self.on_missing_row: Callable[[ErrorContext | None, Any], None] | None = None
        #: called with a conflict's kind, context and DETAIL parts when a check finds one (applier.apply.origin_probe)
        self.on_conflict: Callable[[str, ErrorContext | None, Sequence[str], Any], None] | None = None
        #: the queue entry a flush request was last sent after (see :meth:`poll`)
        self._flush_requested: Any = None

    # --- sending ---------------------------------------------------------------------------------------------
    def enter(self) -> None:
        if not self.active:
            self.pgconn.enter_pipeline_mode()
            self.active = True

    def send_prepare(
        self, name: bytes, command: bytes, types: Sequence[int], ctx: ErrorContext | None
    ) -> None:
        self.enter()
        self.pgconn.send_prepare(name, command, types)
        self._pending.append((ctx, None))

    def send_prepared(
        self,
        name: bytes,
        params: Sequence[bytes | None],
        formats: Sequence[int] | None,
        ctx: ErrorContext | None,
        on_ok: Callable[[Any], None] | None = None,
        row: Any = None,
    ) -> None:
        """Queue a prepared statement; ``row``: the (entry, search tuple, new tuple) of a per-row INSERT or UPDATE,
        kept with it so that a unique violation can name the remote row (applier.apply.unique_conflicts)."""
        self.enter()
        self.pgconn.send_query_prepared(name, params, formats)
        self.unflushed += 32 + sum(map(len, filter(None, params)))
        self._pending.append((ctx, on_ok) if row is None else (ctx, on_ok, row))
        if len(self._pending) > MAX_IN_FLIGHT:
            self._relieve()

    def send_query(
        self,
        command: bytes,
        params: Sequence[bytes | None] | None = None,
        ctx: ErrorContext | None = None,
        on_ok: Callable[[Any], None] | None = None,
        types: Sequence[int] | None = None,
        formats: Sequence[int] | None = None,
    ) -> None:
        self.enter()
        self.pgconn.send_query_params(command, params, types, formats)
        self.unflushed += 32 + len(command) + (sum(map(len, filter(None, params))) if params else 0)
        self._pending.append((ctx, on_ok))

    def sync(self) -> None:
        """Mark a sync point. This also flushes: psycopg's ``pipeline_sync`` is libpq's ``PQpipelineSync``, which
        writes out everything buffered (``PQsendPipelineSync``, which would not, is not wrapped by psycopg 3.3). So
        sync points are kept rare: plain commits share a pipeline segment and need none."""
        self.enter()
        self.pgconn.pipeline_sync()
        self._pending.append(_SYNC)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- receiving -------------------------------------------------------------------------------------------
    def _flush_some(self) -> bool:
        """Push buffered output to the socket without blocking; True when everything was sent."""
        try:
            done = self.pgconn.flush() == 0
        except psycopg.OperationalError as exc:
            raise TargetConnectionError(f"connection to the target was lost: {exc}") from None
        if done:
            self.unflushed = 0
        return done

    def flush_all(self) -> None:
        """Write everything libpq holds to the socket (reading results meanwhile, so neither side can stall)."""
        while not self._flush_some():
            self._wait(1.0)

    def _wait(self, timeout: float | None) -> None:
        """Wait until the socket is readable (or writable, while output is pending), then read what arrived."""
        sock = self.pgconn.socket
        flushed = self._flush_some()
        r, _w, _ = select.select([sock], [] if flushed else [sock], [], timeout)
        try:
            if r:
                self.pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise TargetConnectionError(f"connection to the target was lost: {exc}") from None

    def _process_available(self) -> None:
        """Consume every result libpq already has, without blocking."""
        pgconn = self.pgconn
        pending = self._pending
        while pending and not pgconn.is_busy():
            head = pending[0]
            res = pgconn.get_result()
            if head is _SYNC:
                self._at_sync(res)
            elif res is not None:
                self._current.append(res)
            else:  # end of the head statement's results
                pending.popleft()
                self._statement_done(head)

    def _at_sync(self, res: pq.PGresult | None) -> None:
        """The result where a pipeline sync is due: the end of a segment, which raises the segment's error."""
        if res is None:
            if self.pgconn.status == pq.ConnStatus.BAD:
                raise TargetConnectionError(
                    "connection to the target was lost: "
                    + (self.pgconn.error_message or b"").decode("utf-8", "replace").strip()
                )
            return
        if res.status != _S.PIPELINE_SYNC:  # pragma: no cover - protocol confusion
            raise TargetConnectionError(f"unexpected result {res.status!r} where a pipeline sync was due")
        self._pending.popleft()
        if self._error is not None:
            err, self._error = self._error, None
            self._current = []
            raise err

    def _statement_done(self, head: Any) -> None:
        """All results of one queued statement are in: call its ``on_ok``, or remember its error."""
        results, self._current = self._current, []
        ctx, on_ok = head[0], head[1]
        status = results[-1].status if results else _S.COMMAND_OK
        if status in _OK:
            if on_ok is CHECK_ROWS:
                if self.on_missing_row is not None and results and results[-1].command_tuples == 0:
                    self.on_missing_row(ctx, head[2] if len(head) > 2 else None)
            elif on_ok is not None:
                on_ok(results[-1] if results else None)
        elif status == _S.FATAL_ERROR:
            if self._error is None:
                self._error = _result_error(results[-1], ctx, head[2] if len(head) > 2 else None)
        elif status != _S.PIPELINE_ABORTED:  # pragma: no cover
            raise TargetConnectionError(f"unexpected result status {status!r} in the apply pipeline")

    def poll(self) -> None:
        """Read whatever results have arrived, never blocking. Raises the error of a finished segment.

        Without a sync the server keeps results in its output buffer; a flush request makes it send them. One
        request after the last queued statement is enough (the server runs the statements in order, so when it
        reaches the request every result before it is in its buffer): a poll with nothing queued since sends
        none, saving a write and a wake-up of the target's backend per loop iteration that only waits."""
        if not self._pending:
            return
        last = self._pending[-1]
        if last is not _SYNC and last is not self._flush_requested:
            self.pgconn.send_flush_request()
            self._flush_requested = last
        self._wait(0)
        self._process_available()

    def push(self) -> None:
        """Write what is queued to the socket now, with a flush request after it, without waiting for anything.

        For the end of a remote transaction that the target should start at once (a PREPARE TRANSACTION, a COMMIT
        PREPARED): otherwise it waits in libpq's buffer until the loop's round ends and polls, and while the round
        goes on applying what else arrived, the target backend idles. The flush request makes the server send the
        results as soon as it has them; :meth:`poll` then sends no second one. Whatever the socket does not take at
        once goes with the next poll."""
        pending = self._pending
        if pending and pending[-1] is not _SYNC and pending[-1] is not self._flush_requested:
            self.pgconn.send_flush_request()
            self._flush_requested = pending[-1]
        self._flush_some()

    # --- while the apply loop waits on the publisher (applier.replication.WaitingPeer) ----------------------------
    def io_wanted(self) -> tuple[int, bool] | None:
        """``(socket, output pending)`` while results are owed or output is unsent, else ``None``: the apply loop's
        wait for the publisher then watches this socket too, so the target's backend never sits blocked on a full
        send buffer (results, or a trigger's notices) while we wait for a publisher that has nothing more to send.
        Two attribute checks: called once per wait, never per message."""
        if not self._pending and not self.unflushed:
            return None
        return self.pgconn.socket, self.unflushed > 0

    def serve(self, readable: bool) -> None:
        """The socket is ready during that wait: write what libpq holds, read what arrived and take every result
        that is complete (notices go to the connection's notice handler as they are parsed). Raises the error of
        a finished segment, as :meth:`poll` does."""
        self._flush_some()
        if readable:
            try:
                self.pgconn.consume_input()
            except psycopg.OperationalError as exc:
                raise TargetConnectionError(f"connection to the target was lost: {exc}") from None
        self._process_available()

    def _relieve(self) -> None:
        """Too many statements in flight: make sure the server sees a sync point and wait for about half."""
        if self._pending[-1] is not _SYNC:
            self.sync()
        target = MAX_IN_FLIGHT // 2
        while len(self._pending) > target:
            self._process_available()
            if len(self._pending) > target:
                self._wait(None)

    def drain(self) -> None:
        """Wait for every queued statement's result; raise the first error."""
        if not self._pending:
            return
        if self._pending[-1] is not _SYNC:
            self.sync()
        while self._pending:
            self._process_available()
            if self._pending:
                self._wait(None)

    def exit(self) -> None:
        """Drain and leave pipeline mode (needed before COPY and before psycopg-level queries)."""
        if self.active:
            self.drain()
            self.pgconn.exit_pipeline_mode()
            self.active = False

    def discard(self) -> None:
        """After an error: read and drop everything still pending, ignoring errors; leave pipeline mode."""
        try:
            while self._pending and self.pgconn.status == pq.ConnStatus.OK:
                try:
                    self.drain()
                except ApplyError:
                    continue
            if self.active:
                self.pgconn.exit_pipeline_mode()
        finally:
            self.active = False
            self._pending.clear()
            self._current = []
            self._error = None
