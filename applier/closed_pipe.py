"""Output to a closed pipe never stops a command half way (``applier status --json | head -1``).

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises :class:`BrokenPipeError` wherever the
command happens to print: a progress line of ``migrate abort`` would end the abort between two of its steps, with
a traceback, and the flush of the standard streams at exit would add "Exception ignored ... BrokenPipeError" and
turn the exit status into 120. The reader leaving says nothing about the work, so :func:`install` wraps
``sys.stdout`` and ``sys.stderr``: the first write or flush that meets a closed pipe points that stream's file
descriptor at ``os.devnull`` (``dup2``, as the Python documentation's "Note on SIGPIPE" recommends, so that the
interpreter's own flush at exit succeeds too), and the command goes on with its work and exits with its own status.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO, cast

__all__ = ["ClosedPipeGuard", "install"]


class ClosedPipeGuard:
    """A text stream that passes everything to ``stream`` and, once the reader of its pipe has gone, quietly
    writes to ``os.devnull`` instead. Anything but writing (``fileno``, ``encoding``, ``isatty``...) is the wrapped
    stream's own, so logging handlers, rich and faulthandler see the stream they expect."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.closed_pipe = False  # the reader has gone: output now goes nowhere

    @property
    def wrapped(self) -> TextIO:
        return self._stream

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._to_devnull()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Flushed even after the switch: what the stream still buffers goes to ``os.devnull``, so that its
        buffer is empty before the interpreter's own flush at exit."""
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()

    def _to_devnull(self) -> None:
        """Point the stream's descriptor at ``os.devnull``: the stream object stays (others hold it, and the
        interpreter flushes it at exit), only where its bytes go changes."""
        self.closed_pipe = True
        # no descriptor (an in-memory stream): dropping the output is enough
        with contextlib.suppress(OSError, ValueError):
            fd = self._stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _guarded(stream: TextIO | None) -> TextIO | None:
    if stream is None or isinstance(stream, ClosedPipeGuard):
        return stream
    return cast(TextIO, ClosedPipeGuard(stream))


def install() -> None:
    """Guard ``sys.stdout`` and ``sys.stderr`` (once: a second call changes nothing). Called first thing by the
    console entry point, before anything has printed or kept a reference to either stream."""
    sys.stdout = cast(TextIO, _guarded(sys.stdout))
    sys.stderr = cast(TextIO, _guarded(sys.stderr))
