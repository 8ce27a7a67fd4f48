"""PostgreSQL 18's conflict reports word for word (``conflict.c``'s ``errdetail_apply_conflict`` and
``build_tuple_value_details``), as :mod:`applier.apply.conflicts` builds them: the explanation of each kind with
and without commit timestamp data, the key / local row / remote row / replica identity line, the 64-byte cut; a
missing row's report and its conflict-log-table row (:mod:`applier.apply.conflict_table`); the split of a unique
violation's key (:mod:`applier.apply.unique_conflicts`)."""

from __future__ import annotations

import json
import logging

from applier.apply import conflicts
from applier.apply.apply_state import ApplyStats
from applier.apply.conflict_table import ConflictTable
from applier.apply.conflicts import LocalRow
from applier.apply.context import ErrorContext
from applier.apply.relmap import LocalColumn, LocalTable, RelMapEntry, map_relation
from applier.apply.unique_conflicts import _server_key
from applier.messages import Relation, RelationColumn, TupleData


def test_missing_kinds_name_the_operation_only() -> None:
    assert conflicts.detail("update_missing", None) == "Could not find the row to be updated."
    assert (
        conflicts.detail("update_missing", None, ["1", "x"], "(id)=(1)")
        == "Could not find the row to be updated.\nRemote row (1, x); replica identity (id)=(1)."
    )
    assert conflicts.detail("delete_missing", None, None, "(id)=(2)") == (
        "Could not find the row to be deleted.\nReplica identity (id)=(2)."
    )


def test_origin_differs_says_who_changed_the_row_and_when() -> None:
    at = "2026-12-06 10:00:00.123456+00"
    local = LocalRow(xmin=790, origin_id=0, committed=at, values=["1", "local"])
    assert conflicts.detail("update_origin_differs", local, ["1", "remote"], "(id)=(1)") == (
        f"Updating the row that was modified locally in transaction 790 at {at}.\n"
        "Existing local row (1, local); remote row (1, remote); replica identity (id)=(1)."
    )
    other = LocalRow(xmin=5, origin_id=3, origin_name="pg_16400", committed=at, values=["2", None])
    assert conflicts.detail("delete_origin_differs", other, None, "(2, null)", identity_full=True) == (
        f'Deleting the row that was modified by a different origin "pg_16400" in transaction 5 at {at}.\n'
        "Existing local row (2, null); replica identity full (2, null)."
    )
    gone = LocalRow(xmin=5, origin_id=3, origin_name=None, committed=at)
    assert conflicts.detail("delete_origin_differs", gone) == (
        f"Deleting the row that was modified by a non-existent origin in transaction 5 at {at}."
    )


def test_exists_kinds_name_the_index_and_key() -> None:
    row = LocalRow(xmin=771, values=["10", "in the way"], index="t_pkey", key="(id)=(10)")
    assert conflicts.detail("insert_exists", row, ["10", "remote"]) == (
        'Key already exists in unique index "t_pkey", modified in transaction 771.\n'
        "Key (id)=(10); existing local row (10, in the way); remote row (10, remote)."
    )
    at = "2026-12-06 10:00:00+00"
    timed = LocalRow(
        xmin=771, origin_id=2, origin_name="applier_7", committed=at, index="t_v_key", key="(v)=(x)"
    )
    assert conflicts.detail("update_exists", timed, None, "(id)=(1)") == (
        f'Key already exists in unique index "t_v_key", modified by origin "applier_7" in transaction 771 at {at}.\n'
        "Key (v)=(x); replica identity (id)=(1)."
    )
    local = LocalRow(xmin=9, origin_id=0, committed=at, index="i", key="(a)=(1)")
    assert conflicts.detail("multiple_unique_conflicts", local).startswith(
        f'Key already exists in unique index "i", modified locally in transaction 9 at {at}.'
    )


def test_message_and_descriptions() -> None:
    assert conflicts.message("insert_exists", "public.t", ["a", "b"]) == (
        'conflict detected on relation "public.t": conflict=insert_exists\nDETAIL:  a\nb'
    )
    assert conflicts.row_description(["x" * 70, None, "é" * 40]) == (
        "(" + "x" * 64 + "..., null, " + "é" * 32 + "...)"
    )
    assert conflicts.index_description(["a", '"B"'], ["1", None]) == '(a, "B")=(1, null)'


