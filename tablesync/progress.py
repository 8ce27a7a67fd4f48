"""Visible progress of the initial copy: bars on a terminal, plain lines otherwise, log records in a long-running
process (``applier run``, whose stderr is its log: plain lines there broke ``--log-format json``).

The source of truth is the catalog: every committed partition has a marker row with its rows and bytes, and the
driver polls them while the Spark job runs (the tasks run in other processes, possibly on other machines, so the
markers are the one place every task reports to). Progress is measured in heap pages: each partition is a page
range, so "pages of finished partitions / pages planned" is a fair fraction even though rows vary in width.

No dependency: a few ANSI escapes redraw a block of lines in place on a terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

from applier.humanize import human_bytes

#: ``{relname: {part: (rows, bytes)}}`` — the committed partition markers of this copy.
Markers = Mapping[str, Mapping[int, tuple[int, int]]]


def human_duration(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def bar(fraction: float, width: int = 24) -> str:
    fraction = min(1.0, max(0.0, fraction))
    filled = int(fraction * width)
    return "#" * filled + "-" * (width - filled)


@dataclass
class _Table:
    name: str
    part_pages: dict[int, int]
    rows: int = 0
    bytes: int = 0
    done_parts: int = 0
    done_pages: int = 0
    finished: bool = False
    reported: bool = False

    @property
    def total_pages(self) -> int:
        return max(1, sum(self.part_pages.values()))

    @property
    def fraction(self) -> float:
        return 1.0 if self.finished else min(0.99, self.done_pages / self.total_pages)


@dataclass
class CopyProgress:
    """Reports progress of one initial copy.

    ``mode``: ``"bars"`` (redrawn block on a terminal), ``"lines"`` (a line per finished table and a summary
    every ``interval`` seconds: CI, pipes), ``"log"`` (the same lines as INFO records of ``logger``, each after
    ``prefix``: :meth:`to_log`) or ``"off"``. :meth:`for_setting` maps ``run_initial_copy``'s ``progress`` argument
    to a mode.
    """

    mode: str = "lines"
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    logger: logging.Logger | None = None
    prefix: str = ""
    interval: float = 10.0
    max_live_lines: int = 8
    _tables: dict[str, _Table] = field(default_factory=dict)
    _started: float = 0.0
    _drawn: int = 0
    _last_line: float = 0.0

    @classmethod
    def for_setting(cls, progress: bool | None, stream: TextIO | None = None) -> CopyProgress:
        """``None``: bars when ``stream`` is a terminal, lines otherwise; ``True``: bars; ``False``: plain lines
        (a log keeps a record of the copy either way; :class:`tablesync.InitialCopy` takes ``mode="off"``)."""
        stream = stream if stream is not None else sys.stderr
        if progress is False:
            return cls("lines", stream)
        if progress is None:
            isatty = getattr(stream, "isatty", None)
            return cls("bars" if isatty is not None and isatty() else "lines", stream)
        return cls("bars", stream)

    @classmethod
    def to_log(cls, logger: logging.Logger, prefix: str = "") -> CopyProgress:
        """Progress as log records: a record per note, per finished table and per ``interval``'s summary."""
        return cls("log", logger=logger, prefix=prefix)

    # -- output ----------------------------------------------------------------------------------------------
    def _write(self, text: str) -> None:
        if self.mode == "log":
            for line in text.splitlines():
                if line.strip() and self.logger is not None:
                    self.logger.info("%s%s", self.prefix, line.strip().removeprefix("tablesync: "))
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not fail the copy
            pass

    def _clear_block(self) -> None:
        if self._drawn:
            self._write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def note(self, message: str) -> None:
        """A one-off message (the Spark UI address, a slow slot creation) printed above the bars."""
        if self.mode == "off":
            return
        self._clear_block()
        self._write(f"tablesync: {message}\n")
        self._redraw()

    # -- the copy --------------------------------------------------------------------------------------------
    def start(self, part_pages: Mapping[str, Mapping[int, int]]) -> None:
        """Begin with the planned partitions: ``{relname: {part: pages}}``."""
        self._tables = {name: _Table(name, dict(parts)) for name, parts in sorted(part_pages.items())}
        self._started = self._last_line = time.monotonic()
        total_pages = sum(t.total_pages for t in self._tables.values())
        nparts = sum(len(t.part_pages) for t in self._tables.values())
        self.note(
            f"copying {len(self._tables)} table(s), ~{human_bytes(total_pages * 8192)} on disk, "
            f"in {nparts} partition(s)"
        )

    def update(self, markers: Markers) -> None:
        """Take the current partition markers and redraw (bars) or print what changed (lines)."""
        for name, parts in markers.items():
            t = self._tables.get(name)
            if t is None:
                continue
            t.done_parts = len(parts)
            t.rows = sum(r for r, _ in parts.values())
            t.bytes = sum(b for _, b in parts.values())
            t.done_pages = sum(t.part_pages.get(p, 0) for p in parts)
            t.finished = t.done_parts >= len(t.part_pages)
        if self.mode == "bars":
            self._clear_block()
            self._print_finished()
            self._redraw()
        elif self.mode in ("lines", "log"):
            self._print_finished()
            now = time.monotonic()
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._write(self._overall_line() + "\n")

    def finish(self) -> None:
        if self.mode == "off":
            return
        self._clear_block()
        self._print_finished()
        self._write(self._overall_line(final=True) + "\n")

    # -- rendering -------------------------------------------------------------------------------------------
    def _totals(self) -> tuple[int, int, float]:
        rows = sum(t.rows for t in self._tables.values())
        nbytes = sum(t.bytes for t in self._tables.values())
        pages = sum(t.total_pages for t in self._tables.values()) or 1
        done = sum(t.total_pages if t.finished else t.done_pages for t in self._tables.values())
        return rows, nbytes, min(1.0, done / pages)

    def _overall_line(self, final: bool = False) -> str:
        rows, nbytes, frac = self._totals()
        elapsed = max(1e-6, time.monotonic() - self._started)
        done = sum(1 for t in self._tables.values() if t.finished)
        rate = f"{human_bytes(nbytes / elapsed)}/s, {rows / elapsed:,.0f} rows/s"
        if final:
            return (
                f"tablesync: copied {done}/{len(self._tables)} table(s), {rows:,} rows, {human_bytes(nbytes)} "
                f"in {human_duration(elapsed)} ({rate})"
            )
        eta = human_duration(elapsed * (1 - frac) / frac) if frac > 0 else "?"
        return (
            f"tablesync: [{bar(frac)}] {frac * 100:3.0f}%  {done}/{len(self._tables)} tables  {rows:,} rows  "
            f"{human_bytes(nbytes)}  {rate}  elapsed {human_duration(elapsed)}  ETA {eta}"
        )

    def _table_line(self, t: _Table) -> str:
        elapsed = max(1e-6, time.monotonic() - self._started)
        if t.finished:
            return f"  {t.name}: done, {t.rows:,} rows, {human_bytes(t.bytes)} (at {human_duration(elapsed)})"
        line = (
            f"  {t.name:<30} [{bar(t.fraction, 16)}] {t.fraction * 100:3.0f}%  "
            f"{t.done_parts}/{len(t.part_pages)} parts  {t.rows:,} rows  {human_bytes(t.bytes)}"
        )
        if t.done_parts:  # tables copy side by side: rate and ETA are over the whole copy's elapsed time
            eta = human_duration(elapsed * (1 - t.fraction) / t.fraction)
            line += f"  {human_bytes(t.bytes / elapsed)}/s  ETA {eta}"
        return line

    def _print_finished(self) -> None:
        for t in self._tables.values():
            if t.finished and not t.reported:
                t.reported = True
                self._write(self._table_line(t) + "\n")

    def _redraw(self) -> None:
        if self.mode != "bars" or not self._tables:
            return
        live = [t for t in self._tables.values() if not t.finished]
        # Tables under way first, then those not started; the rest is summarised in one line.
        live.sort(key=lambda t: (t.done_parts == 0, t.name))
        lines = [self._table_line(t) for t in live[: self.max_live_lines]]
        if len(live) > self.max_live_lines:
            lines.append(f"  ... and {len(live) - self.max_live_lines} more table(s)")
        lines.append(self._overall_line())
        self._write("\n".join(lines) + "\n")
        self._drawn = len(lines)
