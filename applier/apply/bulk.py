"""Whole plain transactions applied a batch at a time: each table's stretch of Inserts, Updates or Deletes as one
statement.

Why: on a backlog of small transactions (an UPDATE and an INSERT each, say) the worker spent ~40 µs of Python per
transaction turning every message into objects and every change into a pipelined statement, and its target backend
another ~18 µs executing them; PostgreSQL's own apply worker needs ~15 µs for all of it. Here a batch of messages,
as read, is looked at with array operations: where it holds whole transactions made only of Begin, Inserts,
Updates that keep their key (no old tuple), Deletes by key, Origin and Commit, those transactions are applied
together, inside the open group commit (they would share its one local transaction anyway). Each table's changes
are cut into stretches of one kind, in the table's own order, and each stretch becomes a single statement whose
values travel as one array parameter per column (``unnest``): an INSERT ... SELECT, an UPDATE from the *last* new
tuple of each key, or a DELETE ... USING the keys.

What that changes, and why it is safe where it is used:

* Changes of *different* tables inside the group are no longer applied in their publisher order. Nothing on the
  target can see that order: the apply session runs with ``session_replication_role = replica``, so ordinary
  triggers and foreign-key checks do not fire, and every statement is inside the group's one local transaction.
  Tables that *do* observe it, those with triggers or rules enabled ``REPLICA`` or ``ALWAYS``, are never applied
  this way (:attr:`applier.apply.relmap.LocalTable.bulk`), nor are partitioned tables, nor tables whose columns
  use a nondeterministic collation (two keys the table calls equal could then both be "the last one").
* Several updates of one row inside a stretch become one: the row ends as the last one left it, as it would have.
  Intermediate states never exist on the target, which only unique constraints checked row by row could tell; a
  statement that fails for that (or any) reason fails the group, and the worker applies those transactions again
  one at a time (see ``ApplyWorker._apply_failed``), exactly as the native worker would.
* An UPDATE or DELETE whose row is missing is still skipped and logged as an ``update_missing`` /
  ``delete_missing`` conflict, once per message, with that message's transaction in the context: the statement
  returns the positions of those messages.

An Update with an unchanged-TOAST value, or an Update or Delete with a NULL key, is applied on its own, by the
row-by-row statement that handles its shape, in its place in its table's order. Anything else not of that simple
shape (a Relation message, a Truncate, an Update or Delete with an old tuple, binary values, a value that needs its
precise decoding error) ends the stretch of transactions that can go this way; the rest take the message-by-message
path, in order. Pure code over bytes, like :mod:`applier.apply.copytext`: the
:class:`~applier.apply.handlers.Applier` sends what :func:`plan` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from applier.apply.copytext import source_positions, tuple_segments

_I64 = np.int64
#: message type bytes
BEGIN, COMMIT, INSERT, UPDATE, DELETE, ORIGIN = 66, 67, 73, 85, 68, 79
_NEW, _KEY = 78, 75  # 'N', 'K'
_QUOTE, _BACKSLASH, _COMMA = 34, 92, 44
_OPEN, _CLOSE = 123, 125
#: the message sizes, envelope (25 bytes) included, of a Begin and a Commit
_BEGIN_SIZE, _COMMIT_SIZE = 25 + 21, 25 + 26
#: a transaction stretch shorter than this goes message by message: a bulk statement is parsed and planned anew
#: each time (~0.1 ms), which a handful of pipelined prepared statements beat
MIN_TRANSACTIONS = 8
#: messages larger than this go message by message (their values would make the index arrays large)
MAX_MESSAGE = 1 << 16


class Batch:
    """The XLogData messages of one read, envelope included, joined once, with what :func:`plan` needs per message
    and per transaction. A transaction here is a Begin, the next Commit and what lies between, when the Commit
    comes before the next Begin; it *qualifies* when every message between is an Insert, an Update with no old
    tuple, a Delete by key, or an Origin, and its Begin and Commit are well formed and agree on the final LSN."""

    def __init__(self, messages: Sequence[bytes | memoryview]) -> None:
        lens = np.fromiter(map(len, messages), dtype=_I64, count=len(messages))
        self.ends = np.cumsum(lens)
        self.starts = self.ends - lens
        buffer = b"".join(messages)
        self.null_at = len(buffer)
        self.data = np.frombuffer(buffer + b"NULL", dtype=np.uint8)
        data, starts = self.data, self.starts
        last = self.null_at - 1
        kind = data[np.minimum(starts + 25, last)]
        kind = np.where(lens > 25, kind, 0)
        self.kind = kind
        ok = self._read_changes(lens)
        self._pair_transactions(lens, ok)
        #: messages before this one go message by message (set by the applier when it refused a run)
        self.refused_until = 0
        self._refused: set[int] = set()
        self._refused_at = np.zeros(0, dtype=_I64)  # the change messages of refused relations

    def _read_changes(self, lens: np.ndarray) -> np.ndarray:
        """Find the change messages (:attr:`change`, :attr:`relid`); returns which messages may be inside a
        qualifying transaction (a change or an Origin)."""
        data, starts, kind = self.data, self.starts, self.kind
        # relation id of Inserts, Updates and Deletes (-1 elsewhere), read where it is in all three; then a tuple:
        # the new one ('N'), or for a Delete the key ('K')
        change = (
            ((kind == INSERT) | (kind == UPDATE) | (kind == DELETE))
            & (lens >= 25 + 8)
            & (lens <= MAX_MESSAGE)
        )
        p = np.where(change, starts + 26, 0)
        relid = np.zeros(len(starts), dtype=_I64)
        for i in range(4):
            relid = (relid << 8) | data[p + i]
        change &= data[p + 4] == np.where(kind == DELETE, _KEY, _NEW)
        self.relid = np.where(change, relid, -1)
        self.change = change
        return change | (kind == ORIGIN)

    def _pair_transactions(self, lens: np.ndarray, ok: np.ndarray) -> None:
        """Find the transactions (:attr:`begins`, :attr:`commits`), read their Begin and Commit fields, and decide
        which qualify (:attr:`qualifies`) and where each run of qualifying ones ends."""
        data, starts, kind, last = self.data, self.starts, self.kind, self.null_at - 1
        # transactions: each Begin with the first Commit after it, if no other Begin comes first
        begins = np.flatnonzero(kind == BEGIN)
        commits = np.flatnonzero(kind == COMMIT)
        k = np.searchsorted(commits, begins)
        has_commit = k < len(commits)
        commit_of = np.full(len(begins), -1, dtype=_I64)
        commit_of[has_commit] = commits[k[has_commit]]
        next_begin = np.append(begins[1:], len(starts))
        paired = has_commit & (commit_of < next_begin)
        self.begins = begins[paired]
        self.commits = commit_of[paired]
        b, c = self.begins, self.commits
        # every message between its Begin and Commit qualifies
        bad_before = np.concatenate(([0], np.cumsum(~ok)))
        qualifies = bad_before[c] - bad_before[b + 1] == 0
        qualifies &= (lens[b] == _BEGIN_SIZE) & (lens[c] == _COMMIT_SIZE)
        qualifies &= data[np.minimum(starts[c] + 26, last)] == 0  # the Commit's flags
        self.final_lsn = _u64(data, starts[b] + 26)
        self.xid = _u32(data, starts[b] + 42)
        commit_lsn = _u64(data, starts[c] + 27)
        self.end_lsn = _u64(data, starts[c] + 35)
        self.commit_time = _u64(data, starts[c] + 43).astype(_I64)
        qualifies &= (self.final_lsn != 0) & (self.final_lsn == commit_lsn)
        self.qualifies = qualifies
        # runs: from a transaction on, the next ones as long as each qualifies and begins right after the Commit
        # before it (between transactions there may be anything: a prepared transaction, a Relation message)
        gap = np.ones(len(b), dtype=bool)
        gap[1:] = b[1:] != c[:-1] + 1
        self._run_end = np.minimum(_next_true(~qualifies, 0), _next_true(gap, 1))
        self._index = {int(x): i for i, x in enumerate(b.tolist())}

    def transaction_at(self, message: int) -> int | None:
        """The transaction whose Begin is message ``message``, if it qualifies."""
        t = self._index.get(message)
        return t if t is not None and self.qualifies[t] else None

    def run_end(self, first: int) -> int:
        """One past the last of the qualifying transactions that follow one another from ``first`` on."""
        return int(self._run_end[first])

    def refuse(self, relids: set[int]) -> None:
        """These relations' changes go message by message for the rest of the batch (a relation only changes how
        it is applied at a Relation message, and that ends every run)."""
        self._refused |= relids
        self._refused_at = np.flatnonzero(np.isin(self.relid, list(self._refused)))

    def cut_refused(self, first: int, stop: int) -> int:
        """``stop``, or the transaction before it that holds the first change of a refused relation from
        transaction ``first`` on."""
        at = self._refused_at
        if not len(at):
            return stop
        pos = int(np.searchsorted(at, self.begins[first]))
        if pos == len(at):
            return stop
        return min(stop, int(np.searchsorted(self.begins, at[pos], side="right")) - 1)


def _next_true(flags: np.ndarray, start: int) -> np.ndarray:
    """For each position ``i``, the first ``j >= i + start`` with ``flags[j]``, else ``len(flags)``."""
    at = np.append(np.flatnonzero(flags), len(flags))  # (a sentinel: "none" is len(flags))
    return at[np.searchsorted(at, np.arange(len(flags)) + start)]


def _u64(data: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Big-endian uint64 at each ``at`` (clipped into the buffer: a message too short to hold one never qualifies)."""
    last = len(data) - 1
    v = np.zeros(len(at), dtype=np.uint64)
    for i in range(8):
        v = (v << np.uint64(8)) | data[np.minimum(at + i, last)].astype(np.uint64)
    return v