def _entry() -> RelMapEntry:
    """``public.t (id int primary key, v text, extra text)``, the publisher sending ``id`` and ``v``."""
    cols = (RelationColumn(1, "id", 23, -1), RelationColumn(0, "v", 25, -1))
    local = LocalTable(
        16400,
        "public",
        "t",
        "r",
        (LocalColumn("id", 23), LocalColumn("v", 25), LocalColumn("extra", 25)),
        ("id",),
    )
    return map_relation(Relation(None, 7, "public", "t", "d", cols), local)


def test_a_missing_row_report_names_the_remote_row_and_identity_and_goes_to_the_table() -> None:
    """As PostgreSQL 18's update_missing: the remote row in the local table's columns (not sent: null) and the
    key; with ``--conflict-log table`` the row goes to the table, and no line to the log."""
    entry, seen, lines = _entry(), [], []
    new = TupleData(b"tt", (b"3", b"remote"))
    log = logging.getLogger("test_conflict_words")
    stats = ApplyStats(on_record=lambda kind, ctx, record: seen.append((kind, record)), log=log)
    log.info = lambda *args: lines.append(args[0] % args[1:])  # type: ignore[method-assign]
    ctx = ErrorContext("applier_1", "UPDATE", "public.t", 770, 0x16B3748)
    stats.missing_row(ctx, (entry, new, new))
    assert lines == [
        'conflict detected on relation "public.t": conflict=update_missing\nDETAIL:  Could not find the row to be'
        " updated.\nRemote row (3, remote, null); replica identity (id)=(3).\nCONTEXT:  " + ctx.describe()
    ]
    assert seen == [("update_missing", (entry, new, new, None))] and stats.conflicts["update_missing"] == 1
    stats.log_lines = False
    stats.missing_row(ctx, (entry, None, None))  # a bulk statement's: no tuples
    assert len(lines) == 1 and seen[-1] == ("update_missing", (entry, None, None, None))


def test_conflict_table_rows_carry_the_remote_transaction_and_tuples_as_json() -> None:
    entry = _entry()
    table = ConflictTable(5)
    local = LocalRow(xmin=9, origin_id=0, committed="2026-12-06 10:00:00+00", values=["1", "local", None])
    new = TupleData(b"tu", (b"1", None))
    table.add("update_origin_differs", ErrorContext("o", "UPDATE", "public.t", 770, 0x16B3748),
              (entry, new, new, local))  # fmt: skip
    assert table.rows == [{
        "subid": 5, "relid": 16400, "schemaname": "public", "relname": "t", "conflict_type": "update_origin_differs",
        "remote_xid": 770, "remote_commit_lsn": "0/16B3748", "remote_origin": None,
        "replica_identity": {"id": "1"}, "remote_tuple": {"id": "1"},  # unchanged TOAST left out
        "local_conflicts": [{"xid": 9, "origin": None, "commit_ts": "2026-12-06 10:00:00+00", "key": None,
                             "tuple": {"id": "1", "v": "local", "extra": None}}],
    }]  # fmt: skip
    sent: list[tuple[bytes, list[bytes]]] = []

    class Pipeline:
        def send_query(self, query: bytes, params: list[bytes], ctx: object) -> None:
            sent.append((query, params))

    table.flush(Pipeline(), 123, None)
    assert (
        sent[0][0].startswith(b"INSERT INTO applier.conflict_log")
        and json.loads(sent[0][1][0])[0]["subid"] == 5
    )
    assert sent[0][1][1] == b"123" and table.rows == []
    table.flush(Pipeline(), 124, None)  # nothing gathered: nothing sent
    assert len(sent) == 1


def test_the_server_key_of_a_unique_violation_is_split_only_when_unambiguous() -> None:
    assert _server_key("Key (id)=(10) already exists.", 1) == ["10"]
    assert _server_key("Key (a, b)=(1, x) already exists.", 2) == ["1", "x"]
    assert _server_key("Key (a, b)=(1, x, y) already exists.", 2) is None  # a value with ", " in it
    assert _server_key("Key (v)=(a, b) already exists.", 1) == ["a, b"]
    assert _server_key("something else", 1) is None
