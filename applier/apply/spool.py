"""Streamed (in-progress) transactions spooled to disk until their Stream Commit / Stream Prepare / Stream Abort.

A streamed transaction can be arbitrarily large, so its changes never stay in memory: each chunk between Stream
Start and Stream Stop is appended to one file per remote top-level xid (``<subid>-<xid>.changes``), as
``int32 length | raw pgoutput message`` records (the bytes as received, including the subtransaction-xid prefix;
they are decoded again with ``in_stream=True`` at replay). That mirrors ``stream_write_change`` in worker.c
(behaviours 84-88) without its FileSet: our files live in a directory of our own and are removed when the
transaction ends and at start-up (a restarted stream re-sends everything after the origin position, behaviour 89).

For subtransaction aborts we remember, per top-level xid, the file offset where each subtransaction's first change
was written; an abort of subxact S truncates the file back to S's offset and forgets S and every later subxact
(behaviour 87). A subxact that is not in the list (it had no changes, or an earlier abort already discarded it) is
ignored. That list is small (one pair per subtransaction with changes), so it stays in memory.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

_LEN = struct.Struct(">i")
_READ_BUFFER = 1 << 20
#: messages above this size are written on their own by Spool.write_batch
_BATCH_MESSAGE_MAX = 1 << 16


@dataclass
class _Xact:
    path: Path
    size: int = 0
    #: (subxid, offset of its first change), in the order they appeared
    subxacts: list[tuple[int, int]] = field(default_factory=list)
    known_subxids: set[int] = field(default_factory=set)
    changes: int = 0


class Spool:
    """Files of the streamed transactions of one subscription, in ``directory``."""

    def __init__(self, directory: Path, subid: int) -> None:
        self.directory = directory
        self.subid = subid
        self._xacts: dict[int, _Xact] = {}
        self._open_xid: int | None = None
        self._file: BinaryIO | None = None

    # --- lifecycle -------------------------------------------------------------------------------------------
    def cleanup(self) -> int:
        """Remove every spool file of this subscription (start-up, after an error); return how many."""
        self.close_chunk()
        self._xacts.clear()
        removed = 0
        if self.directory.is_dir():
            for p in self.directory.glob(f"{self.subid}-*.changes"):
                p.unlink(missing_ok=True)
                removed += 1
            with contextlib.suppress(OSError):  # only if empty: the directory may be shared
                self.directory.rmdir()
        return removed

    def _path(self, xid: int) -> Path:
        return self.directory / f"{self.subid}-{xid}.changes"

    # --- chunks ----------------------------------------------------------------------------------------------
    def start_chunk(self, xid: int, first_segment: bool) -> None:
        """Stream Start: (re)open the file of ``xid`` for appending. A first segment starts a new file (a stale
        one from an earlier attempt is replaced)."""
        self.close_chunk()
        xact = self._xacts.get(xid)
        if first_segment or xact is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            xact = _Xact(self._path(xid))
            self._xacts[xid] = xact
            self._file = open(xact.path, "wb")  # noqa: SIM115 - closed by close_chunk
        else:
            self._file = open(xact.path, "ab")  # noqa: SIM115
        self._open_xid = xid

    def write(self, subxid: int | None, payload: bytes) -> None:
        """Append one change message (raw bytes as received) of the open chunk."""
        xid = self._open_xid
        if xid is None or self._file is None:
            raise RuntimeError("spool write outside a stream chunk")
        xact = self._xacts[xid]
        if subxid is not None and subxid != xid and subxid not in xact.known_subxids:
            xact.known_subxids.add(subxid)
            xact.subxacts.append((subxid, xact.size))
        self._file.write(_LEN.pack(len(payload)) + payload)
        xact.size += 4 + len(payload)
        xact.changes += 1

    def write_batch(self, messages: Sequence[bytes | memoryview], offset: int) -> None:
        """Append several change messages of the open chunk at once: ``messages[i][offset:]`` is each one's raw
        bytes (``offset`` skips an envelope). Same records and bookkeeping as :meth:`write` one by one, with the
        per-message work done as array operations and a single ``write``. Every message must be at least
        5 bytes long (type byte and subtransaction xid)."""
        xid = self._open_xid
        if xid is None or self._file is None:
            raise RuntimeError("spool write outside a stream chunk")
        start = 0
        for i, m in enumerate(messages):
            if (
                len(m) > _BATCH_MESSAGE_MAX
            ):  # a large value: written on its own (index arrays cost 16 bytes a byte)
                self._write_many(messages[start:i], offset)
                self.write(int.from_bytes(m[offset + 1 : offset + 5], "big"), bytes(m[offset:]))
                start = i + 1
        self._write_many(messages[start:], offset)

    def _write_many(self, messages: Sequence[bytes | memoryview], offset: int) -> None:
        xid = self._open_xid
        assert xid is not None and self._file is not None
        xact = self._xacts[xid]
        count = len(messages)
        if not count:
            return
        lens = np.fromiter(map(len, messages), dtype=np.int64, count=count)
        src_end = np.cumsum(lens)
        src_start = src_end - lens + offset
        data = np.frombuffer(b"".join(messages), dtype=np.uint8)
        sizes = lens - offset  # record payload sizes
        if (sizes < 5).any():
            raise ValueError("a streamed change shorter than its type byte and xid")
        subxids = np.zeros(count, dtype=np.int64)
        for k in range(1, 5):
            subxids = (subxids << 8) | data[src_start + k]
        rec_end = np.cumsum(sizes + 4)
        rec_start = rec_end - sizes - 4  # where each record's int32 length goes, relative to xact.size
        uniq, first = np.unique(subxids, return_index=True)
        for i in np.argsort(first).tolist():  # in order of first appearance
            subxid = int(uniq[i])
            if subxid != xid and subxid not in xact.known_subxids:
                xact.known_subxids.add(subxid)
                xact.subxacts.append((subxid, xact.size + int(rec_start[first[i]])))
        total = int(rec_end[-1])
        out = np.empty(total, dtype=np.uint8)
        header = rec_start.reshape(-1, 1) + np.arange(4)
        out[header] = sizes.astype(">i4").view(np.uint8).reshape(-1, 4)
        # every payload byte: its source index is its output index shifted by its record's offset
        mask = np.ones(total, dtype=bool)
        mask[header.ravel()] = False
        positions = np.flatnonzero(mask)
        out[positions] = data[positions + np.repeat(src_start - rec_start - 4, sizes)]
        self._file.write(out.tobytes())
        xact.size += total
        xact.changes += count

    def close_chunk(self) -> None:
        """Stream Stop: close the file (the data stays until commit/prepare/abort)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._open_xid = None

    @property
    def open_xid(self) -> int | None:
        return self._open_xid

    # --- endings ---------------------------------------------------------------------------------------------
    def abort(self, xid: int, subxid: int) -> None:
        """Stream Abort: the whole transaction (``subxid == xid``) or one subtransaction (behaviour 87)."""
        xact = self._xacts.get(xid)
        if xact is None:  # nothing was spooled (PG18 may send an abort for an early-aborted xact only)
            return
        if subxid == xid:
            self.discard(xid)
            return
        for i in range(len(xact.subxacts) - 1, -1, -1):
            if xact.subxacts[i][0] == subxid:
                offset = xact.subxacts[i][1]
                for sx, _ in xact.subxacts[i:]:
                    xact.known_subxids.discard(sx)
                del xact.subxacts[i:]
                with open(xact.path, "r+b") as f:
                    f.truncate(offset)
                xact.size = offset
                return

    def discard(self, xid: int) -> None:
        """Forget ``xid`` and remove its file."""
        if self._open_xid == xid:
            self.close_chunk()
        xact = self._xacts.pop(xid, None)
        if xact is not None:
            xact.path.unlink(missing_ok=True)

    def has(self, xid: int) -> bool:
        return xid in self._xacts

    def size(self, xid: int) -> int:
        xact = self._xacts.get(xid)
        return 0 if xact is None else xact.size

    def replay(self, xid: int) -> Iterator[bytes]:
        """The spooled messages of ``xid`` in order, one by one."""
        for buffer, starts, ends in self.replay_batches(xid):
            for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
                yield buffer[start:end]

    def replay_batches(self, xid: int) -> Iterator[tuple[bytes, np.ndarray, np.ndarray]]:
        """The spooled messages of ``xid`` in order, a read at a time: ``(buffer, starts, ends)`` with message
        ``i`` at ``buffer[starts[i]:ends[i]]``. Memory stays flat: one read of :data:`_READ_BUFFER` bytes (or
        one record, when a record is larger)."""
        xact = self._xacts.get(xid)
        if xact is None:
            return
        if self._open_xid == xid:
            self.close_chunk()
        with open(xact.path, "rb", buffering=0) as f:
            remaining = xact.size
            carry = b""
            while remaining > 0:
                chunk = f.read(min(_READ_BUFFER, remaining))
                if not chunk:
                    raise OSError(f"spool file {xact.path} is truncated")
                remaining -= len(chunk)
                buffer = carry + chunk if carry else chunk
                starts, ends, off = _records(buffer)
                carry = buffer[off:]
                if starts:
                    yield buffer, np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
            if carry:
                raise OSError(f"spool file {xact.path} is truncated")

    def __len__(self) -> int:
        return len(self._xacts)


def _records(buffer: bytes) -> tuple[list[int], list[int], int]:
    """The whole ``int32 length | message`` records at the start of ``buffer``: their messages' starts and ends,
    and the offset where the first incomplete record (carried into the next read) begins."""
    unpack = _LEN.unpack_from
    starts: list[int] = []
    ends: list[int] = []
    off = 0
    size = len(buffer)
    while off + 4 <= size:
        (n,) = unpack(buffer, off)
        end = off + 4 + n
        if end > size:
            break
        starts.append(off + 4)
        ends.append(end)
        off = end
    return starts, ends, off


def default_spool_dir() -> Path:
    """Per-user directory under the system temporary directory."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"applier-spool-{os.getuid()}"