def _u32(data: np.ndarray, at: np.ndarray) -> np.ndarray:
    last = len(data) - 1
    v = np.zeros(len(at), dtype=_I64)
    for i in range(4):
        v = (v << 8) | data[np.minimum(at + i, last)]
    return v


@dataclass(frozen=True, slots=True)
class Stretch:
    """Consecutive changes of one kind to one relation: one statement. ``messages`` are their indexes in the
    batch, ``columns`` one array literal (text, ``{...}``) per column (per key column for a DELETE),
    ``transactions`` the transaction of each change (for the conflict context)."""

    relid: int
    kind: int  # INSERT, UPDATE or DELETE
    messages: np.ndarray
    columns: list[bytes]
    transactions: np.ndarray
    #: one change the caller applies on its own, as the message-by-message path would (an Update with an
    #: unchanged-TOAST value, an Update or Delete with a NULL key): ``columns`` is empty
    single: bool = False


def changes_in(batch: Batch, first: int, stop: int) -> np.ndarray:
    """Indexes of the change messages of transactions ``first`` to ``stop - 1``."""
    lo, hi = int(batch.begins[first]), int(batch.commits[stop - 1])
    idx = np.arange(lo + 1, hi, dtype=_I64)
    return idx[batch.change[lo + 1 : hi]]


