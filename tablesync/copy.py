"""Copying partitions from the publisher to the target, each exactly once; runs inside a Spark executor.

The publisher side imports the copy's exported snapshot (behaviour 117: ``BEGIN ISOLATION LEVEL REPEATABLE READ``
then ``SET TRANSACTION SNAPSHOT`` before any query) and streams ``COPY (SELECT ...) TO STDOUT``; the target side
receives the raw bytes with ``COPY ... FROM STDIN``. Rows are never decoded: binary format when the column types
match (see :func:`tablesync.planner.binary_compatible`), text otherwise.

Exactly once: on the target, one transaction

1. takes an advisory lock on the partition (two attempts of the same partition — a Spark retry racing a
   speculative copy — run one after the other, not side by side),
2. checks that this copy generation still owns the table (the *claim* row, ``part = -1``, taken ``FOR SHARE``:
   a resumed run deletes it before it empties the table, so an orphaned task of a killed run can neither copy
   into the emptied table nor make the resumed run wait forever),
3. returns early if the partition's marker already exists,
4. ``SET LOCAL session_replication_role = replica`` (as the native tablesync worker: no user triggers, no FK
   checks), copies, inserts the marker and commits (``synchronous_commit = off``, as the native worker's default:
   the run's final catalog commit flushes the WAL before it).

A crash anywhere before the commit leaves nothing behind; after it, the marker makes every later attempt a no-op.
Text and binary values travel in UTF8 on both connections (``client_encoding``), so servers with different
encodings still copy correctly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict
from tenacity import (
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from applier.catalog import sql as catalog_sql
from tablesync.planner import PartitionTask

log = logging.getLogger("applier.tablesync")

#: ``part`` of the row through which a copy generation (one exported snapshot) claims a table.
CLAIM_PART = -1
#: SQLSTATE classes of errors an immediate retry cannot cure: the target refuses the rows themselves (22 data
#: exception, 23 integrity constraint violation), the statement (42: no privilege, e.g. the trust check's refusal
#: of an owner's trigger, or a missing table or column) or what it needs (0A: not supported, e.g. row-level
#: security for a non-superuser). A head-start stream that meets one reports it and the copy fails at once, into
#: ``applier status`` and the subscription's retry with backoff, instead of starting Spark to meet it four more
#: times.
DEFINITE_SQLSTATE_CLASSES = ("0A", "22", "23", "42")
#: Same value formats on both sides, so text COPY round-trips exactly (what the native worker sets, behaviour 1).
SESSION_OPTIONS = "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3"
#: How much of the COPY stream is gathered before it is handed to the target (fewer, larger writes): psycopg's
#: largest single write (``psycopg._copy_base.MAX_BUFFER_SIZE``; it splits bigger buffers, copying them).
WRITE_CHUNK = 128 * 1024


class SupersededError(RuntimeError):
    """A newer copy run has taken over this table: this task belongs to a killed run and must not copy."""


@dataclass(frozen=True)
class PartitionResult:
    task_id: int
    relname: str
    part: int
    rows: int
    bytes: int
    skipped: bool  # the marker existed: an earlier attempt had copied it
    seconds: float


_MARKER_LOOKUP = sql.SQL(catalog_sql.PARTITION_MARKER)
_CLAIM_LOOKUP = sql.SQL(catalog_sql.PARTITION_CLAIM)
_MARKER_INSERT = sql.SQL(catalog_sql.INSERT_PARTITION_MARKER)


def connect(conninfo: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A plain connection with the session options that make text COPY unambiguous on both sides."""
    params = conninfo_to_dict(conninfo)
    options = f"{params.get('options') or ''} {SESSION_OPTIONS}".strip()
    return psycopg.connect(conninfo, options=options, client_encoding="UTF8", **kwargs)


