"""COPY for long runs of inserts on the target session (:mod:`applier.apply.insert_sink` decides when).

COPY cannot run in pipeline mode, so the pipeline is drained and left first; rows are sent in COPY text format,
buffered into chunks of :data:`_COPY_CHUNK` bytes. Anything else that needs the connection ends the COPY first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.apply.context import ApplyError, ErrorContext
from applier.apply.pipeline import _S, Pipeline, TargetConnectionError, _result_error
from applier.apply.ports import copy_eligible
from applier.apply.relmap import RelMapEntry
from applier.messages import TupleData

_COPY_CHUNK = 1 << 18


def _copy_escape(v: bytes | None) -> bytes:
    """One value in COPY text format. UTF-8 continuation bytes are never ASCII, so escaping byte-wise is exact."""
    if v is None:
        return b"\\N"
    if b"\\" in v or b"\t" in v or b"\n" in v or b"\r" in v:
        return v.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    return v


class CopyIn:
    """The COPY of one target session: :attr:`run` is the open one, if any."""

    def __init__(self, conn: psycopg.Connection[Any], pipeline: Pipeline) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.pipeline = pipeline
        self.run: _CopyRun | None = None

    def start(self, entry: RelMapEntry, rows: Sequence[TupleData], ctx: ErrorContext | None) -> None:
        """Begin a COPY for a run of inserts into ``entry`` and send ``rows``; later :meth:`insert` calls for the
        same relation go into the COPY until something else needs the connection."""
        self.end()
        self.pipeline.exit()
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in entry.names)
        q = (
            sql.SQL("COPY {} ({}) FROM STDIN")
            .format(sql.Identifier(entry.local.schema, entry.local.name), cols)
            .as_bytes(self.conn)
        )
        pgconn = self.pgconn
        pgconn.send_query(q)
        while True:
            self._wait_result()
            res = pgconn.get_result()
            if res is None:  # pragma: no cover
                raise TargetConnectionError("COPY did not start")
            if res.status == _S.COPY_IN:
                break
            if res.status == _S.FATAL_ERROR:
                err = _result_error(res, ctx)
                while pgconn.get_result() is not None:
                    pass
                raise err
        self.run = _CopyRun(self, entry, ctx)
        for r in rows:
            self.run.add(r)

    def _wait_result(self) -> None:
        while self.pgconn.is_busy():
            self.pipeline._wait(None)

    @property
    def copy_entry(self) -> RelMapEntry | None:
        """The relation an open COPY writes into, if any."""
        return None if self.run is None else self.run.entry

    @property
    def copy_run(self) -> _CopyRun | None:
        """The open COPY, if any (its ``add`` takes rows directly)."""
        return self.run

    def end(self) -> None:
        copy = self.run
        if copy is None:
            return
        self.run = None
        copy.finish()

    @staticmethod
    def copy_eligible(t: TupleData) -> bool:
        """COPY text format can carry text values and NULLs; binary values go through INSERT."""
        return copy_eligible(t)


class _CopyRun:
    """An open ``COPY ... FROM STDIN`` (text format) into one relation."""

    def __init__(self, target: CopyIn, entry: RelMapEntry, ctx: ErrorContext | None) -> None:
        self.target = target
        self.entry = entry
        self.ctx = ctx
        self.buf = bytearray()
        self.rows = 0

    def accepts(self, t: TupleData) -> bool:
        return copy_eligible(t)

    def add(self, t: TupleData) -> None:
        """Append one row in COPY text format (tab-separated, ``\\N`` for NULL, backslash escapes)."""
        values = t.values
        if None not in values:
            line = b"\t".join(values)
            # fast path: nothing to escape (the only tabs are our separators)
            if (
                b"\\" not in line
                and b"\n" not in line
                and b"\r" not in line
                and line.count(b"\t") == len(values) - 1
            ):
                self.buf += line + b"\n"
                self.rows += 1
                if len(self.buf) >= _COPY_CHUNK:
                    self._send()
                return
        self.buf += b"\t".join([_copy_escape(v) for v in values]) + b"\n"
        self.rows += 1
        if len(self.buf) >= _COPY_CHUNK:
            self._send()

    def add_text(self, text: bytes, rows: int) -> None:
        """Append ``rows`` rows already in COPY text format (from :mod:`applier.apply.copytext`)."""
        self.buf += text
        self.rows += rows
        if len(self.buf) >= _COPY_CHUNK:
            self._send()

    def _send(self) -> None:
        pgconn = self.target.pgconn
        data = bytes(self.buf)
        self.buf.clear()
        while pgconn.put_copy_data(data) == 0:
            self.target.pipeline._wait(1.0)
        self.target.pipeline._flush_some()

    def finish(self) -> None:
        pgconn = self.target.pgconn
        if self.buf:
            self._send()
        while pgconn.put_copy_end() == 0:
            self.target.pipeline._wait(1.0)
        while not self.target.pipeline._flush_some():
            self.target.pipeline._wait(1.0)
        error: ApplyError | None = None
        while True:
            self.target._wait_result()
            res = pgconn.get_result()
            if res is None:
                break
            if res.status == _S.FATAL_ERROR and error is None:
                error = _result_error(res, self.ctx)
        if error is not None:
            raise error
