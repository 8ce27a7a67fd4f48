"""The guard of the standard streams (:mod:`applier.closed_pipe`) on a real pipe whose reader has gone: no write or
flush raises, and the descriptor then points at ``os.devnull``, so that the interpreter's own flush at exit
succeeds too. The command line's use of it is tested end to end in tests/integration/test_cli_errors.py."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator

import pytest

from applier import closed_pipe
from applier.closed_pipe import ClosedPipeGuard


@pytest.fixture
def closed_pipe_stream() -> Iterator[io.TextIOWrapper]:
    """A text stream writing to a pipe whose read end is closed, as ``| head -1`` leaves stdout."""
    read, write = os.pipe()
    os.close(read)
    stream = open(write, "w", encoding="utf-8")  # closed below
    yield stream
    stream.close()


def _is_devnull(fd: int) -> bool:
    here, null = os.fstat(fd), os.stat(os.devnull)
    return (here.st_dev, here.st_ino) == (null.st_dev, null.st_ino)


def test_a_write_to_a_closed_pipe_switches_to_devnull(closed_pipe_stream: io.TextIOWrapper) -> None:
    guard = ClosedPipeGuard(closed_pipe_stream)
    assert not _is_devnull(closed_pipe_stream.fileno())
    # more than the buffer holds: written at once, into the closed pipe
    assert guard.write("x" * 100_000) == 100_000
    assert guard.closed_pipe
    assert _is_devnull(closed_pipe_stream.fileno())
    guard.write("more\n")
    guard.writelines(["and\n", "more\n"])
    guard.flush()
    closed_pipe_stream.flush()  # the wrapped stream itself flushes cleanly now (as the interpreter's exit does)


def test_a_flush_to_a_closed_pipe_switches_to_devnull(closed_pipe_stream: io.TextIOWrapper) -> None:
    guard = ClosedPipeGuard(closed_pipe_stream)
    guard.write("short\n")  # buffered: the pipe is met at the flush
    assert not guard.closed_pipe
    guard.flush()
    assert guard.closed_pipe and _is_devnull(closed_pipe_stream.fileno())


def test_an_open_pipe_is_left_alone() -> None:
    read, write = os.pipe()
    with open(read, encoding="utf-8") as reader, open(write, "w", encoding="utf-8") as writer:
        guard = ClosedPipeGuard(writer)
        guard.write("hello\n")
        guard.flush()
        assert reader.readline() == "hello\n"
        assert not guard.closed_pipe
        assert guard.fileno() == writer.fileno() and guard.encoding == writer.encoding  # the stream's own


def test_install_guards_both_streams_once(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    closed_pipe.install()
    closed_pipe.install()
    assert isinstance(sys.stdout, ClosedPipeGuard) and sys.stdout.wrapped is out
    assert isinstance(sys.stderr, ClosedPipeGuard) and sys.stderr.wrapped is err
    print("via the guard")
    assert out.getvalue() == "via the guard\n"
