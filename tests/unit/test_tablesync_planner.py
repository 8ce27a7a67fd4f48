"""The copy planner's rules, without servers: page ranges, column lists, row filters, COPY format, SQL."""

from __future__ import annotations

import pytest

from tablesync.planner import (
    ColumnType,
    PlanError,
    PublishedRow,
    RemoteTable,
    binary_compatible,
    combined_row_filter,
    copy_in_sql,
    copy_out_sql,
    effective_columns,
    page_ranges,
    partition_tasks,
    plan_table,
)

INT = ColumnType("integer", 23)
TEXT = ColumnType("text", 25)


def table(*published: PublishedRow, pages: int = 10, relkind: str = "r") -> RemoteTable:
    return RemoteTable(
        schema="s", name="T x", relkind=relkind, columns=("id", "a", "b"),
        types={"id": INT, "a": TEXT, "b": TEXT}, published=published, pages=pages,
    )  # fmt: skip


# --- page ranges ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", [0, 1, 4095, 4096])
def test_small_tables_are_one_open_range(pages):
    assert page_ranges(pages) == ((0, None),)


@pytest.mark.parametrize("pages", [4097, 10_000, 123_457, 1_000_000])
def test_ranges_cover_every_page_once_and_the_last_is_open(pages):
    ranges = page_ranges(pages, partition_bytes=32 << 20)
    assert ranges[0][0] == 0 and ranges[-1][1] is None
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        assert hi == lo  # contiguous, no gap, no overlap
    sizes = [hi - lo for lo, hi in ranges[:-1]]
    assert max(sizes) <= 4096  # about partition_bytes each
    assert pages - ranges[-1][0] <= 4096 and pages - ranges[-1][0] > 0


def test_ranges_follow_block_size_and_partition_size():
    assert len(page_ranges(1000, block_size=8192, partition_bytes=8192 * 100)) == 10
    assert len(page_ranges(1000, block_size=32768, partition_bytes=8192 * 100)) == 40


# --- columns -----------------------------------------------------------------------------------------------


def test_no_column_list_means_every_column():
    assert effective_columns(table(PublishedRow("p", None, None))) == ("id", "a", "b")


def test_column_list_keeps_table_order_and_a_full_list_equals_none():
    t = table(PublishedRow("p1", ("b", "id"), None))
    assert effective_columns(t) == ("id", "b")
    full = table(PublishedRow("p1", ("id", "a", "b"), None), PublishedRow("p2", None, None))
    assert effective_columns(full) == ("id", "a", "b")


def test_different_column_lists_are_an_error_as_natively():
    t = table(PublishedRow("p1", ("id", "a"), None), PublishedRow("p2", ("id", "b"), None))
    with pytest.raises(PlanError, match="different column lists"):
        effective_columns(t)


def test_unpublished_table_is_an_error():
    with pytest.raises(PlanError, match="not in any of the subscribed publications"):
        effective_columns(table())


# --- row filters ---------------------------------------------------------------------------------------------


def test_row_filters_are_ored_and_parenthesised():
    rows = [PublishedRow("p1", None, "(id > 10)"), PublishedRow("p2", None, "a = 'x' OR b IS NULL")]
    assert combined_row_filter(rows) == "((id > 10)) OR (a = 'x' OR b IS NULL)"


def test_a_publication_without_filter_disables_filtering():
    rows = [PublishedRow("p1", None, "(id > 10)"), PublishedRow("p2", None, None)]
    assert combined_row_filter(rows) is None


def test_identical_filters_are_used_once():
    rows = [PublishedRow("p1", None, "(id > 10)"), PublishedRow("p2", None, "(id > 10)")]
    assert combined_row_filter(rows) == "(id > 10)"


# --- format --------------------------------------------------------------------------------------------------


def test_binary_when_type_names_match():
    assert binary_compatible(["id"], {"id": INT}, {"id": ColumnType("integer", 23)}) is None


def test_text_when_types_differ():
    reason = binary_compatible(["id"], {"id": INT}, {"id": ColumnType("bigint", 20)})
    assert reason is not None and "integer" in reason and "bigint" in reason


def test_text_when_embedded_oids_differ_even_with_the_same_name():
    pub = ColumnType("mood[]", 16390, True, (16389,))
    tgt = ColumnType("mood[]", 16501, True, (16500,))
    assert binary_compatible(["m"], {"m": pub}, {"m": tgt}) is not None
    builtin = ColumnType("integer[]", 1007, True, (23,))
    assert binary_compatible(["m"], {"m": builtin}, {"m": builtin}) is None
    # an enum itself has no OID in its binary form: its OID may differ
    assert binary_compatible(["m"], {"m": ColumnType("mood", 1)}, {"m": ColumnType("mood", 2)}) is None


def test_text_when_a_type_has_no_binary_io():
    """contrib's isbn has no send/receive functions (found by the corpus: Debezium's custom_table): binary COPY
    of it fails on either side, so the table is copied as text."""
    no_io = ColumnType("isbn", 16400, binary_io=False)
    reason = binary_compatible(["i"], {"i": no_io}, {"i": ColumnType("isbn", 16500)})
    assert reason is not None and "binary send/receive" in reason and "publisher" in reason
    reason = binary_compatible(["i"], {"i": ColumnType("isbn", 16400)}, {"i": no_io})
    assert reason is not None and "target" in reason