def _relay(pconn: psycopg.Connection[Any], copy_out: str, dst: psycopg.Copy) -> int:
    """Run ``copy_out`` (a ``COPY ... TO STDOUT``) on the publisher and write its raw data to ``dst`` in large
    writes; return the byte count.

    The publisher sends one CopyData message per row. psycopg's ``Copy.read()`` costs a generator and a wait loop
    per message (~0.65 µs of CPU a row, measured); here libpq is driven directly — ``PQgetCopyData``, one C call
    per row (~0.3 µs) — and rows are gathered into chunks of psycopg's largest single write. libpq is used in
    non-blocking mode and waits happen in ``select``: psycopg's ``pq`` calls keep the GIL while libpq blocks, which
    would freeze the driver's other threads (Spark starting) while the driver copies (:class:`HeadStart`).
    """
    pg = pconn.pgconn
    fd = pg.socket
    pg.send_query(copy_out.encode())
    while pg.flush() == 1:  # psycopg's connections are non-blocking: push the whole query out
        select.select([], [fd], [])
    res = _result(pg, fd)
    if res is None or res.status != pq.ExecStatus.COPY_OUT:
        while _result(pg, fd) is not None:
            pass
        raise _error(pconn, res)
    total = 0
    buf = bytearray()
    get, write, consume, wait = pg.get_copy_data, dst.write, pg.consume_input, select.select
    rlist: list[int] = [fd]
    while True:
        nbytes, data = get(1)
        if nbytes > 0:
            buf += data
            if len(buf) >= WRITE_CHUNK:
                total += len(buf)
                write(buf)
                buf = bytearray()
        elif nbytes == 0:  # nothing buffered: wait for the socket (without the GIL)
            wait(rlist, [], [])
            consume()
        else:  # -1: the end; -2: the connection failed
            break
    if nbytes == -2:
        raise psycopg.OperationalError(
            f"reading COPY data from the publisher failed: {pg.get_error_message().strip()}"
        )
    if buf:
        total += len(buf)
        write(buf)
    res = _result(pg, fd)
    while _result(pg, fd) is not None:
        pass
    if res is None or res.status != pq.ExecStatus.COMMAND_OK:
        raise _error(pconn, res)
    return total


def _result(pg: pq.abc.PGconn, fd: int) -> pq.abc.PGresult | None:
    """``PQgetResult`` once it cannot block (waiting in ``select``, which releases the GIL)."""
    while pg.is_busy():
        select.select([fd], [], [])
        pg.consume_input()
    return pg.get_result()


def _error(conn: psycopg.Connection[Any], res: pq.abc.PGresult | None) -> psycopg.Error:
    """The psycopg exception for a failed result (its SQLSTATE class), or for a lost connection."""
    if res is None or conn.pgconn.status != pq.ConnStatus.OK:
        return psycopg.OperationalError(
            f"publisher connection lost: {conn.pgconn.get_error_message().strip()}"
        )
    return psycopg.errors.error_from_result(res, encoding=conn.info.encoding)