def plan(
    batch: Batch, first: int, stop: int, ncols: dict[int, int], keys: dict[int, tuple[int, ...]]
) -> list[Stretch] | None:
    """The statements for transactions ``first`` to ``stop - 1`` (which qualify): per relation, in the order its
    first change arrived, its stretches in its own order. ``ncols`` gives each relation's column count, ``keys``
    the key positions of those that are updated or deleted from. ``None`` when a change is not the simple shape
    (see the module docstring); the caller then applies them message by message."""
    idx = changes_in(batch, first, stop)
    if not len(idx):
        return []
    relids = batch.relid[idx]
    kinds = batch.kind[idx]
    txn = np.searchsorted(batch.begins, idx, side="right") - 1
    out: list[Stretch] = []
    _, first_seen = np.unique(relids, return_index=True)
    for relid in relids[np.sort(first_seen)].tolist():
        mine = relids == relid
        m_idx, m_kind, m_txn = idx[mine], kinds[mine], txn[mine]
        cuts = np.flatnonzero(m_kind[1:] != m_kind[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(m_idx)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            kind = int(m_kind[a])
            key = tuple(keys[relid]) if kind != INSERT else ()
            stretches = _stretches(batch, relid, kind, m_idx[a:b], m_txn[a:b], ncols[relid], key)
            if stretches is None:
                return None
            out.extend(stretches)
    return out


def _stretches(
    batch: Batch, relid: int, kind: int, messages: np.ndarray, txns: np.ndarray, n: int, key: tuple[int, ...]
) -> list[Stretch] | None:
    """The stretches of one run of same-kind changes (``messages``, of transactions ``txns``) to one relation of
    ``n`` columns (``key``: its key positions, for an Update or Delete); ``None`` when one is not the simple shape."""
    segments = tuple_segments(
        batch.data,
        batch.null_at,
        batch.starts[messages] + 31,
        batch.ends[messages],
        n,
        unchanged=kind == UPDATE,
    )
    if segments is None:
        return None
    seg_start, seg_len, is_null = segments
    # changes the row-by-row statements handle (their shape picks the statement) are applied singly, in their
    # place in this table's order: an unchanged-TOAST value keeps the target's, a NULL key searches with IS NULL
    single = np.zeros(len(messages), dtype=bool)
    if kind != INSERT:
        single |= is_null[:, list(key)].any(axis=1)
    if kind == UPDATE:
        single |= (seg_len < 0).any(axis=1)
    out: list[Stretch] = []
    parts = [0, *(np.flatnonzero(single[1:] != single[:-1]) + 1).tolist(), len(messages)]
    for x, y in zip(parts[:-1], parts[1:], strict=False):
        if single[x]:
            out.extend(
                Stretch(relid, kind, messages[i : i + 1], [], txns[i : i + 1], single=True)
                for i in range(x, y)
            )
            continue
        columns = [
            array_literal(batch.data, seg_start[x:y, c], seg_len[x:y, c], is_null[x:y, c], batch.null_at)
            for c in (key if kind == DELETE else range(n))
        ]
        out.append(Stretch(relid, kind, messages[x:y], columns, txns[x:y]))
    return out


def array_literal(
    data: np.ndarray, seg_start: np.ndarray, seg_len: np.ndarray, is_null: np.ndarray, null_at: int
) -> bytes:
    """The values as a PostgreSQL array literal: ``{"v1","v2",NULL}``, every value quoted, ``"`` and ``\\``
    escaped with a backslash, so that ``array_in`` hands each one unchanged to the element type's input function
    (``data[null_at:null_at + 4]`` is ``NULL``)."""
    n = len(seg_start)
    if n == 0:
        return b"{}"
    width = np.where(is_null, 5, seg_len + 3)  # NULL, or "value", each with its separator
    out_end = np.cumsum(width) + 1  # after the opening brace
    out_start = out_end - width
    total = int(out_end[-1])
    base = np.where(is_null, null_at - out_start, seg_start - out_start - 1)
    out = np.empty(total, dtype=np.uint8)
    out[0] = _OPEN
    out[1:] = data[source_positions(base, width, 1, total, len(data))]
    escape = (out == _QUOTE) | (out == _BACKSLASH)
    valued = ~is_null
    out[out_start[valued]] = _QUOTE
    out[out_end[valued] - 2] = _QUOTE
    escape[out_start[valued]] = False
    escape[out_end[valued] - 2] = False
    out[out_end - 1] = _COMMA
    escape[out_end - 1] = False
    out[-1] = _CLOSE
    if not escape.any():
        return out.tobytes()
    doubled = np.repeat(out, escape.astype(_I64) + 1)
    at = np.flatnonzero(escape) + np.arange(int(escape.sum()), dtype=_I64)
    doubled[at] = _BACKSLASH
    return doubled.tobytes()