def test_missing_target_column_is_an_error():
    with pytest.raises(PlanError, match="missing"):
        binary_compatible(["x"], {"x": INT}, {})


# --- SQL -----------------------------------------------------------------------------------------------------


def _plan(rt: RemoteTable, **kw):
    return plan_table(
        relid=1, target_schema="ts", target_name='tg"t', relname="ts.x", remote=rt,
        target_types={"id": INT, "a": TEXT, "b": TEXT}, **kw,
    )  # fmt: skip


def test_copy_sql_quotes_identifiers_and_uses_only_ranges_and_filter():
    plan = _plan(table(PublishedRow("p", ("id", "b"), "(id > 5)"), pages=10_000), partition_bytes=8192 * 4000)
    assert plan.binary and len(plan.ranges) == 3
    first = copy_out_sql(plan, *plan.ranges[0]).as_string()
    assert first == (
        'COPY (SELECT "id", "b" FROM ONLY "s"."T x" WHERE ctid < \'(3334,0)\'::tid AND ((id > 5)))'
        " TO STDOUT (FORMAT binary)"
    )
    mid = copy_out_sql(plan, *plan.ranges[1]).as_string()
    assert "ctid >= '(3334,0)'::tid AND ctid < '(6668,0)'::tid" in mid
    last = copy_out_sql(plan, *plan.ranges[2]).as_string()
    assert "ctid >= '(6668,0)'::tid AND ((id > 5))" in last and "ctid <" not in last
    assert copy_in_sql(plan).as_string() == 'COPY "ts"."tg""t" ("id", "b") FROM STDIN (FORMAT binary)'


def test_single_partition_is_a_plain_scan_and_text_format_when_needed():
    rt = table(PublishedRow("p", None, None))
    plan = plan_table(
        relid=1, target_schema="ts", target_name="t", relname="ts.t", remote=rt,
        target_types={"id": ColumnType("bigint", 20), "a": TEXT, "b": TEXT},
    )  # fmt: skip
    assert not plan.binary and plan.text_reason
    assert copy_out_sql(plan, 0, None).as_string() == (
        'COPY (SELECT "id", "a", "b" FROM ONLY "s"."T x") TO STDOUT (FORMAT text)'
    )


def test_partitioned_parent_is_read_without_only_and_in_one_piece():
    plan = _plan(table(PublishedRow("p", None, None), pages=100_000, relkind="p"))
    assert plan.ranges == ((0, None),)
    assert 'FROM "s"."T x")' in copy_out_sql(plan, 0, None).as_string()


def test_tasks_are_biggest_first_and_numbered():
    big = _plan(table(PublishedRow("p", None, None), pages=9000), partition_bytes=8192 * 4000)
    small = plan_table(
        relid=2, target_schema="ts", target_name="small", relname="ts.small",
        remote=table(PublishedRow("p", None, None), pages=3), target_types={"id": INT, "a": TEXT, "b": TEXT},
    )  # fmt: skip
    tasks = partition_tasks([small, big], subid=7, snapshot="S-1")
    assert [t.task_id for t in tasks] == list(range(4))
    assert [(t.relname, t.part) for t in tasks][:2] == [("ts.x", 0), ("ts.x", 1)]
    assert tasks[-1].relname == "ts.small" and tasks[-1].nparts == 1
    assert all(t.snapshot == "S-1" and t.subid == 7 for t in tasks)
    assert tasks[0].lock_target == 'LOCK TABLE "ts"."tg""t" IN ROW EXCLUSIVE MODE'


def test_the_package_default_partition_size_is_the_planners():
    import inspect

    import tablesync
    from tablesync.planner import DEFAULT_PARTITION_BYTES

    default = inspect.signature(tablesync.run_initial_copy).parameters["partition_bytes"].default
    assert default == DEFAULT_PARTITION_BYTES


def _task(i: int, pages: int):
    from tablesync.planner import PartitionTask

    return PartitionTask(i, 1, "S", f"t{i}", 0, 1, "out", "in", "lock", pages)


def test_pack_tasks_keeps_big_partitions_alone_and_packs_small_ones():
    from tablesync.planner import pack_tasks

    big = [_task(i, 4096) for i in range(4)]
    small = [_task(10 + i, 40) for i in range(100)]
    bins = pack_tasks(big + small, target_bytes=4096 * 8192, min_bins=2)
    ids = sorted(i for b in bins for i in b)
    assert ids == sorted(t.task_id for t in big + small)  # every partition exactly once
    assert len(bins) == 5  # 4 x 4096 + 100 x 40 pages = 20384 pages, ~4096 each
    assert all(len([i for i in b if i < 4]) <= 1 for b in bins)  # no two big partitions together


def test_pack_tasks_spreads_small_work_over_min_bins():
    from tablesync.planner import pack_tasks

    assert len(pack_tasks([_task(i, 1) for i in range(20)], min_bins=8)) == 8
    assert pack_tasks([_task(0, 1)], min_bins=8) == [[0]]
    assert pack_tasks([], min_bins=8) == []