class PartitionCopier:
    """Copies partitions one after another over two connections kept open between them.

    A Spark task usually gets several small partitions (many small tables are packed together, see
    :func:`tablesync.planner.pack_tasks`): opening two connections and importing the snapshot once per task
    instead of once per partition is most of the cost of a small table. The publisher connection stays in one
    ``REPEATABLE READ`` transaction on the imported snapshot for all its COPYs; on the target each partition is
    its own transaction with its marker.

    Any error closes both connections (their state is unknown); the next :meth:`copy` opens fresh ones.
    """

    def __init__(self, publisher_conninfo: str, target_conninfo: str, *, attempts: int = 6) -> None:
        self.publisher_conninfo = publisher_conninfo
        self.target_conninfo = target_conninfo
        self.attempts = attempts
        self._pconn: psycopg.Connection[Any] | None = None
        self._tconn: psycopg.Connection[Any] | None = None
        self._snapshot: str | None = None

    def __enter__(self) -> PartitionCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn in (self._pconn, self._tconn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._pconn = self._tconn = None
        self._snapshot = None

    def _target(self) -> psycopg.Connection[Any]:
        if self._tconn is None or self._tconn.closed:
            self._tconn = connect(self.target_conninfo, autocommit=False)
        return self._tconn

    def _publisher(self, snapshot: str) -> psycopg.Connection[Any]:
        """The publisher connection inside the imported snapshot (imported once per connection)."""
        if self._pconn is None or self._pconn.closed or self._snapshot != snapshot:
            if self._pconn is not None:
                with contextlib.suppress(Exception):
                    self._pconn.close()
            self._pconn = connect(self.publisher_conninfo, autocommit=True)
            self._pconn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self._pconn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            self._snapshot = snapshot
        return self._pconn

    def copy(self, task: PartitionTask) -> PartitionResult:
        """Copy one partition exactly once, retrying connection failures (a server restart, a dropped link) with
        backoff. Other errors (a bad row, an invalid snapshot, a superseded run) fail at once: Spark's own task
        retries then apply, and an exhausted or hopeless task fails the job with the server's message."""
        runner = retry(
            retry=retry_if_exception_type(psycopg.OperationalError),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=0.5, max=10),
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "copy of %s part %d failed (%s); retrying", task.relname, task.part, rs.outcome.exception()
            ),
        )(self._copy_once)
        return runner(task)

    def _copy_once(self, task: PartitionTask) -> PartitionResult:
        started = time.monotonic()
        key = (task.subid, task.relname, task.snapshot)
        try:
            tconn = self._target()
            tconn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"applier.tablesync:{task.subid}:{task.relname}:{task.part}",),
            )
            if tconn.execute(_CLAIM_LOOKUP, (*key, CLAIM_PART)).fetchone() is None:
                raise SupersededError(
                    f"copy of {task.relname} at snapshot {task.snapshot} was superseded by a newer run"
                )
            done = tconn.execute(_MARKER_LOOKUP, (*key, task.part)).fetchone()
            if done is not None:
                tconn.rollback()
                return PartitionResult(
                    task.task_id, task.relname, task.part, done[0], done[1], True, time.monotonic() - started
                )
            tconn.execute("SET LOCAL session_replication_role = replica")
            # Safe without waiting for the flush: the run's final catalog commit (synchronous) flushes the WAL
            # before it, so a partition lost in a crash can only be one whose table is not yet marked copied.
            tconn.execute("SET LOCAL synchronous_commit = off")
            tconn.execute(sql.SQL(task.lock_target))  # type: ignore[arg-type]
            if task.trust_check:  # after the lock: nothing the check passed can change before our commit
                tconn.execute(sql.SQL(task.trust_check))  # type: ignore[arg-type]
            # The claim is checked before the snapshot is imported: an orphaned task stops here either way.
            pconn, tcur = self._publisher(task.snapshot), tconn.cursor()
            with tcur.copy(sql.SQL(task.copy_in)) as dst:  # type: ignore[arg-type]
                nbytes = _relay(pconn, task.copy_out, dst)
            rows = tcur.rowcount
            tconn.execute(_MARKER_INSERT, (*key, task.part, rows, nbytes))
            tconn.commit()
        except BaseException:
            self.close()
            raise
        return PartitionResult(
            task.task_id, task.relname, task.part, rows, nbytes, False, time.monotonic() - started
        )


def copy_partition(
    task: PartitionTask, publisher_conninfo: str, target_conninfo: str, *, attempts: int = 6
) -> PartitionResult:
    """Copy one partition exactly once on connections of its own (see :meth:`PartitionCopier.copy`)."""
    with PartitionCopier(publisher_conninfo, target_conninfo, attempts=attempts) as copier:
        return copier.copy(task)


