"""bench/_trace.py's pure parts: strace's escaped strings back to bytes, the pgoutput kinds of a replication stream
split across reads, and the per-transaction segments of a prepared transaction's timeline."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _trace  # noqa: E402


def test_unescape_reads_strace_escapes() -> None:
    assert _trace.unescape(r"d\0\0\0\4n") == b"d\x00\x00\x00\x04n"
    # strace writes NUL before a digit as \000, so that the digit is not read as part of the escape
    assert _trace.unescape(r"live_12\0003") == b"live_12\x003"
    assert _trace.unescape(r"a\nb\"c\\d\377") == b'a\nb"c\\d\xff'


def _copydata(kind: bytes, body: bytes = b"") -> bytes:
    """One CopyData carrying an XLogData of pgoutput message ``kind``."""
    xlog = b"w" + bytes(24) + kind + body + b"\x00" * 4
    return b"d" + struct.pack(">i", 4 + len(xlog)) + xlog


def test_pgoutput_kinds_across_reads() -> None:
    stream = _copydata(b"B") + _copydata(b"U") + _copydata(b"C")
    keepalive = b"d" + struct.pack(">i", 4 + 18) + b"k" + bytes(17)
    reads = [(1.0, stream[:7], False), (2.0, stream[7:40], False), (3.0, stream[40:] + keepalive, False)]
    kinds, lost = _trace.pgoutput_kinds(reads)
    assert lost == 0
    assert [(t, idx, k) for t, idx, k in kinds] == [(2.0, 1, "B"), (3.0, 2, "U"), (3.0, 2, "C")]
    # a truncated read loses its messages; the stream restarts at the next read
    kinds, lost = _trace.pgoutput_kinds([(1.0, stream[:7], True), (2.0, _copydata(b"C"), False)])
    assert (lost, [k for _, _, k in kinds]) == (1, ["C"])


def test_per_xid_segments_and_the_tail() -> None:
    pub = {1: 10.0, 2: 20.0, 3: 30.0}
    read = {1: 10.001, 2: 20.001}
    out = {1: 10.002}
    tgt = {1: 10.010, 2: 20.003, 3: 30.5}
    segs = _trace.per_xid(pub, read, out, tgt)
    assert segs[1] == pytest.approx({"total": 0.010, "arrive": 0.001, "worker": 0.009, "apply": 0.001,
                                     "target": 0.008})  # fmt: skip
    assert set(segs[2]) == {"total", "arrive", "worker"}
    assert segs[3] == pytest.approx({"total": 0.5})
    tail = _trace.tail_split(segs, 99.0)
    assert tail["n"] == 1.0 and tail["total"] == pytest.approx(0.5)
