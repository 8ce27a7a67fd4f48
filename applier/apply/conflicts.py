"""PostgreSQL 18's conflict reports, word for word (``conflict.c``: ``ReportApplyConflict`` and
``errdetail_apply_conflict``), and the one place a detected conflict is counted and logged.

Operators grep their logs and alert on the counters, so a conflict we detect must read exactly as the native
worker's does: ``conflict detected on relation "s.t": conflict=KIND`` and a DETAIL that explains the kind (with the
local row's transaction, origin and commit time when ``track_commit_timestamp`` knows them), then the key, the
existing local row, the remote row and the replica identity, as far as each is known. Pure: values come in as the
text the target's output functions made; nothing here does I/O (:meth:`applier.apply.apply_state.ApplyStats.conflict`
counts and logs a report).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from applier.apply.relmap import RelMapEntry
from applier.messages import KIND_BINARY, TupleData

#: the kinds that raise an ERROR (the apply stops until the local row goes); the others are logged at LOG
ERROR_KINDS = frozenset(("insert_exists", "update_exists", "multiple_unique_conflicts"))
#: ``ExecBuildSlotValueDescription``'s cut: a longer value shows its first 64 bytes and "..."
MAX_FIELD_BYTES = 64
_PLAIN_NAME = re.compile(r"[a-z_][a-z0-9_$]*")


@dataclass(frozen=True, slots=True)
class LocalRow:
    """The local row a conflict is about: its xmin, and (when track_commit_timestamp recorded them) the origin
    that wrote it (``origin_id`` 0: a local transaction; ``origin_name`` None: an origin since dropped) and its
    commit time as the target prints a timestamptz. ``values``: its columns' text (None for NULL), in column
    order; ``index``/``key``: the unique index it conflicts on and that index's key, ``(a, b)=(1, 2)``."""

    xmin: int
    origin_id: int | None = None
    origin_name: str | None = None
    committed: str | None = None
    values: Sequence[str | None] | None = None
    index: str | None = None
    key: str | None = None


def row_description(values: Sequence[str | None]) -> str:
    """A row as ``ExecBuildSlotValueDescription`` shows it to someone who may read the whole table:
    ``(1, abc, null)``, each value cut at 64 bytes (on a character boundary) with ``...``."""
    return "(" + ", ".join("null" if v is None else _clip(v) for v in values) + ")"


def _clip(value: str) -> str:
    data = value.encode()
    if len(data) <= MAX_FIELD_BYTES:
        return value
    return data[:MAX_FIELD_BYTES].decode("utf-8", "ignore") + "..."


def index_description(columns: Sequence[str], values: Sequence[str | None]) -> str:
    """A unique index's key as ``BuildIndexValueDescription`` shows it: ``(a, b)=(1, null)`` (never cut)."""
    return "(" + ", ".join(columns) + ")=(" + ", ".join("null" if v is None else v for v in values) + ")"


def _explanation(kind: str, row: LocalRow | None) -> str:
    """The first sentence of a conflict's DETAIL: what happened, with the local row's transaction, origin and time."""
    if kind in ("update_missing", "delete_missing"):
        return f"Could not find the row to be {kind.split('_')[0]}d."
    assert row is not None, kind
    if row.committed is None:  # no commit timestamp data (track_commit_timestamp off, or not recorded)
        if kind in ERROR_KINDS:
            return f'Key already exists in unique index "{row.index}", modified in transaction {row.xmin}.'
        who = "locally"
    elif row.origin_id == 0:
        who = "locally"
    elif row.origin_name is not None:
        who = (
            f'by origin "{row.origin_name}"'
            if kind in ERROR_KINDS
            else f'by a different origin "{row.origin_name}"'
        )
    else:
        who = "by a non-existent origin"
    when = f"in transaction {row.xmin} at {row.committed}"
    if kind in ERROR_KINDS:
        return f'Key already exists in unique index "{row.index}", modified {who} {when}.'
    verb = "Updating" if kind == "update_origin_differs" else "Deleting"
    return f"{verb} the row that was modified {who} {when}."


def detail(
    kind: str,
    row: LocalRow | None,
    remote: Sequence[str | None] | None = None,
    identity: str | None = None,
    identity_full: bool = False,
) -> str:
    """One conflicting row's part of the DETAIL (``errdetail_apply_conflict``): the explanation, then on a line of
    its own the key, existing local row, remote row and replica identity known (``identity``: the replica identity
    index's key, ``(id)=(1)``, or with ``identity_full`` the search row's description)."""
    parts: list[tuple[str, str]] = []
    if kind in ERROR_KINDS and row is not None and row.key is not None:
        parts.append(("Key", row.key))
    if row is not None and row.values is not None:
        parts.append(("existing local row", row_description(row.values)))
    if remote is not None:
        parts.append(("remote row", row_description(remote)))
    if identity is not None:
        parts.append(("replica identity full" if identity_full else "replica identity", identity))
    text = _explanation(kind, row)
    if parts:
        values = "; ".join(f"{label} {desc}" for label, desc in parts)
        text += "\n" + values[0].upper() + values[1:] + "."
    return text


def message(kind: str, relation: str, details: Sequence[str]) -> str:
    """The whole report: ``conflict detected on relation "s.t": conflict=KIND`` and its DETAIL, one part per
    conflicting row (several for ``multiple_unique_conflicts``), each on its own lines."""
    return f'conflict detected on relation "{relation}": conflict={kind}\nDETAIL:  ' + "\n".join(details)


def quote_name(name: str) -> str:
    """A column name as ``pg_get_indexdef_columns`` prints it: double-quoted unless plain lower case."""
    return name if _PLAIN_NAME.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def remote_texts(entry: RelMapEntry, t: TupleData) -> list[str | None]:
    """A remote tuple in the local table's column order, as ``slot_store_data`` fills a slot: the text of each
    sent value, NULL for a column not sent, sent NULL or unchanged TOAST (binary values: NULL, shown so)."""
    by_name: dict[str, str | None] = {}
    for name, kind, value in zip(entry.names, t.kinds, t.values, strict=True):
        by_name[name] = value.decode() if value is not None and kind == ord("t") else None
    return [by_name.get(c.name) for c in entry.local.columns]


def identity_description(entry: RelMapEntry, search: TupleData) -> tuple[str, bool]:
    """The replica identity part of a DETAIL: the local key's ``(id)=(1)``, or the whole search row (FULL)."""
    if entry.key_positions is None:
        return row_description(remote_texts(entry, search)), True
    kinds, values = search.kinds, search.values
    texts = [
        values[i].decode() if values[i] is not None and kinds[i] != KIND_BINARY else None  # type: ignore[union-attr]
        for i in entry.key_positions
    ]
    return index_description([quote_name(entry.names[i]) for i in entry.key_positions], texts), False


def change_detail(
    kind: str, entry: RelMapEntry, row: LocalRow, search: TupleData | None, new: TupleData | None
) -> str:
    """The DETAIL of a change whose row ``row`` conflicts (``update_origin_differs``, ...): who changed the row
    when, the row, the remote row (an UPDATE's ``new``), the replica identity (of ``search``)."""
    identity, full = identity_description(entry, search) if search is not None else (None, False)
    remote = remote_texts(entry, new) if new is not None else None
    return detail(kind, row, remote, identity, full)