class HeadStart:
    """Copies partitions on the driver's machine while Spark starts, so the copy does not wait seconds for the JVM.

    A child process per stream (``multiprocessing`` spawn: a thread would hold the GIL between rows and slow every
    py4j call of the Spark start-up to a crawl) copies ``tasks`` one after another from the end of the list (the smallest
    partitions, which the Spark job would take last) until :meth:`stop`; the partition under way then finishes.
    Each is a normal exactly-once copy (:class:`PartitionCopier`): the Spark job leaves out the partitions in
    :attr:`done`, and a Spark task that reaches the one still under way waits for it on its advisory lock and finds
    its marker. A failure here is not the copy's: the partition is left to the Spark job, which retries and reports.
    """

    def __init__(
        self, tasks: list[PartitionTask], publisher_conninfo: str, target_conninfo: str, *, streams: int = 1
    ) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        todo = [dataclasses.asdict(t) for t in reversed(tasks)]
        self._procs: list[Any] = []
        self._results: list[Any] = []
        for i in range(max(1, streams)):  # stream i takes every streams-th partition, so they never collide
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_head_start_main,
                args=(todo[i :: max(1, streams)], publisher_conninfo, target_conninfo, self._stop, sender),
                name=f"tablesync-head-start-{i}",
                daemon=True,
            )
            with _main_module_left_out():
                proc.start()
            sender.close()
            self._procs.append(proc)
            self._results.append(receiver)
        self._done: set[int] = set()
        self._failure: str | None = None
        self._failure_relation: str | None = None

    @property
    def done(self) -> frozenset[int]:
        """Task ids copied (committed with their markers) by the head start so far."""
        for r in self._results:
            with contextlib.suppress(EOFError, OSError):
                while r.poll():
                    self._receive(r.recv())
        return frozenset(self._done)

    def _receive(self, item: Any) -> None:
        """One report of a head-start process: a task id it copied, or ``("failed", error, relation)`` (the first
        failure is kept)."""
        if not isinstance(item, tuple):
            self._done.add(item)
        elif self._failure is None:
            self._failure, self._failure_relation = item[1], item[2]

    @property
    def failure(self) -> str | None:
        """The error of a partition the target refused outright (DEFINITE_SQLSTATE_CLASSES), if one was met:
        the copy fails with it without waiting for Spark to fail the same way."""
        _ = self.done
        return self._failure

    @property
    def failure_relation(self) -> str | None:
        """The table of :attr:`failure` (``applier status`` shows it as the error's relation)."""
        _ = self.done
        return self._failure_relation

    def stop(self) -> None:
        """Take no new partition (the one under way finishes)."""
        self._stop.set()

    def wait(self) -> frozenset[int]:
        """Wait until every stream has ended on its own (its partitions copied, or one failed and left the rest
        to Spark), and return :attr:`done`."""
        for proc in self._procs:
            proc.join()
        return self.done

    def join(self) -> frozenset[int]:
        """Stop, wait for the partition under way, and return :attr:`done`."""
        self._stop.set()
        for proc in self._procs:
            proc.join()
        done = self.done
        for r in self._results:
            r.close()
        return done


@contextlib.contextmanager
def _main_module_left_out() -> Iterator[None]:
    """Start a spawned child without importing our main module in it.

    ``multiprocessing``'s spawn imports the parent's ``__main__`` (by name or path) in the child before the target
    runs: whatever program started the copy, and everything it imports, on the cores the copy needs, before the
    stream's first row (``python -m tablesync.testing``, which the benchmark runs, costs 0.3 s of CPU more per
    stream than this module alone; the ``applier`` CLI imports lazily and costs less). A head-start stream needs only
    this module (imported when its target is unpickled). The swap lasts as long as ``Process.start()`` (which reads
    ``sys.modules["__main__"]`` to prepare the child), a few milliseconds."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _head_start_main(
    todo: list[dict[str, Any]], publisher_conninfo: str, target_conninfo: str, stop: Any, results: Any
) -> None:
    parent = os.getppid()
    with PartitionCopier(publisher_conninfo, target_conninfo, attempts=1) as copier:
        for desc in todo:
            if stop.is_set() or os.getppid() != parent:  # stopped, or the driver died (kill -9)
                return
            task = PartitionTask(**desc)
            try:
                copier.copy(task)
            except Exception as exc:  # noqa: BLE001 - left to the Spark job, which reports real failures
                _give_up(exc, task, results)
                return
            results.send(task.task_id)


def refusal(exc: BaseException) -> str | None:
    """What to report when ``exc`` is an error every attempt would meet (:data:`DEFINITE_SQLSTATE_CLASSES`):
    ``psycopg.errors.Name: message``; None for an error a retry may cure."""
    if isinstance(exc, psycopg.Error) and (exc.sqlstate or "")[:2] in DEFINITE_SQLSTATE_CLASSES:
        return f"psycopg.errors.{type(exc).__name__}: {str(exc).strip()}"
    return None


def _give_up(exc: Exception, task: PartitionTask, results: Any) -> None:
    """The head start stops at a partition it could not copy: an error the target will give every attempt is
    reported (the copy fails with it); any other is left to the Spark job, which retries."""
    refused = refusal(exc)
    if refused is not None:
        # the target refuses these rows or this statement: every Spark attempt would too (after a JVM start)
        results.send(("failed", refused, task.relname))
        return
    log.info("head start: %s part %d left to Spark (%s)", task.relname, task.part, exc)
